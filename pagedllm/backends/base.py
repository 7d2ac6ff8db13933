"""The seams between the device-agnostic engine and a device backend.

A backend supplies three things: a :class:`DeviceBackend` (what device, how much memory, which
collective library), an :class:`AttentionBackend` (the KV-cache layout and the paged-attention
kernels) and a :class:`CacheEngine` (the per-layer KV tensors on the device plus a host swap pool;
the one concrete class of the three, in ``cache_engine.py``, re-exported here as ``kv_layout``'s
names are).

Contract every attention backend keeps, so that the cache engine and the tests stay generic:

* the KV cache of one layer is a single tensor whose dim 0 has size 2 (keys, values) and whose
  dim 1 is the physical block index; the rest of the layout is the backend's own choice;
* a *slot* is ``block_id * block_size + offset_in_block``;
* tokens of one step are packed flat, prefill sequences first, then decode sequences;
* the cache holds ``kv_cache_dtype`` (see :data:`KV_CACHE_DTYPES`); fp8 caches store ``x / scale``
  with one scale per layer for K and one for V (1.0 unless a checkpoint provides them), and the
  kernels dequantise on read.
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from pagedllm.backends.cache_engine import CacheEngine, CacheSpec
from pagedllm.backends.kv_layout import (
    FP8_DTYPES,
    KV_CACHE_DTYPES,
    AttentionMetadata,
    build_attention_metadata,
    byte_view,
    from_cache_dtype,
    to_cache_dtype,
)

if TYPE_CHECKING:
    from pagedllm.backends.kernels import KernelOrder, Op, Selection

__all__ = [
    "FP8_DTYPES",
    "KV_CACHE_DTYPES",
    "AttentionBackend",
    "AttentionMetadata",
    "CacheEngine",
    "CacheSpec",
    "DeviceBackend",
    "build_attention_metadata",
    "byte_view",
    "from_cache_dtype",
    "to_cache_dtype",
]

logger = logging.getLogger(__name__)


class AttentionBackend(ABC):
    """Paged attention and the KV-cache layout it reads.

    ``write_kv`` and ``forward`` are called once per layer per step. ``forward`` must honour
    ``sliding_window`` (a token attends only to the last ``sliding_window`` positions, itself
    included), GQA (``num_heads`` a multiple of ``num_kv_heads``) and, where a model asks for it,
    ``logits_soft_cap`` (Gemma 2: each score ``s = scale * q.k`` becomes ``cap * tanh(s / cap)``
    before the mask and the softmax; the layer passes it only when set).
    """

    name: str = "abstract"
    #: The ``kv_cache_dtype`` values (besides "auto") this backend's kernels read.
    supported_kv_cache_dtypes: tuple[str, ...] = ("float32", "bfloat16", "float16")
    #: True when the kernels read the cache only in the compute dtype (no conversion on load).
    kv_cache_dtype_follows_compute: bool = True

    def resolve_kv_cache_dtype(
        self, kv_cache_dtype: str, compute_dtype: torch.dtype
    ) -> torch.dtype:
        """The torch dtype of the cache, or ``ValueError`` when this backend cannot run it.

        Called once at engine construction, so an unsupported choice fails before any memory is
        allocated, with the values that would work.
        """
        if kv_cache_dtype == "auto":
            return compute_dtype
        wanted = KV_CACHE_DTYPES.get(kv_cache_dtype)
        ok = wanted is not None and kv_cache_dtype in self.supported_kv_cache_dtypes
        if ok and self.kv_cache_dtype_follows_compute:
            ok = wanted == compute_dtype
        if ok and wanted is not None:
            return wanted
        if self.kv_cache_dtype_follows_compute:
            names = [n for n, d in KV_CACHE_DTYPES.items() if d == compute_dtype]
            works = ["auto", *[n for n in names if n in self.supported_kv_cache_dtypes]]
        else:
            works = ["auto", *self.supported_kv_cache_dtypes]
        raise ValueError(
            f"kv_cache_dtype: {kv_cache_dtype!r} cannot run on the {self.name!r} attention backend "
            f"with dtype {str(compute_dtype).removeprefix('torch.')}; this backend supports "
            f"{works}"
        )

    def check_device(self, device: torch.device) -> None:
        """``ValueError`` (naming ``attention_backend``) when these kernels cannot run on
        ``device``: called at engine construction, before any step would fail on it."""

    def describe(self) -> str:
        """Which code path runs, for the log line at engine start (an ISA level, say)."""
        return "generic"

    def kv_cache_shape(
        self, num_blocks: int, block_size: int, num_kv_heads: int, head_size: int
    ) -> tuple[int, ...]:
        """Shape of one layer's cache, the one layout of every kernel and of the reference.

        ``[2 (K, V), num_blocks, num_kv_heads, block_size, head_size]``: the keys of one
        (block, KV head) pair are one contiguous ``[block_size, head_size]`` panel.
        """
        return (2, num_blocks, num_kv_heads, block_size, head_size)

    @abstractmethod
    def write_kv(
        self,
        key: torch.Tensor,  # [num_tokens, num_kv_heads, head_size]
        value: torch.Tensor,  # [num_tokens, num_kv_heads, head_size]
        kv_cache: torch.Tensor,
        slot_mapping: torch.Tensor,  # [num_tokens] int64
    ) -> None:
        """Store the new tokens' keys and values at their slots."""

    @abstractmethod
    def forward(
        self,
        query: torch.Tensor,  # [num_tokens, num_heads, head_size]
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        *,
        sliding_window: int | None = None,
        logits_soft_cap: float | None = None,
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_size]
        """Causal attention of each query token over its sequence's cached keys and values."""

    def build_metadata(self, **kwargs: Any) -> AttentionMetadata:
        """Backends that need extra fields (split-K plans, workspaces) override this."""
        return build_attention_metadata(**kwargs)

    def copy_blocks(self, kv_caches: list[torch.Tensor], pairs: torch.Tensor) -> None:
        """Copy-on-write: for every layer, block ``pairs[i, 0]`` is copied onto ``pairs[i, 1]``."""
        if pairs.numel() == 0:
            return
        src, dst = pairs[:, 0], pairs[:, 1]
        for cache in kv_caches:
            cache[:, dst] = cache[:, src]

    def swap_blocks(self, src: torch.Tensor, dst: torch.Tensor, pairs: torch.Tensor) -> None:
        """Move blocks between pools (device <-> host) of one layer: ``src[:, a] -> dst[:, b]``."""
        if pairs.numel() == 0:
            return
        src_idx = pairs[:, 0].to(src.device)
        dst_idx = pairs[:, 1].to(dst.device)
        dst[:, dst_idx] = src[:, src_idx].to(dst.device)


class DeviceBackend(ABC):
    """One kind of device: how to reach it, size it, and which kernels run on it."""

    name: str = "abstract"
    ray_resource: str | None = None  # the Ray resource one worker of this device reserves

    @classmethod
    @abstractmethod
    def is_available(cls) -> bool:
        """True when this machine can run the backend; never raises."""

    @abstractmethod
    def device(self, rank: int = 0) -> torch.device:
        """The torch device for a worker of this rank."""

    #: Per op, the implementations this device prefers, best first (the rows are in
    #: ``backends/kernels.py``); an op left out runs its layer's PyTorch definition.
    kernel_order: ClassVar[KernelOrder] = {"lora": ("torch",)}
    #: What ``prepare_model`` installed, for logs and benchmarks: the GEMM each kind of linear
    #: layer got (e.g. ``"QKVParallelLinear=cpp-bf16-avx2, ..."``) and the row-wise kernels.
    linear_path: str = ""
    layer_kernels: str = ""

    def kernel(self, op: Op, fmt: str | None = None) -> Selection:
        """The registry's choice for ``op`` (on weights in ``fmt``) on this device, with why every
        other implementation was refused."""
        from pagedllm.backends.kernels import select

        return select(op, self.name, self.kernel_order.get(op, ()), fmt=fmt)

    def attention(self, kind: str | None = None) -> AttentionBackend:
        """The attention backend: ``kind`` names one from the registry, or "auto"/None.

        Any kind registered for this device may be named; "auto" walks the device's
        ``kernel_order["attention"]`` and reports every failure if none constructs.
        """
        from pagedllm.backends import kernels

        kind = kind or "auto"
        if kind != "auto":
            offered = kernels.impls_on("attention", self.name)
            if kind not in offered:
                raise ValueError(
                    f"attention_backend: {kind!r} does not run on device {self.name!r}; "
                    f"choose one of {['auto', *offered]}"
                )
            chosen: AttentionBackend = kernels.build(kernels.entry("attention", kind))
            chosen.check_device(self.device())
            return chosen
        selection = self.kernel("attention")
        failures = selection.failures()
        for failure in failures:
            logger.warning(
                "attention kind %r unavailable on %s: %s", failure.impl, self.name, failure.detail
            )
        if selection.value is None:
            raise ImportError(
                f"device={self.name!r} has no usable attention kernels "
                f"({'; '.join(str(f) for f in failures)})"
            )
        return selection.value

    #: The device's KV pool lives in host memory (the CPU): the lower KV tiers skip their host
    #: tier there, since a host copy would only duplicate the pool (see pagedllm/kv_tiers/).
    kv_pool_in_host_memory: bool = False
    #: Pin the lower tiers' host memory (page-locked, so host <-> device copies are DMA).
    pin_host_tier: bool = False

    #: The cache engine class as ``"module:Class"`` (a device may keep host pools its own way).
    cache_engine_class: str = "pagedllm.backends.cache_engine:CacheEngine"

    def make_cache_engine(
        self,
        spec: CacheSpec,
        num_device_blocks: int,
        num_host_blocks: int,
        *,
        attention: AttentionBackend,
        rank: int = 0,
    ) -> CacheEngine:
        from pagedllm.lazy import load_object

        return load_object(self.cache_engine_class)(
            spec,
            attention,
            device=self.device(rank),
            num_device_blocks=num_device_blocks,
            num_host_blocks=num_host_blocks,
        )

    # -- memory: four primitives an accelerator supplies, one budget formula over them ----------
    def mem_get_info(self, rank: int = 0) -> tuple[int, int]:
        """``(free, total)`` bytes of the device as its driver reports them."""
        raise NotImplementedError(f"device {self.name!r} reports no memory statistics")

    def memory_reserved(self, rank: int = 0) -> int:
        """Bytes the framework's caching allocator holds (used or cached) on the device."""
        raise NotImplementedError(f"device {self.name!r} has no caching allocator")

    def profile_peak_bytes(self, fn: Callable[[], object], rank: int = 0) -> int:
        """Run ``fn``; the allocator's peak during it beyond what was allocated before."""
        raise NotImplementedError(f"device {self.name!r} has no allocator statistics")

    def empty_cache(self, rank: int = 0) -> None:
        """Hand the allocator's cached, unused blocks back to the device."""

    def free_memory_bytes(self, rank: int = 0) -> int:
        return self.mem_get_info(rank)[0]

    def total_memory_bytes(self, rank: int = 0) -> int:
        return self.mem_get_info(rank)[1]

    def kv_cache_budget_bytes(
        self,
        *,
        profile: Callable[[], object],
        gpu_memory_utilization: float,
        cpu_kv_cache_bytes: int,
        rank: int = 0,
    ) -> int:
        """Bytes the KV cache may take: ``total * utilisation`` minus all in use at the peak.

        In use = what the device held before profiling (weights, the runtime's context, other
        processes: ``total - free``) + the allocator's activation peak while ``profile`` runs a
        forward pass at the largest batch the scheduler can form + memory that grew outside the
        allocator meanwhile (BLAS workspaces, collective buffers). The CPU overrides this: there
        the budget is given (``kv_cache_space``).
        """
        self.empty_cache(rank)
        free_before, total = self.mem_get_info(rank)
        reserved_before = self.memory_reserved(rank)
        activation_peak = self.profile_peak_bytes(profile, rank)
        free_after, _ = self.mem_get_info(rank)
        reserved_grew = self.memory_reserved(rank) - reserved_before
        outside = max(0, (free_before - free_after) - reserved_grew)
        self.empty_cache(rank)  # hand the profiling activations back before the KV cache
        held = total - free_before
        budget = int(total * gpu_memory_utilization) - (held + activation_peak + outside)
        gib = float(1 << 30)
        logger.info(
            "KV budget %.2f GiB = %.2f GiB x %.2f - held %.2f - activations %.2f - other %.2f",
            budget / gib,
            total / gib,
            gpu_memory_utilization,
            held / gib,
            activation_peak / gib,
            outside / gib,
        )
        return max(0, budget)

    def prepare_model(
        self,
        model: torch.nn.Module,
        *,
        int8_activations: bool = False,
        enforce_eager: bool = False,
    ) -> None:
        """Fill the layers' fast slots (linear, MoE, norm, activation, rotary) with the installers
        the kernel registry picks for this device. ``int8_activations``: the user allows
        group-wise layers to round activations to int8 (``ModelConfig.int8_activations``); an
        installer without such a kernel ignores it. ``enforce_eager``: no ``decode_stack``
        (C++ stack, CUDA graphs): decode steps run the layer loop."""
        from pagedllm.backends.kernels import install

        self.linear_path, self.layer_kernels = install(
            model,
            self.name,
            self.kernel_order,
            int8_activations=int8_activations,
            enforce_eager=enforce_eager,
        )
        model.linear_path = self.linear_path
        model.layer_kernels = self.layer_kernels

    def preload_packed_layers(
        self, model: torch.nn.Module, *, int8_activations: bool = False
    ) -> frozenset[str]:
        """The linear layers whose packed weights this backend already holds for the model's
        file (``model.packed_source``), which ``prepare_model`` will install: the loader leaves
        their checkpoint tensors unread. None here (no backend cache)."""
        return frozenset()

    def configure_threads(self, world_size: int = 1, total: int | None = None) -> None:
        """Set host-side thread counts for a worker once, before its first forward pass."""

    def synchronize(self, rank: int = 0) -> None:
        """Wait for queued device work (no-op where work is synchronous)."""

    @abstractmethod
    def dist_backend(self) -> str:
        """The torch.distributed backend for tensor parallelism on this device."""

    def default_dtype(self, model_dtype: torch.dtype) -> torch.dtype:
        """The compute dtype when the user asked for "auto"."""
        return model_dtype

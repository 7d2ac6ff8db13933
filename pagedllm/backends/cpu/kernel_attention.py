"""Paged attention through the C++ CPU kernels (``attention_backend="cpp"``).

Cache layout of one layer: ``[2, num_blocks, num_kv_heads, block_size, head_size]`` (K then V).
It is the layout of every kernel and of the reference: the keys of one (block, kv head) pair are
one contiguous ``[block_size, head_size]`` panel, so the kernel streams each block in a single
run and every token row is a contiguous vector load.

The kernels (``csrc/``) take queries in float32, bfloat16 or float16 (the model's compute dtype;
the output has it too) over a cache in any of those or fp8 e4m3/e5m2 (``kv_cache_dtype``),
computing in float32. They handle any head size (vector bodies plus a scalar tail), any block
size, GQA/MQA and sliding windows, and one call serves a whole mixed batch: prompt chunks with or
without cached context and single-token decodes alike, with an online softmax so no score buffer
grows with the context. Anything else (a non-CPU tensor, a strided cache) goes to
:class:`TorchPagedAttention` on the same cache, so the engine never needs to know which path
ran. The build is the one of :func:`resolve_isa`'s level; :attr:`CppPagedAttention.isa` names it.
"""

from __future__ import annotations

from pathlib import Path

import torch

from pagedllm.backends.base import FP8_DTYPES, AttentionBackend, AttentionMetadata
from pagedllm.backends.cpu._ops import load_kernels, resolve_isa
from pagedllm.backends.cpu.attention import TorchPagedAttention

_COMPUTE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_CACHE_DTYPES = (*_COMPUTE_DTYPES, *FP8_DTYPES)


def _kernel_ok(tokens: torch.Tensor, kv_cache: torch.Tensor) -> bool:
    """Whether the C++ kernels take these tensors (CPU, their dtypes, unit inner stride).

    Asked once per tensor per layer of every step, so it sticks to the cheapest attribute
    reads (``is_cpu``, not ``device.type``, which builds a device object each time).
    """
    return (
        tokens.is_cpu
        and kv_cache.is_cpu
        and tokens.dtype in _COMPUTE_DTYPES
        and kv_cache.dtype in _CACHE_DTYPES
        and tokens.stride(-1) == 1
        and kv_cache.is_contiguous()
    )


def _as_kernel_index(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``t`` as the contiguous ``dtype`` tensor the kernels read. The step's metadata is built
    in that form already (``build_attention_metadata``), and a ``.to().contiguous()`` per
    layer costs two dispatches even when it returns ``t`` itself."""
    if t.dtype == dtype and t.is_contiguous():
        return t
    return t.to(dtype).contiguous()


def _scales(kv_cache: torch.Tensor, k_scale: float, v_scale: float) -> tuple[float, float]:
    """fp8 caches use the layer's scales; other dtypes store values as they are."""
    return (float(k_scale), float(v_scale)) if kv_cache.dtype in FP8_DTYPES else (1.0, 1.0)


class CppPagedAttention(AttentionBackend):
    """The CPU backend's default attention; construction builds or loads the extension.

    Raises ``RuntimeError``/``ImportError``/``OSError`` when the extension cannot be built, which
    the CPU backend turns into a fallback to :class:`TorchPagedAttention`.
    """

    name = "cpp"
    supported_kv_cache_dtypes = ("float32", "bfloat16", "float16", "fp8", "fp8_e4m3", "fp8_e5m2")
    kv_cache_dtype_follows_compute = False

    def __init__(self, *, build_root: Path | None = None, isa: str | None = None) -> None:
        # isa=None: PAGEDLLM_CPU_ISA or the best level this CPU runs; tests force each level.
        self.isa = resolve_isa(isa)
        self._ops = load_kernels(build_root, isa=self.isa)
        self._fallback = TorchPagedAttention()

    @property
    def uses_avx2(self) -> bool:
        """True when the loaded build runs the AVX2/FMA code path."""
        return bool(self._ops.built_with_avx2())

    @property
    def vector_path(self) -> str:
        """The widest vector code compiled into the loaded build (``avx512bf16`` ... ``scalar``)."""
        return str(self._ops.built_isa())

    def describe(self) -> str:
        return f"{self.isa} build, {self.vector_path} vector code"

    def write_kv(
        self,
        key: torch.Tensor,  # [num_tokens, num_kv_heads, head_size]
        value: torch.Tensor,  # [num_tokens, num_kv_heads, head_size]
        kv_cache: torch.Tensor,  # [2, num_blocks, num_kv_heads, block_size, head_size]
        slot_mapping: torch.Tensor,  # [num_tokens] int64
        *,
        k_scale: float = 1.0,
        v_scale: float = 1.0,
    ) -> None:
        ks, vs = _scales(kv_cache, k_scale, v_scale)
        if (
            _kernel_ok(key, kv_cache)
            and _kernel_ok(value, kv_cache)
            and key.dtype == value.dtype
            and slot_mapping.is_cpu
        ):
            slots = _as_kernel_index(slot_mapping, torch.int64)
            self._ops.reshape_and_cache(key, value, kv_cache, slots, ks, vs)
            return
        self._fallback.write_kv(key, value, kv_cache, slot_mapping, k_scale=ks, v_scale=vs)

    def forward(
        self,
        query: torch.Tensor,  # [num_tokens, num_heads, head_size]
        kv_cache: torch.Tensor,  # [2, num_blocks, num_kv_heads, block_size, head_size]
        meta: AttentionMetadata,
        scale: float,
        *,
        sliding_window: int | None = None,
        logits_soft_cap: float | None = None,
        k_scale: float = 1.0,
        v_scale: float = 1.0,
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_size]
        ks, vs = _scales(kv_cache, k_scale, v_scale)
        if not _kernel_ok(query, kv_cache):
            return self._fallback.forward(
                query,
                kv_cache,
                meta,
                scale,
                sliding_window=sliding_window,
                logits_soft_cap=logits_soft_cap,
                k_scale=ks,
                v_scale=vs,
            )
        if meta.num_seqs == 0:
            return torch.empty_like(query)
        return self._ops.paged_attention(
            query,
            kv_cache,
            _as_kernel_index(meta.block_tables, torch.int32),
            _as_kernel_index(meta.seq_lens, torch.int32),
            _as_kernel_index(meta.query_start_loc, torch.int32),
            float(scale),
            int(sliding_window or 0),
            ks,
            vs,
            float(logits_soft_cap or 0.0),
        )

    def copy_blocks(self, kv_caches: list[torch.Tensor], pairs: torch.Tensor) -> None:
        """Copy-on-write in every layer with one parallel memcpy pass (any dtype)."""
        if pairs.numel() == 0 or not kv_caches:
            return
        if all(c.device.type == "cpu" and c.is_contiguous() for c in kv_caches):
            self._ops.copy_blocks(kv_caches, pairs.to("cpu", torch.int64).contiguous())
        else:
            super().copy_blocks(kv_caches, pairs)

    def swap_blocks(self, src: torch.Tensor, dst: torch.Tensor, pairs: torch.Tensor) -> None:
        """Block moves between two CPU pools by memcpy; other devices take the generic path."""
        if pairs.numel() == 0:
            return
        if (
            src.device.type == "cpu"
            and dst.device.type == "cpu"
            and src.is_contiguous()
            and dst.is_contiguous()
            and src.dtype == dst.dtype
        ):
            self._ops.swap_blocks(src, dst, pairs.to("cpu", torch.int64).contiguous())
        else:
            super().swap_blocks(src, dst, pairs)

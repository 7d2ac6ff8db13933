"""The CPU device: float32 or 16-bit compute (see :func:`auto_dtype`), an explicit KV budget
(``kv_cache_space``), gloo for TP."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import ClassVar

import torch

from pagedllm.backends.base import DeviceBackend
from pagedllm.backends.kernels import KernelOrder

logger = logging.getLogger(__name__)


def physical_cores() -> int:
    """Cores this process may run on, counting hyper-threads of one core once."""
    allowed = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None
    cores: set[tuple[str, str]] = set()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = package = None
            for line in f:
                key, _, value = line.partition(":")
                key, value = key.strip(), value.strip()
                if key == "processor":
                    cpu = int(value)
                elif key == "physical id":
                    package = value
                elif key == "core id" and (allowed is None or cpu in allowed):
                    cores.add((package or "0", value))
    except (OSError, ValueError):
        pass
    return len(cores) or len(allowed or ()) or os.cpu_count() or 1


class CpuBackend(DeviceBackend):
    name = "cpu"
    kernel_order: ClassVar[KernelOrder] = {
        # The C++ kernels, else batched PyTorch when they cannot build (no compiler, say).
        "attention": ("cpp", "torch"),
        # Per layer the fastest correct GEMM for its weight format (see packed_linear); 4-bit,
        # Q8_0, Q6_K and Q5_K groups stay packed: decode streams a quarter (a half, 0.54, 0.63)
        # of the bf16 bytes.
        "linear": ("cpp",),
        "moe": ("cpp",),
        # One-pass row kernels (layer_kernels): the PyTorch chains cost more than their
        # arithmetic at decode sizes.
        "norm": ("cpp",),
        "activation": ("cpp",),
        "rotary": ("cpp",),
        # Decode-only steps of a Llama-shaped, group-wise packed model: every layer in one C++
        # call (backends/cpu/decode_stack; after the installers above, whose kernels it calls).
        "decode_stack": ("cpp",),
        # Encoders' cache-free attention: SDPA over the padded batch (backends/encoder_attention).
        "encoder_attention": ("torch",),
        # csrc/sampling.cpp: no sort and one random number per row; PyTorch's sort-based
        # top-k/top-p and per-token noise took 60-150 ms for 64 rows of 32,000 logits.
        "sample": ("cpp",),
        # The per-row quantiser: one threaded pass per row where PyTorch's definition made ~8
        # (most of an int8 1B model's load).
        "int8_quantize": ("cpp",),
        # csrc/gguf_decode.cpp: one threaded pass per tensor (numpy's made several).
        "gguf_decode": ("cpp",),
        "lora": ("torch",),
    }
    kv_pool_in_host_memory = True

    def preload_packed_layers(
        self, model: torch.nn.Module, *, int8_activations: bool = False
    ) -> frozenset[str]:
        """The layers whose panels the packed-weight cache holds (``packed_linear``), where the
        chosen linear installer is the one that reads that cache."""
        from pagedllm.backends.cpu import packed_linear

        chosen = self.kernel("linear").kernel
        if chosen is None or not chosen.target.endswith(":pack_linear_layers"):
            return frozenset()
        return packed_linear.preload_packed_layers(model, int8_activations=int8_activations)

    @classmethod
    def is_available(cls) -> bool:
        return True

    def device(self, rank: int = 0) -> torch.device:
        return torch.device("cpu")

    def configure_threads(self, world_size: int = 1, total: int | None = None) -> None:
        """Intra-op threads = ``total`` or the physical cores, shared evenly by co-located TP
        ranks (more threads than cores only make each parallel region wait for a thread the
        kernel has parked)."""
        threads = max(1, (total or physical_cores()) // max(1, world_size))
        if torch.get_num_threads() != threads:
            torch.set_num_threads(threads)
            logger.info("using %d intra-op threads", threads)

    def free_memory_bytes(self, rank: int = 0) -> int:
        try:
            return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (ValueError, OSError):
            return 0

    def total_memory_bytes(self, rank: int = 0) -> int:
        try:
            return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (ValueError, OSError):
            return 0

    def kv_cache_budget_bytes(
        self,
        *,
        profile: Callable[[], object],
        gpu_memory_utilization: float,
        cpu_kv_cache_bytes: int,
        rank: int = 0,
    ) -> int:
        """The CPU's KV budget is explicit (``kv_cache_space``), so no profiling pass is run.

        A forward pass over a full token budget decides nothing here and cost most of the engine
        start on a 1B model (40 of 48 s); activations of a step are bounded by the token budget
        and are small beside the weights and the cache the user sized.
        """
        del profile, gpu_memory_utilization, rank
        return cpu_kv_cache_bytes

    def dist_backend(self) -> str:
        return "gloo"

    def default_dtype(self, model_dtype: torch.dtype) -> torch.dtype:
        """``dtype="auto"``: the rule of :func:`auto_dtype` on this processor, logged with why."""
        from pagedllm.backends.cpu._ops import cpu_flags

        dtype, reason = auto_dtype(model_dtype, cpu_flags())
        logger.info("dtype auto -> %s (%s)", str(dtype).removeprefix("torch."), reason)
        return dtype


# Flags that mean the processor computes a 16-bit type natively (dot products, tile GEMMs).
NATIVE_16BIT_FLAGS: dict[torch.dtype, tuple[str, ...]] = {
    torch.bfloat16: ("amx_bf16", "avx512_bf16"),
    torch.float16: ("amx_fp16", "avx512_fp16"),
}


def auto_dtype(model_dtype: torch.dtype, flags: frozenset[str]) -> tuple[torch.dtype, str]:
    """The compute dtype for a checkpoint stored in ``model_dtype``, and the reason.

    The rule: a float32 checkpoint stays float32. A 16-bit checkpoint keeps its dtype
    (1) where the processor has native arithmetic for it (AMX or AVX-512 bf16/fp16), and
    (2) on AVX2 processors with F16C: decode reads every weight once per step, so halving the
    bytes outweighs widening 16-bit tiles to float32 inside the GEMM, and the weights take half
    the memory. Anything else (no AVX2/F16C, or a processor that reports no x86 flags) computes in
    float32, which every kernel runs. An explicit ``dtype`` always overrides this.
    """
    name = str(model_dtype).removeprefix("torch.")
    if model_dtype not in NATIVE_16BIT_FLAGS:
        return torch.float32, f"checkpoint dtype is {name}"
    native = [f for f in NATIVE_16BIT_FLAGS[model_dtype] if f in flags]
    if native:
        return model_dtype, f"checkpoint dtype; processor has {native[0]}"
    if {"avx2", "f16c"} <= flags:
        return model_dtype, (
            f"checkpoint dtype; no native {name} arithmetic, but avx2/f16c GEMMs widen 16-bit "
            "tiles on the fly and the weights take half the memory of float32"
        )
    return (
        torch.float32,
        f"checkpoint is {name} but the processor reports neither avx2+f16c nor "
        + ("/".join(NATIVE_16BIT_FLAGS[model_dtype])),
    )

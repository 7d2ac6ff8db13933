"""The CPU device: float32 or 16-bit compute (see :func:`auto_dtype`), an explicit KV budget
(``kv_cache_space``), gloo for TP."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from pagedllm.backends.base import DeviceBackend

if TYPE_CHECKING:
    from pagedllm.layers.quantization import WeightQuantizer
    from pagedllm.layers.sampler import SampleKernel

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
    # The C++ kernels, else batched PyTorch when they cannot build (no compiler, say).
    attention_kinds = ("cpp", "torch")
    kv_pool_in_host_memory = True

    @classmethod
    def is_available(cls) -> bool:
        return True

    def device(self, rank: int = 0) -> torch.device:
        return torch.device("cpu")

    # Which GEMM each kind of linear layer got (e.g. "QKVParallelLinear=cpp-bf16-avx2, ..."),
    # set by prepare_model so that benchmarks can name it.
    linear_path = ""
    layer_kernels = ""  # what install_layer_kernels put in, for the log and benchmarks

    def prepare_model(self, model: torch.nn.Module, *, int8_activations: bool = False) -> None:
        """Per layer, the fastest correct GEMM for its weight dtype (see packed_linear), and the
        one-pass norm, activation and rotary kernels (see layer_kernels)."""
        from pagedllm.backends.cpu.fused_moe import pack_moe_layers
        from pagedllm.backends.cpu.layer_kernels import install_layer_kernels
        from pagedllm.backends.cpu.packed_linear import pack_linear_layers

        paths = pack_linear_layers(model, int8_activations=int8_activations)
        self.linear_path = ", ".join(f"{kind}={path}" for kind, path in paths.items())
        moe = pack_moe_layers(model, int8_activations=int8_activations)
        if moe:
            self.linear_path += ", " + moe
        model.linear_path = self.linear_path
        self.layer_kernels = install_layer_kernels(model)
        model.layer_kernels = self.layer_kernels

    def sample_kernel(self) -> SampleKernel | None:
        """The C++ sampler (csrc/sampling.cpp): no sort and one random number per row; PyTorch's
        sort-based top-k/top-p and per-token noise took 60-150 ms for 64 rows of 32,000 logits."""
        from pagedllm.backends.cpu.layer_kernels import sample_kernel

        return sample_kernel()

    def int8_quantizer(self) -> WeightQuantizer | None:
        """The C++ per-row quantiser (one vectorised pass per row, threaded; the PyTorch
        definition made ~8 passes and was most of an int8 1B model's load), where it builds."""
        from pagedllm.backends.cpu.packed_linear import cpp_weight_quantizer

        return cpp_weight_quantizer()

    def gguf_block_decoder(
        self,
    ) -> Callable[[torch.Tensor, str], tuple[torch.Tensor, ...]] | None:
        """The C++ decoder (csrc/gguf_decode.cpp: one threaded pass per tensor), where it
        builds."""
        from pagedllm.backends.cpu.packed_linear import gemm_ops

        ops = gemm_ops()
        return None if ops is None else ops.decode_gguf_blocks

    def native_weight_formats(self) -> frozenset[str]:
        """4-bit, Q8_0, Q6_K and Q5_K groups stay packed: decode streams a quarter (a half,
        0.54, 0.63) of the bf16 bytes, and ``prepare_model`` gives those layers the C++
        group-wise GEMM."""
        from pagedllm.backends.cpu.packed_linear import groupwise_formats

        return groupwise_formats()

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

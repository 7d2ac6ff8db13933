"""The CUDA device: our Triton kernels, allocator-based KV sizing, NCCL for tensor parallelism.

Nothing here imports triton at module level: ``is_available()`` only asks whether it could be
imported, so ``import pagedllm`` and ``device="auto"`` work on machines without it.

dtype policy for ``dtype="auto"``: float16 and bfloat16 checkpoints keep their dtype; a float32
checkpoint runs in bfloat16 where the GPU supports it (same exponent range as float32, so models
trained in float32/bfloat16 do not overflow), else in float16 (what vLLM does everywhere).
Full float32 stays available by asking for it explicitly.
"""

from __future__ import annotations

import importlib.util
import logging
from collections.abc import Callable

import torch

from pagedllm.backends.base import AttentionBackend, CacheEngine, CacheSpec, DeviceBackend

logger = logging.getLogger(__name__)

_ATTENTION_KINDS = ("auto", "triton", "reference")


class CudaBackend(DeviceBackend):
    """NVIDIA GPUs through PyTorch's CUDA runtime and our Triton paged-attention kernels."""

    name = "cuda"
    ray_resource = "GPU"

    @classmethod
    def is_available(cls) -> bool:
        """A CUDA device is visible and triton is installed; never raises."""
        try:
            if not torch.cuda.is_available() or torch.cuda.device_count() == 0:
                return False
            if importlib.util.find_spec("triton") is None:
                logger.info("CUDA is present but triton is not installed: cuda backend disabled")
                return False
            return True
        except Exception as exc:  # a broken driver must not break device="auto"
            logger.info("CUDA probe failed: %s", exc)
            return False

    def device(self, rank: int = 0) -> torch.device:
        return torch.device("cuda", rank)

    def attention(self, kind: str | None = None) -> AttentionBackend:
        """Kinds: "auto" or "triton" (our kernels), "reference" (the slow plain-PyTorch oracle)."""
        kind = kind or "auto"
        if kind in ("auto", "triton"):
            from pagedllm.backends.gpu.attention import TritonPagedAttention

            return TritonPagedAttention()
        if kind == "reference":
            from pagedllm.backends.reference import ReferenceAttention

            return ReferenceAttention()
        raise ValueError(
            f"attention_backend: {kind!r} is not a CUDA attention backend; "
            f"choose one of {list(_ATTENTION_KINDS)}"
        )

    def prepare_model(self, model: torch.nn.Module) -> None:
        """Mixture-of-experts layers run the Triton fused-MoE kernels (float and 16-bit experts;
        int8 experts keep the layer's PyTorch path)."""
        import functools

        from pagedllm.backends.gpu.fused_moe import fused_moe
        from pagedllm.layers.fused_moe import FusedMoE

        for layer in model.modules():
            if isinstance(layer, FusedMoE) and not layer.is_int8:
                layer.fast_moe = functools.partial(_run_fused_moe, fused_moe, layer)
                layer.path = "triton"

    def make_cache_engine(
        self,
        spec: CacheSpec,
        num_device_blocks: int,
        num_host_blocks: int,
        *,
        attention: AttentionBackend,
        rank: int = 0,
    ) -> CacheEngine:
        from pagedllm.backends.gpu.cache_engine import CudaCacheEngine

        return CudaCacheEngine(
            spec,
            attention,
            device=self.device(rank),
            num_device_blocks=num_device_blocks,
            num_host_blocks=num_host_blocks,
        )

    def free_memory_bytes(self, rank: int = 0) -> int:
        free, _ = torch.cuda.mem_get_info(self.device(rank))
        return int(free)

    def total_memory_bytes(self, rank: int = 0) -> int:
        _, total = torch.cuda.mem_get_info(self.device(rank))
        return int(total)

    def profile_peak_bytes(self, fn: Callable[[], object], rank: int = 0) -> int:
        """Peak bytes the caching allocator needed for ``fn`` beyond what was already held.

        Activations of a dummy forward are the quantity the KV budget must leave room for.
        """
        dev = self.device(rank)
        torch.cuda.synchronize(dev)
        torch.cuda.reset_peak_memory_stats(dev)
        before = torch.cuda.memory_allocated(dev)
        fn()
        torch.cuda.synchronize(dev)
        return max(0, int(torch.cuda.max_memory_allocated(dev)) - int(before))

    def kv_cache_budget_bytes(
        self,
        *,
        profile: Callable[[], object],
        gpu_memory_utilization: float,
        cpu_kv_cache_bytes: int,
        rank: int = 0,
    ) -> int:
        """``total * utilization`` minus everything in use at the profiled peak.

        In use = what the device already held before profiling (weights, CUDA context, other
        processes: ``total - free``) + the allocator's activation peak during ``profile`` + memory
        that grew outside PyTorch's allocator meanwhile (cuBLAS workspaces, NCCL buffers).
        """
        dev = self.device(rank)
        torch.cuda.empty_cache()
        free_before, total = torch.cuda.mem_get_info(dev)
        reserved_before = torch.cuda.memory_reserved(dev)
        activation_peak = self.profile_peak_bytes(profile, rank)
        free_after, _ = torch.cuda.mem_get_info(dev)
        reserved_after = torch.cuda.memory_reserved(dev)
        outside_torch = max(0, (free_before - free_after) - (reserved_after - reserved_before))
        torch.cuda.empty_cache()  # hand the profiling activations back before the KV cache
        in_use = (total - free_before) + activation_peak + outside_torch
        budget = int(total * gpu_memory_utilization) - int(in_use)
        gib = float(1 << 30)
        logger.info(
            "KV budget %.2f GiB = %.2f GiB x %.2f - held %.2f - activations %.2f - other %.2f",
            budget / gib,
            total / gib,
            gpu_memory_utilization,
            (total - free_before) / gib,
            activation_peak / gib,
            outside_torch / gib,
        )
        return max(0, budget)

    def synchronize(self, rank: int = 0) -> None:
        torch.cuda.synchronize(self.device(rank))

    def dist_backend(self) -> str:
        return "nccl"

    def default_dtype(self, model_dtype: torch.dtype) -> torch.dtype:
        if model_dtype in (torch.float16, torch.bfloat16):
            return model_dtype
        try:
            bf16 = torch.cuda.is_available() and torch.cuda.is_bf16_supported()
        except Exception:  # no usable device: the caller fails later with a clearer error
            bf16 = False
        return torch.bfloat16 if bf16 else torch.float16


def _run_fused_moe(
    kernel: Callable[..., torch.Tensor],
    layer: torch.nn.Module,
    x: torch.Tensor,  # [T, H]
    topk_weights: torch.Tensor,  # [T, k]
    topk_ids: torch.Tensor,  # [T, k]
) -> torch.Tensor:
    return kernel(
        x, layer.w13_weight, layer.w2_weight, topk_weights, topk_ids,
        expert_start=layer.expert_start,
    )  # fmt: skip

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
from typing import ClassVar

import torch

from pagedllm.backends.base import DeviceBackend
from pagedllm.backends.kernels import KernelOrder

logger = logging.getLogger(__name__)


class CudaBackend(DeviceBackend):
    """NVIDIA GPUs through PyTorch's CUDA runtime and our Triton paged-attention kernels."""

    name = "cuda"
    ray_resource = "GPU"
    kernel_order: ClassVar[KernelOrder] = {
        "attention": ("triton",),
        # Float and 16-bit experts on the Triton fused-MoE kernels (int8 experts keep the
        # layer's PyTorch path).
        "moe": ("triton",),
        # Multi-LoRA shrink/expand as Triton segmented GEMMs (one launch each per layer).
        "lora": ("triton", "torch"),
        "encoder_attention": ("torch",),
        # Decode steps' layer loop captured once per batch bucket and replayed.
        "decode_stack": ("cuda_graph",),
    }
    # Pinned host pool, swaps and copies on a side stream.
    cache_engine_class = "pagedllm.backends.gpu.cache_engine:CudaCacheEngine"
    pin_host_tier = True  # the lower KV tiers' host slab, as the swap pool is

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

    def mem_get_info(self, rank: int = 0) -> tuple[int, int]:
        free, total = torch.cuda.mem_get_info(self.device(rank))
        return int(free), int(total)

    def memory_reserved(self, rank: int = 0) -> int:
        return int(torch.cuda.memory_reserved(self.device(rank)))

    def profile_peak_bytes(self, fn: Callable[[], object], rank: int = 0) -> int:
        dev = self.device(rank)
        torch.cuda.synchronize(dev)
        torch.cuda.reset_peak_memory_stats(dev)
        before = torch.cuda.memory_allocated(dev)
        fn()
        torch.cuda.synchronize(dev)
        return max(0, int(torch.cuda.max_memory_allocated(dev)) - int(before))

    def empty_cache(self, rank: int = 0) -> None:
        torch.cuda.empty_cache()

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

"""The XPU device (Intel GPUs): IPEX paged attention, allocator-based KV sizing, XCCL/oneCCL for TP.

PyTorch has native XPU support since 2.5 (``torch.xpu``), so the device itself needs no extra
package; the attention kernels come from intel-extension-for-pytorch (``"ipex"``) or, where only
Triton with its Intel backend is installed, from our Triton kernels (``"triton"``). Neither is
imported here at module level: ``import pagedllm`` and ``device="auto"`` work without them.

dtype policy for ``dtype="auto"``: float16 and bfloat16 checkpoints keep their dtype; a float32
checkpoint runs in bfloat16, which every Intel data-center GPU supports natively and which keeps
float32's exponent range. Full float32 stays available by asking for it explicitly.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import ClassVar

import torch

from pagedllm.backends.base import DeviceBackend
from pagedllm.backends.kernels import KernelOrder

logger = logging.getLogger(__name__)


def triton_supports_xpu() -> bool:
    """True when triton is importable and has its Intel GPU backend (pytorch-triton-xpu)."""
    try:
        from triton.backends import backends  # type: ignore[import-not-found]
    except Exception:  # not installed, or a broken install: either way not usable
        return False
    return "intel" in backends


class XpuBackend(DeviceBackend):
    """Intel GPUs through PyTorch's native XPU runtime."""

    name = "xpu"
    ray_resource = "GPU"
    # IPEX's kernels, else our Triton kernels where triton has its Intel backend (the registry's
    # triton row requires triton_supports_xpu() here). A missing IPEX then fails with the
    # ImportError that says what to install.
    kernel_order: ClassVar[KernelOrder] = {
        "attention": ("ipex", "triton"),
        "lora": ("torch",),
        "encoder_attention": ("torch",),
    }

    @classmethod
    def is_available(cls) -> bool:
        """An XPU device is visible to this torch build; never raises."""
        try:
            xpu = getattr(torch, "xpu", None)
            return bool(xpu is not None and xpu.is_available() and xpu.device_count() > 0)
        except Exception as exc:  # a broken driver must not break device="auto"
            logger.info("XPU probe failed: %s", exc)
            return False

    def device(self, rank: int = 0) -> torch.device:
        return torch.device("xpu", rank)

    def mem_get_info(self, rank: int = 0) -> tuple[int, int]:
        """The driver's free/total; total minus reserved where it cannot say what is free."""
        total = int(torch.xpu.get_device_properties(rank).total_memory)
        try:
            free, _ = torch.xpu.mem_get_info(rank)
            return int(free), total
        except (AttributeError, RuntimeError) as exc:
            # Older drivers lack the free-memory query (it needs ZES_ENABLE_SYSMAN=1 on some).
            logger.info("torch.xpu.mem_get_info failed (%s); using total - reserved", exc)
            return max(0, total - self.memory_reserved(rank)), total

    def memory_reserved(self, rank: int = 0) -> int:
        return int(torch.xpu.memory_reserved(rank))

    def profile_peak_bytes(self, fn: Callable[[], object], rank: int = 0) -> int:
        torch.xpu.synchronize(rank)
        torch.xpu.reset_peak_memory_stats(rank)
        before = int(torch.xpu.memory_allocated(rank))
        fn()
        torch.xpu.synchronize(rank)
        return max(0, int(torch.xpu.max_memory_allocated(rank)) - before)

    def empty_cache(self, rank: int = 0) -> None:
        torch.xpu.empty_cache()

    def synchronize(self, rank: int = 0) -> None:
        torch.xpu.synchronize(rank)

    def dist_backend(self) -> str:
        """XCCL ("xccl") is built into torch >= 2.8 XPU builds; older ones use oneCCL ("ccl")."""
        try:
            import torch.distributed as dist

            if dist.is_available() and getattr(dist, "is_xccl_available", lambda: False)():
                return "xccl"
        except Exception as exc:  # report, then fall back to the plug-in library
            logger.info("torch.distributed XCCL probe failed: %s", exc)
        return "ccl"

    def default_dtype(self, model_dtype: torch.dtype) -> torch.dtype:
        if model_dtype in (torch.float16, torch.bfloat16):
            return model_dtype
        return torch.bfloat16

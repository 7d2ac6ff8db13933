"""The KV memory every device shares, kept apart from the interfaces in ``base.py``.

``base.py`` is what a backend implements; the cache engine is already implemented: the per-layer
tensors in the attention backend's layout, a host twin for swapping, and block moves through the
backend's ops. A device subclasses it only to change where memory lives (pinned host memory, a
side stream), named by ``DeviceBackend.cache_engine_class``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from pagedllm.backends.base import AttentionBackend

__all__ = ["CacheEngine", "CacheSpec"]


@dataclass(frozen=True)
class CacheSpec:
    """What the model needs stored per token; the cache engine turns it into tensors."""

    num_layers: int
    num_kv_heads: int  # per worker, after tensor-parallel sharding
    head_size: int
    block_size: int
    dtype: torch.dtype  # what the cache stores (kv_cache_dtype), not necessarily the compute dtype


class CacheEngine:
    """Owns every layer's KV tensor on the device and its twin in host swap space.

    The layout comes from the attention backend; the block moves go through the backend's ops,
    so a subclass only changes where memory lives (pinned host memory, a side stream).
    """

    def __init__(
        self,
        spec: CacheSpec,
        attention: AttentionBackend,
        *,
        device: torch.device,
        num_device_blocks: int,
        num_host_blocks: int,
        pin_host_memory: bool = False,
        fill_value: float | None = None,
    ) -> None:
        self.spec = spec
        self.attention = attention
        self.device = device
        self.num_device_blocks = num_device_blocks
        self.num_host_blocks = num_host_blocks
        dev_shape = attention.kv_cache_shape(
            num_device_blocks, spec.block_size, spec.num_kv_heads, spec.head_size
        )
        host_shape = attention.kv_cache_shape(
            num_host_blocks, spec.block_size, spec.num_kv_heads, spec.head_size
        )
        # torch.empty: pages are touched only when blocks are written, so a large budget is cheap.
        self.kv_caches: list[torch.Tensor] = [
            torch.empty(dev_shape, dtype=spec.dtype, device=device) for _ in range(spec.num_layers)
        ]
        self.host_caches: list[torch.Tensor] = [
            torch.empty(host_shape, dtype=spec.dtype, device="cpu", pin_memory=pin_host_memory)
            for _ in range(spec.num_layers)
        ]
        if fill_value is not None:
            # Tests fill every pool (NaN) to prove no kernel reads a slot that was never written.
            for cache in (*self.kv_caches, *self.host_caches):
                cache.fill_(fill_value)

    @staticmethod
    def bytes_per_block(spec: CacheSpec) -> int:
        elem = torch.empty((), dtype=spec.dtype).element_size()
        return 2 * spec.num_layers * spec.block_size * spec.num_kv_heads * spec.head_size * elem

    @staticmethod
    def _pairs(pairs: Sequence[tuple[int, int]]) -> torch.Tensor:
        return torch.tensor(list(pairs), dtype=torch.int64).reshape(-1, 2)

    def swap_in(self, pairs: Sequence[tuple[int, int]]) -> None:
        """Host block ``a`` -> device block ``b`` for each ``(a, b)``."""
        if pairs:
            t = self._pairs(pairs)
            for host, dev in zip(self.host_caches, self.kv_caches, strict=True):
                self.attention.swap_blocks(host, dev, t)

    def swap_out(self, pairs: Sequence[tuple[int, int]]) -> None:
        """Device block ``a`` -> host block ``b`` for each ``(a, b)``."""
        if pairs:
            t = self._pairs(pairs)
            for dev, host in zip(self.kv_caches, self.host_caches, strict=True):
                self.attention.swap_blocks(dev, host, t)

    def copy(self, pairs: Sequence[tuple[int, int]]) -> None:
        """Copy-on-write between device blocks."""
        if pairs:
            self.attention.copy_blocks(self.kv_caches, self._pairs(pairs).to(self.device))

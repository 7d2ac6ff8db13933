"""The CUDA cache engine: pinned host swap pool, block moves on a side stream.

Swaps run on their own stream so a large swap-out overlaps the scheduler's host work; ordering is
kept with events, never a host-side synchronize:

* before a swap or copy the side stream waits for the compute stream, so blocks being swapped out
  or copied already hold what earlier forwards wrote;
* after it, the compute stream waits for the side stream, so the next forward (queued after the
  cache ops by the worker) sees the moved blocks.

Host memory is pinned, which makes the per-block ``copy_(non_blocking=True)`` of
:meth:`TritonPagedAttention.swap_blocks` real asynchronous DMA. On a CPU device (tests) there is
no stream and the moves run inline.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from pagedllm.backends.base import AttentionBackend, CacheEngine, CacheSpec


class CudaCacheEngine(CacheEngine):
    """:class:`CacheEngine` whose swap_in / swap_out / copy are queued on a side CUDA stream."""

    def __init__(
        self,
        spec: CacheSpec,
        attention: AttentionBackend,
        *,
        device: torch.device,
        num_device_blocks: int,
        num_host_blocks: int,
        fill_value: float | None = None,
    ) -> None:
        on_cuda = device.type == "cuda"
        super().__init__(
            spec,
            attention,
            device=device,
            num_device_blocks=num_device_blocks,
            num_host_blocks=num_host_blocks,
            pin_host_memory=on_cuda,
            fill_value=fill_value,
        )
        self._stream: torch.cuda.Stream | None = torch.cuda.Stream(device) if on_cuda else None

    def _on_side_stream(self, op: Callable[[], None]) -> None:
        """Run ``op`` on the side stream, ordered after and before the compute stream's work."""
        if self._stream is None:
            op()
            return
        compute = torch.cuda.current_stream(self.device)
        self._stream.wait_stream(compute)
        with torch.cuda.stream(self._stream):
            op()
        compute.wait_stream(self._stream)

    def swap_in(self, pairs: Sequence[tuple[int, int]]) -> None:
        """Host block ``a`` -> device block ``b``, asynchronously on the side stream."""
        if pairs:
            self._on_side_stream(lambda: CacheEngine.swap_in(self, pairs))

    def swap_out(self, pairs: Sequence[tuple[int, int]]) -> None:
        """Device block ``a`` -> host block ``b``; the host copy is complete before any later
        forward runs, and before the host reads it (:meth:`synchronize`)."""
        if pairs:
            self._on_side_stream(lambda: CacheEngine.swap_out(self, pairs))

    def copy(self, pairs: Sequence[tuple[int, int]]) -> None:
        """Copy-on-write between device blocks, on the side stream."""
        if pairs:
            self._on_side_stream(lambda: CacheEngine.copy(self, pairs))

    def synchronize(self) -> None:
        """Block the host until queued block moves are done (tests, shutdown)."""
        if self._stream is not None:
            self._stream.synchronize()

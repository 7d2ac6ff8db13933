"""A decode step padded to a bucket: the static input buffers a captured step reads.

A captured CUDA graph replays fixed kernels on fixed addresses with fixed launch grids. So a
decode step of ``n`` sequences runs as the graph of the smallest batch bucket ``b >= n`` and of
the smallest context capacity ``C >= max_seq_len`` (the Triton decode kernel's grid is sized from
the longest context, a Python int frozen at capture), with its inputs copied into buffers that
every graph reads, and ``b - n`` padded rows that must neither write a real cache slot nor read
anything a real row depends on:

* slot -1 (the cache-write kernel stores nothing for a negative slot);
* one context token (``seq_len`` 1) at position 0, in block 0 of the table: it reads one key
  and value, whatever they hold, for its own row only; every op of the step is row-wise or per
  sequence, so nothing flows from a padded row into a real one;
* its hidden state is whatever the buffer held (finite values of an earlier step, or zeros).

This module knows nothing of the capture: the same buffers run eagerly on the CPU (the Triton
kernels under the interpreter), which is how the padding is tested without a GPU.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from pagedllm.backends.kv_layout import AttentionMetadata

#: vLLM's choice: every batch up to 4, then steps of 8 (a bucket wastes at most 7 rows).
BATCH_BUCKETS: tuple[int, ...] = (1, 2, 4, *range(8, 257, 8))
#: Context capacities are powers of two from here (shorter contexts share the smallest) ...
MIN_CAPACITY = 512
#: ... up to here; a step with a longer context runs eagerly (vLLM's max_seq_len_to_capture).
MAX_CAPACITY = 8192
PAD_SLOT = -1


def bucket_of(n: int, buckets: Sequence[int]) -> int | None:
    """The smallest bucket holding ``n`` rows (``buckets`` ascending); None past the largest."""
    i = bisect.bisect_left(buckets, n)
    return buckets[i] if i < len(buckets) else None


def capacity_of(max_seq_len: int, lo: int, hi: int) -> int | None:
    """The power-of-two context capacity (at least ``lo``) covering ``max_seq_len``; None
    above ``hi``."""
    cap = lo
    while cap < max_seq_len:
        cap *= 2
    return cap if cap <= hi else None


@dataclass
class PaddedStep:
    """One (bucket, capacity)'s view of the buffers: what a captured step is called with."""

    hidden: torch.Tensor  # [b, hidden]
    positions: torch.Tensor  # [b]
    meta: AttentionMetadata


class StaticDecodeInputs:
    """The buffers every bucket's step reads, sized for the largest bucket and capacity; a
    bucket's step reads their first ``b`` rows (and first ``C / block_size`` table columns)."""

    def __init__(
        self,
        max_batch: int,
        max_capacity: int,
        block_size: int,
        like: torch.Tensor,  # a step's hidden states: width, dtype and device of the buffer
    ) -> None:
        dev = like.device
        self.block_size = block_size
        self.max_batch = max_batch
        self.max_capacity = max_capacity
        self.hidden = torch.zeros((max_batch, like.shape[1]), dtype=like.dtype, device=dev)
        self.positions = torch.zeros(max_batch, dtype=torch.long, device=dev)
        self.slot_mapping = torch.full((max_batch,), PAD_SLOT, dtype=torch.long, device=dev)
        self.seq_lens = torch.ones(max_batch, dtype=torch.int32, device=dev)
        self.context_lens = torch.zeros(max_batch, dtype=torch.int32, device=dev)
        self.query_start_loc = torch.arange(max_batch + 1, dtype=torch.int32, device=dev)
        width = -(-max_capacity // block_size)
        self.block_tables = torch.zeros((max_batch, width), dtype=torch.int32, device=dev)

    def fits(self, hidden: torch.Tensor, block_size: int) -> bool:
        """Whether a step's hidden states can go into these buffers."""
        h = self.hidden
        return (
            block_size == self.block_size
            and hidden.dim() == 2
            and hidden.shape[1] == h.shape[1]
            and hidden.dtype == h.dtype
            and hidden.device == h.device
        )

    def view(self, batch: int, capacity: int) -> PaddedStep:
        """The step a graph of ``batch`` rows and contexts up to ``capacity`` tokens reads."""
        width = -(-capacity // self.block_size)
        meta = AttentionMetadata(
            num_prefills=0,
            num_prefill_tokens=0,
            num_decode_tokens=batch,
            slot_mapping=self.slot_mapping[:batch],
            seq_lens=self.seq_lens[:batch],
            context_lens=self.context_lens[:batch],
            query_start_loc=self.query_start_loc[: batch + 1],
            block_tables=self.block_tables[:batch, :width],
            # The kernels size their grids from these: the capacity, not this step's contexts.
            seq_lens_list=[capacity] + [1] * (batch - 1),
            query_lens_list=[1] * batch,
            max_query_len=1,
            max_seq_len=capacity,
            block_size=self.block_size,
        )
        return PaddedStep(self.hidden[:batch], self.positions[:batch], meta)

    def load(
        self,
        step: PaddedStep,
        hidden: torch.Tensor,  # [n, hidden], n <= the step's batch
        positions: torch.Tensor,  # [n]
        meta: AttentionMetadata,  # n decode sequences
    ) -> None:
        """Copy a decode step's ``n`` real rows into the buffers and make the rest padding."""
        n, b = hidden.shape[0], step.hidden.shape[0]
        pad = step.meta
        step.hidden[:n].copy_(hidden)
        step.positions[:n].copy_(positions)
        pad.slot_mapping[:n].copy_(meta.slot_mapping)
        pad.seq_lens[:n].copy_(meta.seq_lens)
        pad.context_lens[:n].copy_(meta.context_lens)
        # Columns past a sequence's last block are never read: a wider table (blocks held
        # ahead) is cut to the capacity's width, a narrower one leaves stale columns behind.
        width = min(meta.block_tables.shape[1], pad.block_tables.shape[1])
        pad.block_tables[:n, :width].copy_(meta.block_tables[:, :width])
        if n < b:
            step.positions[n:].zero_()
            pad.slot_mapping[n:].fill_(PAD_SLOT)
            pad.seq_lens[n:].fill_(1)
            pad.context_lens[n:].zero_()
            pad.block_tables[n:, :1].zero_()

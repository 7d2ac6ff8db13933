"""The batched LoRA shrink/expand in PyTorch: one GEMM pair per active slot, not per request.

Every LoRA-wrapped layer of a step shares one :class:`LoRAMapping`, built once by the model
runner: the step's adapter tokens sorted by slot (``perm``) and the segment of each slot in that
order. A layer then gathers its input rows once, runs ``shrink`` (``x @ A_s^T``) and ``expand``
(``@ B_s^T``) per segment, and scatters the sum back into the base output. This is the S-LoRA /
Punica idea (segmented GEMM); the GPU backend runs the same contract as Triton kernels.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# One padded bmm replaces the per-segment GEMMs while padding adds at most this factor of rows.
PAD_WASTE = 1.5


@dataclass(frozen=True)
class LoRAMapping:
    """Which tokens of a step run under which device slot.

    ``perm[i]`` is the flat token index of the i-th adapter token in slot order; segment ``j``
    covers ``perm[seg_start[j] : seg_start[j + 1]]`` and uses slot ``seg_slot[j]``. The Python
    lists drive the PyTorch path with no device sync; the tensors feed the kernels.

    Results come back to token order by a gather, not a scatter (``index_add_`` is a slow
    ``scatter_add`` on the CPU): ``inv[t]`` is token ``t``'s row in the slot-ordered results,
    or the extra zero row past them for a base-model token.
    """

    perm: torch.Tensor  # [num_lora_tokens] int64
    inv: torch.Tensor  # [num_tokens] int64, into num_lora_tokens + 1 rows
    segments: list[tuple[int, int, int]]  # (slot, start, end) in perm order
    seg_slot: torch.Tensor  # [num_segments] int32
    seg_start: torch.Tensor  # [num_segments + 1] int32
    max_seg_len: int
    num_tokens: int  # all tokens of the step (base ones included)
    # One padded bmm over every segment (None when padding would waste too much): each
    # segment padded to max_seg_len rows; ``pad_gather`` points padding rows at token 0 (their
    # results are never read), ``pad_inv`` is ``inv`` into the padded rows (+1 zero row).
    pad_gather: torch.Tensor | None = None  # [segments * max_seg_len] int64
    pad_inv: torch.Tensor | None = None  # [num_tokens] int64
    slot_index: torch.Tensor | None = None  # [segments] int64; None when slots are 0..S-1
    # The runner orders a step's sequences by slot, so the adapter tokens are usually one run
    # ``[lo, hi)`` of the batch already in slot order (no gather at all), and in a decode step
    # often in segments of one length (one strided bmm each way).
    token_range: tuple[int, int] | None = None
    equal_len: int | None = None

    @property
    def has_base_tokens(self) -> bool:
        return self.num_lora_tokens < self.num_tokens

    @property
    def num_lora_tokens(self) -> int:
        return self.segments[-1][2] if self.segments else 0

    @property
    def covers_all(self) -> bool:
        """Every token of the step runs one adapter (no gather needed)."""
        return len(self.segments) == 1 and self.num_lora_tokens == self.num_tokens


def _long(values: list[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.long).to(device)


def _padding(
    segments: list[tuple[int, int, int]],
    perm: list[int],
    num_tokens: int,
    longest: int,
    device: torch.device,
) -> dict[str, torch.Tensor | None]:
    """``pad_gather`` and ``pad_inv`` when padding every segment to the longest costs little."""
    if len(segments) == 1 or len(segments) * longest > PAD_WASTE * len(perm):
        return {"pad_gather": None, "pad_inv": None}
    padded = len(segments) * longest
    gather = [0] * padded
    pad_inv = [padded] * num_tokens
    for j, (_, b, e) in enumerate(segments):
        for r in range(e - b):
            gather[j * longest + r] = perm[b + r]
            pad_inv[perm[b + r]] = j * longest + r
    return {"pad_gather": _long(gather, device), "pad_inv": _long(pad_inv, device)}


def build_mapping(
    seq_slots: list[int], seq_lens: list[int], device: torch.device
) -> LoRAMapping | None:
    """The step's mapping from each scheduled sequence's slot (-1: base) and token count.

    A sequence's tokens are contiguous in the flat batch, so sorting is over sequences, once
    per step; a slot's segment follows the order in which slots first appear (ascending slots
    when the runner sorted the batch). None when no token of the step runs an adapter.
    """
    starts: list[int] = []
    pos = 0
    for n in seq_lens:
        starts.append(pos)
        pos += n
    by_slot: dict[int, list[int]] = {}
    for i, slot in enumerate(seq_slots):
        if slot >= 0:
            by_slot.setdefault(slot, []).append(i)
    if not by_slot:
        return None
    perm: list[int] = []
    segments: list[tuple[int, int, int]] = []
    for slot in by_slot:
        begin = len(perm)
        for i in by_slot[slot]:
            perm.extend(range(starts[i], starts[i] + seq_lens[i]))
        segments.append((slot, begin, len(perm)))
    inv = [len(perm)] * pos
    for row, token in enumerate(perm):
        inv[token] = row
    bounds = [s for _, s, _ in segments] + [segments[-1][2]]
    longest = max(e - b for _, b, e in segments)
    pads = _padding(segments, perm, pos, longest, device)
    slot_ids = [s for s, _, _ in segments]
    contiguous = slot_ids == list(range(len(slot_ids)))
    lengths = {e - b for _, b, e in segments}
    one_run = perm == list(range(perm[0], perm[0] + len(perm)))
    return LoRAMapping(
        perm=_long(perm, device),
        inv=_long(inv, device),
        segments=segments,
        seg_slot=torch.tensor(slot_ids, dtype=torch.int32).to(device),
        seg_start=torch.tensor(bounds, dtype=torch.int32).to(device),
        max_seg_len=longest,
        num_tokens=pos,
        slot_index=None if contiguous else _long(slot_ids, device),
        token_range=(perm[0], perm[0] + len(perm)) if one_run else None,
        equal_len=longest if len(lengths) == 1 else None,
        **pads,
    )


def _slot_weights(
    lora_a: torch.Tensor, lora_b: torch.Tensor, mapping: LoRAMapping
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each segment's A and B stacked: views when the segments use slots 0..S-1 in order."""
    if mapping.slot_index is None:
        segs = len(mapping.segments)
        return lora_a[:segs], lora_b[:segs]
    return lora_a.index_select(0, mapping.slot_index), lora_b.index_select(0, mapping.slot_index)


class TorchLoRAOps:
    """Segmented GEMMs with torch.mm: the CPU and XPU path (and the kernels' reference).

    With several segments of similar length (a decode step mixing adapters) the segments are
    padded into one ``bmm`` each way instead, a few large calls rather than two per slot.
    """

    name = "torch"

    def __call__(
        self,
        y: torch.Tensor,  # [num_tokens, out], updated in place
        x: torch.Tensor,  # [num_tokens, in]
        lora_a: torch.Tensor,  # [max_loras, k, in]
        lora_b: torch.Tensor,  # [max_loras, out, k]
        mapping: LoRAMapping,
    ) -> None:
        """Shrink and expand in one go (no collective between them)."""
        if mapping.token_range is not None and mapping.equal_len is not None:
            self._strided(y, x, lora_a, lora_b, mapping)
            return
        if mapping.pad_gather is None or mapping.pad_inv is None:
            if mapping.token_range is not None:  # sorted: each segment is a slice of the batch
                lo = mapping.token_range[0]
                for slot, begin, end in mapping.segments:
                    rows = slice(lo + begin, lo + end)
                    y[rows].addmm_(torch.mm(x[rows], lora_a[slot].t()), lora_b[slot].t())
                return
            self.expand(y, self.shrink(x, lora_a, mapping), lora_b, mapping)
            return
        segs, longest = len(mapping.segments), mapping.max_seg_len
        a, b = _slot_weights(lora_a, lora_b, mapping)
        xs = x.index_select(0, mapping.pad_gather)  # [segs * longest, in]
        s = torch.bmm(xs.view(segs, longest, -1), a.transpose(1, 2))  # [segs, longest, k]
        delta = y.new_empty((segs * longest + 1, y.shape[1]))
        if mapping.has_base_tokens:
            delta[-1].zero_()  # the row base-model tokens read
        torch.bmm(s, b.transpose(1, 2), out=delta[:-1].view(segs, longest, -1))
        y.add_(delta.index_select(0, mapping.pad_inv))

    @staticmethod
    def _strided(
        y: torch.Tensor,
        x: torch.Tensor,
        lora_a: torch.Tensor,
        lora_b: torch.Tensor,
        mapping: LoRAMapping,
    ) -> None:
        """Segments of one length in one run of the batch: views, one bmm and one baddbmm."""
        assert mapping.token_range is not None and mapping.equal_len is not None
        lo, hi = mapping.token_range
        segs, length = len(mapping.segments), mapping.equal_len
        a, b = _slot_weights(lora_a, lora_b, mapping)
        s = torch.bmm(x[lo:hi].view(segs, length, -1), a.transpose(1, 2))  # [segs, len, k]
        y[lo:hi].view(segs, length, -1).baddbmm_(s, b.transpose(1, 2))

    def shrink(
        self,
        x: torch.Tensor,  # [num_tokens, in]
        lora_a: torch.Tensor,  # [max_loras, k, in]
        mapping: LoRAMapping,
    ) -> torch.Tensor:  # [num_lora_tokens, k] in slot order
        xs = x if mapping.covers_all else x.index_select(0, mapping.perm)
        out = x.new_empty((xs.shape[0], lora_a.shape[1]))
        for slot, begin, end in mapping.segments:
            torch.mm(xs[begin:end], lora_a[slot].t(), out=out[begin:end])
        return out

    def expand(
        self,
        y: torch.Tensor,  # [num_tokens, out], updated in place
        s: torch.Tensor,  # [num_lora_tokens, k] in slot order
        lora_b: torch.Tensor,  # [max_loras, out, k]
        mapping: LoRAMapping,
    ) -> None:
        if mapping.covers_all:
            slot = mapping.segments[0][0]
            y.addmm_(s, lora_b[slot].t())
            return
        n = s.shape[0]
        delta = y.new_empty((n + 1, y.shape[1]))
        if mapping.has_base_tokens:
            delta[n].zero_()  # the row base-model tokens read
        for slot, begin, end in mapping.segments:
            torch.mm(s[begin:end], lora_b[slot].t(), out=delta[begin:end])
        y.add_(delta.index_select(0, mapping.inv))

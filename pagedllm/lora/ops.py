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
import torch.nn.functional as F

# One padded bmm replaces the per-segment GEMMs while padding adds at most this factor of rows.
PAD_WASTE = 1.5


@dataclass(frozen=True)
class LoRAMapping:
    """Which tokens of a step run under which device slot.

    ``perm[i]`` is the flat token index of the i-th adapter token in slot order; segment ``j``
    covers ``perm[seg_start[j] : seg_start[j + 1]]`` and uses slot ``seg_slot[j]``. The Python
    lists drive the PyTorch path with no device sync; the tensors feed the kernels.
    """

    perm: torch.Tensor  # [num_lora_tokens] int64
    segments: list[tuple[int, int, int]]  # (slot, start, end) in perm order
    seg_slot: torch.Tensor  # [num_segments] int32
    seg_start: torch.Tensor  # [num_segments + 1] int32
    max_seg_len: int
    num_tokens: int  # all tokens of the step (base ones included)
    # Padded batches for one bmm over every segment (None when padding would waste too much):
    # each segment's tokens padded to max_seg_len; ``pad_gather`` points padding at an extra
    # zero row (index num_tokens), ``pad_scatter`` at row 0 (it adds zeros there).
    pad_gather: torch.Tensor | None = None  # [segments * max_seg_len] int64
    pad_scatter: torch.Tensor | None = None  # [segments * max_seg_len] int64
    slot_index: torch.Tensor | None = None  # [segments] int64; None when slots are 0..S-1

    @property
    def num_lora_tokens(self) -> int:
        return self.segments[-1][2] if self.segments else 0

    @property
    def covers_all(self) -> bool:
        """Every token of the step runs one adapter (no gather or scatter needed)."""
        return len(self.segments) == 1 and self.num_lora_tokens == self.num_tokens


def build_mapping(
    seq_slots: list[int], seq_lens: list[int], device: torch.device
) -> LoRAMapping | None:
    """The step's mapping from each scheduled sequence's slot (-1: base) and token count.

    A sequence's tokens are contiguous in the flat batch, so sorting is over sequences, once
    per step; None when no token of the step runs an adapter.
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
    for slot in sorted(by_slot):
        begin = len(perm)
        for i in by_slot[slot]:
            perm.extend(range(starts[i], starts[i] + seq_lens[i]))
        segments.append((slot, begin, len(perm)))
    bounds = [s for _, s, _ in segments] + [segments[-1][2]]
    longest = max(e - b for _, b, e in segments)
    pads: dict[str, torch.Tensor | None] = {"pad_gather": None, "pad_scatter": None}
    slot_ids = [s for s, _, _ in segments]
    if len(segments) > 1 and len(segments) * longest <= PAD_WASTE * len(perm):
        gather = [pos] * (len(segments) * longest)
        scatter = [0] * len(gather)
        for j, (_, b, e) in enumerate(segments):
            gather[j * longest : j * longest + e - b] = perm[b:e]
            scatter[j * longest : j * longest + e - b] = perm[b:e]
        pads["pad_gather"] = torch.tensor(gather, dtype=torch.long).to(device)
        pads["pad_scatter"] = torch.tensor(scatter, dtype=torch.long).to(device)
    contiguous = slot_ids == list(range(len(slot_ids)))
    return LoRAMapping(
        perm=torch.tensor(perm, dtype=torch.long).to(device),
        segments=segments,
        seg_slot=torch.tensor([s for s, _, _ in segments], dtype=torch.int32).to(device),
        seg_start=torch.tensor(bounds, dtype=torch.int32).to(device),
        max_seg_len=longest,
        num_tokens=pos,
        slot_index=None if contiguous else torch.tensor(slot_ids, dtype=torch.long).to(device),
        **pads,
    )


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
        if mapping.pad_gather is None or mapping.pad_scatter is None:
            self.expand(y, self.shrink(x, lora_a, mapping), lora_b, mapping)
            return
        segs, longest = len(mapping.segments), mapping.max_seg_len
        if mapping.slot_index is None:
            a, b = lora_a[:segs], lora_b[:segs]
        else:
            a = lora_a.index_select(0, mapping.slot_index)
            b = lora_b.index_select(0, mapping.slot_index)
        xs = F.pad(x, (0, 0, 0, 1)).index_select(0, mapping.pad_gather)  # zero row for padding
        s = torch.bmm(xs.view(segs, longest, -1), a.transpose(1, 2))  # [segs, longest, k]
        delta = torch.bmm(s, b.transpose(1, 2))  # [segs, longest, out]
        y.index_add_(0, mapping.pad_scatter, delta.view(segs * longest, -1))

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
        delta = y.new_empty((s.shape[0], y.shape[1]))
        for slot, begin, end in mapping.segments:
            torch.mm(s[begin:end], lora_b[slot].t(), out=delta[begin:end])
        y.index_add_(0, mapping.perm, delta)

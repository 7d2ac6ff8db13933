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
    return LoRAMapping(
        perm=torch.tensor(perm, dtype=torch.long).to(device),
        segments=segments,
        seg_slot=torch.tensor([s for s, _, _ in segments], dtype=torch.int32).to(device),
        seg_start=torch.tensor(bounds, dtype=torch.int32).to(device),
        max_seg_len=max(e - b for _, b, e in segments),
        num_tokens=pos,
    )


class TorchLoRAOps:
    """Segmented GEMMs with torch.mm: the CPU and XPU path (and the kernels' reference)."""

    name = "torch"

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

"""The ``encoder_attention`` op in PyTorch: one scaled-dot-product call over the padded batch.

Every device's PyTorch runs it (SDPA picks its fused CPU, CUDA or XPU kernel), so it sits beside
``reference.py`` rather than in a device folder. Padding the flat batch to ``[seqs, heads,
longest, head]`` with a key mask measured fastest on CPU for 32 sequences of 10-70 tokens (12
heads of 32, 2 threads; 2026-12-06, 2 cores of an AMD EPYC shared with a load of ~12, so ratios
only): in float32 one call over the padded batch took a fifth of the time of one call per
sequence (140 against 630 ms), in bfloat16 half (82 against 164 ms); one call over the whole
flat batch with a block-diagonal mask, which computes every cross-sequence score only to mask
it, took over 10x the padded call. Inputs are 4-D: 3-D ones send SDPA to its unfused math path.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.layers.encoder_attention import EncoderAttention


def padded_sdpa(
    q: torch.Tensor,  # [num_tokens, num_heads, head_size]
    k: torch.Tensor,
    v: torch.Tensor,
    query_lens: list[int],
    scale: float,
) -> torch.Tensor:  # [num_tokens, num_heads, head_size]
    """Bidirectional attention within each sequence of the flat batch."""
    if q.dim() != 3 or k.shape != q.shape or v.shape != q.shape:
        raise ValueError(f"encoder attention: q, k, v must be [n, heads, head], got "
                         f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")  # fmt: skip
    if sum(query_lens) != q.shape[0] or min(query_lens, default=1) < 1:
        raise ValueError(f"encoder attention: query_lens {query_lens} != {q.shape[0]} tokens")
    if len(query_lens) == 1:  # one sequence: no padding, no mask
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None], scale=scale
        )
        return out[0].transpose(0, 1)
    longest = max(query_lens)
    lens = torch.tensor(query_lens, device=q.device)
    starts = torch.cumsum(lens, 0) - lens
    offsets = torch.arange(longest, device=q.device)
    valid = offsets.unsqueeze(0) < lens.unsqueeze(1)  # [seqs, longest]
    # Padded slots read the batch's last token: finite values the key mask then hides.
    index = (starts.unsqueeze(1) + offsets.unsqueeze(0)).clamp(max=q.shape[0] - 1)

    fused = _fused_rows(q, k, v)
    if fused is not None:  # one gather of the QKV rows, not three
        rows = fused[index]  # [seqs, longest, 3, heads, head]
        pq, pk, pv = (rows[:, :, i].permute(0, 2, 1, 3) for i in range(3))
    else:
        pq, pk, pv = (t[index].permute(0, 2, 1, 3) for t in (q, k, v))
    out = F.scaled_dot_product_attention(pq, pk, pv, attn_mask=valid[:, None, None, :], scale=scale)
    return out.permute(0, 2, 1, 3)[valid]


def _fused_rows(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor | None:
    """``[n, 3, heads, head]`` over the one buffer q, k and v are slices of (a fused QKV
    projection's output, split and reshaped), or None where they are not. Gathering the padded
    rows once from it took 18-20 ms against 50 for three gathers (32 MiniLM sentences, 2 threads,
    loaded 2-core host), SDPA reading the strided slices as fast."""
    n, heads, head = q.shape
    width = heads * head
    if any(t.stride() != (3 * width, head, 1) for t in (q, k, v)):
        return None
    storage = q.untyped_storage().data_ptr()
    if any(t.untyped_storage().data_ptr() != storage for t in (k, v)):
        return None
    step = width * q.element_size()
    if k.data_ptr() != q.data_ptr() + step or v.data_ptr() != q.data_ptr() + 2 * step:
        return None
    return q.as_strided((n, 3, heads, head), (3 * width, width, head, 1))


def install_encoder_attention(model: nn.Module, *, int8_activations: bool = False) -> str:
    """Fill every :class:`EncoderAttention`'s slot; ``"encoder_attention xN"`` or "" for none."""
    count = 0
    for module in model.modules():
        if isinstance(module, EncoderAttention):
            module.fast_encoder_attn = padded_sdpa
            count += 1
    return f"encoder_attention x{count}" if count else ""

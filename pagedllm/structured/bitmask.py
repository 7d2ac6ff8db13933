"""Applying packed allowed-token bitmasks to a batch of logits, on the logits' device.

A bitmask row holds one bit per vocabulary entry, 32 to an int32 word (bit ``t % 32`` of word
``t // 32`` allows token ``t``), the layout grammar libraries fill. The rows are unpacked with
tensor ops for the whole batch at once: no loop over rows or over the vocabulary.
"""

from __future__ import annotations

import torch


def unpack_bitmask(bitmask: torch.Tensor, vocab: int) -> torch.Tensor:
    """[rows, words] int32 -> [rows, vocab] bool (True = allowed); missing words disallow."""
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    bits = (bitmask.unsqueeze(-1) >> shifts) & 1  # [rows, words, 32]
    allowed = bits.reshape(bitmask.shape[0], -1).bool()  # [rows, words * 32]
    if allowed.shape[1] >= vocab:
        return allowed[:, :vocab]
    pad = torch.zeros(
        (bitmask.shape[0], vocab - allowed.shape[1]), dtype=torch.bool, device=bitmask.device
    )
    return torch.cat([allowed, pad], dim=1)


def apply_token_bitmask(
    logits: torch.Tensor,  # [n, vocab], modified in place
    bitmask: torch.Tensor,  # [m, words] int32, any device
    row_of: list[int],  # per logits row: its bitmask row, or -1 for an unconstrained row
) -> None:
    """Set the logits of tokens a row's grammar forbids to -inf; unconstrained rows untouched."""
    rows = [i for i, r in enumerate(row_of) if r >= 0]
    if not rows:
        return
    dev = logits.device
    mask_rows = torch.tensor([row_of[i] for i in rows], dtype=torch.long)
    packed = bitmask.index_select(0, mask_rows.to(bitmask.device)).to(dev, non_blocking=True)
    allowed = unpack_bitmask(packed, logits.shape[1])  # [len(rows), vocab]
    index = torch.tensor(rows, dtype=torch.long, device=dev)
    sub = logits.index_select(0, index).masked_fill_(~allowed, float("-inf"))
    logits.index_copy_(0, index, sub)

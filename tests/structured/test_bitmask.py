"""The batched bitmask application against a plain per-token reference."""

from __future__ import annotations

import pytest
import torch

from pagedllm.structured.bitmask import apply_token_bitmask, unpack_bitmask


def reference_allowed(bitmask: torch.Tensor, vocab: int) -> torch.Tensor:
    out = torch.zeros((bitmask.shape[0], vocab), dtype=torch.bool)
    for r in range(bitmask.shape[0]):
        for t in range(vocab):
            word = t // 32
            if word < bitmask.shape[1]:
                out[r, t] = bool((int(bitmask[r, word]) >> (t % 32)) & 1)
    return out


@pytest.mark.parametrize("vocab", [1, 31, 32, 33, 100, 130])
def test_unpack_matches_reference(vocab: int) -> None:
    g = torch.Generator().manual_seed(vocab)
    words = (vocab + 31) // 32
    # int32 words with the sign bit set too (token 31 of each word).
    bitmask = torch.randint(-(2**31), 2**31 - 1, (5, words), generator=g, dtype=torch.int64)
    bitmask = bitmask.to(torch.int32)
    assert torch.equal(unpack_bitmask(bitmask, vocab), reference_allowed(bitmask, vocab))
    # A model vocabulary wider than the mask: the extra tokens are disallowed.
    wide = unpack_bitmask(bitmask, vocab + 40)
    assert not wide[:, words * 32 :].any()


def test_apply_touches_only_constrained_rows() -> None:
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 70, generator=g)
    before = logits.clone()
    bitmask = torch.randint(-(2**31), 2**31 - 1, (2, 3), generator=g, dtype=torch.int64)
    bitmask = bitmask.to(torch.int32)
    row_of = [-1, 1, -1, 0]
    apply_token_bitmask(logits, bitmask, row_of)
    allowed = reference_allowed(bitmask, 70)
    for i, r in enumerate(row_of):
        if r < 0:
            assert torch.equal(logits[i], before[i])
        else:
            expect = before[i].masked_fill(~allowed[r], float("-inf"))
            assert torch.equal(logits[i], expect)

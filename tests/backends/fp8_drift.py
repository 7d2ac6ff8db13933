"""How far an 8-bit KV cache moves greedy decoding from a 16/32-bit one (every backend's test)."""

from __future__ import annotations

from typing import Any

# At least this share of greedy tokens must agree with the wider cache's run.
FP8_MIN_AGREEMENT = 0.75


def greedy_drift(base: list[Any], other: list[Any]) -> tuple[float, int, int]:
    """(worst logprob difference while the texts agree, tokens that agree, tokens compared),
    over pairs of completions (``token_ids`` and per-step ``logprobs`` dicts)."""
    agree = total = 0
    worst = 0.0
    for x, y in zip(base, other, strict=True):
        for step, (ta, tb) in enumerate(zip(x.token_ids, y.token_ids, strict=True)):
            total += 1
            if ta != tb:
                break  # later tokens continue different texts: not comparable
            agree += 1
            worst = max(worst, abs(x.logprobs[step][ta] - y.logprobs[step][tb]))
    return worst, agree, total

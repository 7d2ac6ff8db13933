"""Speculative decoding counters for ``Engine.get_stats()`` and ``/metrics`` (standard library)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass
class SpecDecodeMetrics:
    """Totals over the engine's life; rates are derived when read."""

    verify_runs: int = 0  # (sequence, step) pairs that verified proposals
    draft_tokens: int = 0  # proposals scored by the target
    accepted_tokens: int = 0  # of those, accepted
    draft_time: float = 0.0  # seconds
    verify_time: float = 0.0

    def observe(self, stats: Any) -> None:
        """Add one step's ``SpecStepStats`` (None when the step did not speculate)."""
        if stats is None:
            return
        self.verify_runs += stats.num_seqs
        self.draft_tokens += stats.num_proposed
        self.accepted_tokens += stats.num_accepted
        self.draft_time += stats.draft_time
        self.verify_time += stats.verify_time

    def as_stats(self) -> dict[str, float]:
        runs = self.verify_runs
        return {
            "spec_decode_num_draft_tokens": self.draft_tokens,
            "spec_decode_num_accepted_tokens": self.accepted_tokens,
            "spec_decode_num_verify_runs": runs,
            "spec_decode_draft_acceptance_rate": (
                self.accepted_tokens / self.draft_tokens if self.draft_tokens else 0.0
            ),
            # Tokens each verified run emitted: the accepted proposals plus the target's own.
            "spec_decode_mean_accepted_length": (
                (self.accepted_tokens + runs) / runs if runs else 0.0
            ),
            "spec_decode_draft_time_seconds": self.draft_time,
            "spec_decode_verify_time_seconds": self.verify_time,
        }

"""Speculation's numbers: derived rates, and their names on /metrics."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest

from pagedllm.core.interfaces import SpecStepStats
from pagedllm.entrypoints.openai.metrics import EngineStatsCollector
from pagedllm.spec_decode.metrics import SpecDecodeMetrics


def test_rates_from_step_stats() -> None:
    m = SpecDecodeMetrics()
    assert m.as_stats()["spec_decode_draft_acceptance_rate"] == 0.0
    m.observe(None)  # a step that did not speculate
    m.observe(SpecStepStats(num_seqs=2, num_proposed=8, num_accepted=6, draft_time=0.5))
    m.observe(SpecStepStats(num_seqs=1, num_proposed=4, num_accepted=0, verify_time=0.25))
    s = m.as_stats()
    assert s["spec_decode_num_draft_tokens"] == 12
    assert s["spec_decode_num_accepted_tokens"] == 6
    assert s["spec_decode_draft_acceptance_rate"] == 0.5
    # Three runs emitted 6 accepted + 3 of the target's own tokens.
    assert s["spec_decode_mean_accepted_length"] == 3.0
    assert s["spec_decode_draft_time_seconds"] == 0.5
    assert s["spec_decode_verify_time_seconds"] == 0.25


def test_exported_on_metrics_endpoint() -> None:
    m = SpecDecodeMetrics()
    m.observe(SpecStepStats(num_seqs=1, num_proposed=4, num_accepted=3, draft_time=0.1))
    registry = CollectorRegistry()
    registry.register(EngineStatsCollector(m.as_stats))
    text = generate_latest(registry).decode()
    values = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            values[name] = float(value)
    assert values["pagedllm:spec_decode_num_draft_tokens_total"] == 4
    assert values["pagedllm:spec_decode_num_accepted_tokens_total"] == 3
    assert values["pagedllm:spec_decode_draft_acceptance_rate"] == 0.75
    assert values["pagedllm:spec_decode_mean_accepted_length"] == 4.0
    assert values["pagedllm:spec_decode_draft_time_seconds_total"] == 0.1
    assert "pagedllm:spec_decode_verify_time_seconds_total" in values

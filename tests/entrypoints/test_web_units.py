"""The pure parts of the web face and the benchmarks: the dashboard feed's rates and
percentiles, the request table, Prometheus parsing and histogram quantile buckets."""

from __future__ import annotations

import json
from collections import deque
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from pagedllm.entrypoints.bench import datasets, stats
from pagedllm.entrypoints.web.feed import DashboardFeed, percentile
from pagedllm.entrypoints.web.tracker import RequestTracker


class FakeEngine:
    def __init__(self) -> None:
        self.stats: dict[str, float] = {"generation_tokens_total": 0.0, "prompt_tokens_total": 0.0}

    def get_stats(self) -> dict[str, float]:
        return dict(self.stats)

    def replica_set(self) -> None:
        return None  # one engine: no replicas


def test_feed_rates_hit_rate_and_latency_window(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = [1000.0]
    monkeypatch.setattr("pagedllm.entrypoints.web.feed.time.time", lambda: clock[0])
    engine = FakeEngine()
    metrics = SimpleNamespace(
        recent=deque(
            [(850.0, 9.0, 9.0), (990.0, 0.1, 0.02), (995.0, 0.3, 0.04), (999.0, None, None)]
        )
    )
    feed = DashboardFeed(engine, metrics, RequestTracker(), window_s=300, latency_window_s=60)
    first = feed.snapshot()
    assert first["series"]["gen_tps"] == [0.0] and first["series"]["prefix_hit_rate"] == [None]
    clock[0] += 2.0
    engine.stats.update(
        generation_tokens_total=50.0,
        prompt_tokens_total=10.0,
        prefix_cache_queries=8.0,
        prefix_cache_hits=2.0,
        num_requests_running=3.0,
        kv_cache_usage_perc=0.5,
    )
    d = feed.snapshot()
    assert d["series"]["gen_tps"][-1] == 25.0 and d["series"]["prompt_tps"][-1] == 5.0
    assert d["series"]["prefix_hit_rate"][-1] == 0.25
    assert d["series"]["running"][-1] == 3.0 and d["series"]["kv_device"][-1] == 0.5
    assert d["t"] == [-2.0, 0.0]
    # The last minute holds two finished requests (the one at t=850 is older): nearest rank.
    assert d["series"]["ttft_p50"][-1] == pytest.approx(100.0)
    assert d["series"]["ttft_p90"][-1] == pytest.approx(300.0)
    # the cards cover the charts' minute too (t=850 is older), and say so
    assert d["latency"]["ttft_ms"]["count"] == 2 and d["latency"]["ttft_ms"]["window_s"] == 60
    clock[0] += 0.1  # within min_interval: no new sample
    assert len(feed.snapshot()["t"]) == 2
    clock[0] += 400  # older samples fall out of the window
    assert len(feed.snapshot()["t"]) == 1


def test_latency_cards_and_charts_include_requests_in_flight(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Under load the finished requests' latencies look idle while those in flight stall: the
    waits so far of the live requests count too (for a first token, or since the last one)."""
    clock = [1000.0]
    monkeypatch.setattr("pagedllm.entrypoints.web.feed.time.time", lambda: clock[0])
    tracker = RequestTracker()
    metrics = SimpleNamespace(recent=deque([(999.0, 0.05, 0.024)]))  # one fast, finished
    feed = DashboardFeed(FakeEngine(), metrics, tracker, window_s=300, latency_window_s=60)
    queued = tracker.add("a", "prompt", None)
    streaming = tracker.add("b", "prompt", None)
    out = SimpleNamespace(outputs=[SimpleNamespace(token_ids=[1, 2])], finished=False)
    tracker.update(streaming, out)  # its last token at t=1000
    assert queued.last_token is None
    clock[0] += 0.5
    d = feed.snapshot()
    itl, ttft = d["latency"]["itl_ms"], d["latency"]["ttft_ms"]
    assert itl["count"] == 2 and itl["p99"] == pytest.approx(500.0)  # 0.5 s since its token
    assert ttft["count"] == 2 and ttft["p99"] == pytest.approx(500.0)  # 0.5 s without one
    assert d["series"]["itl_p90"][-1] == pytest.approx(500.0)
    tracker.update(streaming, SimpleNamespace(outputs=out.outputs, finished=False))
    clock[0] += 1.0  # no new token: the wait since the last one keeps growing
    assert feed.snapshot()["latency"]["itl_ms"]["p99"] == pytest.approx(1500.0)


def test_percentile_nearest_rank() -> None:
    assert percentile([], 50) is None
    assert percentile([3.0, 1.0, 2.0], 50) == 2.0
    assert percentile([1.0, 2.0, 3.0, 4.0], 100) == 4.0 and percentile([5.0], 99) == 5.0


def test_tracker_states_and_recent_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    tracker = RequestTracker(keep_finished=2, keep_finished_s=30)
    out = SimpleNamespace(
        outputs=[SimpleNamespace(token_ids=[1, 2], finish_reason=None)], finished=False, error=None
    )
    a = tracker.add("a", {"prompt_token_ids": [1, 2, 3]}, SimpleNamespace(max_tokens=5))
    b = tracker.add("b", "text", SimpleNamespace(max_tokens=None))
    assert [r["state"] for r in tracker.rows()] == ["queued", "queued"]
    tracker.update(a, out)
    assert tracker.rows()[0]["state"] == "streaming" and tracker.rows()[0]["tokens"] == 2
    out.finished, out.outputs[0].finish_reason = True, "length"
    tracker.update(a, out)
    tracker.finish(b, "abort")
    tracker.finish(b, "stop")  # only the first end counts
    rows = tracker.rows()
    assert [(r["id"], r["state"], r["finish_reason"]) for r in rows] == [
        ("b", "finished", "abort"),
        ("a", "finished", "length"),
    ]
    assert tracker.get("a") is None and rows[1]["prompt_tokens"] == 3


def test_prometheus_parsing_and_quantile_buckets() -> None:
    before = (
        "# HELP x\nfoo_total 3\n"
        'h_bucket{le="0.1"} 1\nh_bucket{le="0.5"} 1\nh_bucket{le="+Inf"} 1\nh_sum 0.05\n'
        "h_count 1\n"
    )
    after = (
        "foo_total 10\n"
        'h_bucket{le="0.1"} 3\nh_bucket{le="0.5"} 9\nh_bucket{le="+Inf"} 11\nh_sum 4.05\n'
        "h_count 11\n"
    )
    a, b = stats.parse_prometheus(after), stats.parse_prometheus(before)
    assert a[("foo_total", "")] == 10.0
    h = stats.histogram_delta(stats.histogram(a, "h"), stats.histogram(b, "h"))
    assert h["count"] == 10 and h["sum"] == pytest.approx(4.0)
    assert h["buckets"] == {0.1: 2.0, 0.5: 8.0, float("inf"): 10.0}
    assert stats.bucket_of_quantile(h, 0.2) == (0.0, 0.1)
    assert stats.bucket_of_quantile(h, 0.5) == (0.1, 0.5)
    assert stats.bucket_of_quantile(h, 0.9) == (0.5, float("inf"))
    assert stats.percentile([1.0, 2.0, 3.0, 4.0, 5.0], 50) == 3.0
    assert stats.percentile([1.0, 2.0], 50) == 1.5


def test_sharegpt_filtering(tmp_path: Path) -> None:
    path = tmp_path / "d.json"
    path.write_text(
        json.dumps(
            [
                {
                    "conversations": [
                        {"from": "human", "value": "a b c"},
                        {"from": "gpt", "value": "one two three four five"},
                    ]
                },
                {
                    "conversations": [
                        {"from": "human", "value": "x"},
                        {"from": "gpt", "value": "y z"},
                    ]
                },
                {
                    "conversations": [
                        {"from": "human", "value": "long " * 50},
                        {"from": "gpt", "value": "w " * 10},
                    ]
                },
                {"other": 1},
                "not a dict",
            ]
        )
    )
    count: Any = lambda s: len(s.split())  # noqa: E731
    reqs = datasets.sharegpt_requests(path, 10, 0, count, max_model_len=40)
    assert [(r.prompt, r.output_len, r.prompt_len) for r in reqs] == [("a b c", 5, 3)]
    fixed = datasets.sharegpt_requests(path, 10, 0, count, fixed_output_len=7)
    assert sorted(r.output_len for r in fixed) == [7, 7, 7]
    with pytest.raises(ValueError, match="dataset_path"):
        datasets.sharegpt_requests(tmp_path / "missing.json", 1, 0, count)
    assert datasets.random_requests(3, 4, 5, 0) == datasets.random_requests(3, 4, 5, 0)

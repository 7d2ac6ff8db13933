"""GET /metrics: Prometheus text from a registry owned by the app (never the global one).

Engine-wide numbers (queue lengths, KV usage, token totals) are read from the engine's stats
snapshot at scrape time by a custom collector, so nothing has to be pushed after every step.
Per-request latencies are observed on the engine thread when a request finishes.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    Metric,
    SummaryMetricFamily,
)
from prometheus_client.registry import Collector

from pagedllm.engine.client import EngineClient
from pagedllm.outputs import RequestOutput

PREFIX = "pagedllm:"
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_GAUGES = {
    "num_requests_running": "Requests whose sequences are in the running batch.",
    "num_requests_waiting": "Requests waiting to be scheduled.",
    "num_requests_swapped": "Requests whose KV blocks are swapped out to host memory.",
    "kv_cache_usage_perc": "Fraction of device KV-cache blocks in use (1 = full).",
    "cpu_cache_usage_perc": "Fraction of host (swap space) KV-cache blocks in use (1 = full).",
    "spec_decode_draft_acceptance_rate": "Share of speculative tokens accepted (0 without).",
    "spec_decode_mean_accepted_length": "Tokens emitted per verified speculative run.",
}
_COUNTERS = {
    "prompt_tokens_total": ("prompt_tokens_total", "Prompt tokens processed (prefill)."),
    "generation_tokens_total": ("generation_tokens_total", "Tokens generated."),
    "num_preemptions_total": ("num_preemptions_total", "Preemptions of running requests."),
    "prefix_cache_queries": ("prefix_cache_queries_total", "Blocks looked up in the prefix cache."),
    "prefix_cache_hits": ("prefix_cache_hits_total", "Blocks found in the prefix cache."),
    "num_preemptions_recompute": (
        "num_preemptions_recompute_total",
        "Preemptions that freed blocks for recompute.",
    ),
    "num_preemptions_swap": (
        "num_preemptions_swap_total",
        "Preemptions that swapped blocks to host memory.",
    ),
    "chunked_prefill_steps": (
        "chunked_prefill_steps_total",
        "Steps that ran part of a prompt (chunked prefill).",
    ),
    "spec_decode_num_draft_tokens": (
        "spec_decode_num_draft_tokens_total",
        "Speculative tokens proposed and scored by the target.",
    ),
    "spec_decode_num_accepted_tokens": (
        "spec_decode_num_accepted_tokens_total",
        "Speculative tokens the target accepted.",
    ),
    "spec_decode_draft_time_seconds": (
        "spec_decode_draft_time_seconds_total",
        "Seconds spent proposing speculative tokens (draft model).",
    ),
    "spec_decode_verify_time_seconds": (
        "spec_decode_verify_time_seconds_total",
        "Seconds spent verifying speculative tokens on the target.",
    ),
}
_LATENCY_BUCKETS = (
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
_TOKEN_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
)


# The lower KV tiers (kv_tiers/store.py's stats), one series per tier where it has two.
_TIER_COUNTERS = {
    "kv_tier_stores": ("kv_tier_stored_blocks_total", "KV blocks written to the disk tier."),
    "kv_tier_saves_dropped": (
        "kv_tier_dropped_saves_total",
        "Evicted KV blocks not saved (host memory full of blocks in flight).",
    ),
    "kv_tier_corrupt": (
        "kv_tier_corrupt_blocks_total",
        "Disk-tier block files found damaged (deleted and recomputed).",
    ),
    "kv_tier_load_seconds": (
        "kv_tier_copy_in_seconds_total",
        "Seconds of host-to-device copies of loaded blocks inside steps.",
    ),
}


def pooling_metric(stats: dict[str, float]) -> Metric:
    """Pooling requests finished, by task (embeddings; scores and reranks on a classifier)."""
    family = CounterMetricFamily(
        PREFIX + "pooling_requests", "Pooling requests finished, by task.", labels=["task"]
    )
    for task in ("embed", "classify"):
        family.add_metric([task], float(stats.get(f"pooling_requests_{task}", 0.0)))
    return family


def tier_metrics(stats: dict[str, float]) -> Iterator[Metric]:
    """Hits and bytes per tier, and disk read/write latency (summaries: count and sum)."""
    hits = CounterMetricFamily(
        PREFIX + "kv_tier_hits",
        "KV blocks loaded from a lower tier instead of recomputed.",
        labels=["tier"],
    )
    used = GaugeMetricFamily(PREFIX + "kv_tier_bytes", "Bytes held per tier.", labels=["tier"])
    capacity = GaugeMetricFamily(
        PREFIX + "kv_tier_capacity_bytes", "Capacity per tier.", labels=["tier"]
    )
    for tier in ("host", "disk"):
        hits.add_metric([tier], float(stats.get(f"kv_tier_{tier}_hits", 0.0)))
        used.add_metric([tier], float(stats.get(f"kv_tier_{tier}_bytes", 0.0)))
        capacity.add_metric([tier], float(stats.get(f"kv_tier_{tier}_capacity_bytes", 0.0)))
    yield from (hits, used, capacity)
    for key, (name, doc) in _TIER_COUNTERS.items():
        yield CounterMetricFamily(PREFIX + name, doc, value=float(stats.get(key, 0.0)))
    yield SummaryMetricFamily(
        PREFIX + "kv_tier_load_seconds",
        "Disk reads of KV blocks: from the request to the block in host memory.",
        count_value=float(stats.get("kv_tier_reads", 0.0)),
        sum_value=float(stats.get("kv_tier_read_seconds", 0.0)),
    )
    yield SummaryMetricFamily(
        PREFIX + "kv_tier_store_seconds",
        "Disk writes of KV blocks: from the copy out of the device to the file in place.",
        count_value=float(stats.get("kv_tier_stores", 0.0)),
        sum_value=float(stats.get("kv_tier_store_seconds", 0.0)),
    )


class EngineStatsCollector(Collector):
    """Gauges and counters straight from the engine client's ``get_stats()`` at scrape time."""

    def __init__(self, get_stats: Callable[[], dict[str, float]]) -> None:
        self.get_stats = get_stats

    def collect(self) -> Iterator[Metric]:
        stats = self.get_stats()
        for key, doc in _GAUGES.items():
            yield GaugeMetricFamily(PREFIX + key, doc, value=float(stats.get(key, 0.0)))
        for key, (name, doc) in _COUNTERS.items():
            yield CounterMetricFamily(PREFIX + name, doc, value=float(stats.get(key, 0.0)))
        yield pooling_metric(stats)
        if "kv_tier_disk_hits" in stats:  # lower KV tiers are on
            yield from tier_metrics(stats)


class ServerMetrics:
    def __init__(self, engine: EngineClient) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.registry.register(EngineStatsCollector(engine.get_stats))
        replicas = engine.replica_set()  # data-parallel replicas behind the router
        if replicas is not None:
            from pagedllm.entrypoints.openai.replica_metrics import ReplicaCollector

            self.registry.register(ReplicaCollector(replicas))
        self.ttft = Histogram(
            PREFIX + "time_to_first_token_seconds",
            "Time from arrival to the first token.",
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.tpot = Histogram(
            PREFIX + "time_per_output_token_seconds",
            "Mean time between output tokens.",
            buckets=_TOKEN_BUCKETS,
            registry=self.registry,
        )
        self.e2e = Histogram(
            PREFIX + "e2e_request_latency_seconds",
            "Time from arrival to the last token.",
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.finished = Counter(
            PREFIX + "request_success",
            "Finished requests by finish reason.",
            labelnames=("finished_reason",),
            registry=self.registry,
        )
        # The split between the API server and the engine core (see engine/core_client.py).
        self.timings = {
            "server_queue": Histogram(
                PREFIX + "server_queue_time_seconds",
                "Time from the HTTP request's arrival to the request's arrival in the engine core.",
                buckets=_TOKEN_BUCKETS,
                registry=self.registry,
            ),
            "core_queue": Histogram(
                PREFIX + "core_queue_time_seconds",
                "Time from arrival in the engine core to first being scheduled.",
                buckets=_LATENCY_BUCKETS,
                registry=self.registry,
            ),
            "step": Histogram(
                PREFIX + "step_time_seconds",
                "Time of one engine step in the engine core.",
                buckets=_TOKEN_BUCKETS,
                registry=self.registry,
            ),
        }
        # (finish time, TTFT, TPOT) of recent requests: the dashboard's latency percentiles over
        # the last minutes come from the same observations as the histograms.
        self.recent: deque[tuple[float, float | None, float | None]] = deque(maxlen=20000)
        engine.on_request_finished.append(self.observe)
        engine.on_timing.append(self.observe_timing)

    def observe_timing(self, kind: str, seconds: float) -> None:
        histogram = self.timings.get(kind)
        if histogram is not None:
            histogram.observe(seconds)

    def observe(self, out: RequestOutput) -> None:
        """Called on the engine thread once per finished request (prometheus_client locks)."""
        reason = "error" if out.error else (out.outputs[0].finish_reason if out.outputs else None)
        self.finished.labels(finished_reason=reason or "unknown").inc()
        m = out.metrics
        if m is None or out.error:
            return
        ttft = tpot = None
        if m.first_token_time is not None:
            ttft = max(0.0, m.first_token_time - m.arrival_time)
            self.ttft.observe(ttft)
        if m.finished_time is not None:
            self.e2e.observe(max(0.0, m.finished_time - m.arrival_time))
            num_tokens = max((len(c.token_ids) for c in out.outputs), default=0)
            if m.first_token_time is not None and num_tokens > 1:
                decode = max(0.0, m.finished_time - m.first_token_time)
                tpot = decode / (num_tokens - 1)
                self.tpot.observe(tpot)
        self.recent.append((time.time(), ttft, tpot))  # deque appends are thread-safe

    def render(self) -> bytes:
        return generate_latest(self.registry)

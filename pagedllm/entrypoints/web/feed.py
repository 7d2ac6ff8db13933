"""GET /v1/dashboard: the live numbers behind /dashboard, as JSON.

Everything comes from what /metrics reads: the engine client's ``get_stats()`` snapshot (queue
lengths, KV usage, token, prefix-cache and lower-tier counters) and the request latencies that
``ServerMetrics`` observes, plus the waits of the requests in flight (the tracker's), so latency
under load shows while the requests are still running. The latency cards and each point of the
latency charts cover the last ``latency_window_s`` seconds. Rates need two points in time, so
each call records a sample (at most one every ``min_interval`` seconds) into a ring of the last
``window_s`` seconds; the page polls once a second, so the series fill while someone watches.
Nothing runs in the background.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from typing import Any

from pagedllm.engine.client import EngineClient
from pagedllm.entrypoints.web.tracker import RequestTracker

SERIES = (
    "running",
    "waiting",
    "swapped",
    "kv_device",
    "kv_host",
    "prefix_hit_rate",
    "prompt_tps",
    "gen_tps",
    "ttft_p50",
    "ttft_p90",
    "itl_p50",
    "itl_p90",
    "tier_host_bps",
    "tier_disk_bps",
)


@dataclass
class _Sample:
    t: float
    stats: dict[str, float]
    values: dict[str, float | None]


def percentile(values: list[float], p: float) -> float | None:
    """Nearest-rank percentile (``p`` in 0..100) of unsorted ``values``; None when empty."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(p / 100 * (len(ordered) - 1))))]


def _rate(new: float, old: float, dt: float) -> float:
    return max(0.0, new - old) / dt if dt > 0 else 0.0


class DashboardFeed:
    def __init__(
        self,
        engine: Any,
        metrics: Any,
        tracker: RequestTracker,
        *,
        window_s: float = 300.0,
        latency_window_s: float = 60.0,
        min_interval: float = 0.5,
    ) -> None:
        self.engine, self.metrics, self.tracker = engine, metrics, tracker
        self.window_s, self.latency_window_s = window_s, latency_window_s
        self.min_interval = min_interval
        self.samples: deque[_Sample] = deque()

    def _latencies(self, now: float, window: float) -> tuple[list[float], list[float]]:
        """TTFTs and inter-token latencies: of the requests finished in the window, and of
        those in flight so far (their wait for a first token, or since their last one)."""
        recent = [r for r in list(self.metrics.recent) if now - r[0] <= window]
        waiting, since_last = self.tracker.waits(now)
        return (
            [r[1] for r in recent if r[1] is not None] + waiting,
            [r[2] for r in recent if r[2] is not None] + since_last,
        )

    def _sample(self, now: float) -> None:
        stats = self.engine.get_stats()
        prev = self.samples[-1] if self.samples else None
        values: dict[str, float | None] = {
            "running": stats.get("num_requests_running", 0.0),
            "waiting": stats.get("num_requests_waiting", 0.0),
            "swapped": stats.get("num_requests_swapped", 0.0),
            "kv_device": stats.get("kv_cache_usage_perc", 0.0),
            "kv_host": stats.get("cpu_cache_usage_perc", 0.0),
            "prefix_hit_rate": None,
            "prompt_tps": 0.0,
            "gen_tps": 0.0,
        }
        if prev is not None:
            dt, old = now - prev.t, prev.stats
            values["prompt_tps"] = _rate(
                stats.get("prompt_tokens_total", 0.0), old.get("prompt_tokens_total", 0.0), dt
            )
            values["gen_tps"] = _rate(
                stats.get("generation_tokens_total", 0.0),
                old.get("generation_tokens_total", 0.0),
                dt,
            )
            queries = stats.get("prefix_cache_queries", 0.0) - old.get("prefix_cache_queries", 0)
            hits = stats.get("prefix_cache_hits", 0.0) - old.get("prefix_cache_hits", 0.0)
            values["prefix_hit_rate"] = hits / queries if queries > 0 else None
            for tier in ("host", "disk"):  # blocks loaded from a lower KV tier per second
                key = f"kv_tier_{tier}_hits"
                if key in stats:
                    values[f"tier_{tier}_bps"] = _rate(stats[key], old.get(key, 0.0), dt)
        ttft, itl = self._latencies(now, self.latency_window_s)
        for name, data in (("ttft", ttft), ("itl", itl)):
            for p in (50, 90):
                v = percentile(data, p)
                values[f"{name}_p{p}"] = None if v is None else 1e3 * v
        self.samples.append(_Sample(now, stats, values))
        while self.samples and now - self.samples[0].t > self.window_s:
            self.samples.popleft()

    def snapshot(self) -> dict[str, Any]:
        now = time.time()
        if not self.samples or now - self.samples[-1].t >= self.min_interval:
            self._sample(now)
        samples = list(self.samples)
        stats = samples[-1].stats
        # the cards cover what each point of the charts covers: the last latency_window_s
        ttft, itl = self._latencies(now, self.latency_window_s)
        summary = {}
        for name, data in (("ttft_ms", ttft), ("itl_ms", itl)):
            summary[name] = {
                "count": len(data),
                "window_s": self.latency_window_s,
                **{
                    f"p{p}": (None if (v := percentile(data, p)) is None else 1e3 * v)
                    for p in (50, 90, 99)
                },
            }
        return {
            "time": now,
            "window_s": self.window_s,
            "latency_window_s": self.latency_window_s,
            "t": [round(s.t - now, 3) for s in samples],
            "series": {k: [s.values.get(k) for s in samples] for k in SERIES},
            "latency": summary,
            "totals": {
                k: stats.get(k, 0.0)
                for k in (
                    "prompt_tokens_total",
                    "generation_tokens_total",
                    "num_preemptions_total",
                    "num_device_blocks",
                    "num_free_device_blocks",
                    "num_host_blocks",
                    "num_free_host_blocks",
                    "prefix_cache_queries",
                    "prefix_cache_hits",
                    "pooling_requests_embed",
                    "pooling_requests_classify",
                )
            },
            "requests": self.tracker.rows(),
            "kv_tiers": tier_summary(stats),
            "replicas": replica_summary(self.engine),
        }


def replica_summary(engine: EngineClient) -> dict[str, Any] | None:
    """Data-parallel replicas (None with one engine): the router's policy and predicted prefix
    matches, and per replica its state, routed load, queues, KV use and prefix-cache hits."""
    replicas = engine.replica_set()
    if replicas is None:
        return None
    router = replicas.router_stats()
    rows = []
    for row in replicas.replica_stats():
        s = row["stats"]
        routed = sum(n for (r, _), n in router["decisions"].items() if r == row["replica"])
        queries = s.get("prefix_cache_queries", 0.0)
        rows.append(
            {
                "replica": row["replica"],
                "state": row["state"],
                "load_tokens": row["load_tokens"],
                "in_flight": row["routed_in_flight"],
                "routed": routed,
                "running": s.get("num_requests_running", 0.0),
                "waiting": s.get("num_requests_waiting", 0.0),
                "kv_usage": s.get("kv_cache_usage_perc", 0.0),
                "prefix_hit_rate": s.get("prefix_cache_hits", 0.0) / queries if queries else None,
                "restarts": row["restarts"],
            }
        )
    q = router["query_blocks"]
    return {
        "policy": router["policy"],
        "matched_rate": router["matched_blocks"] / q if q else None,
        "rows": rows,
    }


def tier_summary(stats: dict[str, float]) -> dict[str, float | None] | None:
    """The lower KV tiers' totals (None when they are off): hits and bytes per tier, mean disk
    read and write latency."""
    if "kv_tier_disk_hits" not in stats:
        return None
    reads, stores = stats.get("kv_tier_reads", 0.0), stats.get("kv_tier_stores", 0.0)
    out: dict[str, float | None] = {
        k.removeprefix("kv_tier_"): stats.get(k, 0.0)
        for k in (
            "kv_tier_host_hits",
            "kv_tier_disk_hits",
            "kv_tier_host_bytes",
            "kv_tier_host_capacity_bytes",
            "kv_tier_disk_bytes",
            "kv_tier_disk_capacity_bytes",
            "kv_tier_corrupt",
        )
    }
    out["load_ms"] = 1e3 * stats.get("kv_tier_read_seconds", 0.0) / reads if reads else None
    out["store_ms"] = 1e3 * stats.get("kv_tier_store_seconds", 0.0) / stores if stores else None
    return out

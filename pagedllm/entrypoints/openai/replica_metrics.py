"""The data-parallel part of /metrics: per-replica load and state, and the router's decisions.

Read at scrape time from the client's ``replica_set()`` (``replica_stats()`` and
``router_stats()``); only
registered when the server runs replicas (``--data-parallel-size`` > 1).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from pagedllm.engine.client import ReplicaSet

PREFIX = "pagedllm:"

# name -> (help, where the value is read: a row field, or an engine stat of the replica)
_REPLICA_GAUGES = {
    "replica_up": ("1 while the replica serves, 0 while it restarts or is gone.", "up"),
    "replica_load_tokens": (
        "Tokens routed to the replica and not finished (prompt + max_tokens).",
        "load_tokens",
    ),
    "replica_requests_in_flight": (
        "Requests routed to the replica and not finished.",
        "routed_in_flight",
    ),
    "replica_num_requests_running": ("The replica's running requests.", "num_requests_running"),
    "replica_num_requests_waiting": ("The replica's waiting requests.", "num_requests_waiting"),
    "replica_kv_cache_usage_perc": (
        "The replica's KV-cache usage (1 = full).",
        "kv_cache_usage_perc",
    ),
}
_REPLICA_COUNTERS = {
    "replica_restarts": ("Restarts of the replica after it died.", "restarts"),
    "replica_failed_requests": (
        "Requests ended with an error because the replica died under them.",
        "failed_requests",
    ),
    "replica_prefix_cache_hits": (
        "Blocks the replica found in its prefix cache.",
        "prefix_cache_hits",
    ),
    "replica_prefix_cache_queries": (
        "Blocks the replica looked up in its prefix cache.",
        "prefix_cache_queries",
    ),
}


def _value(row: dict[str, Any], key: str) -> float:
    return float(row[key] if key in row else row["stats"].get(key, 0.0))


class ReplicaCollector(Collector):
    def __init__(self, replicas: ReplicaSet) -> None:
        self.replicas = replicas

    def collect(self) -> Iterator[Metric]:
        rows = self.replicas.replica_stats()
        for name, (doc, key) in _REPLICA_GAUGES.items():
            family = GaugeMetricFamily(PREFIX + name, doc, labels=["replica"])
            for row in rows:
                family.add_metric([str(row["replica"])], _value(row, key))
            yield family
        for name, (doc, key) in _REPLICA_COUNTERS.items():
            family = CounterMetricFamily(PREFIX + name, doc, labels=["replica"])
            for row in rows:
                family.add_metric([str(row["replica"])], _value(row, key))
            yield family
        router = self.replicas.router_stats()
        decisions = CounterMetricFamily(
            PREFIX + "router_decisions",
            f"Requests routed, by replica and reason (policy {router['policy']}): prefix (the "
            "longest cached prefix), balanced (overloaded prefix replica skipped), "
            "least_loaded, rr (round robin).",
            labels=["replica", "reason"],
        )
        for (replica, reason), count in sorted(router["decisions"].items()):
            decisions.add_metric([str(replica), reason], float(count))
        yield decisions
        yield CounterMetricFamily(
            PREFIX + "router_prefix_matched_blocks",
            "Prompt blocks the chosen replica was believed to hold when routed.",
            value=float(router["matched_blocks"]),
        )
        yield CounterMetricFamily(
            PREFIX + "router_prefix_query_blocks",
            "Prompt blocks that could have matched a replica's cache when routed.",
            value=float(router["query_blocks"]),
        )

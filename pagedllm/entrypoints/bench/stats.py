"""Percentiles, the summary table, and the server's own numbers read from /metrics."""

from __future__ import annotations

import math
import re
import statistics
from typing import Any, TextIO

PERCENTILES = (50, 90, 99)
_SAMPLE = re.compile(r"^([a-zA-Z_:][\w:]*)(\{[^}]*\})?\s+(\S+)$")


def percentile(ordered: list[float], p: float) -> float:
    """Linear interpolation between closest ranks of an ascending list."""
    if len(ordered) == 1:
        return ordered[0]
    k = (len(ordered) - 1) * p / 100
    lo = math.floor(k)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)


def summarize(values: list[float], scale: float = 1e3) -> dict[str, float]:
    """mean / median / percentiles / max, times ``scale`` (seconds to ms by default)."""
    if not values:
        return {}
    ordered = sorted(values)
    out = {"mean": scale * statistics.fmean(ordered), "median": scale * percentile(ordered, 50)}
    out.update({f"p{p}": scale * percentile(ordered, p) for p in PERCENTILES})
    out["max"] = scale * ordered[-1]
    return out


def print_table(title: str, rows: list[tuple[str, Any]], out: TextIO) -> None:
    width = max(len(k) for k, _ in rows) + 2
    rule = "=" * (width + 16)
    out.write(f"{rule}\n{title.center(len(rule))}\n{rule}\n")
    for key, value in rows:
        if value is None:
            out.write(f"{'-' * 4} {key} {'-' * max(0, len(rule) - len(key) - 6)}\n")
        elif isinstance(value, float):
            out.write(f"{key + ':':<{width}}{value:>16.2f}\n")
        else:
            out.write(f"{key + ':':<{width}}{value!s:>16}\n")
    out.write(rule + "\n")


def latency_rows(name: str, stats: dict[str, float]) -> list[tuple[str, Any]]:
    if not stats:
        return []
    rows: list[tuple[str, Any]] = [(name, None)]
    for key in ("mean", "median", *(f"p{p}" for p in PERCENTILES)):
        rows.append(
            (f"{key.capitalize() if key != 'median' else 'Median'} {name} (ms)", stats[key])
        )
    return rows


# -- Prometheus text --------------------------------------------------------------------------
def parse_prometheus(text: str) -> dict[tuple[str, str], float]:
    """``{(name, labels): value}`` of every sample line."""
    out = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = _SAMPLE.match(line.strip())
        if m:
            out[(m.group(1), m.group(2) or "")] = float(m.group(3))
    return out


def _sum(samples: dict[tuple[str, str], float], name: str) -> float:
    return sum(v for (n, _), v in samples.items() if n == name)


def histogram(samples: dict[tuple[str, str], float], name: str) -> dict[str, Any]:
    """A histogram's cumulative buckets (upper bound -> count), sum and count."""
    buckets = {}
    for (n, labels), v in samples.items():
        if n == name + "_bucket":
            le = re.search(r'le="([^"]+)"', labels)
            if le:
                buckets[float(le.group(1))] = v
    return {
        "buckets": dict(sorted(buckets.items())),
        "sum": _sum(samples, name + "_sum"),
        "count": _sum(samples, name + "_count"),
    }


def histogram_delta(after: dict[str, Any], before: dict[str, Any]) -> dict[str, Any]:
    return {
        "buckets": {le: c - before["buckets"].get(le, 0.0) for le, c in after["buckets"].items()},
        "sum": after["sum"] - before["sum"],
        "count": after["count"] - before["count"],
    }


def bucket_of_quantile(h: dict[str, Any], q: float) -> tuple[float, float] | None:
    """The bucket ``(lower, upper]`` (seconds) holding the ``q`` quantile; None when empty."""
    if h["count"] <= 0:
        return None
    rank, lower = q * h["count"], 0.0
    for le, cumulative in h["buckets"].items():
        if cumulative >= rank:
            return lower, le
        lower = le
    return lower, math.inf


def server_side(before: str, after: str, prefix: str = "pagedllm:") -> dict[str, Any]:
    """What the server's /metrics say happened between two scrapes."""
    b, a = parse_prometheus(before), parse_prometheus(after)

    def delta(name: str) -> float:
        return _sum(a, prefix + name) - _sum(b, prefix + name)

    out: dict[str, Any] = {
        "requests": delta("request_success_total"),
        "prompt_tokens": delta("prompt_tokens_total"),
        "generation_tokens": delta("generation_tokens_total"),
    }
    for key, name in (
        ("ttft", "time_to_first_token_seconds"),
        ("tpot", "time_per_output_token_seconds"),
        ("e2e", "e2e_request_latency_seconds"),
    ):
        h = histogram_delta(histogram(a, prefix + name), histogram(b, prefix + name))
        entry: dict[str, Any] = {"count": h["count"]}
        if h["count"] > 0:
            entry["mean_ms"] = 1e3 * h["sum"] / h["count"]
            for p in PERCENTILES:
                lo, hi = bucket_of_quantile(h, p / 100) or (0.0, 0.0)
                entry[f"p{p}_bucket_ms"] = [1e3 * lo, 1e3 * hi if math.isfinite(hi) else None]
        out[key] = entry
    return out

"""benchmarks/serving.py against the test server: the report adds up."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

from tests.entrypoints.conftest import API_KEY, MODEL_NAME

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "serving.py"


def _load() -> ModuleType:
    spec = importlib.util.spec_from_file_location("serving_benchmark", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while being built
    spec.loader.exec_module(module)
    return module


def test_benchmark_report(server: Any) -> None:
    bench = _load()
    prompts = bench.make_prompts(6, 8, seed=0)
    assert prompts == bench.make_prompts(6, 8, seed=0)  # a fixed request set
    report = bench.serve_requests(server.base_url, None, prompts, 5, 3, API_KEY, None)
    assert report["model"] == MODEL_NAME
    assert report["completed"] == 6 and report["failed"] == 0, report["errors"]
    assert report["output_tokens"] == 30
    for key in ("ttft_ms", "tpot_ms", "e2e_ms"):
        p = report[key]
        assert 0 < p["p50"] <= p["p90"] <= p["p99"] <= p["max"], (key, p)
    # A reader that lags gets the tokens so far in one chunk (the server coalesces), so a busy
    # machine can stream fewer chunks than tokens: one ITL sample per chunk after the first.
    assert report["completed"] <= report["text_chunks"] <= report["output_tokens"], report
    if report["text_chunks"] > report["completed"]:
        p = report["itl_ms"]
        assert 0 < p["p50"] <= p["p90"] <= p["p99"] <= p["max"], p
    else:
        assert report["itl_ms"] == {}
    assert report["concurrency"] == 3 and report["cpu_seconds"]["client"] > 0
    assert report["ttft_ms"]["max"] <= report["e2e_ms"]["max"]
    assert report["request_throughput"] > 0 and report["output_throughput"] > 0
    failed = bench.serve_requests(server.base_url, MODEL_NAME, prompts[:2], 5, 2, "wrong-key", None)
    assert failed["failed"] == 2 and "API key" in failed["errors"][0], failed["errors"]
    server.assert_all_blocks_free()


def test_clients_run_on_the_server_cpus_and_go_back() -> None:
    """--client-cpus server: during the served turn this process runs on the server's CPUs
    (a stand-in server here, bound to one CPU), afterwards where it ran before."""
    import os
    import subprocess
    import time

    import pytest

    allowed = sorted(os.sched_getaffinity(0))
    if len(allowed) < 2:
        pytest.skip("needs two CPUs this process may use")
    bench = _load()
    before = {tid: os.sched_getaffinity(tid) for tid in map(int, os.listdir("/proc/self/task"))}
    stand_in = subprocess.Popen(
        [
            sys.executable,
            "-c",
            f"import os, time; os.sched_setaffinity(0, {{{allowed[-1]}}}); time.sleep(30)",
        ]
    )
    try:
        deadline = time.monotonic() + 10
        while os.sched_getaffinity(stand_in.pid) != {allowed[-1]}:  # not bound yet
            assert time.monotonic() < deadline, "the stand-in did not bind itself"
            time.sleep(0.01)
        with bench.client_placement(stand_in.pid):
            inside = {
                os.sched_getaffinity(int(t)) == {allowed[-1]} for t in os.listdir("/proc/self/task")
            }
        with bench.client_placement(None):
            untouched = os.sched_getaffinity(0)
    finally:
        stand_in.kill()
        stand_in.wait()
    assert inside == {True}
    assert untouched == set(allowed)
    assert all(os.sched_getaffinity(tid) == mask for tid, mask in before.items())


def test_rounds_are_reported_by_their_median_round() -> None:
    """--rounds: each concurrency is reported by one whole round, the one whose ratio is the
    median (the lower middle one for an even count), so its throughputs, TTFTs and ratio come
    from the same run."""
    bench = _load()

    def run(tok_s: float) -> dict[str, float]:
        return {"output_throughput": tok_s}

    offline = [run(100.0), run(100.0), run(200.0)]
    served = [run(95.0), run(70.0), run(160.0)]  # ratios 0.95, 0.70, 0.80
    assert bench.median_round(served, offline) == 2
    assert bench.median_round(served[:2], offline[:2]) == 1  # 0.70 and 0.95: the lower
    assert bench.median_round(served, None) == 0  # by served throughput: 70, 95, 160
    assert bench.median_round(served[:1], offline[:1]) == 0

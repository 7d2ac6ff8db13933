"""``pagedllm bench``: serve against the test server (checked against its /metrics), and the
offline throughput and latency modes on the tiny model."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest

from pagedllm.entrypoints import cli
from tests.entrypoints.conftest import API_KEY, MODEL_NAME
from tests.entrypoints.test_cli import REPO
from tests.entrypoints.test_web import slowed

ENGINE = ["--device", "cpu", "--dtype", "float32", "--num-kv-blocks", "64", "--block-size", "8"]


def _close(ours: float, theirs: float, rel: float = 0.10) -> bool:
    return abs(ours - theirs) <= rel * abs(theirs)


def _rank(values: list[float], p: float) -> float:
    """The smallest value with at least p% of the values at or below it."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(p / 100 * len(ordered)) - 1)]


def _in_bucket(value_ms: float, bucket: list[float | None], rel: float = 0.10) -> bool:
    lo, hi = bucket
    return lo * (1 - rel) <= value_ms <= (float("inf") if hi is None else hi * (1 + rel))


def test_bench_serve_agrees_with_the_servers_metrics(server: Any, tmp_path: Path) -> None:
    out = tmp_path / "serve.json"
    server.wait_idle()
    # Steps of a real model take a while; so do these (0.4 s), so that the HTTP path, which the
    # client's TTFT includes and the engine's does not (tens of ms on a loaded 2-core machine),
    # is small next to what both sides measure. The client runs in its own process.
    with slowed(server, 0.4):
        proc = subprocess.run(
            [
                sys.executable,
                "-m",
                "pagedllm.entrypoints.cli",
                "bench",
                "serve",
                "--url",
                server.base_url,
                "--api-key",
                API_KEY,
                "--num-prompts",
                "12",
                "--max-concurrency",
                "4",
                "--input-len",
                "8",
                "--output-len",
                "6",
                "--output-json",
                str(out),
                "--no-progress",
            ],
            cwd=REPO,
            env={**os.environ, "PYTHONPATH": str(REPO)},
            capture_output=True,
            text=True,
            timeout=300,
        )
    assert proc.returncode == 0, proc.stderr
    table = proc.stdout
    assert "Serving Benchmark Result" in table and "Request throughput (req/s)" in table
    report = json.loads(out.read_text())
    srv = report["server"]
    assert report["model"] == MODEL_NAME
    assert report["completed"] == 12 and report["failed"] == 0, report["errors"]
    assert report["output_tokens"] == 12 * 6 == srv["generation_tokens"]
    assert report["prompt_tokens"] == srv["prompt_tokens"]
    duration = report["duration_s"]
    assert _close(report["request_throughput"], srv["requests"] / duration)
    assert _close(report["output_throughput"], srv["generation_tokens"] / duration)
    # Latencies: the client's means within 10% of the server's histogram means, and its
    # percentiles inside the histogram bucket that holds the same percentile.
    assert _close(report["ttft_ms"]["mean"], srv["ttft"]["mean_ms"]), (report, srv)
    assert _close(report["tpot_ms"]["mean"], srv["tpot"]["mean_ms"]), (report, srv)
    # ITL is measured between text chunks, which may hold several tokens (a lagging reader's
    # stream coalesces): samples exist only where some answer came in more than one chunk.
    assert report["completed"] <= report["text_chunks"] <= report["output_tokens"], report
    if report["text_chunks"] > report["completed"]:
        assert report["itl_ms"]["p50"] > 0
    for p in (50, 90):  # the same percentile definition as the histogram's: nearest rank
        ttft, tpot = _rank(report["ttfts_s"], p), _rank(report["tpots_s"], p)
        assert _in_bucket(1e3 * ttft, srv["ttft"][f"p{p}_bucket_ms"]), (p, ttft, srv)
        assert _in_bucket(1e3 * tpot, srv["tpot"][f"p{p}_bucket_ms"]), (p, tpot, srv)
    server.assert_all_blocks_free()


def test_bench_serve_sharegpt_chat_at_a_rate(
    server: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    data = [
        {
            "conversations": [
                {"from": "human", "value": f"The quick brown fox {i}"},
                {"from": "gpt", "value": "jumps over the lazy dog " * (i + 1)},
            ]
        }
        for i in range(5)
    ]
    data.append(
        {"conversations": [{"from": "human", "value": "too short"}, {"from": "gpt", "value": "a"}]}
    )  # reply < 4 tokens
    data.append({"id": "no conversations"})
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(data))
    out = tmp_path / "sharegpt-report.json"
    code = cli.main(
        [
            "bench",
            "serve",
            "--url",
            server.base_url,
            "--api-key",
            API_KEY,
            "--endpoint",
            "chat",
            "--dataset",
            "sharegpt",
            "--dataset-path",
            str(path),
            "--num-prompts",
            "10",
            "--request-rate",
            "20",
            "--output-json",
            str(out),
        ]
    )
    assert code == 0
    report = json.loads(out.read_text())
    assert report["completed"] == 5 and report["request_rate"] == 20
    headers = {"Authorization": f"Bearer {API_KEY}"}
    expected = sum(
        httpx.post(
            server.base_url + "/tokenize",
            headers=headers,
            json={"prompt": c["conversations"][1]["value"]},
        ).json()["count"]
        for c in data[:5]
    )
    assert report["output_tokens"] == expected
    assert "requests" in capsys.readouterr().err  # the progress bar
    code = cli.main(
        [
            "bench",
            "serve",
            "--url",
            server.base_url,
            "--api-key",
            "wrong",
            "--num-prompts",
            "2",
            "--no-progress",
        ]
    )
    assert code == 1
    assert "invalid or missing API key" in capsys.readouterr().err


def test_bench_serve_compares_arrivals_with_all_at_once(
    server: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "compare.json"
    args = ["bench", "serve", "--url", server.base_url, "--api-key", API_KEY]
    args += ["--num-prompts", "4", "--input-len", "8", "--output-len", "6", "--no-progress"]
    args += ["--request-rate", "50", "--compare-all-at-once", "--output-json", str(out)]
    assert cli.main(args) == 0
    report = json.loads(out.read_text())
    arrivals, burst = report["arrivals"], report["all_at_once"]
    assert arrivals["request_rate"] == 50 and burst["request_rate"] is None
    assert arrivals["completed"] == burst["completed"] == 4
    assert arrivals["prompt_tokens"] == burst["prompt_tokens"]  # the same requests twice
    ratio = arrivals["tpot_ms"]["median"] / burst["tpot_ms"]["median"]
    assert math.isclose(report["ratios"]["tpot_median"], ratio)
    assert "Ratio tpot p50:" in capsys.readouterr().out


def test_bench_throughput_and_latency_offline(
    llama_path: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "thr.json"
    code = cli.main(
        [
            "bench",
            "throughput",
            str(llama_path),
            *ENGINE,
            "--num-prompts",
            "6",
            "--input-len",
            "10",
            "--output-len",
            "5",
            "--output-json",
            str(out),
            "--no-progress",
        ]
    )
    assert code == 0 and "Throughput Benchmark Result" in capsys.readouterr().out
    report = json.loads(out.read_text())
    assert report["num_requests"] == 6
    assert report["prompt_tokens"] == 60 and report["output_tokens"] == 30
    assert report["output_tokens_per_s"] == pytest.approx(30 / report["elapsed_s"])
    out = tmp_path / "lat.json"
    code = cli.main(
        [
            "bench",
            "latency",
            str(llama_path),
            *ENGINE,
            "--batch-size",
            "2",
            "--input-len",
            "6",
            "--output-len",
            "4",
            "--num-iters",
            "3",
            "--num-iters-warmup",
            "1",
            "--output-json",
            str(out),
            "--no-progress",
        ]
    )
    assert code == 0 and "Latency Benchmark Result" in capsys.readouterr().out
    report = json.loads(out.read_text())
    assert len(report["latencies_s"]) == 3 and report["batch_size"] == 2
    p = report["percentiles_s"]
    assert min(report["latencies_s"]) <= p["p10"] <= p["p50"] <= p["p99"]
    assert p["p99"] <= max(report["latencies_s"])

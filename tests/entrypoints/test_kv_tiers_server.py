"""The lower KV tiers seen from outside: /metrics and /v1/dashboard report their hits, bytes
and latencies, and `pagedllm kv-cache ls|clear` shows and removes the folders."""

from __future__ import annotations

import random
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from pagedllm.entrypoints.cli import main
from pagedllm.kv_tiers.disk import DiskTier
from pagedllm.kv_tiers.fingerprint import Fingerprint
from tests.entrypoints.conftest import small_core_client, start_server


@pytest.fixture(scope="module")
def tiered(llama_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    from pagedllm.entrypoints.openai.api_server import build_app, model_info

    kv_dir = tmp_path_factory.mktemp("kv")
    engine = small_core_client(llama_path, enable_prefix_caching=True, kv_cache_dir=str(kv_dir))
    app = build_app(engine, model_info(engine, ["tiny"]))
    server, thread, port = start_server(app)
    with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=60) as http:
        yield http, engine, kv_dir
    server.should_exit = True
    thread.join(30)


def idle_stats(engine: Any) -> dict[str, float]:
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        stats = engine.get_stats()
        busy = stats["num_requests_running"] + stats["num_requests_waiting"]
        if busy == 0 and engine.num_in_flight == 0:
            return stats
        time.sleep(0.02)
    raise AssertionError("engine not idle")


def metric_values(text: str) -> dict[str, float]:
    values = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            values[name] = float(value)
    return values


def test_tier_hits_bytes_and_latency_on_metrics_and_dashboard(tiered: Any) -> None:
    http, engine, _ = tiered
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 400) for _ in range(100)] for _ in range(9)]
    # 64 blocks of 8: the eight others evict the first prompt's blocks; they come back from disk.
    for prompt in [*prompts, prompts[0]]:
        r = http.post("/v1/completions", json={"model": "tiny", "prompt": prompt, "max_tokens": 2})
        assert r.status_code == 200, r.text
    stats = idle_stats(engine)
    assert stats["kv_tier_disk_hits"] >= 12, stats  # the first prompt's 12 full blocks
    values = metric_values(http.get("/metrics").text)
    assert values['pagedllm:kv_tier_hits_total{tier="disk"}'] >= 12
    assert values['pagedllm:kv_tier_hits_total{tier="host"}'] == 0  # the CPU has no host tier
    assert values['pagedllm:kv_tier_bytes{tier="disk"}'] > 0
    assert values['pagedllm:kv_tier_capacity_bytes{tier="disk"}'] == 10 * (1 << 30)
    assert values["pagedllm:kv_tier_load_seconds_count"] >= 12
    assert values["pagedllm:kv_tier_load_seconds_sum"] > 0
    assert values["pagedllm:kv_tier_store_seconds_count"] > 0
    assert values["pagedllm:kv_tier_corrupt_blocks_total"] == 0
    tiers = http.get("/v1/dashboard").json()["kv_tiers"]
    assert tiers["disk_hits"] >= 12 and tiers["disk_bytes"] > 0 and tiers["load_ms"] > 0
    assert stats["num_free_device_blocks"] == stats["num_device_blocks"]


def _folder(root: Path, digest: str, model: str, blocks: int) -> None:
    fp = Fingerprint(digest, {"format": 1, "model_path": model, "block_size": 16})
    tier = DiskTier(root, fp, capacity_bytes=1 << 30, payload_nbytes=64, layout={})
    for key in range(blocks):
        tier.write(key, memoryview(bytes(64)))


def test_kv_cache_ls_and_clear(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _folder(tmp_path, "a" * 32, "/models/one", 3)
    _folder(tmp_path, "b" * 32, "/models/two", 2)
    (tmp_path / "notes.txt").write_text("not ours")
    assert main(["kv-cache", "ls", "--kv-cache-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "a" * 32 in out and "/models/one" in out and " 3 blocks" in out
    assert "b" * 32 in out and " 2 blocks" in out
    assert (
        main(["kv-cache", "clear", "--kv-cache-dir", str(tmp_path), "--fingerprint", "b" * 32]) == 0
    )
    assert not (tmp_path / ("b" * 32)).exists() and (tmp_path / ("a" * 32)).exists()
    assert main(["kv-cache", "clear", "--kv-cache-dir", str(tmp_path)]) == 0
    assert "removed 1 folder" in capsys.readouterr().out
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"]
    assert main(["kv-cache", "ls", "--kv-cache-dir", str(tmp_path)]) == 0
    assert "no KV blocks" in capsys.readouterr().out
    assert main(["kv-cache", "ls", "--kv-cache-dir", str(tmp_path / "missing")]) == 2
    assert "kv_cache_dir:" in capsys.readouterr().err

"""Data-parallel replicas: the same greedy tokens as one engine, and a replica killed mid-burst.

Ray runs as a two-node cluster started in this process (``ray.cluster_utils.Cluster``, one CPU
per node), so the two replicas' placement group spreads them over both nodes. The tokens are
checked with prefix caching on and a KV cache small enough that requests are preempted; the
local-process path (``distributed_executor_backend="mp"``) runs the same check. The kill test
serves 64 streams through the OpenAI client, SIGKILLs one replica's core mid-burst, and expects
exactly that replica's streams to end with an error naming it, the others to finish with the
single engine's text, the replica to come back, and every gauge to return to zero.
"""

from __future__ import annotations

import asyncio
import os
import random
import re
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from pagedllm import Engine, SamplingParams
from tests.entrypoints.conftest import API_KEY, MODEL_NAME, stall_core, start_server
from tests.hf_reference import assert_greedy_match, hf_greedy

MAX_NEW = 12
# 12 blocks of 8 tokens per engine: six 28-token prompts that grow by 12 do not fit at once.
ENGINE_ARGS: dict[str, Any] = dict(
    dtype="float32", block_size=8, num_kv_blocks=12, enable_prefix_caching=True, max_model_len=64
)
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW)


def shared_prefix_prompts(num: int = 12, *, seed: int = 0) -> list[list[int]]:
    """Two system prompts of 24 tokens (three blocks), each followed by its own question."""
    rng = random.Random(seed)
    heads = [[rng.randrange(5, 400) for _ in range(24)] for _ in range(2)]
    return [heads[i % 2] + [rng.randrange(5, 400) for _ in range(4)] for i in range(num)]


def token_ids(outs: list[Any]) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def baseline(llama_path: Path) -> tuple[list[list[int]], list[list[int]]]:
    prompts = shared_prefix_prompts()
    engine = Engine(str(llama_path), "cpu", **ENGINE_ARGS)
    outs = engine.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    stats = engine.get_stats()
    assert stats["num_preemptions_total"] > 0 and stats["prefix_cache_hits"] > 0, stats
    engine.shutdown()
    refs = hf_greedy(llama_path, prompts, MAX_NEW)
    for i, (ours, ref) in enumerate(zip(token_ids(outs), refs, strict=True)):
        assert_greedy_match(ours, ref, f"single engine prompt {i}")
    return prompts, token_ids(outs)


@pytest.fixture(scope="module")
def ray_cluster() -> Iterator[Any]:
    ray = pytest.importorskip("ray", reason="Ray is not installed (ci/requirements-ray.txt)")
    from ray.cluster_utils import Cluster

    cluster = Cluster(
        initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False}
    )
    cluster.add_node(num_cpus=1)
    ray.init(address=cluster.address, log_to_driver=False)
    try:
        yield ray
    finally:
        ray.shutdown()
        cluster.shutdown()


def idle_replica_stats(client: Any, timeout: float = 10.0) -> list[dict[str, float]]:
    """Each replica's stats once it reports nothing running and every block free (an idle
    core reports within half a second; the report that says a request ended may come before
    the one that counts its blocks free). A leaked block fails here, after ``timeout``."""
    keys = ("num_requests_running", "num_requests_waiting", "num_free_device_blocks")
    deadline = time.monotonic() + timeout
    while True:
        stats = [r["stats"] for r in client.replica_stats()]
        if all(
            s
            and s["num_requests_running"] + s["num_requests_waiting"] == 0
            and s["num_free_device_blocks"] == s["num_device_blocks"]
            for s in stats
        ):
            return stats
        assert time.monotonic() < deadline, [{k: s.get(k) for k in keys} for s in stats]
        time.sleep(0.05)


async def generate_held(engine: Any, prompts: list[list[int]]) -> list[Any]:
    """``generate_async`` with each replica held while the batch is handed over, so each sees
    its whole share at its first step: squeezed however slowly this process runs under load
    (a replica that took its prompts a few steps apart could finish them without preempting)."""
    holds = [asyncio.ensure_future(r.call(stall_core, 0.5)) for r in engine.replicas]
    await asyncio.sleep(0)  # the holds are sent before any prompt
    outs = await engine.generate_async([{"prompt_token_ids": p} for p in prompts], GREEDY)
    await asyncio.gather(*holds)
    return outs


def check_replicas_equal(engine: Any, baseline: tuple[list[list[int]], list[list[int]]]) -> None:
    prompts, expected = baseline
    outs = asyncio.run(generate_held(engine, prompts))
    assert token_ids(outs) == expected
    stats = idle_replica_stats(engine.client)
    seen = [(s["num_preemptions_total"], s["prefix_cache_hits"]) for s in stats]
    assert all(p > 0 for p, _ in seen), seen  # both were squeezed
    assert all(h > 0 for _, h in seen), seen
    assert all(s["num_free_device_blocks"] == s["num_device_blocks"] for s in stats), stats
    # The prefix router keeps each system prompt on one replica.
    assert engine.router.stats.decisions_by_reason().get("prefix", 0) >= len(prompts) - 2


def test_ray_dp2_on_two_nodes_matches_one_engine(
    llama_path: Path, baseline: Any, ray_cluster: Any
) -> None:
    from ray.util.placement_group import placement_group_table

    engine = Engine(
        str(llama_path),
        "cpu",
        data_parallel_size=2,
        distributed_executor_backend="ray",
        **ENGINE_ARGS,
    )
    try:
        nodes = set(
            placement_group_table(engine.client._placement.pg)["bundles_to_node_id"].values()
        )
        assert len(nodes) == 2, f"both replicas on one node: {nodes}"
        check_replicas_equal(engine, baseline)
        with pytest.raises(ValueError, match="^data_parallel_size: "):
            engine.add_request("x", [1, 2, 3], GREEDY)
    finally:
        engine.shutdown()
    deadline = time.monotonic() + 20  # the placement group is released with the replicas
    while ray_cluster.available_resources().get("CPU", 0) < 2 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert ray_cluster.available_resources().get("CPU", 0) == 2


def test_local_processes_dp2_match_one_engine(llama_path: Path, baseline: Any) -> None:
    engine = Engine(
        str(llama_path),
        "cpu",
        data_parallel_size=2,
        distributed_executor_backend="mp",
        **ENGINE_ARGS,
    )
    try:
        assert engine.client.backend == "mp"
        # The replicas' tokenizer loaded once, beside their starts, for all of them.
        first, second = (r.tokenizer for r in engine.client.replicas)
        assert first is not None and first is second
        check_replicas_equal(engine, baseline)
        prompts, expected = baseline
        batch = [{"prompt_token_ids": p} for p in prompts]
        with pytest.raises(ValueError, match="prompt_token_ids: token id 999999 "):
            engine.generate([*batch[:5], {"prompt_token_ids": [5, 999999]}, *batch[5:]], GREEDY)
        idle_replica_stats(engine.client)  # the prompts taken were aborted, every block back
        assert token_ids(engine.generate(batch[:4], GREEDY)) == expected[:4]
    finally:
        engine.shutdown()
    assert not any(r.proc.is_alive() for r in engine.replicas)


# -- a replica killed mid-burst ------------------------------------------------------------------
NUM_STREAMS = 64
BURST_TOKENS = 16
SERVER_ARGS: dict[str, Any] = dict(
    dtype="float32", block_size=8, num_kv_blocks=128, max_model_len=128, max_num_seqs=64,
    enable_prefix_caching=True,
)  # fmt: skip


def burst_prompts() -> list[list[int]]:
    rng = random.Random(1)
    heads = [[rng.randrange(5, 400) for _ in range(16)] for _ in range(8)]
    return [heads[i % 8] + [rng.randrange(5, 400) for _ in range(3)] for i in range(NUM_STREAMS)]


async def run_burst(base_url: str, prompts: list[list[int]], kill: Any) -> list[dict[str, Any]]:
    """Stream every prompt at once while a watcher calls ``kill(streaming)`` every few
    milliseconds until it returns True; ``streaming``: the ids of the streams that have had a
    chunk and not their end. (The streams' own chunks are no clock for the kill: the server
    coalesces a lagging reader's chunks, and on a loaded host a replica's streams could all be
    done before the client had seen half the first chunks.)"""
    import openai

    client = openai.AsyncOpenAI(base_url=base_url, api_key=API_KEY, max_retries=0, timeout=120)
    results: list[dict[str, Any]] = [{} for _ in prompts]
    done = asyncio.Event()
    streaming: set[str] = set()

    async def watch() -> None:
        while not done.is_set() and not kill(streaming):
            await asyncio.sleep(0.002)

    async def one(i: int) -> None:
        text = ""
        try:
            stream = await client.completions.create(
                model=MODEL_NAME,
                prompt=prompts[i],
                max_tokens=BURST_TOKENS,
                temperature=0,
                stream=True,
                extra_body={"ignore_eos": True},
            )
            async for chunk in stream:
                results[i]["id"] = chunk.id
                streaming.add(chunk.id)
                text += chunk.choices[0].text if chunk.choices else ""
            results[i]["text"] = text
        except openai.APIError as exc:
            results[i]["error"] = str(exc)
        finally:
            results[i].setdefault("text", text)
            streaming.discard(results[i].get("id", ""))

    watcher = asyncio.create_task(watch())
    await asyncio.gather(*(one(i) for i in range(len(prompts))))
    done.set()
    await watcher
    await client.close()
    return results


def metric_values(text: str, name: str) -> list[float]:
    pattern = re.compile(rf"^pagedllm:{name}(?:{{[^}}]*}})? (\S+)$", re.M)
    return [float(v) for v in pattern.findall(text)]


def test_killed_replica_fails_only_its_streams_and_comes_back(
    llama_path: Path, ray_cluster: Any
) -> None:
    import httpx

    from pagedllm.engine.dp_client import DataParallelClient
    from pagedllm.entrypoints.openai.api_server import ServerSettings, build_app, model_info

    prompts = burst_prompts()
    single = Engine(str(llama_path), "cpu", **SERVER_ARGS)
    params = SamplingParams(temperature=0.0, max_tokens=BURST_TOKENS, ignore_eos=True)
    expected = [
        o.outputs[0].text
        for o in single.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    ]
    single.shutdown()
    engine = DataParallelClient(
        str(llama_path),
        "cpu",
        data_parallel_size=2,
        distributed_executor_backend="ray",
        log_stats_interval=None,
        **SERVER_ARGS,
    )
    app = build_app(engine, model_info(engine, [MODEL_NAME]), ServerSettings(api_key=API_KEY))
    server, thread, port = start_server(app)
    base = f"http://127.0.0.1:{port}"
    owners: dict[str, int] = {}
    victim = engine.replicas[0]

    stopped_at: list[float] = []

    def kill(streaming: set[str]) -> bool:
        """Freeze the victim (SIGSTOP) when the client sees one of its streams half-way through;
        once its last outputs had time to drain, kill it if such a stream is still unfinished
        (that one must fail), else let it go on (SIGCONT) and wait for the next. Killed
        outright, a victim whose outputs were all on the wire failed no stream; streams it had
        not taken yet are routed to the other replica, as they should be."""
        try:  # the server's thread may be changing the router as we read it
            now = engine.router.owners()
        except RuntimeError:
            return False
        mid_way = any(now.get(f"{rid}-0") == 0 for rid in list(streaming))
        if not stopped_at:
            if mid_way:
                os.kill(victim.proc.pid, signal.SIGSTOP)
                stopped_at.append(time.monotonic())
            return False
        if time.monotonic() < stopped_at[0] + 0.5:
            return False
        if not mid_way:
            os.kill(victim.proc.pid, signal.SIGCONT)
            stopped_at.clear()
            return False
        owners.update(now)
        os.kill(victim.proc.pid, signal.SIGKILL)
        return True

    health: list[str] = []
    stop_polling = threading.Event()

    def poll_health() -> None:
        with httpx.Client(base_url=base, timeout=10) as http:
            while not stop_polling.is_set():
                health.append(http.get("/health").json().get("status", "?"))
                time.sleep(0.05)

    poller = threading.Thread(target=poll_health, daemon=True)
    poller.start()
    try:
        results = asyncio.run(run_burst(base + "/v1", prompts, kill))
        on_victim = {rid for rid, r in owners.items() if r == 0}
        assert on_victim and len(on_victim) < NUM_STREAMS, owners
        failed = [i for i, r in enumerate(results) if "error" in r]
        assert failed, "killing a replica failed no stream"
        for i in failed:
            assert "replica 0" in results[i]["error"], results[i]
            rid = results[i].get("id")
            assert rid is None or f"{rid}-0" in on_victim, (i, rid)
        for i, r in enumerate(results):
            if "error" not in r:
                assert r["text"] == expected[i], f"stream {i} differs from one engine"
        assert len(failed) <= len(on_victim)
        deadline = time.monotonic() + 300  # a restart on a loaded 2-core host: minutes
        while engine.health()["status"] != "ok" and time.monotonic() < deadline:
            time.sleep(0.2)
        assert engine.health() == {"status": "ok", "replicas": ["up", "up"]}
        assert engine.replicas[0] is not victim and engine.restarts == [1, 0]
        time.sleep(0.3)
        stop_polling.set()
        poller.join(5)
        assert "degraded" in health and health[-1] == "ok", health
        # The replica serves again: a few requests land on both.
        again = asyncio.run(run_burst(base + "/v1", prompts[:8], lambda _: True))
        assert [r["text"] for r in again] == expected[:8]
        with httpx.Client(base_url=base, timeout=10) as http:
            for _ in range(100):
                metrics = http.get("/metrics").text
                gauges = [
                    *metric_values(metrics, "num_requests_running"),
                    *metric_values(metrics, "num_requests_waiting"),
                    *metric_values(metrics, "replica_load_tokens"),
                    *metric_values(metrics, "replica_requests_in_flight"),
                ]
                if not any(gauges):
                    break
                time.sleep(0.1)
        assert len(gauges) == 6 and not any(gauges), metrics
        assert metric_values(metrics, "replica_up") == [1.0, 1.0]
        assert metric_values(metrics, "replica_restarts_total") == [1.0, 0.0]
        lost, others = metric_values(metrics, "replica_failed_requests_total")
        assert lost >= len(failed) and others == 0  # (+ any routed there as it died, rerouted)
        assert sum(metric_values(metrics, "router_decisions_total")) >= NUM_STREAMS + 8
        auth = {"Authorization": f"Bearer {API_KEY}"}
        board = httpx.get(base + "/v1/dashboard", headers=auth, timeout=10).json()["replicas"]
        assert board["policy"] == "prefix" and [r["state"] for r in board["rows"]] == ["up"] * 2
        for s in idle_replica_stats(engine):
            assert s["num_free_device_blocks"] == s["num_device_blocks"], s
    finally:
        stop_polling.set()
        server.should_exit = True
        thread.join(30)
        engine.stop()


@pytest.mark.parametrize("split", ["tensor_parallel_size", "pipeline_parallel_size"])
def test_replicas_can_be_tensor_or_pipeline_parallel(
    llama_path: Path, baseline: Any, split: str
) -> None:
    """Two replicas of two tensor-parallel ranks or two pipeline stages each (the ranks are
    processes next to their replica's core): still the single engine's tokens."""
    args = dict(ENGINE_ARGS, **{split: 2})
    if split == "pipeline_parallel_size":  # one scheduler: its 12 blocks squeeze it
        args["virtual_engines"] = 1
    engine = Engine(
        str(llama_path), "cpu", data_parallel_size=2, distributed_executor_backend="mp", **args
    )
    try:
        check_replicas_equal(engine, baseline)
    finally:
        engine.shutdown()

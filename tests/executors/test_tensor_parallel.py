"""Tensor parallelism on the CPU: two ranks over gloo give the tokens one process gives.

Each rank holds half the attention heads (the llama fixture's 4 query / 2 KV heads are GQA; qwen2
is 2 / 2), half the MLP and half the vocabulary; greedy float32 outputs must equal both the
single-process engine and transformers. A rank killed mid-run must surface as a RuntimeError
naming it, with every worker process gone well within 30 s. The Ray executor runs the same checks
on a one-node Ray cluster that the test starts on this machine.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from pagedllm import Engine, SamplingParams
from tests.conftest import PROMPTS
from tests.hf_reference import HFGreedy, assert_first_logprobs_close, assert_greedy_match, hf_greedy

MAX_NEW = 12
ENGINE_ARGS: dict[str, Any] = dict(device="cpu", dtype="float32", block_size=8, num_kv_blocks=96)
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, logprobs=5)
KILL_DEADLINE_S = 30.0


def generate(engine: Engine, ids: list[list[int]], params: Any) -> list[Any]:
    return engine.generate([{"prompt_token_ids": i} for i in ids], params, use_tqdm=False)


@dataclass
class Baseline:
    ids: list[list[int]]
    refs: list[HFGreedy]  # transformers
    single: list[Any]  # the single-process engine's RequestOutputs


class Lazy:
    """Per-model objects built on first use and shared by the module's tests (starting engines
    and worker processes is the costly part on a small machine)."""

    def __init__(self, build: Any) -> None:
        self.build = build
        self.items: dict[str, Any] = {}

    def __getitem__(self, name: str) -> Any:
        if name not in self.items:
            self.items[name] = self.build(name)
        return self.items[name]


@pytest.fixture(scope="module")
def baselines(tiny_models: dict[str, Path]) -> Lazy:
    def build(name: str) -> Baseline:
        from transformers import AutoTokenizer

        path = tiny_models[name]
        tok = AutoTokenizer.from_pretrained(str(path))
        ids = [tok.encode(p) for p in PROMPTS]
        single = generate(Engine(str(path), **ENGINE_ARGS), ids, GREEDY)
        return Baseline(ids, hf_greedy(path, ids, MAX_NEW), single)

    return Lazy(build)


@pytest.fixture(scope="module")
def tp_engines(tiny_models: dict[str, Path]) -> Iterator[Lazy]:
    """TP=2 multiprocess engines; the kill test ends the qwen2 one, so it must use it last."""
    engines = Lazy(
        lambda name: Engine(str(tiny_models[name]), tensor_parallel_size=2, **ENGINE_ARGS)
    )
    yield engines
    for engine in engines.items.values():
        engine.shutdown()


def check_equal(engine: Engine, base: Baseline, label: str) -> None:
    outs = generate(engine, base.ids, GREEDY)
    for i, (tp, single, ref) in enumerate(zip(outs, base.single, base.refs, strict=True)):
        ours, theirs = tp.outputs[0], single.outputs[0]
        assert ours.token_ids == theirs.token_ids, (
            f"{label} prompt {i}: TP {ours.token_ids} != single process {theirs.token_ids}"
        )
        assert_greedy_match(ours.token_ids, ref, f"{label} prompt {i}")
        assert_first_logprobs_close(ours.logprobs[0], ref, f"{label} prompt {i}")
        diff = max(abs(v - theirs.logprobs[0][t]) for t, v in ours.logprobs[0].items())
        assert diff < 1e-4, f"{label} prompt {i}: first-step logprobs differ by {diff:.2e}"
    bm = engine.block_manager
    assert bm.get_num_free_device_blocks() == bm.num_device_blocks


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def kill_mid_run(engine: Engine, pid: int) -> tuple[RuntimeError, float]:
    """Generate long outputs, SIGKILL ``pid`` once decoding is under way; the error and how long
    it took to surface after the kill."""
    gen0 = engine.counters.generation_tokens
    killed_at: list[float] = []

    def killer() -> None:
        deadline = time.monotonic() + 20
        while engine.counters.generation_tokens < gen0 + 8 and time.monotonic() < deadline:
            time.sleep(0.005)
        killed_at.append(time.monotonic())
        os.kill(pid, 9)

    thread = threading.Thread(target=killer, daemon=True)
    thread.start()
    params = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)
    with pytest.raises(RuntimeError) as info:
        generate(engine, [[5, 6, 7, 8]] * 4, params)
    elapsed = time.monotonic() - killed_at[0]
    thread.join(5)
    produced = engine.counters.generation_tokens - gen0
    assert 8 <= produced < 4 * 400, f"the worker was not killed mid-run ({produced} tokens)"
    return info.value, elapsed


# -- multiprocess ------------------------------------------------------------------------------
@pytest.mark.parametrize("model", ["llama", "qwen2"])
def test_tp2_matches_single_process_and_transformers(
    baselines: Lazy, tp_engines: Lazy, model: str
) -> None:
    check_equal(tp_engines[model], baselines[model], f"{model}/tp2")


def test_tp2_random_sampling_matches_single_process(
    tiny_models: dict[str, Path], baselines: Lazy, tp_engines: Lazy
) -> None:
    """Every rank's sampler starts from the engine seed, so unseeded draws agree with one process
    (and seeded requests depend only on their own seed)."""
    ids = baselines["llama"].ids
    params = [
        SamplingParams(temperature=0.9, top_p=0.95, max_tokens=8, seed=(7 if i % 2 else None))
        for i in range(len(ids))
    ]
    single_engine = Engine(str(tiny_models["llama"]), **ENGINE_ARGS)
    single = [o.outputs[0].token_ids for o in generate(single_engine, ids, params)]
    tp = [o.outputs[0].token_ids for o in generate(tp_engines["llama"], ids, params)]
    assert tp == single, f"TP sampled {tp}\n single process sampled {single}"


def test_killed_worker_fails_requests_and_shuts_down(tp_engines: Lazy) -> None:
    engine = tp_engines["qwen2"]
    pids = list(engine.executor.worker_pids)
    assert all(_alive(p) for p in pids)
    err, elapsed = kill_mid_run(engine, pids[1])
    assert "rank 1 (pid" in str(err) and "killed by SIGKILL" in str(err), str(err)
    assert elapsed < KILL_DEADLINE_S, f"the failure took {elapsed:.1f} s to surface: {err}"
    assert not any(_alive(p) for p in pids), f"worker processes left behind: {pids}"
    # The executor stays failed (later calls raise at once, no hang); shutdown is immediate.
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match="rank 1"):
        engine.executor.check_health()
    engine.shutdown()
    assert time.monotonic() - t0 < 5


# -- Ray ---------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def ray_engine(tiny_models: dict[str, Path]) -> Iterator[tuple[Any, Engine]]:
    ray = pytest.importorskip("ray", reason="Ray is not installed (ci/requirements-ray.txt)")
    # A fresh one-node cluster on this machine. (Ray maps a loopback node address to this
    # machine's own IP, so the node address is left to it.)
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        engine = Engine(
            str(tiny_models["llama"]),
            tensor_parallel_size=2,
            distributed_executor_backend="ray",
            **ENGINE_ARGS,
        )
        yield ray, engine
        engine.shutdown()
    finally:
        ray.shutdown()


def test_ray_tp2_matches_single_process_and_transformers(
    baselines: Lazy, ray_engine: tuple[Any, Engine]
) -> None:
    _, engine = ray_engine
    # The rendezvous is on this machine (binding to an address only works for a local one).
    with socket.socket() as s:
        s.bind((engine.executor.master_addr, 0))
    check_equal(engine, baselines["llama"], "llama/ray-tp2")


def test_ray_killed_actor_fails_requests_and_frees_resources(
    ray_engine: tuple[Any, Engine],
) -> None:
    ray, engine = ray_engine
    err, elapsed = kill_mid_run(engine, engine.executor.worker_pids[1])
    assert "rank 1" in str(err) and "died" in str(err), str(err)
    assert elapsed < KILL_DEADLINE_S, f"the failure took {elapsed:.1f} s to surface: {err}"
    with pytest.raises(RuntimeError, match="rank 1"):
        engine.executor.check_health()
    deadline = time.monotonic() + 10
    while ray.available_resources().get("CPU", 0) < 2 and time.monotonic() < deadline:
        time.sleep(0.2)
    free = ray.available_resources().get("CPU", 0)
    assert free == 2, f"the actors or placement group leaked: {free} of 2 CPUs free"

"""Pipeline parallelism on the CPU: stages over gloo give the tokens one process gives.

The llama fixture (2 layers, tied head) splits 1 + 1, mistral (3 layers, untied head) 2 + 1,
and every other family (OPT, GPT-2 and Phi included) splits by inheriting the same base.
Greedy float32 outputs must equal both the single-process engine and transformers, with prefix
caching on and a KV cache small enough that requests are preempted (each virtual engine gets
half of it). The engine keeps two micro-batches in flight (one per virtual engine) and every
virtual engine's blocks are free once its requests finish. A stage killed mid-run surfaces as a
RuntimeError naming it, ends its in-flight requests with that error, and leaves no process (or
Ray reservation) behind. The Ray tests run on a two-node cluster started in this process.
"""

from __future__ import annotations

import itertools
import json
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from pagedllm import Engine, SamplingParams
from pagedllm.layers.parallel import PPContext, stage_layers
from tests.conftest import PROMPTS, load_on_reference
from tests.executors.test_tensor_parallel import Baseline, Lazy, _alive, generate
from tests.hf_reference import assert_greedy_match, hf_greedy

MAX_NEW = 10
# 16 blocks of 8 tokens: 8 per virtual engine, fewer than the prompts need together.
ENGINE_ARGS: dict[str, Any] = dict(
    device="cpu", dtype="float32", block_size=8, num_kv_blocks=16, enable_prefix_caching=True
)
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, logprobs=5)
KILL_DEADLINE_S = 30.0
NGRAM = {"method": "ngram", "num_speculative_tokens": 2}


# -- the split ---------------------------------------------------------------------------------
def test_stage_layers_are_contiguous_with_extra_layers_on_earlier_stages() -> None:
    assert [stage_layers(5, 2, s) for s in range(2)] == [(0, 3), (3, 5)]
    assert [stage_layers(7, 3, s) for s in range(3)] == [(0, 3), (3, 5), (5, 7)]
    assert [stage_layers(4, 4, s) for s in range(4)] == [(0, 1), (1, 2), (2, 3), (3, 4)]
    for layers in range(1, 12):
        for stages in range(1, layers + 1):
            ranges = [stage_layers(layers, stages, s) for s in range(stages)]
            assert ranges[0][0] == 0 and ranges[-1][1] == layers
            assert all(a[1] == b[0] for a, b in itertools.pairwise(ranges))
            sizes = [end - start for start, end in ranges]
            assert max(sizes) - min(sizes) <= 1 and sizes == sorted(sizes, reverse=True)
    with pytest.raises(ValueError, match=r"^pipeline_parallel_size: 3 stages for a model of 2"):
        stage_layers(2, 3, 0)


@pytest.mark.parametrize("model", ["llama", "mistral"])
def test_each_stage_holds_only_its_layers(tiny_models: dict[str, Path], model: str) -> None:
    """Other stages' layers are not materialised: no parameter, no attention layer, no KV."""
    from pagedllm.executors.worker import kv_geometry

    num_layers = 2 if model == "llama" else 3
    tied = model == "llama"
    for stage in range(2):
        pp = PPContext(stage=stage, size=2)
        m = load_on_reference(tiny_models[model], torch.float32, pp=pp)
        start, end = stage_layers(num_layers, 2, stage)
        layers = {int(n.split(".")[1]) for n, _ in m.named_parameters() if n.startswith("layers.")}
        assert layers == set(range(start, end)), (stage, layers)
        tops = {n.split(".")[0] for n, _ in m.named_parameters()}
        expected = {"layers"}
        if stage == 0 or tied:
            expected.add("embed_tokens")
        if stage == 1:
            expected |= {"norm"} if tied else {"norm", "lm_head"}
        assert tops == expected, (stage, tops)
        assert kv_geometry(m)[0] == end - start


def _prefill(model: Any, ids: list[int], intermediate: Any = None) -> Any:
    """One prompt through ``model`` (a whole model or one stage) over a fresh paged cache."""
    from pagedllm.backends.reference import ReferenceAttention
    from pagedllm.executors.worker import kv_geometry

    backend, n, block = ReferenceAttention(), len(ids), 8
    num_layers, kv_heads, head = kv_geometry(model)
    caches = [
        torch.zeros(backend.kv_cache_shape(4, block, kv_heads, head)) for _ in range(num_layers)
    ]
    meta = backend.build_metadata(
        num_prefills=1,
        seq_lens=[n],
        query_lens=[n],
        slot_mapping=list(range(n)),
        block_tables=[list(range((n + block - 1) // block))],
        block_size=block,
        device=torch.device("cpu"),
    )
    args = () if intermediate is None else (intermediate,)
    with torch.inference_mode():
        return model(torch.tensor(ids), torch.arange(n), caches, meta, *args)


STAGE_FAMILIES = [
    "opt",
    "opt350m",
    "gpt2",
    "phi",
    "qwen3",
    "gemma",
    "gemma2",
    "gemma3",
    "phi3",
    "mixtral",
    "qwen2_moe",
    "qwen3_moe",
    "olmoe",
]


@pytest.fixture(scope="module")
def family_paths(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from tests.models.moe_models import MOE_FAMILIES, build_moe
    from tests.models.test_more_families import build_family

    root = tmp_path_factory.mktemp("stage_families")
    return {
        name: (build_moe if name in MOE_FAMILIES else build_family)(root / name, name)
        for name in STAGE_FAMILIES
    }


@pytest.mark.parametrize("family", STAGE_FAMILIES)
def test_every_family_splits_into_stages(family_paths: dict[str, Path], family: str) -> None:
    """OPT (pre- and post-norm), GPT-2, Phi, Qwen3, Gemma 1-3, Phi-3 and the four MoE families
    inherit the split: two stages chained in one process (the second fed the first's
    activations) give the whole model's logits."""
    path = family_paths[family]
    ids = [5, 9, 17, 33, 65, 7, 11, 13, 3, 21]
    whole = load_on_reference(path, torch.float32)
    expected = whole.compute_logits(_prefill(whole, ids))
    first, last = (
        load_on_reference(path, torch.float32, pp=PPContext(stage=s, size=2)) for s in range(2)
    )
    hidden, residual = _prefill(first, ids)
    assert hidden.shape == residual.shape == (len(ids), whole.config.hidden_size)
    got = last.compute_logits(_prefill(last, ids, (hidden, residual)))
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_unsupported_settings_are_refused(tiny_models: dict[str, Path]) -> None:
    """Refused by name in the engine's process, before any stage is started."""
    llama = str(tiny_models["llama"])
    with pytest.raises(ValueError, match=r"^pipeline_parallel_size: 3 stages for a model of 2"):
        Engine(llama, device="cpu", pipeline_parallel_size=3)
    refusals = [  # (engine arguments besides pipeline_parallel_size=2, the field named)
        ({"pipeline_parallel_size": 0}, "pipeline_parallel_size"),
        ({"distributed_executor_backend": "uni"}, "pipeline_parallel_size"),
        ({"speculative_config": json.dumps(NGRAM)}, "speculative_config"),
        ({"enable_lora": True}, "enable_lora"),
        ({"virtual_engines": 0}, "virtual_engines"),
    ]
    for extra, field in refusals:
        args = {"pipeline_parallel_size": 2, **extra}
        with pytest.raises(ValueError, match=rf"^{field}: "):
            Engine(llama, device="cpu", **args)


# -- against one process and transformers ------------------------------------------------------
@pytest.fixture(scope="module")
def model_paths(tiny_models: dict[str, Path], family_paths: dict[str, Path]) -> dict[str, Path]:
    return {**family_paths, **tiny_models}


@pytest.fixture(scope="module")
def baselines(model_paths: dict[str, Path]) -> Lazy:
    def build(name: str) -> Baseline:
        from transformers import AutoTokenizer

        path = model_paths[name]
        tok = AutoTokenizer.from_pretrained(str(path))
        ids = [tok.encode(p) for p in PROMPTS]
        ids += [ids[-1] + ids[0], ids[-1] + ids[1]]  # a shared prefix of whole blocks
        single = generate(Engine(str(path), **ENGINE_ARGS), ids, GREEDY)
        return Baseline(ids, hf_greedy(path, ids, MAX_NEW), single)

    return Lazy(build)


@pytest.fixture(scope="module")
def pp_engines(model_paths: dict[str, Path]) -> Iterator[Lazy]:
    """Multiprocess engines by (model, tp, pp[, virtual engines]); the kill test ends
    ("llama", 1, 2) last."""
    engines = Lazy(
        lambda key: Engine(
            str(model_paths[key[0]]),
            tensor_parallel_size=key[1],
            pipeline_parallel_size=key[2],
            virtual_engines=key[3] if len(key) > 3 else None,
            distributed_executor_backend="mp",
            **ENGINE_ARGS,
        )
    )
    yield engines
    for engine in engines.items.values():
        engine.shutdown()


def all_blocks_free(engine: Engine) -> bool:
    managers = getattr(engine.block_manager, "managers", [engine.block_manager])
    return all(m.get_num_free_device_blocks() == m.num_device_blocks for m in managers)


def check_equal(engine: Engine, base: Baseline, label: str) -> None:
    for run in range(2):  # the second run reads blocks the first left in the prefix cache
        outs = generate(engine, base.ids, GREEDY)
        for i, (pp, single, ref) in enumerate(zip(outs, base.single, base.refs, strict=True)):
            ours, theirs = pp.outputs[0], single.outputs[0]
            assert ours.token_ids == theirs.token_ids, (
                f"{label} run {run} prompt {i}: PP {ours.token_ids} != single {theirs.token_ids}"
            )
            assert_greedy_match(ours.token_ids, ref, f"{label} prompt {i}")
            diff = max(abs(v - theirs.logprobs[0][t]) for t, v in ours.logprobs[0].items())
            assert diff < 1e-4, f"{label} prompt {i}: first-step logprobs differ by {diff:.2e}"
        assert all_blocks_free(engine), f"{label}: KV blocks leaked after run {run}"
    stats = engine.get_stats()
    assert stats["num_preemptions_total"] > 0, f"{label}: the cache was never short"
    assert stats["prefix_cache_hits"] > 0, f"{label}: the prefix cache was never hit"


# OPT-350m's layout: post-norm layers that keep no residual apart, project_in/out on the stages
# that embed and finish.
@pytest.mark.parametrize("model", ["llama", "mistral", "opt350m"])
def test_pp2_matches_single_process_and_transformers(
    baselines: Lazy, pp_engines: Lazy, model: str
) -> None:
    check_equal(pp_engines[(model, 1, 2)], baselines[model], f"{model}/pp2")


def test_pp2_with_one_scheduler_matches_single_process(baselines: Lazy, pp_engines: Lazy) -> None:
    """``virtual_engines=1``: the stages take turns on one scheduler's steps (the whole cache)."""
    engine = pp_engines[("llama", 1, 2, 1)]
    assert not engine.loop.pipelined and engine.block_manager.num_device_blocks == 16
    check_equal(engine, baselines["llama"], "llama/pp2-one-scheduler")
    engine.shutdown()


def test_tp2_pp2_matches_single_process_and_transformers(baselines: Lazy, pp_engines: Lazy) -> None:
    engine = pp_engines[("llama", 2, 2)]
    assert len(engine.executor.worker_pids) == 4
    check_equal(engine, baselines["llama"], "llama/tp2xpp2")


def test_virtual_engines_keep_micro_batches_in_flight(pp_engines: Lazy) -> None:
    """Two virtual engines: the second's micro-batch is submitted before the first's returns,
    requests spread over both, and both give back every block."""
    engine = pp_engines[("llama", 1, 2)]
    managers = engine.block_manager.managers
    assert len(managers) == 2 and managers[0].num_device_blocks == 8
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    engine.executor.peak_in_flight = 0
    for i in range(4):
        engine.add_request(f"vi-{i}", [5 + i, 6, 7], params)
    loads = [s.num_unfinished() for s in engine.scheduler.schedulers]
    assert loads == [2, 2], loads
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.executor.peak_in_flight == 2
    assert engine.executor.in_flight == 0
    assert all_blocks_free(engine)


def test_beams_and_parallel_samples_match_single_process(
    tiny_models: dict[str, Path], baselines: Lazy, pp_engines: Lazy
) -> None:
    """Beams fork and free through the virtual engine holding their blocks; seeded samples
    depend only on their seed, whichever virtual engine runs them."""
    ids = baselines["llama"].ids[:4]
    params = [
        SamplingParams(n=2, best_of=3, use_beam_search=True, temperature=0.0, max_tokens=6),
        SamplingParams(n=2, temperature=0.9, seed=11, max_tokens=6),
    ]
    single = Engine(str(tiny_models["llama"]), **ENGINE_ARGS)
    engine = pp_engines[("llama", 1, 2)]
    for p in params:
        want = [[c.token_ids for c in o.outputs] for o in generate(single, ids, p)]
        got = [[c.token_ids for c in o.outputs] for o in generate(engine, ids, p)]
        assert got == want, f"{p}: PP {got} != single {want}"
    assert all_blocks_free(engine)


def kill_mid_run(engine: Engine, pid: int) -> tuple[RuntimeError, float, list[Any]]:
    """Step long requests, SIGKILL ``pid`` once decoding is under way; the error, how long it
    took to surface after the kill, and the outputs that ended requests with it."""
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
    max_tokens = 50  # within max_model_len, which the small cache lowers to 64
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    ids = [f"kill-{i}" for i in range(4)]
    for rid in ids:
        engine.add_request(rid, [5, 6, 7, 8], params)
    with pytest.raises(RuntimeError) as info:
        while engine.has_unfinished_requests():
            engine.step()
    elapsed = time.monotonic() - killed_at[0]
    thread.join(5)
    produced = engine.counters.generation_tokens - gen0
    assert 8 <= produced < 4 * max_tokens, f"the stage was not killed mid-run ({produced} tokens)"
    ended = [o for o in engine.loop.pending if o.failed]  # what the next step would report
    engine.abort_request([r for r in ids if r in engine.loop.requests])
    return info.value, elapsed, ended


def test_killed_stage_fails_requests_and_shuts_down(pp_engines: Lazy) -> None:
    engine = pp_engines[("llama", 1, 2)]
    pids = list(engine.executor.worker_pids)
    err, elapsed, ended = kill_mid_run(engine, pids[1])
    assert "pipeline stage 1" in str(err) and "killed by SIGKILL" in str(err), str(err)
    assert elapsed < KILL_DEADLINE_S, f"the failure took {elapsed:.1f} s to surface: {err}"
    assert ended and all("pipeline stage 1" in (o.error or "") for o in ended), ended
    assert not any(_alive(p) for p in pids), f"worker processes left behind: {pids}"
    assert all_blocks_free(engine)
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match="pipeline stage 1"):
        engine.executor.check_health()
    engine.shutdown()
    assert time.monotonic() - t0 < 5


# -- Ray, two nodes ----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def ray_cluster() -> Iterator[Any]:
    ray = pytest.importorskip("ray", reason="Ray is not installed (ci/requirements-ray.txt)")
    from ray.cluster_utils import Cluster

    # Two "nodes" on this machine, 2 logical CPUs each: TP=2 x PP=2 fills both.
    node = dict(num_cpus=2, object_store_memory=80 * 1024 * 1024)
    cluster = Cluster(initialize_head=True, head_node_args=dict(node, include_dashboard=False))
    cluster.add_node(**node)
    ray.init(address=cluster.address, log_to_driver=False)
    try:
        yield ray
    finally:
        ray.shutdown()
        cluster.shutdown()


@pytest.fixture(scope="module")
def ray_engines(ray_cluster: Any, tiny_models: dict[str, Path]) -> Iterator[Lazy]:
    engines = Lazy(
        lambda key: Engine(
            str(tiny_models["llama"]),
            tensor_parallel_size=key[0],
            pipeline_parallel_size=key[1],
            distributed_executor_backend="ray",
            **ENGINE_ARGS,
        )
    )
    yield engines
    for engine in engines.items.values():
        engine.shutdown()


def test_ray_tp2_pp2_spans_both_nodes_and_matches(baselines: Lazy, ray_engines: Lazy) -> None:
    engine = ray_engines[(2, 2)]
    nodes = engine.executor.node_ids()
    assert len(set(nodes)) == 2, f"the four ranks did not span both nodes: {nodes}"
    assert nodes[0] == nodes[1] and nodes[2] == nodes[3], f"a stage's TP group was split: {nodes}"
    check_equal(engine, baselines["llama"], "llama/ray-tp2xpp2")
    engine.shutdown()


def test_ray_pp2_matches_single_process(baselines: Lazy, ray_engines: Lazy) -> None:
    check_equal(ray_engines[(1, 2)], baselines["llama"], "llama/ray-pp2")


def test_ray_killed_stage_fails_requests_and_frees_resources(
    ray_cluster: Any, ray_engines: Lazy
) -> None:
    ray = ray_cluster
    engine = ray_engines[(1, 2)]
    err, elapsed, ended = kill_mid_run(engine, engine.executor.worker_pids[1])
    assert "pipeline stage 1" in str(err) and "died" in str(err), str(err)
    assert elapsed < KILL_DEADLINE_S, f"the failure took {elapsed:.1f} s to surface: {err}"
    assert ended and all("pipeline stage 1" in (o.error or "") for o in ended), ended
    assert all_blocks_free(engine)
    deadline = time.monotonic() + 10
    while ray.available_resources().get("CPU", 0) < 4 and time.monotonic() < deadline:
        time.sleep(0.2)
    free = ray.available_resources().get("CPU", 0)
    assert free == 4, f"the actors or placement group leaked: {free} of 4 CPUs free"

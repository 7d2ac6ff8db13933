"""One request never hurts another: admission refuses what cannot run, failing steps are contained.

Each case here was accepted by the engine before and either waited forever at the head of the
queue, failed every request batched with it, or was silently cut short.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from pagedllm import Engine, SamplingParams
from pagedllm.engine.containment import EngineBrokenError
from tests.conftest import PROMPTS

MAX_NUM_SEQS = 8
VOCAB = 512  # the tiny models' vocabulary


@pytest.fixture(scope="module")
def engine(llama_path: Path) -> Engine:
    return Engine(
        str(llama_path),
        device="cpu",
        block_size=8,
        num_kv_blocks=64,
        max_model_len=128,
        max_num_seqs=MAX_NUM_SEQS,
    )


def all_free(engine: Engine) -> bool:
    bm = engine.block_manager
    return bm.get_num_free_device_blocks() == bm.num_device_blocks


def greedy(n: int = 12) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"top_k": 2**63}, "top_k"),  # past a C long: "Overflow when unpacking long long"
        ({"seed": 2**64}, "seed"),
        ({"seed": -(2**63) - 1}, "seed"),
        ({"n": 2**70}, "n"),
        ({"max_tokens": 10**30}, "max_tokens"),
        ({"temperature": 10**400}, "temperature"),
        ({"temperature": float("inf")}, "temperature"),
        ({"temperature": 1e9}, "temperature"),
        ({"repetition_penalty": 1e300}, "repetition_penalty"),
        ({"logit_bias": {5: 1000.0}}, "logit_bias"),
        ({"logit_bias": {5: float("nan")}}, "logit_bias"),
        ({"logit_bias": {5: 10**400}}, "logit_bias"),
        ({"logit_bias": {-1: 1.0}}, "logit_bias"),
        ({"stop": ["x"] * 33}, "stop"),
        ({"stop": ["x" * 513]}, "stop"),
        ({"stop": 5}, "stop"),
        ({"stop_token_ids": [2**64]}, "stop_token_ids"),
        ({"logprobs": 2**63}, "logprobs"),
    ],
)
def test_sampling_params_bounds_every_value(kwargs: dict, field: str) -> None:
    with pytest.raises(ValueError, match=rf"^{field}:"):
        SamplingParams(**kwargs)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"top_k": VOCAB + 1, "temperature": 0.8}, "top_k"),
        ({"n": MAX_NUM_SEQS + 1, "temperature": 0.8}, "n"),
        ({"n": 2, "best_of": MAX_NUM_SEQS + 1, "temperature": 0.8}, "best_of"),
        ({"logprobs": 21}, "logprobs"),
        ({"prompt_logprobs": 21}, "prompt_logprobs"),
        ({"stop_token_ids": [VOCAB]}, "stop_token_ids"),
        ({"logit_bias": {VOCAB: 1.0}}, "logit_bias"),
        ({"max_tokens": 127}, "max_tokens"),  # prompt + max_tokens past max_model_len
    ],
)
def test_add_request_refuses_what_cannot_run(engine: Engine, kwargs: dict, field: str) -> None:
    with pytest.raises(ValueError, match=rf"^{field}:"):
        engine.add_request("hostile", "A B C", SamplingParams(**kwargs))
    assert not engine.has_unfinished_requests()
    out = engine.generate(["A"], greedy(3), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 3
    assert all_free(engine)


def test_more_blocks_than_the_cache_is_refused_not_truncated(
    llama_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # 8 blocks of 8 tokens: max_model_len (512 in the model) is lowered to what one sequence can
    # hold; n=4 sequences of 30 tokens need 13 blocks and used to come back with 2 tokens each.
    small = Engine(str(llama_path), device="cpu", block_size=8, num_kv_blocks=8)
    try:
        assert small.config.scheduler.max_model_len == 64
        assert small.config.model.max_model_len == 64  # what /v1/models reports
        assert "max_model_len lowered from 512 to 64" in caplog.text
        params = SamplingParams(n=4, temperature=0.8, max_tokens=20, ignore_eos=True, seed=0)
        with pytest.raises(ValueError, match=r"^n: 4 sequence"):
            small.add_request("big", {"prompt_token_ids": list(range(10, 20))}, params)
        ok = small.generate(
            [{"prompt_token_ids": list(range(10, 20))}],
            params.clone(n=2, best_of=2, max_tokens=6),
            use_tqdm=False,
        )
        assert [len(c.token_ids) for c in ok[0].outputs] == [6, 6]
        with pytest.raises(ValueError, match="^max_tokens:"):
            small.add_request("long", {"prompt_token_ids": [5] * 40}, greedy(400))
    finally:
        small.shutdown()


def test_cache_smaller_than_an_explicit_context_refuses_to_start(llama_path: Path) -> None:
    with pytest.raises(ValueError, match=r"^max_model_len: the KV cache holds 64 tokens"):
        Engine(str(llama_path), device="cpu", block_size=8, num_kv_blocks=8, max_model_len=128)


class PoisonRows:
    """``execute_model`` that fails whenever a row with the marker's sampling params is batched."""

    def __init__(self, real, marker_seed: int) -> None:
        self.real, self.marker_seed, self.calls = real, marker_seed, 0

    def __call__(self, sched_out):
        self.calls += 1
        if any(s.sampling_params.seed == self.marker_seed for s in sched_out.seqs):
            raise RuntimeError("Overflow when unpacking long long")
        return self.real(sched_out)


def test_failing_request_is_contained_and_others_unchanged(
    engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    prompts = PROMPTS[:4]
    baseline = [o.outputs[0].token_ids for o in engine.generate(prompts, greedy(), use_tqdm=False)]
    poison = PoisonRows(engine.executor.execute_model, marker_seed=666)
    monkeypatch.setattr(engine.executor, "execute_model", poison)
    bad = SamplingParams(temperature=0.8, seed=666, max_tokens=12)
    for i, p in enumerate(prompts):
        engine.add_request(f"innocent-{i}", p, greedy())
        if i == 1:  # batched in the middle of the innocents' prefill
            engine.add_request("poison", "hello world", bad)
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    assert done["poison"].failed and "Overflow" in done["poison"].error
    for i in range(len(prompts)):
        assert not done[f"innocent-{i}"].failed
        assert done[f"innocent-{i}"].outputs[0].token_ids == baseline[i]
    assert poison.calls > 3  # the failing step was bisected
    assert all_free(engine)


def test_a_step_that_fails_for_everyone_is_the_engines_fault(
    engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    def boom(sched_out):
        raise RuntimeError("device lost")

    for i, p in enumerate(PROMPTS[:3]):
        engine.add_request(f"r{i}", p, greedy(4))
    monkeypatch.setattr(engine.executor, "execute_model", boom)
    with pytest.raises(EngineBrokenError, match="device lost"):
        engine.step()
    monkeypatch.undo()
    outs = engine.step()
    assert sorted(o.outputs[0].finish_reason for o in outs) == ["abort"] * 3
    assert all_free(engine)

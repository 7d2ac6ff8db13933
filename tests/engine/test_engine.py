"""Engine API: validation errors name the field, aborts free every block, outputs keep order."""

from __future__ import annotations

from pathlib import Path

import pytest

from pagedllm import Engine, SamplingParams
from tests.conftest import PROMPTS


@pytest.fixture(scope="module")
def engine(llama_path: Path) -> Engine:
    return Engine(str(llama_path), device="cpu", block_size=8, num_kv_blocks=64, max_model_len=128)


def all_free(engine: Engine) -> bool:
    bm = engine.block_manager
    return (
        bm.get_num_free_device_blocks() == bm.num_device_blocks
        and bm.get_num_free_host_blocks() == bm.num_host_blocks
    )


def test_abort_half_mid_flight_frees_everything(engine: Engine) -> None:
    params = SamplingParams(temperature=0.8, max_tokens=40, ignore_eos=True, seed=1)
    for i, p in enumerate(PROMPTS):
        engine.add_request(f"req-{i}", p, params)
    for _ in range(3):
        engine.step()
    aborted = {f"req-{i}" for i in range(0, len(PROMPTS), 2)}
    engine.abort_request(sorted(aborted))
    finished = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
    assert set(finished) == {f"req-{i}" for i in range(len(PROMPTS))}
    for rid, out in finished.items():
        reason = out.outputs[0].finish_reason
        assert reason == ("abort" if rid in aborted else "length"), (rid, reason)
    assert all_free(engine)


def test_outputs_in_input_order_and_lengths(engine: Engine) -> None:
    outs = engine.generate(PROMPTS, SamplingParams(max_tokens=5, ignore_eos=True), use_tqdm=False)
    assert [o.prompt for o in outs] == PROMPTS
    assert all(len(o.outputs[0].token_ids) == 5 for o in outs)
    assert all(o.outputs[0].finish_reason == "length" for o in outs)
    assert all_free(engine)


def test_too_long_prompt_finishes_with_reason_and_others_run(engine: Engine) -> None:
    long_prompt = {"prompt_token_ids": [5] * 200}
    outs = engine.generate([long_prompt, "A"], SamplingParams(max_tokens=3), use_tqdm=False)
    assert outs[0].finished and outs[0].outputs[0].token_ids == []
    assert outs[0].error and "max_model_len" in outs[0].error
    assert len(outs[1].outputs[0].token_ids) >= 1
    assert all_free(engine)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"temperature": -1.0}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_k": -5}, "top_k"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"n": 0}, "n"),
        ({"min_p": 2.0}, "min_p"),
        ({"presence_penalty": 3.0}, "presence_penalty"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"logprobs": -1}, "logprobs"),
        ({"stop": [""]}, "stop"),
        ({"seed": "x"}, "seed"),
        ({"min_tokens": 10, "max_tokens": 5}, "min_tokens"),
        ({"temperature": float("nan")}, "temperature"),
    ],
)
def test_sampling_params_errors_name_the_field(kwargs: dict, field: str) -> None:
    with pytest.raises(ValueError, match=rf"^{field}:"):
        SamplingParams(**kwargs)


def test_bad_requests_raise_and_engine_keeps_serving(engine: Engine) -> None:
    with pytest.raises(ValueError, match="^prompt_token_ids:"):
        engine.add_request("bad-1", {"prompt_token_ids": [1, 10**6]})
    with pytest.raises(ValueError, match="^prompt:"):
        engine.add_request("bad-2", "")
    with pytest.raises(ValueError, match="^prompt:"):
        engine.add_request("bad-3", 12345)  # type: ignore[arg-type]
    engine.add_request("dup", "A", SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match="^request_id:"):
        engine.add_request("dup", "A")
    while engine.has_unfinished_requests():
        engine.step()
    assert all_free(engine)


def test_bad_engine_args_name_the_field(llama_path: Path) -> None:
    with pytest.raises(ValueError, match="^block_size:"):
        Engine(str(llama_path), device="cpu", block_size=3)
    with pytest.raises(ValueError, match="^device:"):
        Engine(str(llama_path), device="tpu")
    with pytest.raises(ValueError, match="^bogus_arg:"):
        Engine(str(llama_path), device="cpu", bogus_arg=1)
    with pytest.raises(ValueError, match="^max_model_len:"):
        Engine(str(llama_path), device="cpu", max_model_len=10**6)


def test_missing_or_corrupt_checkpoint_names_the_file(llama_path: Path, tmp_path: Path) -> None:
    import shutil

    broken = tmp_path / "broken"
    shutil.copytree(llama_path, broken)
    (broken / "model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(ValueError, match=r"model\.safetensors"):
        Engine(str(broken), device="cpu")
    (broken / "model.safetensors").unlink()
    with pytest.raises(ValueError, match="safetensors"):
        Engine(str(broken), device="cpu")
    (broken / "config.json").unlink()
    with pytest.raises(ValueError, match=r"config\.json"):
        Engine(str(broken), device="cpu")


def test_failed_step_ends_its_requests_and_engine_recovers(
    engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A step failing with one request in it is that request's fault: it ends with an error.
    engine.add_request("doomed", "A", SamplingParams(max_tokens=4))
    real = engine.executor.execute_model

    def boom(sched_out):
        raise RuntimeError("worker exploded")

    monkeypatch.setattr(engine.executor, "execute_model", boom)
    outs = engine.step()
    monkeypatch.setattr(engine.executor, "execute_model", real)
    assert [(o.request_id, o.outputs[0].finish_reason, o.failed) for o in outs] == [
        ("doomed", "abort", True)
    ]
    assert "worker exploded" in (outs[0].error or "")
    assert all_free(engine)
    ok = engine.generate(["A"], SamplingParams(max_tokens=3, ignore_eos=True), use_tqdm=False)
    assert len(ok[0].outputs[0].token_ids) == 3


def test_shutdown_hands_the_model_and_kv_cache_back(llama_path: Path) -> None:
    """An in-process engine's process outlives it: after ``shutdown`` nothing it allocated may
    stay reachable, or a GPU's next engine would size its cache around it (seen on an H200: the
    second engine of a process got 0 blocks)."""
    import weakref

    engine = Engine(str(llama_path), num_kv_blocks=16, block_size=8)
    engine.generate(PROMPTS[:1], SamplingParams(max_tokens=2), use_tqdm=False)
    worker = engine.executor.worker  # type: ignore[attr-defined]
    cache = weakref.ref(worker.cache_engine.kv_caches[0])
    weight = weakref.ref(next(worker.runner.model.parameters()))
    engine.shutdown()
    engine.shutdown()  # idempotent
    assert cache() is None and weight() is None


def test_engine_factory_builds_the_one_engine_and_refuses_replicas_on_it(
    engine: Engine, llama_path: Path
) -> None:
    """``Engine(...)`` is a factory: one engine unless replicas are asked for, and the one-engine
    class itself refuses replicas rather than quietly running one engine."""
    from pagedllm import LLMEngine

    assert type(engine) is LLMEngine
    with pytest.raises(ValueError, match="^data_parallel_size: LLMEngine is one engine"):
        LLMEngine(str(llama_path), device="cpu", data_parallel_size=2)

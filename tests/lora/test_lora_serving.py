"""Adapters under load: slots rotate (more adapters than max_loras), the prefix cache keeps
adapters apart, and bad adapters are refused with a ValueError naming them."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from pagedllm import Engine, SamplingParams
from pagedllm.lora import LoRARequest
from tests.conftest import PROMPTS, build_model
from tests.hf_reference import assert_greedy_match
from tests.lora.adapters import ATTN, MLP, make_adapter, peft_greedy

MAX_NEW = 8
GREEDY = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def five_adapters(llama_path: Path, tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    root = tmp_path_factory.mktemp("five")
    return [
        make_adapter(
            llama_path, root / f"a{i}", rank=8 if i % 2 else 16, targets=ATTN + MLP, seed=10 + i
        )
        for i in range(5)
    ]


def _engine(llama_path: Path, **kw: object) -> Engine:
    args: dict[str, object] = dict(
        device="cpu", block_size=8, num_kv_blocks=256, max_model_len=256, enable_lora=True
    )
    args.update(kw)
    return Engine(str(llama_path), **args)  # type: ignore[arg-type]


def test_more_adapters_than_slots_rotate(llama_path: Path, five_adapters: list[Path]) -> None:
    engine = _engine(llama_path, max_loras=2, max_cpu_loras=3, max_num_seqs=4)
    tok = engine.get_tokenizer()
    prompts = [tok.encode(p) for p in PROMPTS[:3]]
    reqs = [LoRARequest(f"a{i}", i + 1, str(p)) for i, p in enumerate(five_adapters)]
    # 15 requests, adapters interleaved, at most 4 running: slots and host memory both rotate.
    order = [(i % 5, i % 3) for i in range(15)]
    outs = engine.generate(
        [{"prompt_token_ids": prompts[j]} for _, j in order],
        GREEDY,
        lora_request=[reqs[a] for a, _ in order],
        use_tqdm=False,
    )
    refs = {
        (a, j): peft_greedy(llama_path, five_adapters[a], [prompts[j]], MAX_NEW)[0]
        for a, j in set(order)
    }
    for (a, j), out in zip(order, outs, strict=True):
        assert_greedy_match(list(out.outputs[0].token_ids), refs[a, j], f"adapter a{a} prompt {j}")
    manager = engine.executor.worker.lora_manager  # type: ignore[attr-defined]
    assert len(manager.slot_of) <= 2 and len(manager.host) <= 3


def test_steps_never_mix_more_adapters_than_slots(
    llama_path: Path, five_adapters: list[Path]
) -> None:
    engine = _engine(llama_path, max_loras=2, max_num_seqs=8)
    reqs = [LoRARequest(f"a{i}", i + 1, str(p)) for i, p in enumerate(five_adapters)]
    for i in range(10):
        engine.add_request(f"r{i}", PROMPTS[i % 3], GREEDY, lora_request=reqs[i % 5])
    seen_max = 0
    while engine.has_unfinished_requests():
        sched = engine.scheduler
        engine.step()
        running = {g.lora_id for g in sched.running if g.lora_id}
        seen_max = max(seen_max, len(running))
    assert seen_max == 2


def test_prefix_cache_never_shared_between_adapters(
    llama_path: Path, five_adapters: list[Path]
) -> None:
    engine = _engine(llama_path, max_loras=2, enable_prefix_caching=True)
    tok = engine.get_tokenizer()
    prompt = tok.encode(PROMPTS[8])  # several full blocks
    assert len(prompt) > 24
    a, b = (LoRARequest(f"a{i}", i + 1, str(five_adapters[i])) for i in (0, 1))
    ids = {"prompt_token_ids": prompt}
    stats = engine.block_manager.prefix_stats
    first = engine.generate(ids, GREEDY, lora_request=a, use_tqdm=False)[0]
    hits0 = stats.hits
    second = engine.generate(ids, GREEDY, lora_request=b, use_tqdm=False)[0]
    base = engine.generate(ids, GREEDY, use_tqdm=False)[0]
    assert stats.hits == hits0, "a prompt under another adapter (or the base) hit a's blocks"
    again = engine.generate(ids, GREEDY, lora_request=a, use_tqdm=False)[0]
    assert stats.hits > hits0, "the same adapter's prompt should hit its own cached blocks"
    for label, out, adapter in (
        ("a", first, five_adapters[0]),
        ("b", second, five_adapters[1]),
        ("base", base, None),
        ("a again", again, five_adapters[0]),
    ):
        ref = peft_greedy(llama_path, adapter, [prompt], MAX_NEW)[0]
        assert_greedy_match(list(out.outputs[0].token_ids), ref, label)


# -- bad input ----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def small_engine(llama_path: Path) -> Engine:
    return _engine(llama_path, max_loras=1, max_lora_rank=8)


def _refused(engine: Engine, req: LoRARequest, *words: str) -> None:
    with pytest.raises(ValueError) as info:
        engine.add_request(f"bad-{req.lora_name}", "A", GREEDY, lora_request=req)
    message = str(info.value)
    assert f"lora {req.lora_name!r}" in message, message
    for w in words:
        assert w in message, message
    assert not engine.has_unfinished_requests()


def test_missing_folder(small_engine: Engine, tmp_path: Path) -> None:
    _refused(small_engine, LoRARequest("ghost", 7, str(tmp_path / "nope")), "does not exist")


def test_malformed_config_and_weights(
    small_engine: Engine, five_adapters: list[Path], tmp_path: Path
) -> None:
    bad = tmp_path / "bad"
    shutil.copytree(five_adapters[1], bad)
    (bad / "adapter_config.json").write_text("{not json")
    _refused(small_engine, LoRARequest("badcfg", 8, str(bad)), "not valid JSON")
    empty = tmp_path / "empty"
    empty.mkdir()
    _refused(small_engine, LoRARequest("empty", 9, str(empty)), "adapter_config.json")
    trunc = tmp_path / "trunc"
    shutil.copytree(five_adapters[1], trunc)
    data = (trunc / "adapter_model.safetensors").read_bytes()
    (trunc / "adapter_model.safetensors").write_bytes(data[: len(data) // 2])
    _refused(small_engine, LoRARequest("trunc", 10, str(trunc)), "cannot read")
    dora = tmp_path / "dora"
    shutil.copytree(five_adapters[1], dora)
    cfg = json.loads((dora / "adapter_config.json").read_text())
    (dora / "adapter_config.json").write_text(json.dumps({**cfg, "use_dora": True}))
    _refused(small_engine, LoRARequest("dora", 11, str(dora)), "DoRA")


def test_rank_above_max_lora_rank(small_engine: Engine, five_adapters: list[Path]) -> None:
    _refused(small_engine, LoRARequest("big", 12, str(five_adapters[0])), "max_lora_rank (8)")


def test_adapter_for_another_base(
    small_engine: Engine, tmp_path_factory: pytest.TempPathFactory
) -> None:
    other = build_model(tmp_path_factory.mktemp("other") / "m", "llama", intermediate_size=96)
    adapter = make_adapter(other, other.parent / "ad", rank=8, targets=MLP)
    _refused(small_engine, LoRARequest("other", 13, str(adapter)), "another base model")


def test_lora_not_enabled(llama_path: Path, five_adapters: list[Path]) -> None:
    engine = Engine(str(llama_path), device="cpu", block_size=8, num_kv_blocks=32)
    _refused(engine, LoRARequest("a1", 1, str(five_adapters[1])), "enable_lora")


def test_bad_request_leaves_engine_serving(
    small_engine: Engine, five_adapters: list[Path], tmp_path: Path
) -> None:
    _refused(small_engine, LoRARequest("ghost2", 14, str(tmp_path / "none")))
    ok = LoRARequest("a1", 2, str(five_adapters[1]))
    out = small_engine.generate("A", GREEDY, lora_request=ok, use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == MAX_NEW
    with pytest.raises(ValueError, match="already names"):
        small_engine.add_lora(LoRARequest("a3", 2, str(five_adapters[3])))
    assert small_engine.remove_lora(2) and not small_engine.remove_lora(2)
    assert small_engine.list_loras() == []


def test_chunked_prefill_mixes_prompt_chunks_and_decodes(
    llama_path: Path, five_adapters: list[Path]
) -> None:
    """Steps that hold prompt chunks of one adapter next to decodes of others."""
    engine = _engine(
        llama_path, max_loras=3, enable_chunked_prefill=True, max_num_batched_tokens=16
    )
    tok = engine.get_tokenizer()
    prompts = [tok.encode(p) for p in (PROMPTS[8], PROMPTS[5], PROMPTS[1], PROMPTS[8])]
    which = [0, 1, None, 2]
    outs = engine.generate(
        [{"prompt_token_ids": p} for p in prompts],
        GREEDY,
        lora_request=[
            None if w is None else LoRARequest(f"a{w}", w + 1, str(five_adapters[w])) for w in which
        ],
        use_tqdm=False,
    )
    assert engine.scheduler.stats.chunked_prefill_steps > 0
    for i, (w, out) in enumerate(zip(which, outs, strict=True)):
        adapter = None if w is None else five_adapters[w]
        ref = peft_greedy(llama_path, adapter, [prompts[i]], MAX_NEW)[0]
        assert_greedy_match(list(out.outputs[0].token_ids), ref, f"chunked prompt {i} a{w}")


def test_removed_adapter_finishes_its_running_requests(
    llama_path: Path, five_adapters: list[Path]
) -> None:
    engine = _engine(llama_path, max_loras=1)
    tok = engine.get_tokenizer()
    prompt = tok.encode(PROMPTS[1])
    req = LoRARequest("a1", 2, str(five_adapters[1]))
    engine.add_request("r", {"prompt_token_ids": prompt}, GREEDY, lora_request=req)
    engine.step()
    engine.step()
    assert engine.remove_lora(2)
    assert engine.list_loras() == []
    final = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            final = out if out.finished else final
    assert final is not None
    ref = peft_greedy(llama_path, five_adapters[1], [prompt], MAX_NEW)[0]
    assert_greedy_match(list(final.outputs[0].token_ids), ref, "removed mid-run")

"""LoRA under tensor parallelism (two CPU ranks over gloo): column-parallel layers keep their
rows of B, row-parallel layers their columns of A (the shrink is all-reduced); greedy output
equals transformers + PEFT, and a bad adapter is refused without taking the workers down."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from pagedllm import Engine, SamplingParams
from pagedllm.lora import LoRARequest
from tests.conftest import PROMPTS
from tests.hf_reference import assert_greedy_match
from tests.lora.adapters import ATTN, MLP, make_adapter, peft_greedy

MAX_NEW = 10


@pytest.fixture(scope="module")
def tp_engine(llama_path: Path) -> Iterator[Engine]:
    engine = Engine(
        str(llama_path),
        device="cpu",
        dtype="float32",
        block_size=8,
        num_kv_blocks=96,
        tensor_parallel_size=2,
        enable_lora=True,
        max_loras=2,
    )
    yield engine
    engine.shutdown()


def test_tp2_mixed_batch_matches_peft(
    tp_engine: Engine, llama_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    root = tmp_path_factory.mktemp("tp-adapters")
    paths = [
        make_adapter(llama_path, root / "all", rank=8, targets=ATTN + MLP, seed=31),
        make_adapter(llama_path, root / "kv", rank=16, targets=["k_proj", "v_proj"], seed=32),
    ]
    reqs = [LoRARequest(f"tp{i}", i + 1, str(p)) for i, p in enumerate(paths)]
    tok = tp_engine.get_tokenizer()
    prompts = [tok.encode(p) for p in PROMPTS[:4]]
    which = [0, None, 1, 0]
    outs = tp_engine.generate(
        [{"prompt_token_ids": p} for p in prompts],
        SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True),
        lora_request=[None if w is None else reqs[w] for w in which],
        use_tqdm=False,
    )
    for i, (w, out) in enumerate(zip(which, outs, strict=True)):
        ref = peft_greedy(llama_path, None if w is None else paths[w], [prompts[i]], MAX_NEW)[0]
        assert_greedy_match(list(out.outputs[0].token_ids), ref, f"TP=2 prompt {i} adapter {w}")


def test_tp2_bad_adapter_is_refused_and_workers_live(tp_engine: Engine, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="lora 'ghost'"):
        tp_engine.add_lora(LoRARequest("ghost", 9, str(tmp_path / "none")))
    out = tp_engine.generate("A", SamplingParams(max_tokens=3), use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) >= 1

"""Greedy output under LoRA adapters equals transformers + PEFT, in one mixed batch.

The batch runs the base model and two or three adapters at once (ranks 8 and 16, rsLoRA,
adapters on the fused q/k/v and gate/up layers and on attention only); each row must match
its own reference, so neighbours cannot leak into it.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from pagedllm import Engine, SamplingParams
from pagedllm.lora import LoRARequest
from tests.conftest import PROMPTS
from tests.hf_reference import assert_greedy_match
from tests.lora.adapters import ATTN, MLP, make_adapter, peft_greedy

MAX_NEW = 12


@pytest.fixture(scope="module")
def adapters(llama_path: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("adapters")
    return {
        "r8_all": make_adapter(llama_path, root / "r8_all", rank=8, targets=ATTN + MLP, seed=1),
        "r16_rs": make_adapter(
            llama_path, root / "r16_rs", rank=16, targets=ATTN + MLP, use_rslora=True, seed=2
        ),
        "r16_qv": make_adapter(
            llama_path, root / "r16_qv", rank=16, targets=["q_proj", "v_proj"], seed=3, std=0.2
        ),
    }


@pytest.fixture(scope="module")
def engine(llama_path: Path) -> Engine:
    return Engine(
        str(llama_path),
        device="cpu",
        block_size=8,
        num_kv_blocks=256,
        max_model_len=256,
        enable_lora=True,
        max_loras=3,
        max_lora_rank=16,
    )


def test_mixed_batch_matches_peft(
    engine: Engine, llama_path: Path, adapters: dict[str, Path]
) -> None:
    tok = engine.get_tokenizer()
    prompts = [tok.encode(p) for p in PROMPTS[:6]]
    names = [None, "r8_all", "r16_rs", None, "r16_qv", "r8_all"]
    reqs = {
        name: LoRARequest(name, i + 1, str(path)) for i, (name, path) in enumerate(adapters.items())
    }
    outs = engine.generate(
        [{"prompt_token_ids": p} for p in prompts],
        SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True),
        lora_request=[None if n is None else reqs[n] for n in names],
        use_tqdm=False,
    )
    for i, (name, out) in enumerate(zip(names, outs, strict=True)):
        adapter = None if name is None else adapters[name]
        ref = peft_greedy(llama_path, adapter, [prompts[i]], MAX_NEW)
        assert_greedy_match(list(out.outputs[0].token_ids), ref[0], f"prompt {i} lora {name}")


def test_adapter_changes_the_output(engine: Engine, adapters: dict[str, Path]) -> None:
    """A guard on the test above: the adapters are strong enough to change greedy tokens."""
    params = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)
    req = LoRARequest("r8_all", 1, str(adapters["r8_all"]))
    base = engine.generate(PROMPTS[0], params, use_tqdm=False)[0].outputs[0].token_ids
    lora = engine.generate(PROMPTS[0], params, lora_request=req, use_tqdm=False)
    assert list(base) != list(lora[0].outputs[0].token_ids)

"""Adapters on every family's attention and MLP projections, including the layers transformers
itself fuses (GPT-2's ``c_attn``, Phi-3's ``qkv_proj`` and ``gate_up_proj``) and those this engine
fuses: greedy output of a base row and an adapter row in one batch equals transformers + PEFT."""

from __future__ import annotations

from pathlib import Path

import pytest

from pagedllm import Engine, LoRARequest, SamplingParams
from tests.conftest import PROMPTS
from tests.hf_reference import assert_greedy_match
from tests.lora.adapters import ATTN, MLP, make_adapter, peft_greedy
from tests.models.test_more_families import FAMILIES, build_family

MAX_NEW = 8
TARGETS: dict[str, list[str]] = {
    "qwen2": ATTN + MLP,
    "mistral": ATTN + MLP,
    "gemma": ATTN + MLP,
    "gemma2": ATTN + MLP,
    "gemma3": ATTN + MLP,
    "qwen3": ["q_proj", "v_proj", "down_proj"],
    "opt": ["q_proj", "k_proj", "v_proj", "out_proj", "fc1", "fc2"],
    "gpt2": ["c_attn", "c_proj", "c_fc"],
    "phi": ["q_proj", "k_proj", "v_proj", "dense", "fc1", "fc2"],
    "phi3": ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"],
}


@pytest.mark.parametrize("family", sorted(TARGETS))
def test_family_adapter_matches_peft(
    family: str, tiny_models: dict[str, Path], tmp_path: Path
) -> None:
    path = tiny_models.get(family) or build_family(tmp_path / family, family)
    block = FAMILIES[family][2] if family in FAMILIES else 8
    adapter = make_adapter(path, tmp_path / "adapter", rank=8, targets=TARGETS[family], seed=7)
    engine = Engine(
        str(path),
        device="cpu",
        dtype="float32",
        block_size=block,
        num_kv_blocks=64,
        max_model_len=128,
        enable_lora=True,
    )
    prompt = engine.get_tokenizer().encode(PROMPTS[0])
    outs = engine.generate(
        [{"prompt_token_ids": prompt}] * 2,
        SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True),
        lora_request=[None, LoRARequest("a", 1, str(adapter))],
        use_tqdm=False,
    )
    base_ref = peft_greedy(path, None, [prompt], MAX_NEW)[0]
    lora_ref = peft_greedy(path, adapter, [prompt], MAX_NEW)[0]
    assert base_ref.token_ids != lora_ref.token_ids, "the adapter should change the output"
    assert_greedy_match(list(outs[0].outputs[0].token_ids), base_ref, f"{family} base")
    assert_greedy_match(list(outs[1].outputs[0].token_ids), lora_ref, f"{family} adapter")

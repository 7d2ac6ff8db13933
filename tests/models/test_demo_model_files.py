"""The demo model shipped in ``pagedllm/assets/demo-model/`` loads with plain transformers, offline.

Why: ``make demo`` is the first thing a new user runs and must work without a download, so these
checks guard the committed files themselves (not the engine): they load, fit the size budget,
round-trip code through the tokenizer, and generate. Written by ``tools/train_demo_model.py``.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    PreTrainedTokenizerBase,
)

DEMO_DIR = Path(__file__).resolve().parents[2] / "pagedllm" / "assets" / "demo-model"
MAX_BYTES = 30 * 1024 * 1024
EXPECTED_FILES = (
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
    "README.md",
)
CODE_SAMPLES = (
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)\n",
    "class Stack:\n\tdef push(self, x):\n\t\tself._items.append(x)  # tab-indented\n",
    "x = {'a': [1, 2.5e-3, None]}\r\n\r\n\n\n    trailing spaces   \n",
    's = "naïve café — 東京 🐍"\n',
    "",
    "   \n\t \n",
)


@pytest.fixture(scope="module")
def tokenizer() -> PreTrainedTokenizerBase:
    return AutoTokenizer.from_pretrained(DEMO_DIR, local_files_only=True)


@pytest.fixture(scope="module")
def model() -> torch.nn.Module:
    m = AutoModelForCausalLM.from_pretrained(DEMO_DIR, local_files_only=True, dtype=torch.float32)
    return m.eval()


def test_folder_complete_and_small() -> None:
    names = {p.name for p in DEMO_DIR.iterdir()}
    missing = [f for f in EXPECTED_FILES if f not in names]
    assert not missing, f"missing from {DEMO_DIR}: {missing}"
    size = sum(p.stat().st_size for p in DEMO_DIR.iterdir() if p.is_file())
    assert size <= MAX_BYTES, f"demo model folder is {size} bytes, over {MAX_BYTES}"


def test_config_is_small_gqa_llama() -> None:
    config = AutoConfig.from_pretrained(DEMO_DIR, local_files_only=True)
    assert config.architectures == ["LlamaForCausalLM"]
    assert config.model_type == "llama"
    assert config.num_attention_heads % config.num_key_value_heads == 0
    assert config.num_key_value_heads < config.num_attention_heads, "meant to exercise GQA"
    assert config.tie_word_embeddings
    assert config.max_position_embeddings == 1024


def test_weights_are_float32_and_within_budget(model: torch.nn.Module) -> None:
    dtypes = {p.dtype for p in model.parameters()}
    assert dtypes == {torch.float32}, dtypes
    num_params = sum(p.numel() for p in model.parameters())
    assert num_params * 4 <= MAX_BYTES, f"{num_params} parameters"
    torch.testing.assert_close(
        model.get_input_embeddings().weight,
        model.get_output_embeddings().weight,
        atol=0.0,
        rtol=0.0,
        msg="embeddings are meant to be tied",
    )


@pytest.mark.parametrize("text", CODE_SAMPLES)
def test_tokenizer_round_trips_code(tokenizer: PreTrainedTokenizerBase, text: str) -> None:
    ids = tokenizer(text)["input_ids"]
    assert ids[0] == tokenizer.bos_token_id, "every text starts after <|endoftext|>"
    back = tokenizer.decode(ids, skip_special_tokens=True)
    assert back == text, f"round-trip changed {text!r} into {back!r}"
    plain = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert tokenizer.decode(plain) == text


def test_special_tokens(tokenizer: PreTrainedTokenizerBase) -> None:
    assert tokenizer.bos_token == tokenizer.eos_token == "<|endoftext|>"
    assert tokenizer.bos_token_id == tokenizer.eos_token_id == tokenizer.pad_token_id
    assert len(tokenizer) == AutoConfig.from_pretrained(DEMO_DIR).vocab_size


def test_greedy_generation_of_16_tokens(
    model: torch.nn.Module, tokenizer: PreTrainedTokenizerBase
) -> None:
    prompt = "def fibonacci(n):"
    enc = tokenizer(prompt, return_tensors="pt")
    prompt_len = enc["input_ids"].shape[1]
    with torch.no_grad():
        gen = model.generate(
            **enc,
            max_new_tokens=16,
            min_new_tokens=16,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
        )
    new = gen.sequences[0, prompt_len:]  # [16]
    assert new.numel() == 16
    text = tokenizer.decode(new, skip_special_tokens=True)
    print(f"greedy completion of {prompt!r}: {text!r}")
    assert text.strip(), "the completion is empty"

    # generate() decodes with its KV cache; one uncached forward pass over the whole sequence must
    # give the same logits at every generated position, hence the same greedy tokens.
    with torch.no_grad():
        full = model(input_ids=gen.sequences).logits[0, prompt_len - 1 : -1]  # [16, vocab]
    cached = torch.cat(gen.logits)  # [16, vocab]
    diff = (cached - full).abs().max().item()
    torch.testing.assert_close(
        cached, full, atol=1e-4, rtol=1e-4, msg=f"cached vs full pass: max abs diff {diff:.3e}"
    )
    assert torch.equal(full.argmax(-1), new), f"{new.tolist()} != {full.argmax(-1).tolist()}"


def test_fibonacci_completion_opens_an_indented_body(
    model: torch.nn.Module, tokenizer: PreTrainedTokenizerBase
) -> None:
    """The demo prints this completion; code-looking output is what makes engine bugs visible."""
    enc = tokenizer("def fibonacci(n):", return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**enc, max_new_tokens=16, do_sample=False)
    text = tokenizer.decode(out[0], skip_special_tokens=True)
    lines = text.split("\n")
    assert len(lines) > 1 and lines[1][:1] in (" ", "\t"), f"no indented body in {text!r}"


def test_model_card_names_corpus_licence_and_losses() -> None:
    card = (DEMO_DIR / "README.md").read_text()
    needles = ("Python Software Foundation", "standard library", "Held-out loss", "train loss")
    for needle in needles:
        assert needle in card, f"model card lacks {needle!r}"

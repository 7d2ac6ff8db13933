"""Shared fixtures: tiny random-weight Hugging Face models and a tiny trained tokenizer.

Every model is built here from a transformers config with ``torch.manual_seed(0)`` and saved
with ``save_pretrained`` into a temporary folder, so no test ever needs the network.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch

# tools/gpu_check.sh reruns the model equality tests on a device in half precision.
TEST_DEVICE = os.environ.get("PAGEDLLM_TEST_DEVICE", "cpu")
TEST_DTYPE = os.environ.get("PAGEDLLM_TEST_DTYPE", "float32")
# Engines in tests pack their weights at every start (as before the packed-weight cache), so a
# test that swaps a kernel or counts checks sees them run; tests/backends/test_pack_cache.py
# turns the cache on in a folder of its own. Subprocesses inherit it.
os.environ.setdefault("PAGEDLLM_PACKED_CACHE", "0")

_CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "def fibonacci(n):\n    if n < 2:\n        return n\n"
    "    return fibonacci(n - 1) + fibonacci(n - 2)\n",
    "Paged attention keeps the KV cache in fixed-size blocks.",
    "你好，世界！这是一个测试。 Emoji: 🚀🔥✨",
    "import os\nimport sys\n\nprint(os.getcwd(), sys.argv)\n",
    "Continuous batching schedules every iteration anew.",
] * 20


def build_tokenizer(folder: Path, vocab_size: int = 512) -> Any:
    """A byte-level BPE tokenizer trained on a small corpus, saved as a transformers tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<s>", "</s>", "<pad>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(_CORPUS, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>"
    )
    fast.save_pretrained(str(folder))
    return fast


MODEL_SPECS: dict[str, dict[str, Any]] = {
    # GQA, head size 16
    "llama": dict(
        arch="llama",
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
        num_hidden_layers=2,
    ),
    # MHA, head size 32, qkv bias
    "qwen2": dict(
        arch="qwen2",
        hidden_size=64,
        num_attention_heads=2,
        num_key_value_heads=2,
        intermediate_size=96,
        num_hidden_layers=2,
    ),
    # GQA 4:1, head size 8, untied head
    "mistral": dict(
        arch="mistral",
        hidden_size=64,
        num_attention_heads=8,
        num_key_value_heads=2,
        intermediate_size=128,
        num_hidden_layers=3,
        sliding_window=None,
    ),
}


def make_hf_config(spec: dict[str, Any], vocab_size: int) -> Any:
    from transformers import LlamaConfig, MistralConfig, Qwen2Config

    spec = dict(spec)
    arch = spec.pop("arch")
    cls = {"llama": LlamaConfig, "qwen2": Qwen2Config, "mistral": MistralConfig}[arch]
    common = dict(
        vocab_size=vocab_size,
        max_position_embeddings=512,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=2,
        tie_word_embeddings=(arch != "mistral"),
    )
    common.update(spec)
    return cls(**common)


def build_model(folder: Path, name: str, **overrides: Any) -> Path:
    """The tiny model ``name`` of MODEL_SPECS (config fields overridden) saved in ``folder``."""
    from transformers import AutoModelForCausalLM

    folder.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(folder)
    config = make_hf_config({**MODEL_SPECS[name], **overrides}, len(tokenizer))
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    # Random init is near-uniform; widen the weights so greedy choices are well separated.
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.08)
    model.save_pretrained(str(folder))
    return folder


def load_on_reference(path: Path, dtype: torch.dtype, **kwargs: Any) -> torch.nn.Module:
    """``load_model`` of a model folder on the CPU with the reference attention (no engine):
    for tests that inspect the loaded parameters."""
    from pagedllm.backends.reference import ReferenceAttention
    from pagedllm.models.model_loader import load_hf_config, load_model

    return load_model(
        str(path),
        load_hf_config(str(path)),
        attn_backend=ReferenceAttention(),
        device=torch.device("cpu"),
        dtype=dtype,
        **kwargs,
    )


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("models")
    return {name: build_model(root / name, name) for name in MODEL_SPECS}


@pytest.fixture(scope="session")
def llama_path(tiny_models: dict[str, Path]) -> Path:
    return tiny_models["llama"]


PROMPTS = [
    "The quick brown fox",
    "def fibonacci(n):",
    "Paged attention",
    "你好",
    "import os\nimport sys\n\nprint(",
    "Continuous batching schedules every iteration anew. The quick brown fox jumps over",
    "A",
    "Emoji: 🚀",
    "The lazy dog sleeps while the quick brown fox jumps over it again and again, "
    "and the KV cache keeps every block",
]

"""Draft models for speculative decoding: the tiny llama with a layer fewer; a tiny-vocab pair."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.conftest import MODEL_SPECS, build_model, make_hf_config


@pytest.fixture(scope="session")
def draft_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The conftest llama with 1 layer instead of 2: its first layer and embeddings are the
    target's (same seed, same initialisation order), so it agrees with the target often."""
    return build_model(tmp_path_factory.mktemp("draft") / "llama1", "llama", num_hidden_layers=1)


def build_small_vocab(folder: Path, num_layers: int, vocab: int = 8) -> Path:
    """A llama over ``vocab`` tokens and no tokenizer (prompts are token ids)."""
    from transformers import AutoModelForCausalLM

    config = make_hf_config({**MODEL_SPECS["llama"], "num_hidden_layers": num_layers}, vocab)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.15)
    model.save_pretrained(str(folder))
    return folder


@pytest.fixture(scope="session")
def small_vocab_paths(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(target, draft) over 8 tokens: 2 layers and 1 layer."""
    root = tmp_path_factory.mktemp("small_vocab")
    return build_small_vocab(root / "target", 2), build_small_vocab(root / "draft", 1)

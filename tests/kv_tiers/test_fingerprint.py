"""The fingerprint changes with anything the keys and values depend on, and only with that."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from pagedllm.kv_tiers.fingerprint import compute_fingerprint

SETTINGS = {"dtype": "float32", "kv_cache_dtype": "float32", "block_size": 16, "num_layers": 2}


@pytest.fixture()
def model(tmp_path: Path) -> Path:
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "model.safetensors").write_bytes(os.urandom(5 << 20))
    (folder / "config.json").write_text('{"rope_theta": 10000}')
    (folder / "tokenizer.json").write_text('{"vocab": {"a": 0}}')
    return folder


def digest(model: Path, **settings: object) -> str:
    return compute_fingerprint(
        model=str(model), tokenizer=str(model), settings={**SETTINGS, **settings}
    ).digest


def test_same_model_same_digest_even_copied(model: Path, tmp_path: Path) -> None:
    copy = tmp_path / "copy"
    shutil.copytree(model, copy)
    assert digest(model) == digest(model) == digest(copy)


@pytest.mark.parametrize(
    "change",
    [
        "dtype",
        "kv_cache_dtype",
        "block_size",
        "weights",
        "weights_middle",
        "weights_between_windows",
        "config",
        "tokenizer",
    ],
)
def test_anything_the_kv_depends_on_changes_it(model: Path, change: str) -> None:
    before = digest(model)
    if change in SETTINGS:
        after = digest(model, **{change: "other"})
    else:
        if change.startswith("weights"):
            path = model / "model.safetensors"
            data = bytearray(path.read_bytes())
            # The first byte, one in the middle, and one no sampled window would have held.
            at = {"weights": 0, "weights_middle": len(data) // 2, "weights_between_windows": 0}[
                change
            ] or 8 * len(data) // 17 + (100 << 10)
            data[at] ^= 1
            path.write_bytes(bytes(data))
        elif change == "config":
            (model / "config.json").write_text('{"rope_theta": 500000}')
        else:
            (model / "tokenizer.json").write_text('{"vocab": {"b": 0}}')
        after = digest(model)
    assert before != after

"""Altered Hugging Face folders (config.json fields absent, zero, absurd or inconsistent; a
safetensors header with an absurd length, offsets past the file or overlapping, unknown dtypes,
shapes that do not match the bytes; tensors missing) are each refused in one line naming the
file and the key or tensor, before anything costly, and none loads."""

from __future__ import annotations

import json
import re
import shutil
import struct
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from safetensors.torch import load_file, save_file

from pagedllm import Engine

WEIGHTS = "model.safetensors"
K1 = "model.layers.1.self_attn.k_proj.weight"


def edit_config(**changes: Any) -> Callable[[Path], None]:
    def edit(folder: Path) -> None:
        config = json.loads((folder / "config.json").read_text())
        for key, value in changes.items():
            if value is ...:
                config.pop(key, None)
            else:
                config[key] = value
        (folder / "config.json").write_text(json.dumps(config))  # NaN written as NaN

    return edit


def edit_header(change: Callable[[dict[str, Any]], None]) -> Callable[[Path], None]:
    def edit(folder: Path) -> None:
        path = folder / WEIGHTS
        raw = path.read_bytes()
        (n,) = struct.unpack("<Q", raw[:8])
        header = json.loads(raw[8 : 8 + n])
        change(header)
        new = json.dumps(header).encode()
        path.write_bytes(struct.pack("<Q", len(new)) + new + raw[8 + n :])

    return edit


def set_entry(name: str, **fields: Any) -> Callable[[dict[str, Any]], None]:
    return lambda header: header[name].update(fields)


def overlap(header: dict[str, Any]) -> None:
    q = header["model.layers.0.self_attn.q_proj.weight"]["data_offsets"]
    header["model.layers.0.self_attn.o_proj.weight"]["data_offsets"] = list(q)


def absurd_length(folder: Path) -> None:
    path = folder / WEIGHTS
    raw = path.read_bytes()
    path.write_bytes(struct.pack("<Q", 1 << 62) + raw[8:])


def drop(*names: str) -> Callable[[Path], None]:
    def edit(folder: Path) -> None:
        weights = load_file(folder / WEIGHTS)
        for name in names:
            del weights[name]
        save_file(weights, folder / WEIGHTS, metadata={"format": "pt"})

    return edit


def rows(header: dict[str, Any], name: str) -> list[int]:
    return [header[name]["shape"][0] * 2, header[name]["shape"][1]]


CASES: dict[str, tuple[Callable[[Path], None], str]] = {
    # config.json
    "hidden_size absent": (edit_config(hidden_size=...), r"hidden_size is absent"),
    "vocab_size absent": (edit_config(vocab_size=...), r"vocab_size is absent"),
    "heads 0": (edit_config(num_attention_heads=0), r"num_attention_heads is 0 \(expected an"),
    "heads a string": (edit_config(num_attention_heads="4"), r"num_attention_heads is '4'"),
    "hidden not divisible": (
        edit_config(hidden_size=66),
        r"hidden_size is 66 \(expected a multiple of num_attention_heads = 4\)",
    ),
    "kv heads not dividing": (
        edit_config(num_key_value_heads=3),
        r"num_key_value_heads is 3 \(expected a divisor of num_attention_heads = 4\)",
    ),
    "layers 0": (edit_config(num_hidden_layers=0), r"num_hidden_layers is 0"),
    "layers absurd": (edit_config(num_hidden_layers=1_000_000), r"num_hidden_layers is 1000000"),
    "vocab 0": (edit_config(vocab_size=0), r"vocab_size is 0"),
    "rope_theta nan": (edit_config(rope_theta=float("nan")), r"rope_theta is nan \(expected a"),
    "rope_theta negative": (edit_config(rope_theta=-10000.0), r"rope_theta is -10000.0"),
    "rope_theta zero": (edit_config(rope_theta=0), r"rope_theta is 0 "),
    "eps nan": (edit_config(rms_norm_eps=float("nan")), r"rms_norm_eps is nan"),
    "eps zero": (edit_config(rms_norm_eps=0.0), r"rms_norm_eps is 0.0"),
    "eps negative": (edit_config(rms_norm_eps=-1e-6), r"rms_norm_eps is -1e-06"),
    "context 0": (edit_config(max_position_embeddings=0), r"max_position_embeddings is 0"),
    # the safetensors header
    "absurd header length": (absurd_length, r"header length 4611686018427387904 does not fit"),
    "offsets past the file": (
        edit_header(set_entry(K1, data_offsets=[0, 1 << 60])),
        rf"tensor '{K1}': bytes \[0, 1152921504606846976\) run past the \d+ data bytes",
    ),
    "offsets overlap": (edit_header(overlap), r"overlap tensor 'model.layers.0.self_attn"),
    "unknown dtype": (edit_header(set_entry(K1, dtype="F7")), rf"'{K1}': dtype 'F7' is unknown"),
    "shape past bytes": (
        edit_header(lambda h: h[K1].update(shape=rows(h, K1))),
        rf"'{K1}': shape \[64, 64\] of F32 needs 16384 bytes, found \[\d+, \d+\) = 8192",
    ),
    "negative dimension": (edit_header(set_entry(K1, shape=[-32, -64])), rf"'{K1}': shape"),
    # tensors missing: named as the checkpoint spells them
    "k_proj missing": (drop(K1), rf"lacks weights for: \['{K1}'\]"),
    "norm missing": (drop("model.norm.weight"), r"lacks weights for: \['model.norm.weight'\]"),
}


@pytest.fixture(scope="module")
def warm(llama_path: Path) -> None:
    """Imports and one load done before any case is timed."""
    Engine(str(llama_path), device="cpu", skip_tokenizer_init=True).shutdown()


@pytest.mark.parametrize("case", list(CASES))
def test_hostile_folder_is_refused_in_one_line(
    llama_path: Path, tmp_path: Path, case: str, warm: None
) -> None:
    alter, expected = CASES[case]
    folder = tmp_path / "model"
    shutil.copytree(llama_path, folder)
    alter(folder)
    named = "config.json" if case in list(CASES)[:16] else WEIGHTS
    start = time.process_time()
    with pytest.raises(ValueError) as info:
        Engine(str(folder), device="cpu", skip_tokenizer_init=True)
    spent = time.process_time() - start
    message = str(info.value)
    assert "\n" not in message, message
    assert str(folder) in message and (named in message or "lacks" in message), message
    assert re.search(expected, message), message
    assert spent < 2.0, f"{spent:.2f} s of CPU"

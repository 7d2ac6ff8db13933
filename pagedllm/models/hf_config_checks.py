"""A Hugging Face ``config.json`` checked before transformers or the model sees it.

transformers fills an absent field with its class's default (a 4096-wide model for a config
that lost ``hidden_size``), divides by ``num_attention_heads`` while building the config (a
``ZeroDivisionError`` for 0) and accepts NaN for ``rope_theta``; the model then loads garbage,
allocates what an absurd count asks or fails deep in a kernel. Each field is therefore read
from the JSON itself, under the names the families spell it, and refused in one line naming
the file, the key, what it must be and what was found.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from pagedllm.models.safetensors_reader import CheckpointError

# Each field under the names the families spell it; the first one present is checked.
_NAMES: dict[str, tuple[str, ...]] = {
    "hidden_size": ("hidden_size", "n_embd", "d_model"),
    "num_attention_heads": ("num_attention_heads", "n_head", "num_heads"),
    "num_hidden_layers": ("num_hidden_layers", "n_layer", "num_layers"),
    "num_key_value_heads": ("num_key_value_heads", "num_kv_heads", "multi_query_group_num"),
    "vocab_size": ("vocab_size",),
    "max_position_embeddings": ("max_position_embeddings", "n_positions"),
    "head_dim": ("head_dim",),
    "intermediate_size": ("intermediate_size", "n_inner", "ffn_dim"),
}
REQUIRED = ("hidden_size", "num_attention_heads", "num_hidden_layers", "vocab_size")
# Far past any released model, small enough that building the model's tables cannot exhaust
# a host before the weights are read.
LIMITS = {
    "hidden_size": 1 << 17,
    "num_attention_heads": 1 << 12,
    "num_hidden_layers": 1024,
    "num_key_value_heads": 1 << 12,
    "vocab_size": 1 << 24,
    "max_position_embeddings": 1 << 24,
    "head_dim": 1 << 12,
    "intermediate_size": 1 << 20,
}
_POSITIVE_FLOATS = ("rope_theta", "rms_norm_eps", "layer_norm_epsilon", "layer_norm_eps")
_MAX_CONFIG_BYTES = 16 << 20


def read_config_json(config_file: Path) -> dict[str, Any]:
    """The parsed ``config.json``: a JSON object of bounded size, else CheckpointError."""
    try:
        size = config_file.stat().st_size
        if size > _MAX_CONFIG_BYTES:
            raise CheckpointError(
                f"{config_file}: {size} bytes (a config.json is at most {_MAX_CONFIG_BYTES})"
            )
        raw = json.loads(config_file.read_bytes())
    except (OSError, ValueError) as exc:
        if isinstance(exc, CheckpointError):
            raise
        raise CheckpointError(f"{config_file}: cannot be read as JSON ({exc})") from exc
    if not isinstance(raw, dict):
        raise CheckpointError(f"{config_file}: must hold a JSON object, found {type(raw).__name__}")
    return raw


def check_config_json(config_file: Path, raw: dict[str, Any]) -> None:
    """Refuse absent, zero, absurd or inconsistent fields (see the module doc)."""
    text = raw.get("text_config")
    if isinstance(text, dict):  # a multimodal checkpoint: its text part (defaults allowed)
        _check(config_file, {**raw, **text}, required=())
    else:
        _check(config_file, raw, required=REQUIRED)


def _check(config_file: Path, raw: dict[str, Any], required: tuple[str, ...]) -> None:
    def fail(key: str, expected: str, found: object) -> CheckpointError:
        return CheckpointError(f"{config_file}: {key} is {found!r} (expected {expected})")

    ints: dict[str, tuple[str, int]] = {}
    for field, names in _NAMES.items():
        key = next((n for n in names if n in raw and raw[n] is not None), None)
        if key is None:
            if field in required:
                raise CheckpointError(
                    f"{config_file}: {field} is absent (every model needs it; "
                    f"looked for {' / '.join(names)})"
                )
            continue
        value, limit = raw[key], LIMITS[field]
        if not isinstance(value, int) or isinstance(value, bool) or not 0 < value <= limit:
            raise fail(key, f"an integer from 1 to {limit}", value)
        ints[field] = (key, value)
    for key in _POSITIVE_FLOATS:
        _check_positive_float(raw, key, fail)
    for holder in ("rope_scaling", "rope_parameters"):
        if isinstance(raw.get(holder), dict) and "rope_theta" in raw[holder]:
            _check_positive_float(raw[holder], "rope_theta", fail, f"{holder}.")
    _check_heads(ints, fail)


def _check_positive_float(raw: dict[str, Any], key: str, fail: Any, prefix: str = "") -> None:
    value = raw.get(key)
    if value is None:
        return
    ok = isinstance(value, int | float) and not isinstance(value, bool)
    if not ok or not math.isfinite(value) or value <= 0:
        raise fail(prefix + key, "a finite number > 0", value)


def _check_heads(ints: dict[str, tuple[str, int]], fail: Any) -> None:
    heads_key, heads = ints.get("num_attention_heads", ("", 0))
    if not heads:
        return
    if "hidden_size" in ints:  # (transformers asks it even where head_dim is set)
        key, hidden = ints["hidden_size"]
        if hidden % heads:
            raise fail(key, f"a multiple of {heads_key} = {heads}", hidden)
    if "num_key_value_heads" in ints:
        key, kv = ints["num_key_value_heads"]
        if heads % kv:
            raise fail(key, f"a divisor of {heads_key} = {heads}", kv)

"""Checkpoints quantised in the compressed-tensors format (llm-compressor's W8A16 / W8A8 output).

Supported: ``quant_method: "compressed-tensors"`` whose every config group quantises weights to
8-bit symmetric ints per output channel, with either no activation quantisation (W8A16) or
dynamic symmetric int8 per-token activations (W8A8; the scales are computed at run time, so the
checkpoint carries none), the same in every group, stored either as int8
``weight`` tensors (``int-quantized`` / ``naive-quantized``) or packed four to an int32
(``pack-quantized``: ``weight_packed`` with values offset by 128, first value in the low byte,
plus ``weight_shape``), each with a ``weight_scale`` ``[N, 1]``. Anything else is refused with a
``ValueError`` naming ``quantization``, rather than loaded wrongly.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch

_FORMATS = ("int-quantized", "naive-quantized", "pack-quantized")
_SKIPPED_NAMES = ("lm_head", "embed", "wte", "wpe")


def _refuse(message: str) -> ValueError:
    return ValueError(f"quantization: compressed-tensors checkpoint {message}")


_W8A8_INPUTS = {"num_bits": 8, "type": "int", "symmetric": True, "dynamic": True}


def _group_scheme(name: str, group: dict[str, Any]) -> str:
    """``"int8"`` (W8A16) or ``"w8a8"`` for one config group; refuses anything else."""
    weights = group.get("weights") or {}
    wanted = {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel"}
    got = {key: weights.get(key) for key in wanted}
    inputs = group.get("input_activations")
    if got != wanted or weights.get("dynamic"):
        raise _refuse(
            f"group {name!r} does not quantise weights to int8 per channel, symmetric "
            f"(W8A16 / W8A8); got weights={got}"
        )
    if not inputs:
        return "int8"
    got_inputs = {key: inputs.get(key) for key in _W8A8_INPUTS}
    if got_inputs != _W8A8_INPUTS or inputs.get("strategy") not in ("token", None):
        raise _refuse(
            f"group {name!r} quantises activations other than to dynamic symmetric int8 per "
            f"token (W8A8); got input_activations={inputs!r}"
        )
    return "w8a8"


def check_config(qc: dict[str, Any]) -> tuple[str, str]:
    """Validate a ``quantization_config``; returns (its format, ``"int8"`` or ``"w8a8"``)."""
    fmt = qc.get("format", "int-quantized")
    if fmt not in _FORMATS:
        raise _refuse(f"format {fmt!r} is not supported (only {_FORMATS})")
    groups = qc.get("config_groups") or {}
    if not groups:
        raise _refuse("has no config_groups")
    schemes = {_group_scheme(name, group) for name, group in groups.items()}
    if len(schemes) > 1:
        raise _refuse("mixes W8A16 and W8A8 groups")
    for entry in qc.get("ignore") or []:
        if not any(s in entry for s in _SKIPPED_NAMES):
            raise _refuse(
                f"leaves {entry!r} unquantized; only the LM head and embeddings may stay 16-bit"
            )
    return fmt, schemes.pop()


def unpack_int8(packed: torch.Tensor, columns: int) -> torch.Tensor:
    """``weight_packed`` int32 ``[N, ceil(K/4)]`` -> int8 ``[N, K]`` (undo the +128 offset)."""
    as_bytes = packed.contiguous().view(torch.int32)
    shifts = torch.arange(4, dtype=torch.int32) * 8
    unsigned = (as_bytes.unsqueeze(-1) >> shifts) & 0xFF  # [N, ceil(K/4), 4]
    values = (unsigned - 128).to(torch.int8).reshape(packed.shape[0], -1)
    return values[:, :columns].contiguous()


def _materialize(tensor: Any) -> torch.Tensor:
    return tensor.materialize() if hasattr(tensor, "materialize") else tensor


def transform_weights(weights: Iterable[tuple[str, Any]], fmt: str) -> Iterator[tuple[str, Any]]:
    """Checkpoint tensors as plain ``<layer>.weight`` int8 + ``<layer>.weight_scale``.

    A packed weight and its ``weight_shape`` are paired whichever comes first (a reader may
    yield tensors in file order, not by name); zero points of a symmetric scheme are checked to
    be zero and dropped.
    """
    pending: dict[str, torch.Tensor] = {}
    shapes: dict[str, int] = {}  # prefix -> K, for shapes seen before their packed weight
    for name, tensor in weights:
        prefix, _, leaf = name.rpartition(".")
        if leaf == "weight_zero_point":
            if bool(_materialize(tensor).any()):
                raise _refuse(f"tensor {name!r} has non-zero zero points (asymmetric)")
            continue
        if fmt == "pack-quantized" and leaf in ("weight_packed", "weight_shape"):
            if leaf == "weight_packed":
                pending[prefix] = _materialize(tensor)
            else:
                shapes[prefix] = int(_materialize(tensor).tolist()[1])
            if prefix in pending and prefix in shapes:
                yield f"{prefix}.weight", unpack_int8(pending.pop(prefix), shapes.pop(prefix))
            continue
        yield name, tensor
    for prefix, packed in pending.items():  # no weight_shape: K is a multiple of 4
        yield f"{prefix}.weight", unpack_int8(packed, packed.shape[1] * 4)

"""Checkpoints quantised in the compressed-tensors format (llm-compressor's output).

Supported: ``quant_method: "compressed-tensors"`` whose every config group quantises weights
either to 8-bit symmetric ints per output channel, with no activation quantisation (W8A16) or
dynamic symmetric int8 per-token activations (W8A8; the scales are computed at run time, so the
checkpoint carries none), stored as int8 ``weight`` tensors (``int-quantized`` /
``naive-quantized``) or packed four to an int32 (``pack-quantized``: ``weight_packed`` with
values offset by 128, first value in the low byte, plus ``weight_shape``), each with a
``weight_scale`` ``[N, 1]``; or to 4-bit symmetric ints in groups (a multiple of 32) or per
channel, activations unquantised (W4A16, ``pack-quantized``: eight values offset by 8 to an
int32, first in the lowest nibble, scales ``[N, K / group]``), which run as the group-wise int4
of :mod:`.groupwise`. The scheme is the same in every group. Anything else is refused with a
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


def _int4_scheme(name: str, group: dict[str, Any]) -> str:
    """``"int4"`` (W4A16) for one config group; refuses what is not symmetric int4 groups."""
    weights = group["weights"]
    size = weights.get("group_size")
    wanted = {"type": "int", "symmetric": True}
    got = {key: weights.get(key) for key in wanted}
    strategy = weights.get("strategy")
    grouped = strategy == "group" and isinstance(size, int) and size > 0 and size % 32 == 0
    if got != wanted or not (grouped or strategy == "channel") or weights.get("dynamic"):
        raise _refuse(
            f"group {name!r} quantises weights to 4 bits other than symmetric ints in groups "
            f"of a multiple of 32 or per channel; got weights={weights!r}"
        )
    if group.get("input_activations"):
        raise _refuse(f"group {name!r} quantises activations of a 4-bit scheme (only W4A16)")
    return "int4"


def _group_scheme(name: str, group: dict[str, Any]) -> str:
    """``"int8"`` (W8A16), ``"w8a8"`` or ``"int4"`` (W4A16) for one config group; refuses
    anything else."""
    weights = group.get("weights") or {}
    if weights.get("num_bits") == 4:
        return _int4_scheme(name, group)
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
    """Validate a ``quantization_config``; returns (its format, ``"int8"``, ``"w8a8"`` or
    ``"int4"``)."""
    fmt = qc.get("format", "int-quantized")
    if fmt not in _FORMATS:
        raise _refuse(f"format {fmt!r} is not supported (only {_FORMATS})")
    groups = qc.get("config_groups") or {}
    if not groups:
        raise _refuse("has no config_groups")
    schemes = {_group_scheme(name, group) for name, group in groups.items()}
    if len(schemes) > 1:
        raise _refuse(f"mixes schemes {sorted(schemes)} between groups")
    if schemes == {"int4"} and fmt != "pack-quantized":
        raise _refuse(f"stores 4-bit weights as {fmt!r} (only pack-quantized)")
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


def transform_weights(
    weights: Iterable[tuple[str, Any]], fmt: str, scheme: str = "int8"
) -> Iterator[tuple[str, Any]]:
    """Checkpoint tensors as plain ``<layer>.weight`` int8 + ``<layer>.weight_scale`` (or, for
    W4A16, the group-wise int4 tensors: :func:`transform_int4`).

    A packed weight and its ``weight_shape`` are paired whichever comes first (a reader may
    yield tensors in file order, not by name); zero points of a symmetric scheme are checked to
    be zero and dropped.
    """
    if scheme == "int4":
        yield from transform_int4(weights)
        return
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


_INT4_PARTS = ("weight_packed", "weight_shape", "weight_scale")


def transform_int4(weights: Iterable[tuple[str, Any]]) -> Iterator[tuple[str, Any]]:
    """W4A16 tensors as the group-wise int4 layer's ``weight`` (nibbles ``[N, K/2]``: the
    int32 words' bytes, read little-endian, are already that layout), ``weight_scale`` and
    ``weight_offset = -8 * scale`` per group of 32 (a scale per 64 or 128 columns repeats)."""
    parts: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in weights:
        prefix, _, leaf = name.rpartition(".")
        if leaf == "weight_zero_point":
            if bool(_materialize(tensor).any()):
                raise _refuse(f"tensor {name!r} has non-zero zero points (asymmetric)")
            continue
        if leaf not in _INT4_PARTS:
            yield name, tensor
            continue
        got = parts.setdefault(prefix, {})
        got[leaf] = _materialize(tensor)
        if len(got) == len(_INT4_PARTS):
            yield from _int4_layer(prefix, parts.pop(prefix))
    if parts:
        prefix, got = next(iter(parts.items()))
        missing = sorted(set(_INT4_PARTS) - set(got))
        raise _refuse(f"layer {prefix!r} lacks {missing}")


def _int4_layer(prefix: str, got: dict[str, torch.Tensor]) -> Iterator[tuple[str, torch.Tensor]]:
    n, k = (int(v) for v in got["weight_shape"].tolist())
    packed = got["weight_packed"].contiguous()
    scale = got["weight_scale"].float()
    if packed.dtype != torch.int32 or tuple(packed.shape) != (n, k // 8) or k % 32:
        raise _refuse(
            f"{prefix}.weight_packed: expected int32 [{n}, {k // 8}] for a [{n}, {k}] weight "
            f"(K a multiple of 32), got {packed.dtype} {list(packed.shape)}"
        )
    groups = scale.shape[-1] if scale.dim() == 2 else 0
    if scale.shape[0] != n or groups == 0 or k % groups or (k // groups) % 32:
        raise _refuse(f"{prefix}.weight_scale: shape {list(scale.shape)} fits no group size")
    per_32 = scale.repeat_interleave(k // groups // 32, dim=1)  # [N, K/32]
    yield f"{prefix}.weight", packed.view(torch.uint8)
    yield f"{prefix}.weight_scale", per_32
    yield f"{prefix}.weight_offset", per_32 * -8.0

"""fp8 KV-cache scales carried by checkpoints, read into the attention layers.

A checkpoint calibrated for an fp8 KV cache stores, per attention layer, the scale ``s`` with
which the cache holds ``k / s`` (and ``v / s'``). The tools name them differently:

- ``<attn>.k_scale`` / ``<attn>.v_scale`` (compressed-tensors' ``kv_cache_scheme``, vLLM);
- ``<attn>.k_proj.k_scale`` / ``<attn>.v_proj.v_scale`` and
  ``<attn>.k_proj.output_scale`` / ``<attn>.v_proj.output_scale`` (ModelOpt, Quark);
- ``<attn>.kv_scale``: one scale for both (older AutoFP8 checkpoints);

where ``<attn>`` is the attention block (``model.layers.3.self_attn``) or the paged-attention
layer inside it (``...self_attn.attn``). Scales are scalars; a per-head vector is reduced to its
maximum (the cache's scale is per layer, and the largest keeps every head in range). They only
matter when ``kv_cache_dtype`` is fp8; 16-bit caches ignore them.
"""

from __future__ import annotations

import math
import re
from typing import Any

import torch
from torch import nn

from pagedllm.layers.attention import Attention
from pagedllm.models.safetensors_reader import CheckpointError

_KV_SCALE = re.compile(
    r"^(?P<attn>.+?)\."
    r"(?:(?P<proj>[kv])_proj\.(?:output_scale|[kv]_scale)|(?P<which>k|v|kv)_scale)$"
)


def kv_scale_target(name: str) -> tuple[str, tuple[str, ...]] | None:
    """``(attention block's checkpoint name, ("k_scale", ...))`` for a KV-scale tensor name."""
    m = _KV_SCALE.match(name)
    if m is None:
        return None
    which = m.group("proj") or m.group("which")
    fields = ("k_scale", "v_scale") if which == "kv" else (f"{which}_scale",)
    return m.group("attn"), fields


def _attention_at(model: nn.Module, path: str) -> Attention | None:
    try:
        module = model.get_submodule(path)
    except AttributeError:
        return None
    if isinstance(module, Attention):
        return module
    found = [m for m in module.children() if isinstance(m, Attention)]
    return found[0] if len(found) == 1 else None


def load_kv_scale(model: nn.Module, mapper: Any, name: str, tensor: Any) -> bool:
    """Set the attention layer's scale(s) if ``name`` is a KV-cache scale; False otherwise."""
    target = kv_scale_target(name)
    if target is None:
        return False
    prefix, fields = target
    mapped = mapper.map(f"{prefix}.x")  # the model's name for the block, as for its weights
    attn = None if mapped is None else _attention_at(model, mapped[0].removesuffix(".x"))
    if attn is None:
        raise CheckpointError(f"checkpoint tensor {name!r}: no attention layer at {prefix!r}")
    if hasattr(tensor, "materialize"):
        tensor = tensor.materialize()
    value = float(torch.as_tensor(tensor).float().max())
    if not (math.isfinite(value) and value > 0):
        raise CheckpointError(f"checkpoint tensor {name!r}: a KV-cache scale must be > 0")
    for field in fields:
        setattr(attn, field, value)
    return True

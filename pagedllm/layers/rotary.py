"""Rotary position embeddings (NeoX "rotate half" style), with scaling read from the HF config.

Frequencies for scaled variants (linear, llama3, yarn, longrope, ...) come from transformers'
own initialisers so that they match the reference exactly; the cos/sin table is built once for
every position up to the context window.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn


def rope_parameters(config: Any, layer_type: str | None = None) -> dict[str, Any]:
    """transformers 5 keeps rope settings in ``rope_parameters``; 4.x in ``rope_theta``/scaling.
    Gemma 3 keys them by layer type (its local layers rotate at another base): ``layer_type``
    picks one ("full_attention", "sliding_attention")."""
    params = dict(getattr(config, "rope_parameters", None) or {})
    if layer_type is not None:
        if not isinstance(params.get(layer_type), dict):
            raise ValueError(f"rope_parameters: no settings for {layer_type!r} layers")
        params = dict(params[layer_type])
    elif not params:
        params = dict(getattr(config, "rope_scaling", None) or {})
        params.setdefault("rope_theta", getattr(config, "rope_theta", 10000.0))
    params.setdefault("rope_type", params.get("type", "default"))
    return params


def inverse_frequencies(
    config: Any, rotary_dim: int, layer_type: str | None = None
) -> tuple[torch.Tensor, float]:
    """The rotary inverse frequencies and attention scaling the config describes.

    ``rope_freq_factors`` (a GGUF file's ``rope_freqs`` tensor, how llama.cpp's converter
    stores Llama 3's frequency-dependent scaling) divides them, as llama.cpp does.
    """
    inv_freq, scaling = _scaled_inverse_frequencies(config, rotary_dim, layer_type)
    factors = getattr(config, "rope_freq_factors", None)
    if factors is not None:
        if len(factors) != inv_freq.numel():
            raise ValueError(
                f"rope_freq_factors: {len(factors)} values for {inv_freq.numel()} frequencies"
            )
        inv_freq = inv_freq / torch.tensor(factors, dtype=torch.float32)
    return inv_freq, scaling


def _scaled_inverse_frequencies(
    config: Any, rotary_dim: int, layer_type: str | None
) -> tuple[torch.Tensor, float]:
    params = rope_parameters(config, layer_type)
    rope_type = params["rope_type"]
    if rope_type in ("default", None):
        base = float(params["rope_theta"])
        exponents = torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim
        return 1.0 / (base**exponents), 1.0
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    if rope_type not in ROPE_INIT_FUNCTIONS:
        raise ValueError(f"rope_scaling: unsupported rope type {rope_type!r}")
    per_type = {} if layer_type is None else {"layer_type": layer_type}
    inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](config, torch.device("cpu"), **per_type)
    return inv_freq.float(), float(scaling)


# (positions, q, k) -> (q, k) rotated: the shape of RotaryEmbedding.forward.
RotaryFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


class RotaryEmbedding(nn.Module):
    """Neox-style rotary embedding over float32 ``cos``/``sin`` tables.

    ``fast_rotary`` is a backend's kernel (``prepare_model``): it may rotate q and k in place
    (they are views of this step's fresh QKV output), rounds as :meth:`forward_native` does and
    hands it any input it cannot take.
    """

    fast_rotary: RotaryFn | None = None

    def __init__(
        self,
        config: Any,
        head_size: int,
        rotary_dim: int,
        max_position: int,
        layer_type: str | None = None,
    ) -> None:
        super().__init__()
        self.head_size = head_size
        self.rotary_dim = rotary_dim
        # The tables are computed, not loaded: build them in float32 on the CPU even while the
        # model is being constructed on the meta device (the loader moves them to the device).
        with torch.device("cpu"):
            inv_freq, scaling = inverse_frequencies(config, rotary_dim, layer_type)
            t = torch.arange(max_position, dtype=torch.int64).float()
            freqs = t[:, None] * inv_freq[None, :]  # [max_position, rotary_dim / 2]
            emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", emb.cos() * scaling, persistent=False)
        self.register_buffer("sin", emb.sin() * scaling, persistent=False)

    @staticmethod
    def _rotate_half(x: torch.Tensor) -> torch.Tensor:
        half = x.shape[-1] // 2
        return torch.cat((-x[..., half:], x[..., :half]), dim=-1)

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        if self.rotary_dim == self.head_size:
            return (x * cos) + (self._rotate_half(x) * sin)
        rot, keep = x[..., : self.rotary_dim], x[..., self.rotary_dim :]
        return torch.cat(((rot * cos) + (self._rotate_half(rot) * sin), keep), dim=-1)

    def forward(
        self,
        positions: torch.Tensor,  # [num_tokens]
        q: torch.Tensor,  # [num_tokens, num_heads, head_size]
        k: torch.Tensor,  # [num_tokens, num_kv_heads, head_size]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if self.fast_rotary is not None:
            return self.fast_rotary(positions, q, k)
        return self.forward_native(positions, q, k)

    def forward_native(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The definition (PyTorch ops, new tensors): what every backend kernel is tested
        against."""
        cos = self.cos[positions].to(q.dtype)[:, None, :]  # [num_tokens, 1, rotary_dim]
        sin = self.sin[positions].to(q.dtype)[:, None, :]
        return self._rotate(q, cos, sin), self._rotate(k, cos, sin)

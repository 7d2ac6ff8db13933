"""From a Hugging Face folder to a ready model: config, class, weights, dtype, device."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch
from torch import nn

from pagedllm.backends.base import AttentionBackend
from pagedllm.layers.parallel import SINGLE, TPContext
from pagedllm.layers.quantization import (
    attach_quantization,
    finish_quantization,
    get_quant_config,
)
from pagedllm.models.loading import CheckpointError, iterate_weights
from pagedllm.models.registry import resolve_model_class

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def load_hf_config(model: str) -> Any:
    """The model's transformers config, read from its folder only (never from a hub)."""
    folder = Path(model)
    config_file = folder / "config.json"
    if not folder.is_dir():
        raise ValueError(f"model: {model!r} is not a local model folder")
    if not config_file.exists():
        raise CheckpointError(f"{config_file}: missing (every model folder needs config.json)")
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(str(folder), local_files_only=True)
    except (ValueError, OSError, KeyError) as exc:
        raise CheckpointError(f"{config_file}: cannot be read as a model config ({exc})") from exc


def config_dtype(hf_config: Any) -> torch.dtype:
    dtype = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None)
    if isinstance(dtype, str):
        dtype = _DTYPES.get(dtype, torch.float32)
    return dtype if isinstance(dtype, torch.dtype) else torch.float32


def resolve_dtype(requested: str, hf_config: Any, default: torch.dtype | None) -> torch.dtype:
    if requested != "auto":
        return _DTYPES[requested]
    return default or config_dtype(hf_config)


def max_model_len_of(hf_config: Any) -> int:
    for key in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length"):
        value = getattr(hf_config, key, None)
        if isinstance(value, int) and value > 0:
            return value
    return 2048


def load_model(
    model: str,
    hf_config: Any,
    *,
    attn_backend: AttentionBackend,
    device: torch.device,
    dtype: torch.dtype,
    tp: TPContext = SINGLE,
    quantization: str | None = None,
) -> nn.Module:
    cls = resolve_model_class(getattr(hf_config, "architectures", None))
    quant = get_quant_config(quantization, hf_config)
    with torch.device("cpu"):
        module = cls(hf_config, attn_backend=attn_backend, tp=tp)
    # Under tensor parallelism each rank reads only the slices it keeps.
    weights = iterate_weights(Path(model), lazy=tp.size > 1)
    if quant is not None:  # quantised linear layers: see layers/quantization
        attach_quantization(module, quant)
        weights = quant.transform(weights)
    loaded = module.load_weights(weights)
    if quant is not None:
        logger.info("%d linear layers in %s", finish_quantization(module), quant.method.name)
    logger.info("loaded %d weight tensors for %s", len(loaded), cls.__name__)
    module = module.to(device=device, dtype=dtype)
    # Buffers such as rotary tables stay float32; only parameters follow the compute dtype.
    for name, buf in module.named_buffers():
        if buf.is_floating_point() and name.endswith(("cos", "sin")):
            buf.data = buf.data.float()
    return module.eval()


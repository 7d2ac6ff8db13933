"""Quantization schemes of linear layers (see :mod:`.base` for the method interface).

``quantization=None`` keeps checkpoint weights as they are, unless the checkpoint itself is
quantised (compressed-tensors W8A16 or W8A8), which is then run as the checkpoint says.
``quantization="int8"`` (weight-only) and ``"w8a8"`` (int8 weights and dynamic per-token int8
activations, :mod:`.w8a8`) quantise 16/32-bit checkpoints at load, or choose how an int8
checkpoint's weights are run (a W8A8 checkpoint may run weight-only, and the reverse);
``"int4"`` quantises them to 4-bit groups of 32 (:mod:`.groupwise`). A GGUF checkpoint brings
its own quantised layers (:func:`with_checkpoint_layers`); the requested scheme then applies to
the layers it stores in float. The LM head and embeddings are never quantised: they are not
column/row-parallel linear layers.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from pagedllm.layers.quantization.base import UNQUANTIZED, LinearMethod
from pagedllm.layers.quantization.compressed_tensors import check_config, transform_weights
from pagedllm.layers.quantization.groupwise import GroupwiseMethod
from pagedllm.layers.quantization.groupwise_parts import GroupwisePartsMethod
from pagedllm.layers.quantization.int8 import (
    Int8WeightOnly,
    WeightQuantizer,
    dequantize,
    quantize_per_channel,
    weight_scale,
)
from pagedllm.layers.quantization.w8a8 import Int8W8A8, quantize_per_token
from pagedllm.names import QUANTIZATION_METHODS

# The int8 methods by the name each declares (int4 is the group-wise method, below).
_METHODS: dict[str, type[Int8WeightOnly]] = {m.name: m for m in (Int8WeightOnly, Int8W8A8)}

__all__ = [
    "QUANTIZATION_METHODS",
    "UNQUANTIZED",
    "GroupwiseMethod",
    "GroupwisePartsMethod",
    "Int8W8A8",
    "Int8WeightOnly",
    "LinearMethod",
    "QuantConfig",
    "WeightQuantizer",
    "attach_quantization",
    "dequantize",
    "finish_quantization",
    "get_quant_config",
    "quantize_per_channel",
    "quantize_per_token",
    "weight_scale",
    "with_checkpoint_layers",
]


@dataclass(frozen=True)
class QuantConfig:
    """What the loader needs: the linear methods and how to read the checkpoint's tensors.

    ``method`` applies to every linear layer not in ``layer_methods`` (module name -> method:
    the layers a GGUF checkpoint stores quantised); None leaves those layers in float.
    """

    method: LinearMethod | None
    checkpoint_format: str | None = None  # compressed-tensors format, None for float checkpoints
    checkpoint_scheme: str = "int8"  # what the compressed-tensors checkpoint holds
    layer_methods: Mapping[str, LinearMethod] = field(default_factory=dict)

    def method_for(self, module_name: str) -> LinearMethod | None:
        return self.layer_methods.get(module_name, self.method)

    def describe(self) -> str:
        names = {m.name for m in self.layer_methods.values()}
        if self.method is not None:
            names.add(self.method.name)
        return ", ".join(sorted(names))

    def transform(self, weights: Iterable[tuple[str, Any]]) -> Iterator[tuple[str, Any]]:
        if self.checkpoint_format is None:
            yield from weights
        else:
            yield from transform_weights(weights, self.checkpoint_format, self.checkpoint_scheme)


def get_quant_config(
    quantization: str | None, hf_config: Any, quantizer: WeightQuantizer | None = None
) -> QuantConfig | None:
    """The scheme for this model: the requested one, or the checkpoint's own.

    ``quantizer``: how weights quantised at load are computed (the device backend's kernel; the
    PyTorch definition when None).
    """
    if quantization is not None and quantization not in QUANTIZATION_METHODS:
        raise ValueError(
            f"quantization: {quantization!r} is not supported; choose one of "
            f"{[None, *QUANTIZATION_METHODS]}"
        )
    qc = getattr(hf_config, "quantization_config", None)
    if qc is not None and not isinstance(qc, dict):
        qc = qc.to_dict() if hasattr(qc, "to_dict") else vars(qc)
    if qc:
        method = qc.get("quant_method")
        if method != "compressed-tensors":
            raise ValueError(
                f"quantization: checkpoint quantised with {method!r} is not supported "
                "(only compressed-tensors int8 per-channel W8A16 / W8A8 and int4 W4A16)"
            )
        fmt, scheme = check_config(qc)
        if scheme == "int4":
            if quantization not in (None, "int4"):
                raise ValueError(
                    f"quantization: {quantization!r} cannot run a 4-bit (W4A16) checkpoint"
                )
            method = GroupwiseMethod(bits=4, prequantized=True)
            return QuantConfig(method, checkpoint_format=fmt, checkpoint_scheme="int4")
        if quantization == "int4":
            raise ValueError("quantization: 'int4' cannot run an int8 checkpoint")
        cls = _METHODS[quantization or scheme]  # the request chooses how int8 weights run
        return QuantConfig(cls(prequantized=True), checkpoint_format=fmt)
    if quantization == "int4":
        return QuantConfig(GroupwiseMethod(bits=4, prequantized=False))
    if quantization is not None:
        return QuantConfig(_METHODS[quantization](quantizer=quantizer))
    return None


def with_checkpoint_layers(
    config: QuantConfig | None, plan: Mapping[str, str | tuple[str, ...]]
) -> QuantConfig | None:
    """``config`` plus the layers a checkpoint stores group-quantised (``{module: "int4" |
    "q8_0" | "q6_k" | "q5_k"}``, from a GGUF file; a tuple of those for a fused layer whose
    parts differ, one per part, ``dense`` for a part dequantised), which are read as they are
    whatever scheme was requested."""
    if not plan:
        return config

    def method(fmt: str | tuple[str, ...]) -> LinearMethod:
        if isinstance(fmt, tuple):
            return GroupwisePartsMethod(fmt)
        return GroupwiseMethod.for_format(fmt)

    methods = {fmt: method(fmt) for fmt in set(plan.values())}
    layers = {module: methods[fmt] for module, fmt in plan.items()}
    if config is not None and config.checkpoint_format is not None:
        raise ValueError("quantization: a GGUF checkpoint is not a compressed-tensors one")
    return QuantConfig(None if config is None else config.method, layer_methods=layers)


class _FinishingLoader:
    """The layer's own weight loader, then ``finish_loading`` once its last shard is in.

    Quantising each layer as soon as it is complete keeps one layer's float copy alive, not the
    model's: the float parameter's storage is released right after (the checkpoint reader still
    holds the parameter object in its name table until loading ends). It exposes the wrapped
    loader's ``__func__`` so that the checkpoint reader still knows the loader only reads slices
    (tensor-parallel ranks read only their part), and ``finishes_layer`` so that the reader
    never adopts a read buffer as the parameter, which would bypass this loader.
    """

    finishes_layer = True

    def __init__(self, layer: nn.Module, method: LinearMethod, inner: Any, shards: int) -> None:
        self.layer, self.method, self.inner, self.shards = layer, method, inner, shards
        self.seen: set[int] = set()

    @property
    def __func__(self) -> Any:
        return getattr(self.inner, "__func__", None)

    def __call__(self, param: nn.Parameter, loaded: Any, shard_id: int | None = None) -> None:
        if shard_id is None:
            self.inner(param, loaded)
        else:
            self.inner(param, loaded, shard_id)
        self.seen.add(shard_id or 0)
        if len(self.seen) == self.shards:
            self.method.finish_loading(self.layer)
            if self.layer.weight is not param:  # replaced by the quantised weight
                param.data = torch.empty(0, dtype=param.dtype, device=param.device)


def _linear_layers(model: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    from pagedllm.layers.linear import ColumnParallelLinear, RowParallelLinear

    for name, module in model.named_modules():
        if isinstance(module, (ColumnParallelLinear, RowParallelLinear)):
            yield name, module


def _checkpoint_embeddings(
    model: nn.Module, config: QuantConfig
) -> Iterator[tuple[str, nn.Module]]:
    """The embedding tables (and untied heads) a checkpoint stores quantised (GGUF)."""
    from pagedllm.layers.linear import VocabParallelEmbedding

    for name, module in model.named_modules():
        if isinstance(module, VocabParallelEmbedding) and name in config.layer_methods:
            yield name, module


def attach_quantization(model: nn.Module, config: QuantConfig) -> None:
    """Give every column/row-parallel layer its method, before weights are loaded (and the
    embeddings a checkpoint stores quantised theirs; schemes applied at load never touch
    embeddings or the LM head)."""
    for name, layer in [*_linear_layers(model), *_checkpoint_embeddings(model, config)]:
        method = config.method_for(name)
        if method is None:
            continue
        layer.quant_method = method
        method.create_weights(layer)
        if getattr(method, "prequantized", False):
            continue  # already quantised on disk: finished with the rest, at the end
        shards = len(getattr(layer, "output_sizes", [0]))
        inner = layer.weight.weight_loader
        layer.weight.weight_loader = _FinishingLoader(layer, method, inner, shards)


def finish_quantization(model: nn.Module) -> int:
    """Finish any layer a model loaded without its weight loader; returns quantised layers."""
    from pagedllm.layers.linear import VocabParallelEmbedding

    embeddings = [
        ("", m)
        for m in model.modules()
        if isinstance(m, VocabParallelEmbedding) and m.quant_method is not None
    ]
    count = 0
    with torch.no_grad():
        for _, layer in [*_linear_layers(model), *embeddings]:
            method = layer.quant_method
            if method is not None:
                method.finish_loading(layer)
                count += int(method.is_quantized(layer))
    return count

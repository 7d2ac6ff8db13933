"""From a Hugging Face folder to a ready model: config, class, weights, dtype, device."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from pagedllm.backends.base import AttentionBackend
from pagedllm.layers.parallel import SINGLE, WHOLE_MODEL, PPContext, TPContext, stage_layers
from pagedllm.layers.quantization import (
    WeightQuantizer,
    attach_quantization,
    finish_quantization,
    get_quant_config,
    with_checkpoint_layers,
)
from pagedllm.models.checkpoint import CheckpointError, iterate_weights
from pagedllm.models.gguf.reader import gguf_path_of
from pagedllm.models.gguf.weights import BlockDecoder, GGUFWeights
from pagedllm.models.hf_config_checks import check_config_json, read_config_json
from pagedllm.models.registry import model_task, resolve_model_class

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def load_hf_config(model: str) -> Any:
    """The model's transformers config, read from its folder only (never from a hub), or from
    the metadata of a GGUF file (``model.gguf``, or a folder holding one)."""
    gguf_path = gguf_path_of(model)
    if gguf_path is not None:
        from pagedllm.models.gguf.loading import gguf_config

        return gguf_config(gguf_path)
    folder = Path(model)
    config_file = folder / "config.json"
    if not folder.is_dir():
        raise ValueError(f"model: {model!r} is not a local model folder")
    if not config_file.exists():
        raise CheckpointError(f"{config_file}: missing (every model folder needs config.json)")
    check_config_json(config_file, read_config_json(config_file))
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(str(folder), local_files_only=True)
    except (ValueError, OSError, KeyError, *_config_validation_errors()) as exc:
        detail = " ".join(str(exc).split())  # validation errors span lines
        raise CheckpointError(
            f"{config_file}: cannot be read as a model config ({detail})"
        ) from exc
    return text_part(config)


# Checkpoints of models with a vision tower whose language model is one of our families (Gemma
# 3's 4B and up ship only so): the engine serves their text. The text config stands for the
# model and its family reads the language model's weights, leaving the vision tower unread.
TEXT_PARTS = {"Gemma3ForConditionalGeneration": "Gemma3ForCausalLM"}


def text_part(config: Any) -> Any:
    """``config``, or for a checkpoint in :data:`TEXT_PARTS` its ``text_config`` (with the
    checkpoint's dtype and the text family's architecture)."""
    for arch in getattr(config, "architectures", None) or []:
        if arch in TEXT_PARTS:
            text = config.text_config
            text.architectures = [TEXT_PARTS[arch]]
            if getattr(text, "dtype", None) is None:
                text.dtype = config.dtype
            return text
    return config


def _config_validation_errors() -> tuple[type[Exception], ...]:
    """The errors of the configs' field validation (huggingface_hub's strict dataclasses, which
    newer transformers configs are): a mistyped field in config.json is the user's input."""
    try:
        from huggingface_hub.errors import StrictDataclassError
    except ImportError:
        return ()
    return (StrictDataclassError,)


def config_dtype(hf_config: Any) -> torch.dtype:
    dtype = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None)
    if isinstance(dtype, str):
        dtype = _DTYPES.get(dtype, torch.float32)
    return dtype if isinstance(dtype, torch.dtype) else torch.float32


def resolve_dtype(
    requested: str,
    hf_config: Any,
    default: Callable[[torch.dtype], torch.dtype] | None = None,
) -> torch.dtype:
    """An explicit ``dtype`` is honoured; "auto" asks the backend (``default``) what to make of
    the checkpoint's dtype, or takes the checkpoint's dtype when there is no backend rule."""
    if requested == "auto":
        stored = config_dtype(hf_config)
        return default(stored) if default is not None else stored
    if requested not in _DTYPES:
        raise ValueError(f"dtype: {requested!r} is not one of {['auto', *_DTYPES]}")
    return _DTYPES[requested]


def max_model_len_of(hf_config: Any) -> int:
    for key in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length"):
        value = getattr(hf_config, key, None)
        if isinstance(value, int) and value > 0:
            return value
    return 2048


@dataclass(frozen=True)
class PackedSource:
    """A model's single checkpoint file and the folder its packed weights may be kept in (the
    CPU backend's ``pack_cache``): set on the model as ``packed_source`` where that is on."""

    file: Path
    folder: Path
    shard: tuple[int, int] = (0, 1)  # (tensor-parallel rank, size)


def load_model(
    model: str,
    hf_config: Any,
    *,
    attn_backend: AttentionBackend,
    device: torch.device,
    dtype: torch.dtype,
    tp: TPContext = SINGLE,
    pp: PPContext = WHOLE_MODEL,
    quantization: str | None = None,
    quantizer: WeightQuantizer | None = None,
    native_formats: frozenset[str] = frozenset(),
    gguf_block_decoder: BlockDecoder | None = None,
    task: str | None = None,
    packed_cache: Path | None = None,
    packed_layers: Callable[[nn.Module], frozenset[str]] | None = None,
) -> nn.Module:
    """Build the model with its parameters already in ``dtype`` and fill them from the checkpoint.

    Modules are constructed on the meta device (no storage at all), then every parameter gets
    empty storage in ``dtype`` on ``device`` and the checkpoint tensors are copied straight in.
    A 16-bit checkpoint therefore never passes through a float32 copy: memory peaks at the
    model plus the largest single tensor. ``quantizer``: the device backend's kernel for weights
    quantised at load (see :class:`~pagedllm.layers.quantization.Int8WeightOnly`).
    ``native_formats``: the group-wise weight formats the device runs without dequantising
    (the formats its linear kernel claims, ``backends/kernels.py``): GGUF layers in them stay
    quantised.
    ``pp``: the pipeline stage whose layers alone are built and loaded.
    ``gguf_block_decoder``: the device's ``gguf_decode`` kernel for GGUF 4-bit and Q6_K blocks
    (``backends/kernels.py``); None: the numpy definition.
    ``task``: "generate", "embed" or "classify" (``registry.TASKS``); None: the checkpoint's
    (``registry.model_task``: a sentence-transformers folder over a decoder embeds).
    ``packed_cache``: the folder a backend may keep a GGUF's packed weights in (a whole model,
    or a tensor-parallel shard; not a pipeline stage), set on the model as ``packed_source``.
    ``packed_layers``: the backend's answer, asked of the model as built with ``packed_source``
    set, naming the linear layers whose packed form it already holds: their GGUF weights are
    neither decoded nor copied (:func:`leave_unread`).
    """
    if task is None:
        task = model_task(getattr(hf_config, "architectures", None), _folder_of(model))
    cls = pipeline_model_class(hf_config, pp.size, task)
    quant = get_quant_config(quantization, hf_config, quantizer)
    with torch.device("meta"):
        module = cls(hf_config, attn_backend=attn_backend, tp=tp, pp=pp)
    materialize(module, device=device, dtype=dtype)
    gguf_path = gguf_path_of(model)
    if gguf_path is not None:
        from pagedllm.models.gguf.loading import gguf_weights, keep_experts_quantised

        weights, plan = gguf_weights(
            gguf_path, hf_config, native_formats, block_decoder=gguf_block_decoder
        )
        keep_experts_quantised(module, weights.expert_plan)
        quant = with_checkpoint_layers(quant, plan)
        if packed_cache is not None and pp.size == 1:
            module.packed_source = PackedSource(gguf_path, packed_cache, (tp.rank, tp.size))
    else:
        # Under tensor (pipeline) parallelism each rank reads only the slices (layers) it keeps.
        weights = iterate_weights(Path(model), lazy=tp.size > 1 or pp.size > 1)
    if quant is not None:  # quantised linear layers: see layers/quantization
        attach_quantization(module, quant)
        source = getattr(module, "packed_source", None)
        if packed_layers is not None and source is not None and isinstance(weights, GGUFWeights):
            leave_unread(module, packed_layers(module), weights)
        weights = quant.transform(weights)
    try:
        loaded = module.load_weights(weights)
    except CheckpointError as exc:
        source = str(gguf_path if gguf_path is not None else model)
        if source in str(exc):
            raise
        raise CheckpointError(f"{source}: {exc}") from exc  # which model lacks the tensor
    if quant is not None:
        logger.info(
            "%d linear layers quantised (%s)", finish_quantization(module), quant.describe()
        )
    logger.info("loaded %d weight tensors for %s in %s", len(loaded), cls.__name__, dtype)
    if getattr(module, "task", None) == "embed" and gguf_path is None:
        _read_pooling(module, Path(model))  # the folder's pooling, over the class's default
    elif getattr(module, "task", None) == "embed":
        from pagedllm.models.gguf.loading import gguf_pooling_config

        module.pooling_config = gguf_pooling_config(gguf_path, module.pooling_config)
    return module.eval()


def leave_unread(module: nn.Module, layers: frozenset[str], weights: GGUFWeights) -> None:
    """Keep ``layers``' weight tensors (the group-wise q and its factors, not a bias) as meta
    placeholders of their shapes, and have ``weights`` skip the GGUF tensors that would fill
    them: the backend installs those layers' packed form instead. A meta parameter has no
    storage, so whatever read one would fail loudly, and the loader's missing-weight check
    passes it over."""
    if not layers:
        return
    params: set[str] = set()
    for name in layers:
        layer = module.get_submodule(name)
        for attr, param in list(layer.named_parameters(recurse=False)):
            if attr.startswith("weight"):
                placeholder = nn.Parameter(torch.empty_like(param, device="meta"), False)
                placeholder.__dict__.update(param.__dict__)
                setattr(layer, attr, placeholder)
                params.add(f"{name}.{attr}")
    mapper = module.weight_mapper() if hasattr(module, "weight_mapper") else None

    def unread(stem: str) -> bool:  # a checkpoint layer's name, without ".weight"
        mapped = mapper.map(f"{stem}.weight") if mapper is not None else None
        return mapped is not None and mapped[0] in params

    weights.unread = unread
    logger.info("%d linear layers' weights left unread: packed form cached", len(layers))


def _read_pooling(module: nn.Module, folder: Path) -> None:
    """An embedder pools as its sentence-transformers folder says, when it says anything."""
    from pagedllm.models.pooling import PoolingConfig

    declared = PoolingConfig.from_folder(folder)
    if declared is not None:
        module.pooling_config = declared
        logger.info("pooling from %s: %s", folder / "modules.json", declared)


def _folder_of(model: str) -> Path | None:
    return Path(model) if gguf_path_of(model) is None and Path(model).is_dir() else None


def pipeline_model_class(
    hf_config: Any, pipeline_parallel_size: int, task: str | None = None
) -> type[nn.Module]:
    """The model class, refused by name when it cannot be split into ``pipeline_parallel_size``
    stages (fewer layers than stages). Every generative family splits: they all run as a
    :class:`~pagedllm.models.causal_lm.CausalLM` (pooling models refuse at construction)."""
    cls = resolve_model_class(getattr(hf_config, "architectures", None), task)
    if pipeline_parallel_size == 1:
        return cls
    layers = int(getattr(hf_config, "num_hidden_layers", 0) or 0)
    stage_layers(layers, pipeline_parallel_size, 0)  # raises when there are too few layers
    return cls


# Buffers that must keep float32 whatever the compute dtype: the rotary cos/sin tables are
# rounded to the activations' dtype at use, as transformers rounds its float32 tables.
FLOAT32_BUFFERS = ("cos", "sin")


def materialize(module: nn.Module, *, device: torch.device, dtype: torch.dtype) -> None:
    """Give every meta parameter empty storage (floating ones in ``dtype``) on ``device``.

    Tied parameters stay tied (one new tensor per original). Attributes set on a parameter
    (``weight_loader``) carry over. Buffers are computed at construction, so they must be real
    already: floating ones follow ``dtype`` except :data:`FLOAT32_BUFFERS`.
    """
    new_params: dict[int, nn.Parameter] = {}
    for mod in module.modules():
        for name, param in list(mod._parameters.items()):
            if param is None:
                continue
            new = new_params.get(id(param))
            if new is None:
                target = dtype if param.is_floating_point() else param.dtype
                new = nn.Parameter(
                    torch.empty(param.shape, dtype=target, device=device), requires_grad=False
                )
                new.__dict__.update(param.__dict__)
                new_params[id(param)] = new
            mod._parameters[name] = new
        for name, buf in list(mod._buffers.items()):
            if buf is None:
                continue
            if buf.is_meta:
                raise RuntimeError(
                    f"{type(mod).__name__}.{name}: buffer built on the meta device; "
                    "computed buffers must be built on the CPU"
                )
            keep = not buf.is_floating_point() or name in FLOAT32_BUFFERS
            mod._buffers[name] = buf.to(device=device, dtype=None if keep else dtype)

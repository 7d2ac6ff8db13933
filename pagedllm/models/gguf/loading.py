"""The three things the engine asks of a GGUF file: its config, its tokenizer, its weights."""

from __future__ import annotations

import logging
from collections import Counter
from pathlib import Path
from typing import Any

from torch import nn

from pagedllm.models.gguf.checks import cap_context, check_model
from pagedllm.models.gguf.config import family_of, hf_config_from_gguf
from pagedllm.models.gguf.encoder import gguf_pooling
from pagedllm.models.gguf.names import NOT_WEIGHTS, hf_name
from pagedllm.models.gguf.plan import (
    STACK_OF,
    LayerFormat,
    check_types,
    plan_experts,
    plan_layers,
    tensor_format,
)
from pagedllm.models.gguf.reader import GGUFFile, open_gguf
from pagedllm.models.gguf.tokenizer import load_gguf_tokenizer
from pagedllm.models.gguf.weights import BlockDecoder, GGUFWeights
from pagedllm.models.pooling import PoolingConfig

logger = logging.getLogger(__name__)


def gguf_config(path: Path) -> Any:
    """The file's config, after its types, hyper-parameters and tensors are checked
    (``checks.check_model``): the first thing an engine start asks of a GGUF file."""
    gguf = open_gguf(path)
    check_types(gguf)
    check_model(gguf)
    config = hf_config_from_gguf(gguf)
    cap_context(gguf, config)
    return config


def gguf_tokenizer(path: Path) -> Any:
    return load_gguf_tokenizer(open_gguf(path))


def gguf_pooling_config(path: Path, default: PoolingConfig) -> PoolingConfig:
    """An embedder's pooling: the file's ``<arch>.pooling_type`` over the class's default."""
    return gguf_pooling(open_gguf(path), default)


def gguf_weights(
    path: Path,
    hf_config: Any,
    native: frozenset[str],
    *,
    block_decoder: BlockDecoder | None = None,
) -> tuple[GGUFWeights, dict[str, LayerFormat]]:
    """The file's tensors under Hugging Face names, and ``{linear module: format}`` for the
    layers that stay quantised (the rest are dequantised); logs what became of each type."""
    gguf = open_gguf(path)
    family = family_of(gguf)
    plan = plan_layers(gguf, family, native)
    experts = plan_experts(gguf, family, native)
    _log_types(gguf, family, plan, experts)
    weights = GGUFWeights(
        gguf, family, hf_config, plan, block_decoder=block_decoder, expert_plan=experts
    )
    return weights, plan


def keep_experts_quantised(model: nn.Module, expert_plan: dict[str, str]) -> None:
    """Give the expert stacks the plan keeps quantised their group-wise storage, before the
    weights are loaded (stacks of layers another pipeline stage holds are not here)."""
    from pagedllm.layers.fused_moe import FusedMoE

    for name, layer in model.named_modules():
        if not isinstance(layer, FusedMoE):
            continue
        stem = name[name.index("layers.") :] if "layers." in name else name
        for stack in ("w13_weight", "w2_weight"):
            fmt = expert_plan.get(f"{stem}.{stack}")
            if fmt is not None:
                layer.use_groupwise(stack, fmt)


def _log_types(
    gguf: GGUFFile, family: Any, plan: dict[str, LayerFormat], experts: dict[str, str]
) -> None:
    fate: Counter[tuple[str, str]] = Counter()
    for name, tensor in gguf.tensors.items():
        kept = None
        if name not in NOT_WEIGHTS and name.endswith(".weight"):  # biases: dequantised
            module = hf_name(name, family)[1]
            kept = tensor_format(plan, name, module) or _expert_format(name, experts)
        fate[(tensor.type_name, f"kept as {kept}" if kept else "dequantized")] += 1
    logger.info(
        "%s: %s",
        gguf.path.name,
        ", ".join(f"{n} {t} tensors {what}" for (t, what), n in sorted(fate.items())),
    )


def _expert_format(gguf_name: str, experts: dict[str, str]) -> str | None:
    parts = gguf_name.split(".")  # blk.N.ffn_gate_exps.weight
    if len(parts) != 4 or parts[2] not in STACK_OF:
        return None
    return experts.get(f"layers.{parts[1]}.mlp.experts.{STACK_OF[parts[2]]}")

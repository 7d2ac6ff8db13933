"""The three things the engine asks of a GGUF file: its config, its tokenizer, its weights."""

from __future__ import annotations

import functools
import logging
from collections import Counter
from pathlib import Path
from typing import Any

from pagedllm.models.gguf.config import family_of, hf_config_from_gguf
from pagedllm.models.gguf.reader import GGUFFile
from pagedllm.models.gguf.tokenizer import load_gguf_tokenizer
from pagedllm.models.gguf.weights import (
    NOT_WEIGHTS,
    BlockDecoder,
    GGUFWeights,
    LayerFormat,
    check_types,
    hf_name,
    plan_layers,
    tensor_format,
)

logger = logging.getLogger(__name__)


@functools.lru_cache(maxsize=2)
def _open(path: str, size: int, mtime_ns: int) -> GGUFFile:
    return GGUFFile(Path(path))


def open_gguf(path: Path) -> GGUFFile:
    """The parsed file, parsed once per process while it is unchanged (config, tokenizer and
    weights are read at different moments of one engine start; parsing takes ~0.1-1 s)."""
    stat = path.stat()
    return _open(str(path.resolve()), stat.st_size, stat.st_mtime_ns)


def gguf_config(path: Path) -> Any:
    gguf = open_gguf(path)
    check_types(gguf)
    return hf_config_from_gguf(gguf)


def gguf_tokenizer(path: Path) -> Any:
    return load_gguf_tokenizer(open_gguf(path))


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
    _log_types(gguf, family, plan)
    return GGUFWeights(gguf, family, hf_config, plan, block_decoder=block_decoder), plan


def _log_types(gguf: GGUFFile, family: Any, plan: dict[str, LayerFormat]) -> None:
    fate: Counter[tuple[str, str]] = Counter()
    for name, tensor in gguf.tensors.items():
        module = None if name in NOT_WEIGHTS else hf_name(name, family)[1]
        kept = None if name in NOT_WEIGHTS else tensor_format(plan, name, module)
        fate[(tensor.type_name, f"kept as {kept}" if kept else "dequantized")] += 1
    logger.info(
        "%s: %s",
        gguf.path.name,
        ", ".join(f"{n} {t} tensors {what}" for (t, what), n in sorted(fate.items())),
    )

"""Reading Hugging Face checkpoints: safetensors files (sharded or not) -> named tensors -> params.

Errors name the file: a missing, truncated or corrupt checkpoint must say which file is wrong.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from pagedllm.layers.linear import default_weight_loader


class CheckpointError(ValueError):
    """A checkpoint file is missing, unreadable or does not match the model."""


def checkpoint_files(folder: Path) -> list[Path]:
    """The safetensors files of a model folder, following ``model.safetensors.index.json``."""
    index = folder / "model.safetensors.index.json"
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as exc:
            raise CheckpointError(f"{index}: not a valid safetensors index ({exc})") from exc
        files = [folder / name for name in sorted(set(weight_map.values()))]
    else:
        files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise CheckpointError(
            f"{folder}: no *.safetensors weights found (pytorch_model.bin is not supported)"
        )
    for f in files:
        if not f.exists():
            raise CheckpointError(f"{f}: listed in the checkpoint index but missing")
    return files


def iterate_weights(folder: Path) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import SafetensorError
    from safetensors.torch import safe_open

    for path in checkpoint_files(folder):
        try:
            with safe_open(str(path), framework="pt") as f:
                for name in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                    yield name, f.get_tensor(name)
        except (SafetensorError, OSError, RuntimeError) as exc:
            raise CheckpointError(f"{path}: cannot read safetensors file ({exc})") from exc


@dataclass
class WeightMapper:
    """How checkpoint names become parameter names (prefixes, fused projections)."""

    strip_prefixes: tuple[str, ...] = ()
    fused: dict[str, tuple[str, int]] = field(default_factory=dict)
    renames: dict[str, str] = field(default_factory=dict)
    ignore: tuple[str, ...] = ()

    def map(self, name: str) -> tuple[str, int | None] | None:
        if any(name.endswith(s) or s in name for s in self.ignore):
            return None
        for prefix in self.strip_prefixes:
            if name.startswith(prefix):
                name = name[len(prefix) :]
                break
        for old, new in self.renames.items():
            name = name.replace(old, new)
        parts = name.split(".")
        for i, part in enumerate(parts):
            if part in self.fused:
                new, shard = self.fused[part]
                parts[i] = new
                return ".".join(parts), shard
        return name, None


def load_mapped_weights(
    model: nn.Module,
    weights: Iterable[tuple[str, torch.Tensor]],
    mapper: WeightMapper,
    *,
    skip_lm_head: bool = False,
) -> set[str]:
    """Copy checkpoint tensors into the model's parameters; every parameter must be covered."""
    params = dict(model.named_parameters(remove_duplicate=False))
    loaded: set[str] = set()
    for ckpt_name, tensor in weights:
        mapped = mapper.map(ckpt_name)
        if mapped is None:
            continue
        name, shard = mapped
        if skip_lm_head and name.startswith("lm_head."):
            continue
        param = params.get(name)
        if param is None:
            raise CheckpointError(f"checkpoint tensor {ckpt_name!r} has no place in the model")
        loader = getattr(param, "weight_loader", None)
        tensor = tensor.to(param.dtype)
        try:
            if shard is not None:
                loader(param, tensor, shard)  # type: ignore[misc]
            elif loader is not None:
                loader(param, tensor)
            else:
                default_weight_loader(param, tensor)
        except ValueError as exc:
            raise CheckpointError(f"checkpoint tensor {ckpt_name!r}: {exc}") from exc
        loaded.add(name)
    missing = {n for n in params if n not in loaded}
    if skip_lm_head:
        missing = {n for n in missing if not n.startswith("lm_head.")}
    if missing:
        raise CheckpointError(f"checkpoint lacks weights for: {sorted(missing)[:8]}")
    return loaded

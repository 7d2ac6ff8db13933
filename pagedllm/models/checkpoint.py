"""Reading Hugging Face checkpoints: safetensors files (sharded or not) -> named tensors -> params.

Errors name the file: a missing, truncated or corrupt checkpoint must say which file is wrong.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from pagedllm.layers.linear import default_weight_loader
from pagedllm.models.checkpoint_kv_scales import load_kv_scale
from pagedllm.models.safetensors_reader import (
    CheckpointError,
    check_safetensors,
    read_safetensors,
)

__all__ = ["CheckpointError", "WeightMapper", "iterate_weights", "load_mapped_weights"]


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


class LazyTensor:
    """A checkpoint tensor read on demand, so a tensor-parallel rank reads only its slice.

    It offers the few tensor operations the sharding weight loaders use (``shape``,
    ``narrow``, row slicing); anything else calls :meth:`materialize` first.
    """

    def __init__(self, handle: Any, name: str) -> None:
        self._slice = handle.get_slice(name)
        self.shape = torch.Size(self._slice.get_shape())

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor:
        index = [slice(None)] * len(self.shape)
        index[dim] = slice(start, start + length)
        return self._slice[tuple(index)]

    def __getitem__(self, key: slice) -> torch.Tensor:
        return self._slice[key]

    def dim(self) -> int:
        return len(self.shape)

    def materialize(self) -> torch.Tensor:
        return self._slice[:]

    def __getattr__(self, name: str) -> Any:
        # Model-specific preprocessing (transposes, fused splits) works on the whole tensor.
        return getattr(self.materialize(), name)


def iterate_weights(
    folder: Path, *, lazy: bool = False
) -> Iterator[tuple[str, torch.Tensor | LazyTensor]]:
    """Named checkpoint tensors in the checkpoint's own dtype; ``lazy`` yields slice handles.

    Eager tensors are read with plain file reads into fresh buffers (:func:`read_safetensors`),
    one at a time: the caller copies each into its parameter and drops it, so loading holds the
    model plus one tensor, and the file's pages stay in the page cache rather than in this
    process's resident set (a memory map would count them twice until the file is closed).
    """
    for path in checkpoint_files(folder):
        if lazy:
            yield from _iterate_lazy(path)
        else:
            yield from read_safetensors(path)


def _iterate_lazy(path: Path) -> Iterator[tuple[str, LazyTensor]]:
    from safetensors import SafetensorError
    from safetensors.torch import safe_open

    check_safetensors(path)
    try:
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                yield name, LazyTensor(f, name)
    except (SafetensorError, OSError, RuntimeError) as exc:
        raise CheckpointError(f"{path}: cannot read safetensors file ({exc})") from exc


@dataclass
class WeightMapper:
    """How checkpoint names become parameter names (prefixes, renames, fused projections)."""

    strip_prefixes: tuple[str, ...] = ()
    fused: dict[str, tuple[str, int]] = field(default_factory=dict)
    # Substrings replaced in every name, e.g. Mixtral's ".block_sparse_moe." -> ".mlp.".
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

    def checkpoint_name(self, name: str, seen: list[str]) -> str:
        """The checkpoint's spelling of parameter ``name`` (for messages): renames undone and
        the prefix the checkpoint's other tensors carry put back."""
        for old, new in self.renames.items():
            name = name.replace(new, old)
        counts = {p: sum(n.startswith(p) for n in seen) for p in self.strip_prefixes}
        prefix = max(counts, key=counts.__getitem__, default="")
        if prefix and counts[prefix] and not name.startswith("lm_head."):
            name = prefix + name
        return name


def _reads_slices(loader: Any) -> bool:
    """Whether a weight loader only narrows or row-slices what it is given."""
    from pagedllm.layers.linear import (
        ColumnParallelLinear,
        QKVParallelLinear,
        RowParallelLinear,
        VocabParallelEmbedding,
    )

    if getattr(loader, "reads_slices", False):  # declared by the loader (MoE expert stacks)
        return True
    func = getattr(loader, "__func__", None)
    return func in (
        ColumnParallelLinear.load_shard,
        QKVParallelLinear.load_shard,
        RowParallelLinear.load_weight,
        VocabParallelEmbedding.load_weight,
    )


def _copies(loader: Any) -> bool:
    """Whether a weight loader only copies (slices of) its tensor into the parameter."""
    return loader is None or loader is default_weight_loader or _reads_slices(loader)


def _adopt(param: nn.Parameter, loader: Any, tensor: torch.Tensor, shard: int | None) -> bool:
    """Make a freshly read tensor the parameter's storage when loading would copy it whole.

    Saves a copy of every unfused weight (and the page faults of touching the parameter's
    empty storage). Only for loaders known to copy a same-shaped tensor unchanged on a single
    rank; model-specific loaders (transposes, splits) always run.
    """
    if shard not in (None, 0) or param.shape != tensor.shape or param.device != tensor.device:
        return False
    if not _copies(loader) or getattr(loader, "finishes_layer", False):
        return False  # (a loader that quantises the layer once loaded must see the tensor)
    owner = getattr(loader, "__self__", None)
    tp = getattr(owner, "tp", None)
    if tp is not None and tp.size != 1:
        return False
    if shard == 0 and len(getattr(owner, "output_sizes", ())) != 1:
        return False  # the first part of a fused projection
    if not tensor.is_contiguous() or tensor.dtype != param.dtype:
        return False
    if tensor.untyped_storage().nbytes() != tensor.nbytes:
        return False  # a view into something larger (a fused tensor, a mapped file): copy
    param.data = tensor
    return True


def load_mapped_weights(
    model: nn.Module,
    weights: Iterable[tuple[str, torch.Tensor | LazyTensor]],
    mapper: WeightMapper,
    *,
    skip_lm_head: bool = False,
) -> set[str]:
    """Copy checkpoint tensors into the model's parameters; every parameter must be covered."""
    params = dict(model.named_parameters(remove_duplicate=False))
    loaded: set[str] = set()
    shards: dict[str, set[Any]] = {}  # the parts of each parameter the checkpoint filled
    seen: list[str] = []
    for ckpt_name, tensor in weights:
        if load_kv_scale(model, mapper, ckpt_name, tensor):
            continue  # an fp8 KV-cache scale: an attribute of the attention layer
        mapped = mapper.map(ckpt_name)
        if mapped is None:
            continue
        name, shard = mapped
        if skip_lm_head and name.startswith("lm_head."):
            continue
        seen.append(ckpt_name)
        shards.setdefault(name, set()).add(shard)
        param = params.get(name)
        if param is None:
            raise CheckpointError(f"checkpoint tensor {ckpt_name!r} has no place in the model")
        loader = getattr(param, "weight_loader", None)
        if isinstance(tensor, LazyTensor) and not _reads_slices(loader):
            tensor = tensor.materialize()
        if not isinstance(tensor, LazyTensor):
            if _adopt(param, loader, tensor, shard):
                loaded.add(name)
                continue
            if not _copies(loader):
                # Known loaders convert while copying (no second whole-tensor buffer).
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
        except RuntimeError as exc:  # a shape mismatch: the config does not describe the weights
            raise CheckpointError(
                f"checkpoint tensor {ckpt_name!r} of shape {list(tensor.shape)} does not fit "
                f"{name} of shape {list(param.shape)}: config.json does not match the weights "
                f"({str(exc).splitlines()[0]})"
            ) from exc
        loaded.add(name)
    # A meta parameter was left unread on purpose (``model_loader.leave_unread``).
    missing = {n for n, p in params.items() if n not in loaded and not p.is_meta}
    if skip_lm_head:
        missing = {n for n in missing if not n.startswith("lm_head.")}
    lacking = [mapper.checkpoint_name(n, seen) for n in sorted(missing)]
    lacking += _unfilled_parts(shards, mapper, seen)
    if lacking:
        more = f" and {len(lacking) - 8} more" if len(lacking) > 8 else ""
        raise CheckpointError(f"checkpoint lacks weights for: {lacking[:8]}{more}")
    return loaded


def _unfilled_parts(
    shards: dict[str, set[Any]], mapper: WeightMapper, seen: list[str]
) -> list[str]:
    """The checkpoint tensors a fused parameter lacks (``k_proj`` of a ``qkv_proj`` whose
    ``q_proj`` and ``v_proj`` were read): the part left unfilled would hold garbage."""
    parts_of: dict[str, dict[int, str]] = {}
    for old, (new, shard) in mapper.fused.items():
        parts_of.setdefault(new, {})[shard] = old
    out = []
    for name, got in sorted(shards.items()):
        if None in got or not all(isinstance(s, int) for s in got):
            continue  # a whole tensor, or expert stacks (their own loader checks them)
        if name.rsplit(".", 1)[-1] not in ("weight", "bias"):
            continue  # a format's side tensor (group offsets): parts in other formats lack it
        fused = next((p for p in name.split(".") if p in parts_of), None)
        if fused is None:
            continue
        for shard, old in sorted(parts_of[fused].items()):
            if shard not in got:
                out.append(mapper.checkpoint_name(name.replace(fused, old), seen))
    return out

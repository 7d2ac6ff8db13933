"""Pooling: from a flat batch's hidden states to one vector (or one row of logits) per sequence.

The contract between pooling models and the engine (issue 59):

* A pooling model class has ``task: str`` in :data:`TASKS` (``"embed"``: a vector per input;
  ``"classify"``: a classification head's logits, what a cross-encoder reranker answers),
  ``pooling_config: PoolingConfig`` (the checkpoint's defaults), and ``uses_kv_cache: bool``.
* ``forward(input_ids, positions, kv_caches, attn_meta, token_type_ids=None) -> hidden
  [num_tokens, H]``: the first four arguments as a generative model's forward (a flat batch,
  sequences back to back, no padding). ``uses_kv_cache=False`` (bidirectional encoders: BERT,
  RoBERTa, XLM-R): the model attends within each sequence using ``attn_meta.query_start_loc``
  only, holds no KV blocks (``kv_caches`` is ignored: pass ``[]``) and needs each whole prompt in
  one step, its positions ``0 .. len-1``. ``uses_kv_cache=True`` (decoder embedders): it runs
  causally on the paged cache as a generative model does, so prefix caching works.
  ``token_type_ids`` [num_tokens] (BERT's segment ids; zeros when None).
* ``pool(hidden, query_lens: list[int]) -> Tensor[num_seqs, D]``: embedders pool as their
  ``pooling_config`` says, NOT yet truncated nor normalised (the engine applies
  :func:`finish_embedding` with the request's ``dimensions`` and ``normalize``); classifiers
  return the head's logits ``[num_seqs, num_labels]``. Always float32.

Pooling is computed in float32 whatever the model dtype, as sentence-transformers accumulates
16-bit activations in float32: a bfloat16 mean over hundreds of tokens would otherwise lose the
digits the 0.999 cosine bound needs.
"""

from __future__ import annotations

import enum
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

TASKS = ("embed", "classify")


class PoolingType(str, enum.Enum):
    MEAN = "mean"
    CLS = "cls"  # the first token of each sequence
    LAST = "last"  # the last token (decoder embedders, whose last token has seen the whole text)


@dataclass(frozen=True)
class PoolingConfig:
    """A checkpoint's pooling defaults; a request's ``dimensions``/``normalize`` override them."""

    pooling_type: PoolingType
    normalize: bool
    dimensions: int | None = None

    def __post_init__(self) -> None:
        if self.dimensions is not None and self.dimensions < 1:
            raise ValueError(f"dimensions: must be >= 1, got {self.dimensions}")

    @classmethod
    def from_folder(cls, path: str | Path) -> PoolingConfig | None:
        """The pooling a sentence-transformers folder declares (``modules.json`` and its
        Pooling module's ``config.json``); None for a folder without ``modules.json``.

        A module the engine does not run (Dense, LayerNorm...) or a pooling mode it does not
        implement is a ValueError naming it: an embedding computed without it would be silently
        different from the checkpoint's.
        """
        folder = Path(path)
        modules_file = folder / "modules.json"
        if not modules_file.is_file():
            return None
        modules = _read_json(modules_file)
        if not isinstance(modules, list):
            raise ValueError(f"{modules_file}: expected a list of modules")
        pooling: PoolingType | None = None
        normalize = False
        for module in modules:
            kind = str(module.get("type", "")) if isinstance(module, dict) else ""
            name = kind.rpartition(".")[2]
            if name == "Transformer":
                continue
            if name == "Normalize":
                normalize = True
            elif name == "Pooling":
                sub = folder / str(module.get("path", "")) / "config.json"
                pooling = _pooling_mode(sub, _read_json(sub))
            else:
                raise ValueError(
                    f"{modules_file}: module {kind!r} is not supported "
                    "(pagedllm runs Transformer, Pooling and Normalize modules)"
                )
        if pooling is None:
            raise ValueError(f"{modules_file}: no Pooling module")
        return cls(pooling, normalize)


def sentence_max_seq_length(path: str | Path) -> int | None:
    """The input length a sentence-transformers folder truncates to (``max_seq_length`` of its
    ``sentence_bert_config.json``; all-MiniLM-L6-v2 says 256 of its 512 positions); None when it
    says nothing. An engine that truncates there embeds long texts as the folder's users do."""
    config_file = Path(path) / "sentence_bert_config.json"
    if not config_file.is_file():
        return None
    value = _read_json(config_file)
    length = value.get("max_seq_length") if isinstance(value, dict) else None
    if length is None:
        return None
    if not isinstance(length, int) or isinstance(length, bool) or length < 1:
        raise ValueError(
            f"{config_file}: max_seq_length must be a positive integer, got {length!r}"
        )
    return length


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ValueError(f"{path}: cannot be read as JSON ({exc})") from exc


# sentence-transformers' legacy boolean keys (still what most published folders hold), and
# the modes of its current single ``pooling_mode`` key, onto ours.
_LEGACY_KEYS = {
    "pooling_mode_mean_tokens": PoolingType.MEAN,
    "pooling_mode_cls_token": PoolingType.CLS,
    "pooling_mode_lasttoken": PoolingType.LAST,
}
_MODES = {"mean": PoolingType.MEAN, "cls": PoolingType.CLS, "lasttoken": PoolingType.LAST}
_UNSUPPORTED_LEGACY = (
    "pooling_mode_max_tokens",
    "pooling_mode_mean_sqrt_len_tokens",
    "pooling_mode_weightedmean_tokens",
)


def _pooling_mode(path: Path, config: Any) -> PoolingType:
    if not isinstance(config, dict):
        raise ValueError(f"{path}: expected an object")
    if "pooling_mode" in config:
        mode = config["pooling_mode"]
        if isinstance(mode, str) and mode in _MODES:
            return _MODES[mode]
        raise ValueError(
            f"{path}: pooling_mode {mode!r} is not supported; use one of {list(_MODES)}"
        )
    chosen = [kind for key, kind in _LEGACY_KEYS.items() if config.get(key)]
    other = [key for key in _UNSUPPORTED_LEGACY if config.get(key)]
    if other or len(chosen) > 1:
        on = [key for key in (*_LEGACY_KEYS, *_UNSUPPORTED_LEGACY) if config.get(key)]
        raise ValueError(f"{path}: pooling {on} is not supported; set exactly one of "
                         f"{list(_LEGACY_KEYS)}")  # fmt: skip
    return chosen[0] if chosen else PoolingType.MEAN  # sentence-transformers' default


def parse_pooling_override(text: str) -> PoolingType:
    """The ``--pooling`` flag's value."""
    try:
        return PoolingType(text.strip().lower())
    except ValueError:
        raise ValueError(
            f"--pooling: {text!r} is not one of {[p.value for p in PoolingType]}"
        ) from None


def pool_hidden(
    hidden: torch.Tensor,  # [num_tokens, H], sequences back to back
    query_lens: list[int],
    pooling_type: PoolingType | str,
) -> torch.Tensor:  # [num_seqs, H] float32
    """One vector per sequence of a flat batch."""
    kind = PoolingType(pooling_type)
    if sum(query_lens) != hidden.shape[0] or any(n < 1 for n in query_lens):
        raise ValueError(
            f"pool_hidden: query_lens {query_lens} do not cover {hidden.shape[0]} tokens"
        )
    lens = torch.tensor(query_lens, device=hidden.device)
    ends = torch.cumsum(lens, 0)
    if kind is PoolingType.CLS:
        return hidden[ends - lens].float()
    if kind is PoolingType.LAST:
        return hidden[ends - 1].float()
    if hidden.device.type in ("cpu", "cuda"):
        # One segmented reduction: index_add_ over the flat batch took ~160 ms for 32 MiniLM
        # sentences with 2 threads on a loaded 2-core host (1.6 ms with one thread), this ~3 ms.
        return torch.segment_reduce(hidden.float(), "mean", lengths=lens)
    seq_of_token = torch.repeat_interleave(
        torch.arange(len(query_lens), device=hidden.device), lens
    )
    sums = torch.zeros(len(query_lens), hidden.shape[1], device=hidden.device, dtype=torch.float32)
    sums.index_add_(0, seq_of_token, hidden.float())
    return sums / lens.unsqueeze(1).to(torch.float32)


def finish_embedding(
    vec: torch.Tensor,  # [num_seqs, H]
    normalize: bool,
    dimensions: int | None = None,
) -> torch.Tensor:  # [num_seqs, dimensions or H] float32
    """Matryoshka truncation, then L2 normalisation: truncating first keeps a truncated vector
    unit-length, as sentence-transformers' ``truncate_dim`` does."""
    out = vec.float()
    if dimensions is not None:
        if not 1 <= dimensions <= out.shape[-1]:
            raise ValueError(f"dimensions: must be in 1..{out.shape[-1]}, got {dimensions}")
        out = out[..., :dimensions]
    if normalize:
        out = torch.nn.functional.normalize(out, p=2.0, dim=-1)
    return out

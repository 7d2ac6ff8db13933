"""The engine's pooling side: which task the model serves, and what a pooling request may ask.

The model says what it is (``task`` "embed" or "classify" on a pooling model; a causal LM is
"generate"), ``--task`` may say otherwise where that makes sense: a causal LM is loaded as a
decoder embedder with ``--task embed`` (its last token's final hidden state), and an embedding
model scores by the cosine of two embeddings. Everything else is refused by name at start-up.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pagedllm.core.pooling_params import PoolingParams
from pagedllm.core.sampling_params import SamplingParams


def model_context(model: str, hf_config: Any) -> int:
    """The model's context: its positions, or less where a sentence-transformers folder says it
    reads less (``max_seq_length``: all-MiniLM-L6-v2 256 of its 512), as vLLM caps it; a longer
    input is refused unless ``truncate_prompt_tokens`` asks for it to be cut."""
    from pagedllm.models.model_loader import max_model_len_of
    from pagedllm.models.pooling import sentence_max_seq_length

    positions = max_model_len_of(hf_config)
    if getattr(hf_config, "model_type", "") in ("roberta", "xlm-roberta"):
        # RoBERTa counts positions from padding_idx + 1: two of its table's rows are never read.
        positions -= int(getattr(hf_config, "pad_token_id", 1) or 1) + 1
    folder = Path(model)
    limit = sentence_max_seq_length(folder) if folder.is_dir() else None
    return positions if limit is None else min(positions, limit)


def prefill_only() -> SamplingParams:
    """The sampling side of a pooling request, which the scheduler reads like any request's."""
    return SamplingParams(temperature=0.0, max_tokens=1)


# What ``--task`` may turn each kind of checkpoint into ("auto" picks the first); a causal LM
# asked to embed is loaded as a decoder embedder (``models/decoder_embedder.py``), an "embed" model.
_ALLOWED = {
    "generate": ("generate",),
    "embed": ("embed", "score"),
    "classify": ("score",),
}


@dataclass(frozen=True)
class PoolingInfo:
    """The served model's pooling facts, read once from the worker (``Worker.pooling_info``).

    ``task`` is what the engine serves ("generate", "embed" or "score"); ``model_task`` what the
    checkpoint is. ``whole_prompt``: the model pools over every position (mean, CLS), so a
    prompt runs whole in one step without prefix-cache skips.
    """

    task: str
    model_task: str = "generate"
    uses_kv_cache: bool = True
    whole_prompt: bool = False
    normalize: bool = True
    pooling_type: str = "last"
    num_labels: int | None = None
    embed_dim: int | None = None  # an embedding's width: the most ``dimensions`` may keep

    @property
    def is_pooling(self) -> bool:
        return self.task != "generate"


def resolve_task(
    requested: str, facts: dict[str, Any], *, embed_dim: int | None = None
) -> PoolingInfo:
    """The task the engine serves, from ``--task`` and the worker's facts about the model."""
    model_task = str(facts.get("task", "generate"))
    allowed = _ALLOWED.get(model_task, ("generate",))
    task = allowed[0] if requested == "auto" else requested
    if task not in allowed:
        raise ValueError(
            f"task: {requested!r} is not served by this checkpoint, a {model_task} model "
            f"(it serves {', '.join(allowed)})"
        )
    pooling_type = str(facts.get("pooling_type", "last"))
    return PoolingInfo(
        task=task,
        model_task=model_task,
        uses_kv_cache=bool(facts.get("uses_kv_cache", True)),
        whole_prompt=pooling_type != "last",
        normalize=bool(facts.get("normalize", True)),
        pooling_type=pooling_type,
        num_labels=facts.get("num_labels"),
        embed_dim=embed_dim,
    )


# The special tokens a tokenizer puts before and after a text's own: ([CLS],), ([SEP],) for BERT.
SpecialFrame = tuple[tuple[int, ...], tuple[int, ...]]


def special_frame(tokenizer: Any) -> SpecialFrame:
    """The tokens the tokenizer adds around one text, found by encoding a word with and without
    them (BERT's [CLS] and [SEP], RoBERTa's <s> and </s>); empty where there is no tokenizer or
    the word's own tokens cannot be found in the framed encoding."""
    if tokenizer is None:
        return (), ()
    inner = list(tokenizer.encode("a", add_special_tokens=False))
    whole = list(tokenizer.encode("a"))
    for start in range(len(whole) - len(inner) + 1):
        if inner and whole[start : start + len(inner)] == inner:
            return tuple(whole[:start]), tuple(whole[start + len(inner) :])
    return (), ()


def truncate_prompt(
    token_ids: list[int],
    types: tuple[int, ...] | None,
    keep: int,
    *,
    keep_head: bool,
    frame: SpecialFrame = ((), ()),
) -> tuple[list[int], tuple[int, ...] | None]:
    """At most ``keep`` tokens of a pooled input (and its token types, aligned).

    A decoder embedder pools its last token, so it keeps the last ``keep`` (vLLM's slice of
    token-id inputs). An encoder reads its text from the start and pools [CLS] or the mean: it
    keeps the head, and where the input carries the tokenizer's frame ([CLS] ... [SEP]) the
    frame stays and the text between is cut, as a Hugging Face tokenizer's ``truncation=True``
    does for sentence-transformers and for vLLM's text inputs to a BERT.
    """
    if len(token_ids) <= keep:
        return token_ids, types
    if not keep_head:
        return token_ids[-keep:], None if types is None else types[-keep:]
    head, tail = frame
    framed = (
        len(head) + len(tail) < keep
        and tuple(token_ids[: len(head)]) == head
        and tuple(token_ids[len(token_ids) - len(tail) :]) == tail
    )
    if not framed:
        return token_ids[:keep], None if types is None else types[:keep]
    cut, end = keep - len(tail), len(token_ids) - len(tail)
    ids = token_ids[:cut] + token_ids[end:]
    return ids, None if types is None else (*types[:cut], *types[end:])


def admit_pooling(
    params: PoolingParams,
    token_ids: list[int],
    info: PoolingInfo,
    *,
    max_model_len: int,
    token_budget: int,
    frame: SpecialFrame = ((), ()),
) -> tuple[PoolingParams, list[int]]:
    """The request's params completed with the model's facts, and its (truncated) tokens.

    A ValueError naming the field where the request cannot run here: the wrong task, a prompt
    longer than the model's positions (unless ``truncate_prompt_tokens``), or, for a model
    that runs each prompt whole, longer than one step's token budget. ``frame``: the special
    tokens the tokenizer puts around a text (:func:`special_frame`), kept when an encoder's
    input is truncated.
    """
    if not info.is_pooling:
        raise ValueError(
            f"task: this model generates text ({info.model_task}); it serves no {params.task} "
            "requests"
        )
    wanted = "embed" if info.task == "embed" else "classify"
    if params.task != wanted and not (params.task == "embed" and info.model_task == "embed"):
        raise ValueError(f"task: this model serves {info.task}, not {params.task}")
    dims = params.dimensions
    if dims is not None and info.embed_dim is not None and dims > info.embed_dim:
        raise ValueError(f"dimensions: at most {info.embed_dim} for this model, got {dims}")
    types = params.token_type_ids
    if types is not None and len(types) != len(token_ids):
        raise ValueError("token_type_ids: must be as long as the prompt's token ids")
    if params.truncate_prompt_tokens is not None:
        token_ids, types = truncate_prompt(
            token_ids,
            types,
            params.truncate_prompt_tokens,
            keep_head=not info.uses_kv_cache,
            frame=frame,
        )
    if len(token_ids) > max_model_len:
        kept = "the last ones" if info.uses_kv_cache else "the first ones and [SEP]"
        raise ValueError(
            f"input: {len(token_ids)} tokens, more than the model's maximum context length "
            f"({max_model_len}); set truncate_prompt_tokens to keep {kept}"
        )
    whole = info.whole_prompt or not info.uses_kv_cache
    if whole and len(token_ids) > token_budget:
        raise ValueError(
            f"input: {len(token_ids)} tokens, more than one step computes "
            f"(max_num_batched_tokens={token_budget}); a pooled prompt runs whole"
        )
    resolved = params.clone(
        normalize=info.normalize if params.normalize is None else params.normalize,
        whole_prompt=info.whole_prompt,
        uses_kv_cache=info.uses_kv_cache,
        token_type_ids=types,
    )
    return resolved, token_ids

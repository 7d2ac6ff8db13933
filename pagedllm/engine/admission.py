"""What the engine admits: requests that can run with its limits, and a context it can hold.

A request that can never be scheduled (more sequences than ``max_num_seqs``, more KV blocks than
the whole cache) would wait at the head of the queue forever and hold every later request behind
it; a value the model cannot take (a ``top_k`` past the vocabulary, a token id outside it) would
fail the batched step of every request that shares it. Both are refused here, at ``add_request``,
with a ``ValueError`` naming the field, before anything is queued.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass

from pagedllm.config import EngineConfig
from pagedllm.core.block_manager import window_block_count
from pagedllm.core.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class EngineLimits:
    """The numbers a request is checked against (all known once the KV cache is sized)."""

    vocab_size: int
    max_model_len: int
    max_num_seqs: int
    max_logprobs: int
    block_size: int
    usable_blocks: int  # device blocks a single request may hold (the cache less the watermark)
    # Block sliding window: the blocks one sequence needs at any length (window_block_count)
    window_blocks: int | None = None
    max_priority: int = 2**63 - 1


# The words of the refusal of a request past the context window (``max_model_len``), by which
# the server answers it with OpenAI's ``context_length_exceeded`` code.
CONTEXT_LENGTH = "maximum context length"


def default_max_tokens(prompt_len: int, max_model_len: int) -> int:
    """``max_tokens=None``: the rest of the context window (at least one token: a prompt that
    fills the window is admitted, and the scheduler ends it with its error)."""
    return max(1, max_model_len - prompt_len)


def blocks_for_group(prompt_len: int, total_len: int, num_seqs: int, block_size: int) -> int:
    """KV blocks ``num_seqs`` sequences hold together once each reaches ``total_len`` tokens.

    The prompt's full blocks are shared; the rest (the prompt's partial block, copied on write,
    and every generated token) is each sequence's own.
    """
    shared = prompt_len // block_size
    own = -(-total_len // block_size) - shared
    return shared + num_seqs * own


def check_request(params: SamplingParams, prompt_len: int, limits: EngineLimits) -> None:
    """Raise ``ValueError("field: ...")`` unless the request can run to its end here."""
    vocab = limits.vocab_size
    if params.top_k > vocab:
        raise ValueError(
            f"top_k: must be -1 (off) or at most the vocabulary size ({vocab}), got {params.top_k}"
        )
    for name in ("logprobs", "prompt_logprobs"):
        value = getattr(params, name)
        if value is not None and value > min(limits.max_logprobs, vocab):
            raise ValueError(
                f"{name}: at most {min(limits.max_logprobs, vocab)} are supported, got {value}"
            )
    bad = [t for t in params.stop_token_ids if t >= vocab]
    if bad:
        raise ValueError(
            f"stop_token_ids: token id {bad[0]} is outside the vocabulary [0, {vocab})"
        )
    bad = [t for t in (params.logit_bias or {}) if t >= vocab]
    if bad:
        raise ValueError(f"logit_bias: token id {bad[0]} is outside the vocabulary [0, {vocab})")
    num_seqs = params.best_of or params.n
    if num_seqs > limits.max_num_seqs:
        name = "n" if params.n == num_seqs else "best_of"
        raise ValueError(
            f"{name}: {num_seqs} sequences are more than this engine runs at once "
            f"(max_num_seqs={limits.max_num_seqs})"
        )
    _check_length(params, prompt_len, num_seqs, limits)


def _check_length(
    params: SamplingParams, prompt_len: int, num_seqs: int, limits: EngineLimits
) -> None:
    max_len = limits.max_model_len
    if prompt_len >= max_len:
        return  # the scheduler ends it with an error naming max_model_len (a documented output)
    assert params.max_tokens is not None
    if prompt_len + params.max_tokens > max_len:
        raise ValueError(
            f"max_tokens: this model's {CONTEXT_LENGTH} is {max_len} tokens; the prompt has "
            f"{prompt_len} tokens and max_tokens asks for {params.max_tokens} more "
            f"({prompt_len + params.max_tokens} in all); lower max_tokens or shorten the prompt"
        )
    needed = blocks_for_group(
        prompt_len, prompt_len + params.max_tokens, num_seqs, limits.block_size
    )
    if limits.window_blocks is not None:
        needed = min(needed, num_seqs * limits.window_blocks)
    if needed > limits.usable_blocks:
        name = "max_tokens" if num_seqs == 1 else ("n" if params.n == num_seqs else "best_of")
        raise ValueError(
            f"{name}: {num_seqs} sequence(s) of up to {prompt_len + params.max_tokens} tokens "
            f"need {needed} KV blocks but the whole cache holds {limits.usable_blocks}; lower "
            f"{name} or give the cache more memory"
        )


def fit_max_model_len(
    max_model_len: int,
    *,
    usable_blocks: int,
    block_size: int,
    explicit: bool,
    window_blocks: int | None = None,
) -> int:
    """The context length this cache can actually serve.

    Chosen behaviour: when the user set ``max_model_len`` and the cache cannot hold one sequence
    that long, refuse to start (they asked for something impossible); when it came from the
    model's config, lower it to what fits and log a warning (vLLM's behaviour for the derived
    length), so ``/v1/models`` never promises more than the engine can deliver.

    ``window_blocks``: under a block sliding window, the most blocks one sequence needs at any
    length (``window_block_count``: blocks behind the window are freed and prompts are given
    blocks chunk by chunk). A cache with that many usable blocks serves any ``max_model_len``;
    a smaller one only sequences that fit whole, as without a window.
    """
    if window_blocks is not None and usable_blocks >= window_blocks:
        return max_model_len
    capacity = usable_blocks * block_size
    if capacity >= max_model_len:
        return max_model_len
    if explicit or capacity < 1:
        raise ValueError(
            f"max_model_len: the KV cache holds {capacity} tokens ({usable_blocks} blocks of "
            f"{block_size}), fewer than one sequence of max_model_len ({max_model_len}); give "
            f"the cache more memory (kv_cache_space / gpu_memory_utilization / num_kv_blocks) "
            f"or lower max_model_len"
        )
    logger.warning(
        "max_model_len lowered from %d to %d: the KV cache holds only %d blocks of %d tokens",
        max_model_len,
        capacity,
        usable_blocks,
        block_size,
    )
    return capacity


def fit_context(
    config: EngineConfig,
    num_device: int,
    *,
    window: int | None,
    window_blocks: int | None,
    explicit: bool,
) -> EngineConfig:
    """``config`` with max_model_len fitted to a cache of ``num_device`` blocks (see
    :func:`fit_max_model_len`; ``explicit``: the user set it, so it is refused, not lowered).

    Under a block sliding window (``window_blocks`` given) a sequence of any length runs in
    ``window_blocks`` blocks, so a cache that holds them keeps max_model_len as it is.
    """
    cache, sched = config.cache, config.scheduler
    usable = num_device - int(cache.watermark * num_device)
    if (
        window is not None
        and window_blocks is None
        and usable * cache.block_size < sched.max_model_len
    ):
        logger.warning(
            "every layer slides over %d tokens, but a prompt is computed whole (holding all "
            "its blocks) without enable_chunked_prefill or with prefix caching; with chunked "
            "prefill a sequence of any length runs in %d blocks",
            window,
            window_block_count(window, cache.block_size),
        )
    new_len = fit_max_model_len(
        sched.max_model_len,
        usable_blocks=usable,
        block_size=cache.block_size,
        explicit=explicit,
        window_blocks=window_blocks,
    )
    if new_len == sched.max_model_len:
        return config
    return dataclasses.replace(
        config,
        model=dataclasses.replace(config.model, max_model_len=new_len),
        scheduler=dataclasses.replace(sched, max_model_len=new_len),
    )

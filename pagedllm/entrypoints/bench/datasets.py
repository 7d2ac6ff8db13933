"""What the benchmarks send: random prompts of a set length, or ShareGPT conversations.

ShareGPT format: a JSON list of ``{"conversations": [{"from": "human", "value": ...},
{"from": "gpt", "value": ...}, ...]}``; each entry's first human turn is the prompt and the
reply that follows sets how many tokens to ask for (its length in the model's tokens).
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

_TEXT = (
    "the quick brown fox jumps over lazy dog paged attention keeps cache in fixed size blocks "
    "continuous batching schedules every iteration anew def return import print while for "
    "class self value list dict token model server request stream latency throughput memory "
    "kernel block table slot mapping prefill decode sampler logits softmax"
)
WORDS = _TEXT.split()


@dataclass(frozen=True)
class BenchRequest:
    prompt: str | list[int]  # text, or token ids (offline random prompts are exact)
    output_len: int
    prompt_len: int | None = None  # tokens, where known before sending


def random_text(n: int, words: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(words)) for _ in range(n)]


def random_requests(n: int, input_len: int, output_len: int, seed: int) -> list[BenchRequest]:
    """``n`` prompts of ``input_len`` words from a fixed list: every run sends the same ones."""
    if n < 1 or input_len < 1 or output_len < 1:
        raise ValueError("num_prompts, input_len, output_len: must each be >= 1")
    return [BenchRequest(p, output_len) for p in random_text(n, input_len, seed)]


def random_token_requests(
    n: int, input_len: int, output_len: int, vocab_size: int, seed: int
) -> list[BenchRequest]:
    """``n`` prompts of exactly ``input_len`` random token ids (offline benchmarks)."""
    rng = random.Random(seed)
    return [
        BenchRequest([rng.randrange(vocab_size) for _ in range(input_len)], output_len, input_len)
        for _ in range(n)
    ]


def sharegpt_requests(
    path: str | Path,
    n: int,
    seed: int,
    count_tokens: Callable[[str], int],
    *,
    max_model_len: int | None = None,
    fixed_output_len: int | None = None,
) -> list[BenchRequest]:
    """Up to ``n`` (prompt, reply length) pairs from a ShareGPT file, shuffled with ``seed``.

    Entries without a human turn followed by a reply, replies under 4 tokens, and pairs that
    do not fit ``max_model_len`` are skipped.
    """
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"dataset_path: cannot read {path}: {exc}") from None
    if not isinstance(data, list):
        raise ValueError(f"dataset_path: {path} is not a JSON list of conversations")
    pairs = []
    for entry in data:
        turns = entry.get("conversations") if isinstance(entry, dict) else None
        if (
            isinstance(turns, list)
            and len(turns) >= 2
            and all(isinstance(t, dict) and isinstance(t.get("value"), str) for t in turns[:2])
        ):
            pairs.append((turns[0]["value"], turns[1]["value"]))
    random.Random(seed).shuffle(pairs)
    out: list[BenchRequest] = []
    for prompt, reply in pairs:
        if len(out) >= n:
            break
        prompt_len = count_tokens(prompt)
        output_len = fixed_output_len or count_tokens(reply)
        if prompt_len < 1 or output_len < 4:
            continue
        if max_model_len is not None and prompt_len + output_len > max_model_len:
            continue
        out.append(BenchRequest(prompt, output_len, prompt_len))
    if not out:
        raise ValueError(f"dataset_path: no usable conversations in {path}")
    return out

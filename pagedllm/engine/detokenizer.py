"""Incremental detokenization that only ever emits complete text.

Each step decodes a small window of tokens (a few of context plus the unread ones) and emits
the new suffix only when it does not end in U+FFFD, so a multi-byte character split over several
byte-level tokens appears once, whole. Stop strings are looked for in the newly added text plus
enough of the old to span a token boundary, and text that may still become a stop string is held
back from streaming until it is known not to.
"""

from __future__ import annotations

from typing import Any

from pagedllm.core.sampling_params import SamplingParams
from pagedllm.core.sequence import Sequence

_CONTEXT_TOKENS = 5  # tokens decoded before the new ones, so merges and spaces come out right


def _convert(tokenizer: Any, tokens: list[str], params: SamplingParams) -> str:
    if not tokens:
        return ""
    return tokenizer.convert_tokens_to_string(tokens)


class Detokenizer:
    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.all_special_ids = set(getattr(tokenizer, "all_special_ids", []) or [])

    def decode_new(self, seq: Sequence, params: SamplingParams) -> str:
        """Append the text of the newest token(s) to ``seq.output_text``; return what was added."""
        state = seq.detok
        tok = self.tokenizer
        if state.tokens is None:
            prompt_tail = seq.prompt_token_ids[-_CONTEXT_TOKENS - 1 :]
            state.tokens = tok.convert_ids_to_tokens(
                prompt_tail, skip_special_tokens=params.skip_special_tokens
            )
            state.prefix_offset = max(len(state.tokens) - _CONTEXT_TOKENS, 0)
            state.read_offset = len(state.tokens)
        outputs = seq.output_token_ids
        new_ids = outputs[state.decoded_outputs :]
        state.decoded_outputs = len(outputs)
        if params.skip_special_tokens:
            new_ids = [t for t in new_ids if t not in self.all_special_ids]
        if new_ids:
            pieces = tok.convert_ids_to_tokens(new_ids)
            state.tokens.extend(t for t in pieces if t is not None)
        prefix = _convert(tok, state.tokens[state.prefix_offset : state.read_offset], params)
        full = _convert(tok, state.tokens[state.prefix_offset :], params)
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            added = full[len(prefix) :]
            state.prefix_offset = state.read_offset
            state.read_offset = len(state.tokens)
            # Keep the window short: only the context tokens are ever re-decoded.
            if state.prefix_offset > 4 * _CONTEXT_TOKENS:
                drop = state.prefix_offset - _CONTEXT_TOKENS
                del state.tokens[:drop]
                state.prefix_offset -= drop
                state.read_offset -= drop
            seq.output_text += added
            return added
        return ""


def find_stop_string(
    text: str, num_new_chars: int, params: SamplingParams
) -> tuple[str, int] | None:
    """The first stop string completed by the newest characters, and where the text is cut."""
    if not params.stop or not num_new_chars:
        return None
    longest = max(len(s) for s in params.stop)
    search_from = max(0, len(text) - num_new_chars - longest + 1)
    best: tuple[int, str] | None = None
    for stop in params.stop:
        idx = text.find(stop, search_from)
        if idx != -1 and (best is None or idx < best[0]):
            best = (idx, stop)
    if best is None:
        return None
    idx, stop = best
    cut = idx + len(stop) if params.include_stop_str_in_output else idx
    return stop, cut


def stream_holdback(params: SamplingParams) -> int:
    """Characters kept back while streaming, since they might be the start of a stop string."""
    if not params.stop or params.include_stop_str_in_output:
        return 0
    return max(len(s) for s in params.stop) - 1

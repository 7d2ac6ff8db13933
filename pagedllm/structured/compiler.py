"""Constraint -> ready grammar matcher, cached per (kind, spec), compiled off the caller's thread.

Built on llguidance (why this library: docs/serving.md, "Why llguidance"): a constraint is turned
into an llguidance grammar, checked against the model's tokenizer once, and kept as a *template*
matcher in its start state. Every guided sequence gets a ``deep_copy`` of the template, which
costs microseconds, so 64 requests with one schema compile it once.

Compilation runs on a small thread pool (llguidance drops the GIL while it builds), so the engine
loop keeps stepping other requests while a large schema compiles; ``submit`` returns a future.
"""

from __future__ import annotations

import json
import logging
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from pagedllm.core.guided_params import GuidedDecodingParams

logger = logging.getLogger(__name__)

_ANY_JSON_OBJECT: dict[str, Any] = {"type": "object"}
# Compact JSON with one space after separators (as json.dumps writes it): no free whitespace,
# which a model could otherwise fill forever before the next key.
_JSON_OPTIONS: dict[str, Any] = {
    "whitespace_flexible": False,
    "item_separator": ", ",
    "key_separator": ": ",
}


class CompiledGrammar:
    """One constraint compiled for one tokenizer: hands out fresh matchers in the start state."""

    def __init__(self, template: Any) -> None:
        self._template = template

    def new_matcher(self) -> Any:
        return self._template.deep_copy()


def grammar_text(guided: GuidedDecodingParams) -> str:
    """The llguidance grammar for a constraint; a ValueError naming the field if it is invalid."""
    import llguidance

    kind = guided.kind
    try:
        if kind == "json":
            schema = guided.json if isinstance(guided.json, dict) else {}
            if guided.json is False:
                raise ValueError("the schema false accepts nothing")
            return llguidance.LLMatcher.grammar_from_json_schema(
                json.dumps(schema), defaults=_JSON_OPTIONS
            )
        if kind == "json_object":
            return llguidance.LLMatcher.grammar_from_json_schema(
                json.dumps(_ANY_JSON_OBJECT), defaults=_JSON_OPTIONS
            )
        if kind == "regex":
            return llguidance.LLMatcher.grammar_from_regex(guided.regex or "")
        if kind == "choice":
            return llguidance.grammar_from("choice", json.dumps(guided.choice))
        return llguidance.grammar_from("grammar", guided.grammar or "")
    except ValueError as exc:
        raise ValueError(f"guided_decoding.{kind}: {exc}") from exc


class GrammarCompiler:
    """Caches compiled grammars per constraint and compiles them on a thread pool.

    The tokenizer conversion (about a second for a large vocabulary) happens once, on the pool,
    the first time a constraint is submitted.
    """

    def __init__(
        self,
        tokenizer: Any,
        *,
        vocab_size: int,
        eos_token_ids: set[int],
        max_workers: int = 2,
        cache_size: int = 256,
    ) -> None:
        self._hf_tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._eos = sorted(eos_token_ids)
        self._pool = ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="grammar")
        self._lock = threading.Lock()
        self._cache: OrderedDict[tuple[str, str], Future[CompiledGrammar]] = OrderedDict()
        self._cache_size = cache_size
        self._tok_lock = threading.Lock()
        self._lltok: Any = None

    def _tokenizer(self) -> Any:
        # Called on pool threads only; the first one converts, the others wait for it.
        with self._tok_lock:
            if self._lltok is None:
                self._lltok = self._convert_tokenizer()
            return self._lltok

    def _convert_tokenizer(self) -> Any:
        import copy

        import llguidance

        tok = self._hf_tokenizer
        if tok is None:
            raise ValueError("guided_decoding: needs a tokenizer (skip_tokenizer_init is set)")
        # The mask covers the model's vocabulary (rows past the tokenizer's stay disallowed).
        n_vocab = max(self.vocab_size, len(tok))
        eos: Any = self._eos if self._eos else tok.eos_token_id
        # What llguidance.hf.from_tokenizer does, from the backend that transformers' fast
        # tokenizer and pagedllm's own both hold (that helper accepts transformers' class only,
        # and importing it imports transformers).
        backend = copy.copy(tok.backend_tokenizer)
        backend.no_padding()
        backend.no_truncation()
        return llguidance.LLTokenizer(backend.to_str(), n_vocab=n_vocab, eos_token=eos)

    def submit(self, guided: GuidedDecodingParams) -> Future[CompiledGrammar]:
        """The (possibly already finished) compilation of ``guided``; failures are ValueErrors."""
        key = guided.key()
        with self._lock:
            fut = self._cache.get(key)
            if fut is not None:
                self._cache.move_to_end(key)
                return fut
            fut = self._pool.submit(self._compile, guided)
            self._cache[key] = fut
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        return fut

    def compile(self, guided: GuidedDecodingParams) -> CompiledGrammar:
        """Blocking form of ``submit``: raises the ValueError if the constraint is invalid."""
        return self.submit(guided).result()

    def _compile(self, guided: GuidedDecodingParams) -> CompiledGrammar:
        import llguidance

        text = grammar_text(guided)
        matcher = llguidance.LLMatcher(self._tokenizer(), text, log_level=0)
        if matcher.is_error():
            raise ValueError(f"guided_decoding.{guided.kind}: {matcher.get_error()}")
        return CompiledGrammar(matcher)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

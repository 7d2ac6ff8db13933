"""Structured output on the OpenAI endpoints: request fields -> one constraint, checked up front.

``response_format`` (``json_object``, ``json_schema``) and vLLM's ``guided_json``,
``guided_regex``, ``guided_choice`` and ``guided_grammar`` all become one
``GuidedDecodingParams``; two at once is a 400 naming the second. The constraint is compiled here,
in the server, before the request reaches the engine (and before any stream starts), so an invalid
schema, regex or grammar is a 400 naming the parameter that carried it. The compiler keeps its own
cache and thread pool and needs only the tokenizer, so this check does not depend on where the
engine runs; compiling with llguidance takes milliseconds, so doing it on both sides is cheap.
"""

from __future__ import annotations

import asyncio
from typing import Any

from pagedllm.core.guided_params import GuidedDecodingParams
from pagedllm.entrypoints.openai.errors import APIError
from pagedllm.entrypoints.openai.protocol import SamplingFields

_GUIDED_FIELDS = {
    "guided_json": "json",
    "guided_regex": "regex",
    "guided_choice": "choice",
    "guided_grammar": "grammar",
}


def _response_format(fmt: dict[str, Any]) -> GuidedDecodingParams | None:
    kind = fmt.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return GuidedDecodingParams(json_object=True)
    if kind == "json_schema":
        spec = fmt.get("json_schema")
        if not isinstance(spec, dict):
            raise APIError(
                "response_format: json_schema must be an object with a 'schema'",
                param="response_format",
            )
        schema = spec.get("schema", {})
        if not isinstance(schema, dict):
            raise APIError(
                "response_format: json_schema.schema must be a JSON schema object",
                param="response_format",
            )
        return GuidedDecodingParams(json=schema)
    raise APIError(
        f"response_format: type must be 'text', 'json_object' or 'json_schema', got {kind!r}",
        param="response_format",
    )


def guided_from_request(req: SamplingFields) -> tuple[GuidedDecodingParams | None, str | None]:
    """The request's one constraint and the parameter that carried it (None, None if none)."""
    found: list[tuple[GuidedDecodingParams, str]] = []
    if req.response_format is not None:
        try:
            g = _response_format(req.response_format)
        except ValueError as exc:
            raise APIError(f"response_format: {exc}", param="response_format") from exc
        if g is not None:
            found.append((g, "response_format"))
    for field, kind in _GUIDED_FIELDS.items():
        value = getattr(req, field)
        if value is None:
            continue
        try:
            found.append((GuidedDecodingParams(**{kind: value}), field))
        except ValueError as exc:
            raise APIError(f"{field}: {exc}", param=field) from exc
    if len(found) > 1:
        names = [p for _, p in found]
        raise APIError(
            f"{names[1]}: only one of response_format, guided_json, guided_regex, guided_choice "
            f"and guided_grammar may be given, got {names}",
            param=names[1],
        )
    return found[0] if found else (None, None)


class GuidedValidator:
    """Compiles constraints in the server process (cached) to refuse bad ones with a 400."""

    def __init__(self, tokenizer: Any, vocab_size: int) -> None:
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._compiler: Any = None
        self._lock = asyncio.Lock()

    def _build(self) -> Any:
        from pagedllm.structured.compiler import GrammarCompiler

        eos = getattr(self._tokenizer, "eos_token_id", None)
        return GrammarCompiler(
            self._tokenizer,
            vocab_size=self._vocab_size,
            eos_token_ids=set() if eos is None else {int(eos)},
        )

    async def _get(self) -> Any:
        """The compiler, built once in a thread: its tokenizer setup takes a few hundred ms on
        a 32k vocabulary, which must not freeze the event loop on the first guided request."""
        async with self._lock:
            if self._compiler is None:
                self._compiler = await asyncio.to_thread(self._build)
        return self._compiler

    async def check(self, guided: GuidedDecodingParams | None, param: str | None) -> None:
        if guided is None:
            return
        try:
            await asyncio.wrap_future((await self._get()).submit(guided))
        except ValueError as exc:
            raise APIError(f"{param}: {exc}", param=param) from exc

    def shutdown(self) -> None:
        if self._compiler is not None:
            self._compiler.shutdown()

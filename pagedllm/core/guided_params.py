"""What a request's output must match: a JSON schema, any JSON object, a regex, a choice, a grammar.

A plain dataclass of JSON-able values, so a ``SamplingParams`` that carries it can be serialised
generically (to another process, to JSON). Only the shape of the request is checked here; whether
the schema, regex or grammar compiles is the grammar library's verdict (``pagedllm.structured``),
which names the same field.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from typing import Any

GUIDED_KINDS = ("json", "json_object", "regex", "choice", "grammar")
MAX_SPEC_CHARS = 1 << 20  # one MiB of schema, regex or grammar text
MAX_CHOICES = 4096


def _fail(name: str, message: str) -> None:
    raise ValueError(f"guided_decoding.{name}: {message}")


@dataclass
class GuidedDecodingParams:
    """Exactly one of the kinds is set.

    ``json`` is a JSON schema (a dict or its JSON text; stored as a dict), ``json_object`` asks for
    any JSON object, ``regex`` a regular expression the whole output matches, ``choice`` a list of
    strings the output equals one of, ``grammar`` a Lark/EBNF or GBNF grammar.
    """

    json: dict[str, Any] | bool | None = None
    json_object: bool | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None

    def __post_init__(self) -> None:
        if self.json_object is False:
            self.json_object = None
        if isinstance(self.json, str):
            try:
                self.json = json.loads(self.json)
            except (ValueError, RecursionError) as exc:
                _fail("json", f"is not valid JSON ({exc})")
        chosen = [k for k in GUIDED_KINDS if getattr(self, k) is not None]
        if len(chosen) != 1:
            raise ValueError(
                "guided_decoding: exactly one of json, json_object, regex, choice, grammar "
                f"must be set, got {chosen or 'none'}"
            )
        self._check(chosen[0])

    def _check(self, kind: str) -> None:
        value = getattr(self, kind)
        if kind == "json":
            if not isinstance(value, (dict, bool)):
                _fail("json", f"must be a JSON schema object, got {type(value).__name__}")
            if len(json.dumps(value)) > MAX_SPEC_CHARS:
                _fail("json", f"at most {MAX_SPEC_CHARS} characters")
        elif kind == "json_object":
            if value is not True:
                _fail("json_object", "must be true")
        elif kind == "choice":
            if not isinstance(value, (list, tuple)) or not value:
                _fail("choice", "must be a non-empty list of strings")
            if len(value) > MAX_CHOICES:
                _fail("choice", f"at most {MAX_CHOICES} choices")
            if not all(isinstance(c, str) and c for c in value):
                _fail("choice", "must be a list of non-empty strings")
            self.choice = list(value)
        else:
            if not isinstance(value, str) or not value:
                _fail(kind, "must be a non-empty string")
            if len(value) > MAX_SPEC_CHARS:
                _fail(kind, f"at most {MAX_SPEC_CHARS} characters")

    @property
    def kind(self) -> str:
        return next(k for k in GUIDED_KINDS if getattr(self, k) is not None)

    def key(self) -> tuple[str, str]:
        """A hashable identity of the constraint: the compile cache's key."""
        kind = self.kind
        value = getattr(self, kind)
        return kind, json.dumps(value, sort_keys=True) if kind in ("json", "choice") else str(value)

    def to_dict(self) -> dict[str, Any]:
        return {k: v for k, v in asdict(self).items() if v is not None}

    @classmethod
    def coerce(cls, value: Any) -> GuidedDecodingParams | None:
        """Accept the dataclass itself, its dict form (after a generic round trip), or None."""
        if value is None or isinstance(value, cls):
            return value
        if isinstance(value, dict):
            unknown = set(value) - set(GUIDED_KINDS)
            if unknown:
                raise ValueError(f"guided_decoding: unknown fields {sorted(unknown)}")
            return cls(**value)
        raise ValueError(
            f"guided_decoding: must be a GuidedDecodingParams or a dict, got {type(value).__name__}"
        )

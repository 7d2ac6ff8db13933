"""``speculative_config``: what to propose and how many tokens; validated once, at the edge.

Standard library only: ``config.py`` and the scheduler read it without importing torch.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from typing import Any

METHODS = ("ngram", "draft_model")
MAX_SPECULATIVE_TOKENS = 32


def _fail(name: str, message: str) -> None:
    raise ValueError(f"speculative_config.{name}: {message}")


def _int_field(value: Any, name: str, low: int, high: int) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
        _fail(name, f"must be an integer in [{low}, {high}], got {value!r}")
    return int(value)


@dataclass(frozen=True)
class SpeculativeConfig:
    """``method`` "ngram": the next tokens are looked up in the sequence's own earlier tokens
    (the longest trailing n-gram of ``prompt_lookup_max`` .. ``prompt_lookup_min`` tokens that
    occurred before); "draft_model": a smaller model ``model`` of the same vocabulary proposes
    greedily. Either way the target verifies ``num_speculative_tokens`` proposals per step.
    """

    method: str
    num_speculative_tokens: int
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 1
    model: str | None = None  # draft model folder (method "draft_model")

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            _fail("method", f"must be one of {METHODS}, got {self.method!r}")
        _int_field(self.num_speculative_tokens, "num_speculative_tokens", 1, MAX_SPECULATIVE_TOKENS)
        _int_field(self.prompt_lookup_min, "prompt_lookup_min", 1, 1 << 10)
        _int_field(self.prompt_lookup_max, "prompt_lookup_max", self.prompt_lookup_min, 1 << 10)
        if self.method == "draft_model" and not (isinstance(self.model, str) and self.model):
            _fail("model", "the draft model's folder is required for method 'draft_model'")
        if self.method == "ngram" and self.model is not None:
            _fail("model", "is only read by method 'draft_model'")

    @property
    def uses_draft_model(self) -> bool:
        return self.method == "draft_model"


def parse_speculative_config(value: Any) -> SpeculativeConfig | None:
    """A dict, a JSON object string (the CLI's ``--speculative-config``) or None."""
    if value is None or isinstance(value, SpeculativeConfig):
        return value
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise ValueError(f"speculative_config: not valid JSON ({exc})") from exc
    if not isinstance(value, dict):
        raise ValueError(
            f"speculative_config: must be a JSON object or dict, got {type(value).__name__}"
        )
    known = {f.name for f in fields(SpeculativeConfig)}
    unknown = sorted(set(value) - known)
    if unknown:
        _fail(unknown[0], f"unknown field; known ones are {sorted(known)}")
    if "method" not in value:
        _fail("method", f"is required (one of {METHODS})")
    if "num_speculative_tokens" not in value:
        _fail("num_speculative_tokens", "is required (a positive integer)")
    return SpeculativeConfig(**value)

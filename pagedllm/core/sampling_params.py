"""Per-request sampling parameters, validated up front so bad input never reaches the batch."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from typing import Any

from pagedllm.core.guided_params import GuidedDecodingParams

_GREEDY_EPS = 1e-5
# Bounds that hold whatever the model: a request past them is refused before it reaches a batch,
# where a value too big for a C integer or a float would fail the step of everyone batched with it.
MAX_INT = 2**63 - 1  # every integer field fits a signed 64-bit integer
SEED_RANGE = (-(2**63), 2**64)  # what a 64-bit generator seed can hold
MAX_LOGIT_BIAS = 100.0
MAX_TEMPERATURE = 100.0
MAX_REPETITION_PENALTY = 2.0
MAX_STOP_STRINGS = 32
MAX_STOP_CHARS = 512
MAX_TOKEN_ID_LIST = 4096  # stop_token_ids, logit_bias entries


def _fail(name: str, message: str) -> None:
    raise ValueError(f"{name}: {message}")


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


@dataclass
class SamplingParams:
    """The vLLM-compatible sampling surface.

    ``temperature == 0`` means greedy. ``top_k`` of -1 (or 0) and ``top_p`` of 1 disable those
    filters. ``seed`` makes one request's randomness independent of what else is batched with it.
    """

    n: int = 1
    best_of: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    seed: int | None = None
    use_beam_search: bool = False
    length_penalty: float = 1.0
    early_stopping: bool | str = False
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    # Constrained decoding (structured output); a dict is accepted and converted.
    guided_decoding: GuidedDecodingParams | None = None
    # Speculative decoding (when the engine has it): False decodes this request one token a step.
    allow_speculation: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        for name in ("stop", "stop_token_ids"):
            value = getattr(self, name) or []
            if not isinstance(value, (list, tuple)):
                _fail(name, f"must be a list, got {type(value).__name__}")
            setattr(self, name, list(value))
        if self.best_of is None:
            self.best_of = self.n
        if self.top_k == 0:
            self.top_k = -1
        if self.logit_bias is not None:
            try:
                self.logit_bias = {int(k): float(v) for k, v in self.logit_bias.items()}
            except (TypeError, ValueError, AttributeError, OverflowError):
                _fail("logit_bias", "must map token ids to numbers")
        self.guided_decoding = GuidedDecodingParams.coerce(self.guided_decoding)
        self._validate()

    def _validate(self) -> None:
        self._check_ints()
        self._check_floats()
        self._check_lists()
        if self.use_beam_search:
            if self.guided_decoding is not None:
                _fail("guided_decoding", "is not supported with beam search")
            if self.best_of < 2:  # type: ignore[operator]
                _fail("best_of", "must be at least 2 with beam search")
            if self.temperature > _GREEDY_EPS:
                _fail("temperature", "must be 0 with beam search")
            if self.top_p < 1.0 or self.top_k != -1 or self.min_p > 0:
                _fail("top_p", "top_p, top_k and min_p must be off with beam search")
            if self.early_stopping not in (True, False, "never"):
                _fail("early_stopping", "must be True, False or 'never'")
        elif self.early_stopping is not False:
            _fail("early_stopping", "applies only to beam search")
        elif self.length_penalty != 1.0:
            _fail("length_penalty", "applies only to beam search")
        elif self.temperature < _GREEDY_EPS and self.best_of > 1:  # type: ignore[operator]
            _fail("best_of", "must be 1 when sampling greedily (temperature 0)")

    def _check_lists(self) -> None:
        if len(self.stop) > MAX_STOP_STRINGS:
            _fail("stop", f"at most {MAX_STOP_STRINGS} stop strings, got {len(self.stop)}")
        for s in self.stop:
            if not isinstance(s, str) or not s:
                _fail("stop", "must be non-empty strings")
            if len(s) > MAX_STOP_CHARS:
                _fail("stop", f"each stop string is at most {MAX_STOP_CHARS} characters")
        if len(self.stop_token_ids) > MAX_TOKEN_ID_LIST:
            _fail("stop_token_ids", f"at most {MAX_TOKEN_ID_LIST} token ids")
        if not all(_is_int(t) and 0 <= t <= MAX_INT for t in self.stop_token_ids):
            _fail("stop_token_ids", "must be non-negative integers")
        bias = self.logit_bias or {}
        if len(bias) > MAX_TOKEN_ID_LIST:
            _fail("logit_bias", f"at most {MAX_TOKEN_ID_LIST} entries")
        if not all(0 <= k <= MAX_INT for k in bias):
            _fail("logit_bias", "keys must be non-negative token ids")

    def _check_ints(self) -> None:
        is_int = _is_int

        if not is_int(self.n) or not 1 <= self.n <= MAX_INT:
            _fail("n", f"must be an integer >= 1, got {self.n!r}")
        best_of = self.best_of
        if not is_int(best_of) or not self.n <= best_of <= MAX_INT:  # type: ignore[operator]
            _fail("best_of", f"must be an integer >= n ({self.n}), got {self.best_of!r}")
        if not is_int(self.top_k) or not -1 <= self.top_k <= MAX_INT:
            _fail("top_k", f"must be -1 (off) or a positive integer, got {self.top_k!r}")
        if self.max_tokens is not None and (
            not is_int(self.max_tokens) or not 1 <= self.max_tokens <= MAX_INT
        ):
            _fail("max_tokens", f"must be an integer >= 1, got {self.max_tokens!r}")
        if not is_int(self.min_tokens) or not 0 <= self.min_tokens <= MAX_INT:
            _fail("min_tokens", f"must be an integer >= 0, got {self.min_tokens!r}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            _fail("min_tokens", f"must be <= max_tokens ({self.max_tokens})")
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            if v is not None and (not is_int(v) or not 0 <= v <= MAX_INT):
                _fail(name, f"must be an integer >= 0, got {v!r}")
        if self.seed is not None and not (
            is_int(self.seed) and SEED_RANGE[0] <= self.seed < SEED_RANGE[1]
        ):
            _fail("seed", f"must be an integer that fits in 64 bits, got {self.seed!r}")

    def _check_floats(self) -> None:
        def finite(name: str) -> float:
            v = getattr(self, name)
            try:
                ok = not isinstance(v, bool) and math.isfinite(float(v))
            except (TypeError, ValueError, OverflowError):
                ok = False
            if not ok or not isinstance(v, (int, float)):
                _fail(name, f"must be a finite number, got {v!r}")
            return float(v)

        if not 0 <= finite("temperature") <= MAX_TEMPERATURE:
            _fail("temperature", f"must be in [0, {MAX_TEMPERATURE:g}], got {self.temperature}")
        if not 0.0 < finite("top_p") <= 1.0:
            _fail("top_p", f"must be in (0, 1], got {self.top_p}")
        if not 0.0 <= finite("min_p") <= 1.0:
            _fail("min_p", f"must be in [0, 1], got {self.min_p}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= finite(name) <= 2.0:
                _fail(name, f"must be in [-2, 2], got {getattr(self, name)}")
        if not 0 < finite("repetition_penalty") <= MAX_REPETITION_PENALTY:
            _fail(
                "repetition_penalty",
                f"must be in (0, {MAX_REPETITION_PENALTY:g}], got {self.repetition_penalty}",
            )
        finite("length_penalty")
        for v in (self.logit_bias or {}).values():
            if not (math.isfinite(v) and -MAX_LOGIT_BIAS <= v <= MAX_LOGIT_BIAS):
                _fail("logit_bias", f"values must be in [-100, 100], got {v}")

    @property
    def is_greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS

    @property
    def needs_token_history(self) -> bool:
        """Penalties look at the tokens generated (and prompted) so far."""
        return (
            self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
        )

    def clone(self, **changes: Any) -> SamplingParams:
        values = {f.name: getattr(self, f.name) for f in fields(self)}
        values.update(changes)
        return SamplingParams(**values)

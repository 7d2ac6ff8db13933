"""Per-request sampling parameters, validated up front so bad input never reaches the batch."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from typing import Any

_GREEDY_EPS = 1e-5


def _fail(name: str, message: str) -> None:
    raise ValueError(f"{name}: {message}")


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

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.best_of is None:
            self.best_of = self.n
        if self.top_k == 0:
            self.top_k = -1
        if self.logit_bias is not None:
            try:
                self.logit_bias = {int(k): float(v) for k, v in self.logit_bias.items()}
            except (TypeError, ValueError, AttributeError):
                _fail("logit_bias", "must map token ids to numbers")
        self._validate()

    def _validate(self) -> None:
        self._check_ints()
        self._check_floats()
        if not all(isinstance(s, str) and s for s in self.stop):
            _fail("stop", "must be non-empty strings")
        if not all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids):
            _fail("stop_token_ids", "must be non-negative integers")
        if self.use_beam_search:
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

    def _check_ints(self) -> None:
        def is_int(v: Any) -> bool:
            return isinstance(v, int) and not isinstance(v, bool)

        if not is_int(self.n) or self.n < 1:
            _fail("n", f"must be an integer >= 1, got {self.n!r}")
        if not is_int(self.best_of) or self.best_of < self.n:  # type: ignore[operator]
            _fail("best_of", f"must be an integer >= n ({self.n}), got {self.best_of!r}")
        if not is_int(self.top_k) or self.top_k < -1:
            _fail("top_k", f"must be -1 (off) or a positive integer, got {self.top_k!r}")
        if self.max_tokens is not None and (not is_int(self.max_tokens) or self.max_tokens < 1):
            _fail("max_tokens", f"must be an integer >= 1, got {self.max_tokens!r}")
        if not is_int(self.min_tokens) or self.min_tokens < 0:
            _fail("min_tokens", f"must be an integer >= 0, got {self.min_tokens!r}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            _fail("min_tokens", f"must be <= max_tokens ({self.max_tokens})")
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            if v is not None and (not is_int(v) or v < 0):
                _fail(name, f"must be an integer >= 0, got {v!r}")
        if self.seed is not None and not is_int(self.seed):
            _fail("seed", f"must be an integer, got {self.seed!r}")

    def _check_floats(self) -> None:
        def finite(name: str) -> float:
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                _fail(name, f"must be a finite number, got {v!r}")
            return float(v)

        if finite("temperature") < 0:
            _fail("temperature", f"must be >= 0, got {self.temperature}")
        if not 0.0 < finite("top_p") <= 1.0:
            _fail("top_p", f"must be in (0, 1], got {self.top_p}")
        if not 0.0 <= finite("min_p") <= 1.0:
            _fail("min_p", f"must be in [0, 1], got {self.min_p}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= finite(name) <= 2.0:
                _fail(name, f"must be in [-2, 2], got {getattr(self, name)}")
        if finite("repetition_penalty") <= 0:
            _fail("repetition_penalty", f"must be > 0, got {self.repetition_penalty}")
        finite("length_penalty")
        if self.logit_bias and not all(math.isfinite(v) for v in self.logit_bias.values()):
            _fail("logit_bias", "values must be finite")

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

"""The periodic throughput line of a busy engine (vLLM's format)."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

logger = logging.getLogger("pagedllm.engine.async_engine")


@dataclass
class StatLogger:
    """A vLLM-style throughput line every ``interval`` seconds while the engine is busy."""

    interval: float = 5.0
    last_time: float = field(default_factory=time.monotonic)
    last_prompt: float = 0.0
    last_gen: float = 0.0

    def maybe_log(self, stats: dict[str, float], now: float | None = None) -> str | None:
        now = time.monotonic() if now is None else now
        elapsed = now - self.last_time
        if elapsed < self.interval:
            return None
        prompt, gen = stats["prompt_tokens_total"], stats["generation_tokens_total"]
        busy = (
            stats["num_requests_running"]
            or stats["num_requests_waiting"]
            or stats["num_requests_swapped"]
            or prompt != self.last_prompt
            or gen != self.last_gen
        )
        line = None
        if busy:
            line = (
                f"Avg prompt throughput: {(prompt - self.last_prompt) / elapsed:.1f} tokens/s, "
                f"Avg generation throughput: {(gen - self.last_gen) / elapsed:.1f} tokens/s, "
                f"Running: {int(stats['num_requests_running'])} reqs, "
                f"Swapped: {int(stats['num_requests_swapped'])} reqs, "
                f"Pending: {int(stats['num_requests_waiting'])} reqs, "
                f"KV cache usage: {100 * stats['kv_cache_usage_perc']:.1f}%"
            )
            logger.info(line)
        self.last_time, self.last_prompt, self.last_gen = now, prompt, gen
        return line

"""Heavy per-request work off the event loop, within limits, and memory handed back after.

Tokenizing, rendering a chat template and detokenizing are CPU work that can take seconds on a
big input; on the event loop they froze /health and every stream (a 30 MB prompt: 19 s). They
run in a small thread pool instead. A thread does not make them free: the tokenizer holds the GIL
for part of its work (measured: about 0.15 s per million characters), so the limits below keep
any single job short enough that the loop keeps answering within a few tens of milliseconds:
prompt characters (413 beyond), prompt token ids (400 beyond) and /detokenize ids (413 beyond).
After a large request the allocator's free pages go back to the system (``malloc_trim``).
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import ctypes.util
import logging
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

from pagedllm.entrypoints.openai.errors import APIError

logger = logging.getLogger(__name__)
T = TypeVar("T")

_TRIM_AFTER_CHARS = 1 << 20  # a request this large (characters or ids) trims afterwards


@dataclass(frozen=True)
class RequestLimits:
    """Per-request sizes the server accepts; the defaults keep a 2-core machine responsive."""

    max_prompt_chars: int = 256 * 1024  # tokenizing this takes ~1 s in a thread, GIL slices <50 ms
    max_prompt_tokens: int = 128 * 1024  # token-id prompts, checked before any per-id work
    max_detokenize_tokens: int = 64 * 1024

    def __post_init__(self) -> None:
        for name in ("max_prompt_chars", "max_prompt_tokens", "max_detokenize_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be at least 1, got {getattr(self, name)}")

    def check_chars(self, num_chars: int, param: str) -> None:
        if num_chars > self.max_prompt_chars:
            raise APIError(
                f"{param}: {num_chars} characters, more than this server accepts "
                f"({self.max_prompt_chars}, --max-prompt-chars)",
                status=413,
                param=param,
                code="prompt_too_large",
            )

    def check_tokens(self, num_tokens: int, param: str) -> None:
        if num_tokens > self.max_prompt_tokens:
            raise APIError(
                f"{param}: {num_tokens} token ids, more than this server accepts "
                f"({self.max_prompt_tokens}, --max-prompt-tokens)",
                param=param,
                code="prompt_too_large",
            )

    def check_detokenize(self, num_tokens: int) -> None:
        if num_tokens > self.max_detokenize_tokens:
            raise APIError(
                f"tokens: {num_tokens} ids, more than /detokenize accepts "
                f"({self.max_detokenize_tokens}, --max-detokenize-tokens)",
                status=413,
                param="tokens",
                code="request_too_large",
            )


class Offloader:
    """A thread pool for tokenizer work and the memory trim after large requests."""

    def __init__(self, max_workers: int = 2) -> None:
        self.pool = ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="pagedllm-tok")
        self._trim = _malloc_trim()

    async def run(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self.pool, lambda: fn(*args, **kwargs))

    def trim_later(self, size: int) -> None:
        """After a request of ``size`` characters or ids: give freed memory back (in the pool)."""
        if size >= _TRIM_AFTER_CHARS and self._trim is not None:
            with contextlib.suppress(RuntimeError):  # the pool is shut down
                self.pool.submit(self._trim, 0)

    def shutdown(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)


def _malloc_trim() -> Callable[[int], int] | None:
    """glibc's ``malloc_trim`` (None elsewhere): freed arenas back to the OS, not kept for reuse."""
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        fn = ctypes.CDLL(name).malloc_trim
    except (OSError, AttributeError):
        return None
    fn.argtypes, fn.restype = [ctypes.c_size_t], ctypes.c_int
    return fn

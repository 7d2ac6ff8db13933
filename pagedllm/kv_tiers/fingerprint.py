"""Which model and settings a disk tier's blocks belong to.

A block file holds keys and values as one model computed them, so it may only be read by the
same model under the same settings. The fingerprint hashes everything the contents depend on:

* the weights, by identity rather than by content: each checkpoint file's name and size and a
  BLAKE2b of its first and last MiB plus 16 windows of 64 KiB spread over it. Hashing whole
  checkpoints would cost seconds to minutes at every start; the sampled bytes cover the
  safetensors/GGUF header (every tensor's name, shape, dtype and offset) and data from every
  part of the file, so a fine-tune, another quantisation or another shard layout changes it.
  (A change confined to bytes between the windows of a same-sized file would not; the config
  and tokenizer hashes below still catch a swapped model folder.) Modification times are left
  out, so a copied checkpoint keeps its cache;
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
from dataclasses import dataclass
from pathlib import Path
from typing import Any

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
_EDGE = 1 << 20
_WINDOW = 64 << 10
_NUM_WINDOWS = 16


@dataclass(frozen=True)
class Fingerprint:
    digest: str  # 32 hex digits: the folder's name
    fields: dict[str, Any]  # what went into it (meta.json, `pagedllm kv-cache ls`)


def sampled_file_hash(path: Path) -> str:
    """BLAKE2b of a file's first and last MiB and 16 evenly spread 64 KiB windows, with its size."""
    size = path.stat().st_size
    h = hashlib.blake2b(size.to_bytes(8, "little"), digest_size=16)
    with open(path, "rb") as f:
        if size <= 2 * _EDGE + _NUM_WINDOWS * _WINDOW:
            h.update(f.read())
            return h.hexdigest()
        h.update(f.read(_EDGE))
        for i in range(1, _NUM_WINDOWS + 1):
            f.seek(size * i // (_NUM_WINDOWS + 1))
            h.update(f.read(_WINDOW))
        f.seek(size - _EDGE)
        h.update(f.read(_EDGE))
    return h.hexdigest()


def _content_hash(path: Path) -> str:
    return hashlib.blake2b(path.read_bytes(), digest_size=16).hexdigest()


def weights_identity(model: str) -> list[dict[str, Any]]:
    """Name, size and sampled hash of each checkpoint file (a folder's, or one GGUF file)."""
    path = Path(model)
    if path.is_file():
        files = [path]
    else:
        files = sorted(p for p in path.iterdir() if p.is_file() and p.suffix in _WEIGHT_SUFFIXES)
    out = [
        {"name": p.name, "size": p.stat().st_size, "sample": sampled_file_hash(p)} for p in files
    ]
    if path.is_dir():
        for name in _MODEL_FILES:
            if (path / name).is_file():
                out.append({"name": name, "content": _content_hash(path / name)})
    return out


def tokenizer_identity(tokenizer: str) -> list[dict[str, str]]:
    path = Path(tokenizer)
    if path.is_file():  # a GGUF file carries its tokenizer
        return [{"name": path.name, "sample": sampled_file_hash(path)}]
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
) -> Fingerprint:
    """The fingerprint of ``model`` + ``tokenizer`` under ``settings`` (dtypes, geometry...).

    ``settings`` holds plain JSON values; ``model`` and ``tokenizer`` are hashed as the module
    doc says. The model's path itself is kept for display only, never hashed, so a moved
    checkpoint keeps its cache.
    """
    fields: dict[str, Any] = {
        "format": FORMAT_VERSION,
        **settings,
        "weights": weights_identity(model),
        "tokenizer": tokenizer_identity(tokenizer),
    }
    blob = json.dumps(fields, sort_keys=True).encode()
    digest = hashlib.blake2b(blob, digest_size=16).hexdigest()
    return Fingerprint(digest, {**fields, "model_path": str(Path(model).resolve())})

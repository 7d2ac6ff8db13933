"""What ``pagedllm inspect FILE`` prints: the checks an engine start makes of a GGUF file, run
without loading anything, and a summary of what the file holds; or the first problem.

GGUF carries no checksum of its tensor data: a flipped byte in a weight passes every check
here (the structure and hyper-parameters are intact) and loads. ``verify_sha256`` hashes the
whole file against a digest its publisher gave.
"""

from __future__ import annotations

import hashlib
from collections import Counter
from pathlib import Path

from pagedllm.models.gguf.checks import check_model, check_tokenizer
from pagedllm.models.gguf.config import config_values
from pagedllm.models.gguf.plan import check_types
from pagedllm.models.gguf.reader import GGUFFile, GGUFFileError

_SHOWN_KEYS = (
    "context_length",
    "embedding_length",
    "block_count",
    "feed_forward_length",
    "attention.head_count",
    "attention.head_count_kv",
    "attention.key_length",
    "rope.freq_base",
    "attention.layer_norm_rms_epsilon",
    "expert_count",
    "expert_used_count",
)


def describe(path: Path, verify_sha256: str | None = None) -> list[str]:
    """Lines describing the file; ``GGUFFileError`` (one line) for the first problem."""
    gguf = GGUFFile(path)
    check_types(gguf)
    check_model(gguf)
    check_tokenizer(gguf)
    family, _ = config_values(gguf)  # what the config needs beyond the checks (rope, experts)
    arch = gguf.architecture
    version = gguf.metadata("GGUF.version", "?")
    lines = [
        f"{path}: GGUF v{version}, {gguf.file_size:,} bytes, {arch} "
        f"(runs as {family.architecture})",
    ]
    name = gguf.metadata("general.name", None)
    if isinstance(name, str) and name:
        lines.append(f"name: {name}")
    types = Counter(t.type_name for t in gguf.tensors.values())
    by_type = ", ".join(f"{n} {t}" for t, n in sorted(types.items(), key=lambda kv: -kv[1]))
    lines.append(f"tensors: {len(gguf.tensors)} ({by_type})")
    values = []
    for key in _SHOWN_KEYS:
        value = gguf.metadata(f"{arch}.{key}", None)
        if value is not None:
            values.append(f"{key} {value}")
    lines.append("hyper-parameters: " + ", ".join(values))
    lines.append(_tokenizer_line(gguf))
    template = gguf.metadata("tokenizer.chat_template", None)
    if isinstance(template, str) and template.strip():
        first = template.strip().splitlines()[0]
        lines.append(f"chat template: {first[:100]}{'...' if len(first) > 100 else ''}")
    else:
        lines.append("chat template: none")
    if verify_sha256 is not None:
        lines.append(_verify(path, verify_sha256))
    return lines


def _tokenizer_line(gguf: GGUFFile) -> str:
    tokens = gguf.array_length("tokenizer.ggml.tokens")
    if tokens is None:
        return "tokenizer: none (pass tokenizer=<a tokenizer folder>)"
    model = gguf.metadata("tokenizer.ggml.model", "?")
    parts = [f"tokenizer: {model}", f"{tokens} tokens"]
    merges = gguf.array_length("tokenizer.ggml.merges")
    if merges is not None:
        parts.append(f"{merges} merges")
    for special in ("bos", "eos"):
        value = gguf.metadata(f"tokenizer.ggml.{special}_token_id", None)
        if value is not None:
            parts.append(f"{special} {value}")
    return ", ".join(parts)


def _verify(path: Path, expected: str) -> str:
    want = expected.strip().lower()
    if len(want) != 64 or any(c not in "0123456789abcdef" for c in want):
        raise GGUFFileError(f"{path}: --verify-sha256 {expected!r} is not 64 hex digits")
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    got = digest.hexdigest()
    if got != want:
        raise GGUFFileError(f"{path}: sha256 is {got}, not the expected {want}")
    return f"sha256: {got} (matches)"

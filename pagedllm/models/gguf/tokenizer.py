"""The tokenizer a GGUF file carries, as a transformers tokenizer, converted once and cached.

transformers builds a fast tokenizer from ``tokenizer.ggml.*`` (vocabulary, merges, token types,
special ids, chat template): the same conversion its own GGUF loading uses, so token ids match
the reference (a ``bert`` WordPiece vocabulary, which transformers does not convert, is built
by :mod:`.wordpiece`). The conversion reads the whole vocabulary through Python (seconds for a
49k or 128k vocabulary); its result is saved as ``tokenizer.json`` under the user's cache
folder, keyed by a hash of the file's metadata and the transformers version, and later starts
load that.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from pagedllm.models.gguf.reader import GGUFFile, GGUFFileError
from pagedllm.models.gguf.wordpiece import WORDPIECE_VERSION, wordpiece_tokenizer

logger = logging.getLogger(__name__)


def _cache_folder(gguf: GGUFFile) -> Path:
    import transformers

    from pagedllm.config import user_cache_dir

    digest = hashlib.sha256(gguf.metadata_bytes)
    digest.update(transformers.__version__.encode())
    if gguf.metadata("tokenizer.ggml.model", None) == "bert":  # our converter: its version too
        digest.update(WORDPIECE_VERSION.encode())
    return Path(user_cache_dir()) / "gguf-tokenizers" / digest.hexdigest()[:32]


def load_gguf_tokenizer(gguf: GGUFFile) -> Any:
    """The file's tokenizer; ``GGUFFileError`` naming the file when it has none."""
    from transformers import PreTrainedTokenizerFast

    if not gguf.has("tokenizer.ggml.tokens") or not gguf.has("tokenizer.ggml.model"):
        raise GGUFFileError(
            f"{gguf.path}: tokenizer.ggml.tokens is missing: the file carries no tokenizer "
            "(pass tokenizer=<a tokenizer folder>)"
        )
    cached = _cache_folder(gguf)
    if (cached / "tokenizer.json").exists():
        try:
            # The class it was converted as, not AutoTokenizer: resolving the class by name
            # imports transformers' auto mappings (~0.6 s of every start, more than the load).
            return PreTrainedTokenizerFast.from_pretrained(str(cached), local_files_only=True)
        except (OSError, ValueError) as exc:
            logger.warning("cached GGUF tokenizer in %s unreadable (%s); converting", cached, exc)
    if gguf.metadata("tokenizer.ggml.model") == "bert":  # WordPiece: transformers has none
        tokenizer = wordpiece_tokenizer(gguf)
        _save(tokenizer, cached)
        return tokenizer
    # Here, not at the top: the checks import the model's modules (torch), and a cached
    # tokenizer is loaded in a server's torch-free front process too.
    from pagedllm.models.gguf.checks import check_tokenizer

    check_tokenizer(gguf)  # a merge of unknown tokens: our line, not the library's exception
    try:
        # The fast-tokenizer class itself, not AutoTokenizer: that one first reads the model
        # config from the file and refuses architectures transformers cannot load (Gemma), while
        # the tokenizer depends only on tokenizer.ggml.model.
        tokenizer = PreTrainedTokenizerFast.from_pretrained(
            str(gguf.path.parent), gguf_file=gguf.path.name, local_files_only=True
        )
    except (OSError, ValueError, KeyError, TypeError, IndexError) as exc:
        raise GGUFFileError(
            f"{gguf.path}: tokenizer.ggml.* cannot be made into a tokenizer "
            f"({' '.join(str(exc).split())})"
        ) from exc
    _save(tokenizer, cached)
    return tokenizer


def _save(tokenizer: Any, folder: Path) -> None:
    """Write the converted tokenizer to a temporary folder, then rename it into place: a reader
    never sees half a tokenizer, and of two processes converting at once one rename wins. A
    cache that cannot be written only costs the conversion again next time."""
    tmp: Path | None = None
    try:
        folder.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=folder.parent, prefix=".tmp-"))
        tokenizer.save_pretrained(str(tmp))
        os.rename(tmp, folder)
        tmp = None
    except OSError as exc:
        logger.info("GGUF tokenizer not cached in %s (%s)", folder, exc)
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)

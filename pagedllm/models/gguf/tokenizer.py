"""The tokenizer a GGUF file carries: converted by transformers once, cached, then loaded
without it.

transformers builds a fast tokenizer from ``tokenizer.ggml.*`` (vocabulary, merges, token types,
special ids, chat template): the same conversion its own GGUF loading uses, so token ids match
the reference (a ``bert`` WordPiece vocabulary, which transformers does not convert, is built
by :mod:`.wordpiece`). The conversion reads the whole vocabulary through Python (seconds for a
49k or 128k vocabulary); its result is saved as ``tokenizer.json`` under the user's cache
folder, keyed by a hash of the file's metadata and the transformers version (read from its
package metadata, not by importing it), and later starts load that folder as
:class:`pagedllm.tokenization.tokenizer.Tokenizer`, over the ``tokenizers`` library alone
(``import transformers`` alone is ~1.3 s of a start), or as transformers' class where the saved
folder is not plain enough for it (the log says which).
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


def _transformers_version() -> str:
    """transformers' version from its installed metadata (a file read, not its ~1 s import)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("transformers")
    except PackageNotFoundError:
        return "none"


def _cache_folder(gguf: GGUFFile) -> Path:
    from pagedllm.config import user_cache_dir

    digest = hashlib.sha256(gguf.metadata_bytes)
    digest.update(_transformers_version().encode())
    if gguf.metadata("tokenizer.ggml.model", None) == "bert":  # our converter: its version too
        digest.update(WORDPIECE_VERSION.encode())
    return Path(user_cache_dir()) / "gguf-tokenizers" / digest.hexdigest()[:32]


def load_gguf_tokenizer(gguf: GGUFFile) -> Any:
    """The file's tokenizer; ``GGUFFileError`` naming the file when it has none."""
    if not gguf.has("tokenizer.ggml.tokens") or not gguf.has("tokenizer.ggml.model"):
        raise GGUFFileError(
            f"{gguf.path}: tokenizer.ggml.tokens is missing: the file carries no tokenizer "
            "(pass tokenizer=<a tokenizer folder>)"
        )
    cached = _cache_folder(gguf)
    if (cached / "tokenizer.json").exists():
        try:
            return load_cached_tokenizer(cached)
        except (OSError, ValueError) as exc:
            logger.warning("cached GGUF tokenizer in %s unreadable (%s); converting", cached, exc)
    if gguf.metadata("tokenizer.ggml.model") == "bert":  # WordPiece: transformers has none
        return _saved(wordpiece_tokenizer(gguf), cached)
    # Here, not at the top: the checks import the model's modules (torch), and a cached
    # tokenizer is loaded in a server's torch-free front process too.
    from transformers import PreTrainedTokenizerFast

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
    return _saved(tokenizer, cached)


def _saved(converted: Any, folder: Path) -> Any:
    """The conversion saved, then loaded back as every later start loads it (so the first
    start serves with the same class as the next ones); the converted object itself where the
    cache cannot be written or read."""
    _save(converted, folder)
    if (folder / "tokenizer.json").exists():
        try:
            return load_cached_tokenizer(folder)
        except (OSError, ValueError) as exc:
            logger.warning("cached GGUF tokenizer in %s unreadable (%s)", folder, exc)
    return converted


def load_cached_tokenizer(folder: Path) -> Any:
    """A converted tokenizer folder: pagedllm's own class where the folder is plain enough for
    it, else transformers' (the class it was converted as, not AutoTokenizer: resolving the
    class by name imports transformers' auto mappings, ~0.6 s more)."""
    from pagedllm.tokenization.loading import NotPlain, load_plain_tokenizer

    try:
        tokenizer = load_plain_tokenizer(folder)
    except NotPlain as why:
        logger.info("tokenizer: transformers' (%s: %s)", folder.name, why)
    else:
        logger.info("tokenizer: pagedllm's over the tokenizers library (%s)", folder.name)
        return tokenizer
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast.from_pretrained(str(folder), local_files_only=True)


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

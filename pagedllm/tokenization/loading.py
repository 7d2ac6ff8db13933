"""A tokenizer folder read as transformers' fast tokenizer reads it, or refused.

Whether a folder is plain enough to skip transformers, and the backend state transformers would
build from it, are decided once, at load; :class:`~.tokenizer.Tokenizer` then only answers
from that state. :func:`load_plain_tokenizer` reads a folder's ``tokenizer.json``,
``tokenizer_config.json`` and ``chat_template.jinja`` and builds the same backend state
transformers' fast tokenizer builds from them (its special tokens added to the backend where
missing, an empty post-processor replaced), so that ids, tokens and text are the library's own
answers. What it cannot express the same way (a tokenizer class of transformers with its own
set-up, truncation or padding in the file, legacy side files, model-specific special tokens,
Mistral's patched regex) it refuses with the reason, and the caller loads transformers'
tokenizer instead.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, processors
from tokenizers import Tokenizer as Backend

from pagedllm.tokenization.tokenizer import Tokenizer

SPECIAL_NAMES = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)
# transformers' tokenizer classes that load a tokenizer.json as it is (others rebuild it).
PLAIN_CLASSES = ("PreTrainedTokenizerFast", "TokenizersBackend")
# tokenizer_config.json keys with no effect beyond what Tokenizer does with them.
_PLAIN_KEYS = frozenset(
    {
        *SPECIAL_NAMES,
        "backend",
        "tokenizer_class",
        "is_local",
        "local_files_only",
        "name_or_path",
        "model_max_length",
        "extra_special_tokens",
        "additional_special_tokens",
        "chat_template",
        "clean_up_tokenization_spaces",
        "add_bos_token",  # ignored by transformers where tokenizer.json exists, as here
        "add_eos_token",
        "added_tokens_decoder",
        "model_input_names",
        "padding_side",
        "truncation_side",
        "split_special_tokens",
        "do_lower_case",  # recorded only: the normalizer in tokenizer.json does the lowering
    }
)
_MISTRAL_TYPES = ("mistral", "mistral3", "voxtral", "ministral", "pixtral")


class NotPlain(ValueError):
    """A tokenizer folder :class:`Tokenizer` does not load as transformers would; the text says
    why."""


def _read_config(folder: Path) -> dict[str, Any]:
    try:
        config = json.loads((folder / "tokenizer_config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise NotPlain(f"tokenizer_config.json unreadable ({exc})") from None
    if not isinstance(config, dict):
        raise NotPlain("tokenizer_config.json is not an object")
    cls = config.get("tokenizer_class")
    if cls not in PLAIN_CLASSES:
        raise NotPlain(f"tokenizer_class {cls!r} is not one of {', '.join(PLAIN_CLASSES)}")
    unknown = sorted(set(config) - _PLAIN_KEYS)
    if unknown:
        raise NotPlain(f"tokenizer_config.json sets {', '.join(unknown)}")
    if config.get("split_special_tokens"):
        raise NotPlain("split_special_tokens is set")
    if isinstance(config.get("extra_special_tokens"), dict):
        raise NotPlain("extra_special_tokens names model-specific tokens")
    for side in ("padding_side", "truncation_side"):
        if config.get(side, "right") not in ("right", "left"):
            raise NotPlain(f"{side} is {config[side]!r}")
    return config


def _refuse_side_files(folder: Path, config: Mapping[str, Any]) -> None:
    if (folder / "additional_chat_templates").is_dir():
        raise NotPlain("additional_chat_templates/ holds named templates")
    if "added_tokens_decoder" not in config:  # then transformers reads the legacy files
        for name in ("special_tokens_map.json", "added_tokens.json"):
            if (folder / name).exists():
                raise NotPlain(f"{name} without added_tokens_decoder")


def _refuse_mistral_regex(folder: Path, backend: Backend) -> None:
    """transformers rewrites the pre-tokenizer's regex of some Mistral tokenizers (a vocabulary
    past 100k, a config.json of a Mistral type written before transformers 5)."""
    if backend.get_vocab_size() <= 100_000 or backend.pre_tokenizer is None:
        return
    try:
        model_type = json.loads((folder / "config.json").read_text()).get("model_type")
    except (OSError, ValueError, AttributeError):
        return
    if model_type in _MISTRAL_TYPES:
        raise NotPlain(f"a {model_type} vocabulary whose regex transformers may rewrite")


def load_plain_tokenizer(folder: str | Path) -> Tokenizer:
    """The folder's tokenizer as transformers' fast tokenizer would load it; ``NotPlain`` (a
    ``ValueError``) saying why where :class:`Tokenizer` would not behave the same."""
    folder = Path(folder)
    if not (folder / "tokenizer.json").is_file():
        raise NotPlain("no tokenizer.json")
    config = _read_config(folder)
    _refuse_side_files(folder, config)
    try:
        backend = Backend.from_file(str(folder / "tokenizer.json"))
    except Exception as exc:  # the library's own exception type: a file it cannot parse
        raise NotPlain(f"tokenizer.json unreadable ({' '.join(str(exc).split())})") from None
    if backend.truncation is not None or backend.padding is not None:
        raise NotPlain("tokenizer.json sets truncation or padding")
    _refuse_mistral_regex(folder, backend)
    try:
        template: Any = config.get("chat_template")
        if (folder / "chat_template.jinja").is_file():  # the file wins over the config's entry
            template = (folder / "chat_template.jinja").read_text(encoding="utf-8")
        elif isinstance(template, list):  # several named templates
            template = {t["name"]: t["template"] for t in template}
        named, extra = _special_tokens(backend, config)
        _add_missing_specials(backend, named, extra)
        if backend.post_processor is None:  # as transformers: the plain template, no specials
            backend.post_processor = processors.TemplateProcessing(
                single="$A:0", pair="$A:0 $B:1", special_tokens=[]
            )
        return Tokenizer(
            backend,
            config,
            template,
            name_or_path=str(folder),
            named_specials=named,
            extra_specials=extra,
        )
    except NotPlain:
        raise
    except (OSError, ValueError, TypeError, KeyError) as exc:  # transformers says it better
        raise NotPlain(f"not read as a plain tokenizer ({' '.join(str(exc).split())})") from None


def _added_token(value: Any) -> AddedToken | str:
    """A special token as a config writes it: a string, or an AddedToken's fields."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        fields = {k: v for k, v in value.items() if k != "__type"}
        return AddedToken(**fields)
    raise NotPlain(f"a special token written as {type(value).__name__}")


def _special_tokens(
    backend: Backend, config: Mapping[str, Any]
) -> tuple[dict[str, AddedToken | str], list[AddedToken | str]]:
    """The named special tokens (as the file's added tokens where they are one) and the
    extra ones, as transformers reads them from the config."""
    known: dict[str, AddedToken] = {}
    if "added_tokens_decoder" in config:
        entries = config["added_tokens_decoder"]
        if not isinstance(entries, dict):
            raise NotPlain("added_tokens_decoder is not an object")
        current = {i: repr(t) for i, t in backend.get_added_tokens_decoder().items()}
        for index, fields in entries.items():
            token = _added_token(fields)
            if not isinstance(token, AddedToken):
                raise NotPlain("an added_tokens_decoder entry is not an AddedToken")
            if current.get(int(index)) != repr(token):  # transformers would add it
                raise NotPlain(f"added token {index} differs from tokenizer.json's")
            known[str(token)] = token
    else:
        known = {str(t): t for t in backend.get_added_tokens_decoder().values()}
    named: dict[str, AddedToken | str] = {}
    for name in SPECIAL_NAMES:
        value = config.get(name)
        if value is not None:
            token = _added_token(value)
            named[name] = known.get(str(token), token) if known else token
    extra_values = config.get("extra_special_tokens")
    if extra_values is None:
        extra_values = config.get("additional_special_tokens")
    extra = [_added_token(v) for v in (extra_values or [])]
    return named, extra


def _add_missing_specials(
    backend: Backend, named: Mapping[str, AddedToken | str], extra: list[AddedToken | str]
) -> None:
    """Special tokens the backend does not have as added tokens become ones (special), as
    transformers' constructor adds them."""
    present = {t.content for t in backend.get_added_tokens_decoder().values()}
    missing: list[AddedToken | str] = []
    for value in [*named.values(), *extra]:
        if str(value) not in present and value not in missing:
            missing.append(value)
    if not missing:
        return
    named_texts = {str(v) for v in named.values()}
    tokens = []
    for value in missing:
        if isinstance(value, str):
            value = AddedToken(value, special=True)
        elif not value.special and str(value) in named_texts:
            value.special = True
        tokens.append(value)
    backend.add_tokens(tokens)

"""A tokenizer over the ``tokenizers`` library alone: what the engine, the server and the chat
template workers use where a ``tokenizer.json`` is plain enough, instead of importing
transformers (~1.3 s of a start on a quiet 2-core host, in the engine, the server's front and
each template worker).

:func:`load_plain_tokenizer` reads a folder's ``tokenizer.json``, ``tokenizer_config.json`` and
``chat_template.jinja`` and builds the same backend state transformers' fast tokenizer builds
from them (its special tokens added to the backend where missing, an empty post-processor
replaced), so that ids, tokens and text are the library's own answers. What it cannot express
the same way (a tokenizer class of transformers with its own set-up, truncation or padding in
the file, legacy side files, model-specific special tokens, Mistral's patched regex) it
refuses with the reason, and the caller loads transformers' tokenizer instead.

:class:`Tokenizer` offers the part of transformers' interface this package uses: ``encode``,
``__call__`` for texts and pairs (a cross-encoder's, with ``only_second`` truncation),
``decode``, ``convert_ids_to_tokens`` / ``convert_tokens_to_ids`` /
``convert_tokens_to_string``, the named special tokens and their ids, ``all_special_ids``,
``vocab_size`` and ``len()``, ``backend_tokenizer``, ``chat_template`` and
``apply_chat_template`` (:mod:`.chat_template`); it pickles (the template workers get a copy).
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, processors
from tokenizers import Tokenizer as Backend

logger = logging.getLogger(__name__)

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
# tokenizer_config.json keys with no effect beyond what this class does with them.
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
# Text cleanup of WordPiece-style decoding (transformers' clean_up_tokenization_spaces).
_CLEANUPS = (
    (" .", "."),
    (" ?", "?"),
    (" !", "!"),
    (" ,", ","),
    (" ' ", "'"),
    (" n't", "n't"),
    (" 'm", "'m"),
    (" 's", "'s"),
    (" 've", "'ve"),
    (" 're", "'re"),
)


class NotPlain(ValueError):
    """A tokenizer folder this class does not load as transformers would; the text says why."""


def _added_token(value: Any) -> AddedToken | str:
    """A special token as a config writes it: a string, or an AddedToken's fields."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        fields = {k: v for k, v in value.items() if k != "__type"}
        return AddedToken(**fields)
    raise NotPlain(f"a special token written as {type(value).__name__}")


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
    ``ValueError``) saying why where this class would not behave the same."""
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
        return Tokenizer(backend, config, template, name_or_path=str(folder))
    except NotPlain:
        raise
    except (OSError, ValueError, TypeError, KeyError) as exc:  # transformers says it better
        raise NotPlain(f"not read as a plain tokenizer ({' '.join(str(exc).split())})") from None


class Tokenizer:
    """transformers' fast tokenizer's behaviour over a ``tokenizers.Tokenizer`` (see the module
    for which part); built by :func:`load_plain_tokenizer`."""

    is_fast = True

    def __init__(
        self,
        backend: Backend,
        config: Mapping[str, Any],
        chat_template: str | dict[str, str] | None = None,
        *,
        name_or_path: str = "",
    ) -> None:
        self._backend = backend
        self.name_or_path = name_or_path
        self.chat_template = chat_template
        self.model_max_length = int(config.get("model_max_length") or int(1e30))
        self.padding_side = str(config.get("padding_side", "right"))
        self.truncation_side = str(config.get("truncation_side", "right"))
        self.model_input_names = list(
            config.get("model_input_names") or ["input_ids", "attention_mask"]
        )
        self.clean_up_tokenization_spaces = bool(config.get("clean_up_tokenization_spaces"))
        self._config = dict(config)
        self._named, self._extra = self._special_tokens(config)
        self._add_missing_specials()
        if backend.post_processor is None:  # as transformers: the plain template, no specials
            backend.post_processor = processors.TemplateProcessing(
                single="$A:0", pair="$A:0 $B:1", special_tokens=[]
            )
        self._lock = threading.Lock()  # pair truncation sets it on the backend for one call
        self._refresh()

    # -- set-up ------------------------------------------------------------------------------
    def _special_tokens(
        self, config: Mapping[str, Any]
    ) -> tuple[dict[str, AddedToken | str], list[AddedToken | str]]:
        """The named special tokens (as the file's added tokens where they are one) and the
        extra ones, as transformers reads them from the config."""
        known: dict[str, AddedToken] = {}
        if "added_tokens_decoder" in config:
            entries = config["added_tokens_decoder"]
            if not isinstance(entries, dict):
                raise NotPlain("added_tokens_decoder is not an object")
            current = {i: repr(t) for i, t in self._backend.get_added_tokens_decoder().items()}
            for index, fields in entries.items():
                token = _added_token(fields)
                if not isinstance(token, AddedToken):
                    raise NotPlain("an added_tokens_decoder entry is not an AddedToken")
                if current.get(int(index)) != repr(token):  # transformers would add it
                    raise NotPlain(f"added token {index} differs from tokenizer.json's")
                known[str(token)] = token
        else:
            known = {str(t): t for t in self._backend.get_added_tokens_decoder().values()}
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

    def _add_missing_specials(self) -> None:
        """Special tokens the backend does not have as added tokens become ones (special), as
        transformers' constructor adds them."""
        present = {t.content for t in self._backend.get_added_tokens_decoder().values()}
        missing: list[AddedToken | str] = []
        for value in [*self._named.values(), *self._extra]:
            if str(value) not in present and value not in missing:
                missing.append(value)
        if not missing:
            return
        named = {str(v) for v in self._named.values()}
        tokens = []
        for value in missing:
            if isinstance(value, str):
                value = AddedToken(value, special=True)
            elif not value.special and str(value) in named:
                value.special = True
            tokens.append(value)
        self._backend.add_tokens(tokens)

    def _refresh(self) -> None:
        """Answers that do not change: a token's id is asked for every decoded token."""
        self.all_special_tokens = list(
            dict.fromkeys([str(v) for v in self._named.values()] + [str(v) for v in self._extra])
        )
        self.all_special_ids = [self._id_or_unk(t) for t in self.all_special_tokens]
        self._special_id_set = frozenset(i for i in self.all_special_ids if i is not None)

    # -- state for pickling: the backend as its JSON, the rest as built -------------------
    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        del state["_lock"]
        state["_backend"] = self._backend.to_str()
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        state["_backend"] = Backend.from_str(state["_backend"])
        state["_lock"] = threading.Lock()
        self.__dict__.update(state)

    # -- vocabulary ---------------------------------------------------------------------------
    @property
    def backend_tokenizer(self) -> Backend:
        return self._backend

    @property
    def vocab_size(self) -> int:
        """The base vocabulary, without added tokens (transformers' meaning)."""
        return self._backend.get_vocab_size(with_added_tokens=False)

    def __len__(self) -> int:
        return self._backend.get_vocab_size(with_added_tokens=True)

    def __bool__(self) -> bool:
        return True

    def get_vocab(self) -> dict[str, int]:
        return self._backend.get_vocab(with_added_tokens=True)

    @property
    def added_tokens_decoder(self) -> dict[int, AddedToken]:
        return self._backend.get_added_tokens_decoder()

    def _id_or_unk(self, token: str) -> int | None:
        index = self._backend.token_to_id(token)
        if index is None and "unk_token" in self._named:
            return self._backend.token_to_id(str(self._named["unk_token"]))
        return index

    def convert_tokens_to_ids(self, tokens: str | Iterable[str]) -> Any:
        if isinstance(tokens, str):
            return self._id_or_unk(tokens)
        return [self._id_or_unk(t) for t in tokens]

    def convert_ids_to_tokens(
        self, ids: int | Iterable[int], skip_special_tokens: bool = False
    ) -> Any:
        if isinstance(ids, int):
            return self._backend.id_to_token(ids)
        skip = self._special_id_set if skip_special_tokens else frozenset()
        to_token = self._backend.id_to_token
        return [to_token(int(i)) for i in ids if int(i) not in skip]

    def convert_tokens_to_string(self, tokens: list[str]) -> str:
        decoder = self._backend.decoder
        return decoder.decode(tokens) if decoder is not None else " ".join(tokens)

    # -- special tokens -----------------------------------------------------------------------
    @property
    def special_tokens_map(self) -> dict[str, str]:
        return {name: str(value) for name, value in self._named.items()}

    @property
    def extra_special_tokens(self) -> list[str]:
        return [str(v) for v in self._extra]

    additional_special_tokens = extra_special_tokens

    def _named_token(self, name: str) -> str | None:
        value = self._named.get(name)
        return None if value is None else str(value)

    def _named_id(self, name: str) -> int | None:
        value = self._named.get(name)
        return None if value is None else self._id_or_unk(str(value))

    bos_token = property(lambda self: self._named_token("bos_token"))
    eos_token = property(lambda self: self._named_token("eos_token"))
    unk_token = property(lambda self: self._named_token("unk_token"))
    sep_token = property(lambda self: self._named_token("sep_token"))
    pad_token = property(lambda self: self._named_token("pad_token"))
    cls_token = property(lambda self: self._named_token("cls_token"))
    mask_token = property(lambda self: self._named_token("mask_token"))
    bos_token_id = property(lambda self: self._named_id("bos_token"))
    eos_token_id = property(lambda self: self._named_id("eos_token"))
    unk_token_id = property(lambda self: self._named_id("unk_token"))
    sep_token_id = property(lambda self: self._named_id("sep_token"))
    pad_token_id = property(lambda self: self._named_id("pad_token"))
    cls_token_id = property(lambda self: self._named_id("cls_token"))
    mask_token_id = property(lambda self: self._named_id("mask_token"))

    # -- text to ids --------------------------------------------------------------------------
    def encode(
        self, text: str, text_pair: str | None = None, add_special_tokens: bool = True
    ) -> list[int]:
        return self._encode(text, text_pair, add_special_tokens, None, None).ids

    def tokenize(self, text: str, add_special_tokens: bool = False) -> list[str]:
        return self._backend.encode(text, add_special_tokens=add_special_tokens).tokens

    def __call__(
        self,
        text: str,
        text_pair: str | None = None,
        *,
        add_special_tokens: bool = True,
        truncation: bool | str = False,
        max_length: int | None = None,
        return_token_type_ids: bool | None = None,
        return_attention_mask: bool | None = None,
    ) -> dict[str, list[int]]:
        """One text or pair as transformers' ``tokenizer(text, pair, ...)`` answers it (lists,
        no tensors; ``truncation``: False, True / ``longest_first``, ``only_first`` or
        ``only_second`` at ``max_length``, default the model's)."""
        strategy = None
        if truncation:
            strategy = "longest_first" if truncation is True else str(truncation)
            if strategy not in ("longest_first", "only_first", "only_second"):
                raise ValueError(f"truncation: unknown strategy {truncation!r}")
        limit = max_length if max_length is not None else self.model_max_length
        encoding = self._encode(text, text_pair, add_special_tokens, strategy, limit)
        out: dict[str, list[int]] = {"input_ids": encoding.ids}
        if return_token_type_ids is None:
            return_token_type_ids = "token_type_ids" in self.model_input_names
        if return_attention_mask is None:
            return_attention_mask = "attention_mask" in self.model_input_names
        if return_token_type_ids:
            out["token_type_ids"] = encoding.type_ids
        if return_attention_mask:
            out["attention_mask"] = encoding.attention_mask
        return out

    def _encode(
        self,
        text: str,
        pair: str | None,
        add_special_tokens: bool,
        strategy: str | None,
        max_length: int | None,
    ) -> Any:
        if not isinstance(text, str) or (pair is not None and not isinstance(pair, str)):
            raise ValueError("text: must be a string")
        pair = pair or None  # an empty second text is no pair (transformers' reading)
        if strategy is None:
            return self._backend.encode(text, pair, add_special_tokens=add_special_tokens)
        with self._lock:  # truncation is the backend's state: set for this call only
            self._backend.enable_truncation(
                max_length, strategy=strategy, direction=self.truncation_side
            )
            try:
                return self._backend.encode(text, pair, add_special_tokens=add_special_tokens)
            finally:
                self._backend.no_truncation()

    # -- ids to text --------------------------------------------------------------------------
    def decode(
        self,
        token_ids: int | Iterable[int],
        skip_special_tokens: bool = False,
        clean_up_tokenization_spaces: bool | None = None,
    ) -> str:
        ids = [token_ids] if isinstance(token_ids, int) else [int(i) for i in token_ids]
        text = self._backend.decode(ids, skip_special_tokens=skip_special_tokens)
        clean = (
            self.clean_up_tokenization_spaces
            if clean_up_tokenization_spaces is None
            else clean_up_tokenization_spaces
        )
        # transformers skips the cleanup for BPE (it would delete spaces the text has).
        if clean and type(self._backend.model).__name__ != "BPE":
            for before, after in _CLEANUPS:
                text = text.replace(before, after)
        return text

    # -- chat ---------------------------------------------------------------------------------
    def chat_renderer(self) -> Any:
        """The chat templates and special tokens alone (``ChatRenderer``): what a template
        worker needs, without the vocabulary."""
        from pagedllm.tokenization.chat_template import ChatRenderer

        return ChatRenderer(self.chat_template, self.special_tokens_map)

    def get_chat_template(self, chat_template: str | None = None, tools: Any = None) -> str:
        return self.chat_renderer().get_chat_template(chat_template, tools)

    def apply_chat_template(
        self,
        conversation: Any,
        tools: list[Any] | None = None,
        documents: list[Any] | None = None,
        chat_template: str | None = None,
        add_generation_prompt: bool = False,
        continue_final_message: bool | str = False,
        tokenize: bool = True,
        return_dict: bool = True,
        **kwargs: Any,
    ) -> Any:
        """The conversation through the chat template (:mod:`.chat_template`); with
        ``tokenize``, its ids (``{"input_ids", "attention_mask"}`` with ``return_dict``, as
        transformers 5 answers), encoded without added special tokens."""
        text = self.chat_renderer().apply_chat_template(
            conversation,
            tools=tools,
            documents=documents,
            chat_template=chat_template,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            **kwargs,
        )
        if not tokenize:
            return text
        ids = self.encode(text, add_special_tokens=False)
        return {"input_ids": ids, "attention_mask": [1] * len(ids)} if return_dict else ids

    def __repr__(self) -> str:
        return (
            f"Tokenizer({self.name_or_path!r}, vocab_size={self.vocab_size}, "
            f"len={len(self)}, special={self.special_tokens_map})"
        )

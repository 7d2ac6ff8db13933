"""A tokenizer over the ``tokenizers`` library alone: what the engine, the server and the chat
template workers use where a ``tokenizer.json`` is plain enough, instead of importing
transformers (~1.3 s of a start on a quiet 2-core host, in the engine, the server's front and
each template worker).

:class:`Tokenizer` offers the part of transformers' interface this package uses: ``encode``,
``__call__`` for texts and pairs (a cross-encoder's, with ``only_second`` truncation),
``decode``, ``convert_ids_to_tokens`` / ``convert_tokens_to_ids`` /
``convert_tokens_to_string``, the named special tokens and their ids, ``all_special_ids``,
``vocab_size`` and ``len()``, ``backend_tokenizer``, ``chat_template`` and
``apply_chat_template`` (:mod:`.chat_template`); it pickles (the template workers get a copy).
It answers from a backend already in the state transformers would build; whether a folder
allows that, and building it, is :mod:`.loading`'s.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from tokenizers import AddedToken
from tokenizers import Tokenizer as Backend

logger = logging.getLogger(__name__)

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


class Tokenizer:
    """transformers' fast tokenizer's behaviour over a ``tokenizers.Tokenizer`` (see the module
    for which part); built by :func:`.loading.load_plain_tokenizer`."""

    is_fast = True

    def __init__(
        self,
        backend: Backend,
        config: Mapping[str, Any],
        chat_template: str | dict[str, str] | None = None,
        *,
        name_or_path: str = "",
        named_specials: Mapping[str, AddedToken | str],
        extra_specials: Sequence[AddedToken | str],
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
        # As transformers reads them from the config, already in the backend as added tokens.
        self._named = dict(named_specials)
        self._extra = list(extra_specials)
        self._lock = threading.Lock()  # pair truncation sets it on the backend for one call
        self._refresh()

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

"""A ``bert`` (WordPiece) GGUF tokenizer as the fast tokenizer ``BertTokenizerFast`` would be.

transformers converts no WordPiece vocabulary from GGUF, so this builds the ``tokenizers``
pipeline itself: BERT's normaliser (lower-casing and accent stripping when the vocabulary has
no upper-case letter, as llama.cpp's tokenizer always lower-cases), its pre-tokeniser, WordPiece
with ``##`` continuations, and ``[CLS] A [SEP] (B [SEP])`` with segment ids.

llama.cpp's converter rewrites the vocabulary into its "phantom space" form: a word-initial
piece gets a leading ``▁``, a continuation loses its ``##``, and bracketed tokens (``[CLS]``,
``[unused0]``) stay as they are. The original vocabulary is that rewrite undone.
"""

from __future__ import annotations

from typing import Any

from pagedllm.models.gguf.reader import GGUFFile, GGUFFileError

_PHANTOM_SPACE = "\u2581"
# Part of the cache key of a converted tokenizer (``tokenizer._cache_folder``): raise it when the
# conversion changes, so that no start loads an earlier conversion of the same file.
WORDPIECE_VERSION = "1"
# Special token -> where a llama.cpp file keeps its id: a BERT's [CLS] is written as the bos
# token and its [SEP] as the separator (older files) or eos token.
_SPECIAL_KEYS = {
    "cls_token": ("tokenizer.ggml.cls_token_id", "tokenizer.ggml.bos_token_id"),
    "sep_token": ("tokenizer.ggml.seperator_token_id", "tokenizer.ggml.eos_token_id"),
    "pad_token": ("tokenizer.ggml.padding_token_id",),
    "unk_token": ("tokenizer.ggml.unknown_token_id",),
    "mask_token": ("tokenizer.ggml.mask_token_id",),
}
_DEFAULT_SPECIALS = {
    "cls_token": "[CLS]",
    "sep_token": "[SEP]",
    "pad_token": "[PAD]",
    "unk_token": "[UNK]",
    "mask_token": "[MASK]",
}


def wordpiece_vocab(tokens: list[str]) -> list[str]:
    """The WordPiece vocabulary (``##`` continuations) behind a phantom-space token list."""
    out = []
    for token in tokens:
        if token.startswith(_PHANTOM_SPACE):
            out.append(token[1:])
        elif token.startswith("[") and token.endswith("]"):
            out.append(token)
        else:
            out.append("##" + token)
    return out


def _specials(gguf: GGUFFile, vocab: list[str]) -> dict[str, str]:
    found: dict[str, str] = {}
    for role, keys in _SPECIAL_KEYS.items():
        for key in keys:
            index = gguf.metadata(key, None)
            if isinstance(index, int) and 0 <= index < len(vocab):
                found[role] = vocab[index]
                break
        else:
            if _DEFAULT_SPECIALS[role] in vocab:
                found[role] = _DEFAULT_SPECIALS[role]
    for role in ("cls_token", "sep_token", "unk_token"):
        if role not in found:
            raise GGUFFileError(
                f"{gguf.path}: the bert tokenizer has no {role.removesuffix('_token')} token "
                f"(no {' or '.join(_SPECIAL_KEYS[role])}, no {_DEFAULT_SPECIALS[role]} token)"
            )
    return found


def _lowercase(vocab: list[str]) -> bool:
    """Whether the vocabulary was made from lower-cased text (no piece has an upper-case
    letter outside the bracketed specials)."""
    words = (p for p in vocab if not (p.startswith("[") and p.endswith("]")))
    return all(p == p.lower() for p in words)


def wordpiece_tokenizer(gguf: GGUFFile) -> Any:
    """The file's ``tokenizer.ggml.*`` as a ``PreTrainedTokenizerFast`` (see the module)."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    tokens = gguf.metadata("tokenizer.ggml.tokens")
    if not isinstance(tokens, list) or not all(isinstance(t, str) for t in tokens):
        raise GGUFFileError(f"{gguf.path}: tokenizer.ggml.tokens is not a list of strings")
    vocab = wordpiece_vocab(tokens)
    index = {piece: i for i, piece in reversed(list(enumerate(vocab)))}  # first id wins
    specials = _specials(gguf, vocab)
    lower = _lowercase(vocab)
    tok = Tokenizer(models.WordPiece(index, unk_token=specials["unk_token"]))
    tok.normalizer = normalizers.BertNormalizer(
        clean_text=True, handle_chinese_chars=True, strip_accents=None, lowercase=lower
    )
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    cls, sep = specials["cls_token"], specials["sep_token"]
    tok.post_processor = processors.TemplateProcessing(
        single=f"{cls}:0 $A:0 {sep}:0",
        pair=f"{cls}:0 $A:0 {sep}:0 $B:1 {sep}:1",
        special_tokens=[(cls, index[cls]), (sep, index[sep])],
    )
    tok.decoder = decoders.WordPiece(prefix="##")
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        model_max_length=int(gguf.metadata(f"{gguf.architecture}.context_length", 512)),
        do_lower_case=lower,
        model_input_names=["input_ids", "token_type_ids", "attention_mask"],
        **specials,
    )

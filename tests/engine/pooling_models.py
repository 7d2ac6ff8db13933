"""Tiny random-weight pooling checkpoints with a real tokenizer, built by the tests: a BERT
sentence-transformers folder (mean pooling, normalised) and a BERT cross-encoder (one label)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

_TEXT = (
    "the quick brown fox jumps over a lazy dog while paged attention keeps every block of a "
    "cache in use and continuous batching schedules each iteration anew so that short long "
    "requests share one forward pass retrieval needs embeddings documents queries answers"
)
WORDS = tuple(dict.fromkeys(_TEXT.split()))


def bert_tokenizer(folder: Path) -> Any:
    from tokenizers import Tokenizer, pre_tokenizers, processors
    from tokenizers import models as tok_models
    from transformers import BertTokenizerFast

    specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    vocab = {w: i for i, w in enumerate([*specials, *WORDS])}
    tok = Tokenizer(tok_models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]",
        pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", 2), ("[SEP]", 3)],
    )
    fast = BertTokenizerFast(tokenizer_object=tok, do_lower_case=False)
    fast.save_pretrained(str(folder))
    return fast


def _bert_config(vocab_size: int, **extra: Any) -> Any:
    from transformers import BertConfig

    shape: dict[str, Any] = {
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "intermediate_size": 128,
        "max_position_embeddings": 128,
        "type_vocab_size": 2,
    }
    return BertConfig(vocab_size=vocab_size, **{**shape, **extra})


def widen(model: torch.nn.Module) -> None:
    """Random weights wide enough that a wrong layer shows in the outputs (HF's init is tiny)."""
    torch.manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.1)
            elif "LayerNorm" in name:
                p.normal_(1.0 if name.endswith("weight") else 0.0, 0.1)


def build_st_bert(folder: Path) -> Path:
    """A sentence-transformers folder: BERT, mean pooling, Normalize."""
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.modules import Normalize, Pooling, Transformer
    from transformers import BertModel

    hf = folder / "hf"
    hf.mkdir(parents=True, exist_ok=True)
    tok = bert_tokenizer(hf)
    model = BertModel(_bert_config(len(tok)), add_pooling_layer=False)
    widen(model)
    model.save_pretrained(str(hf))
    word = Transformer(str(hf), max_seq_length=128)
    pooling = Pooling(64, pooling_mode="mean")
    SentenceTransformer(modules=[word, pooling, Normalize()]).save(str(folder / "st"))
    return folder / "st"


def build_cross_encoder(folder: Path, **config: Any) -> Path:
    """A BERT sequence classifier with one label: a cross-encoder reranker."""
    from transformers import BertForSequenceClassification

    folder.mkdir(parents=True, exist_ok=True)
    tok = bert_tokenizer(folder)
    model = BertForSequenceClassification(_bert_config(len(tok), num_labels=1, **config))
    widen(model)
    model.save_pretrained(str(folder))
    return folder

"""``bert`` GGUF files for tests, written with ggml's ``gguf`` package from a BERT folder.

What llama.cpp's converter writes for a sentence-transformers BERT: hyper-parameters under
``bert.*`` (``attention.causal`` false, ``pooling_type`` from the folder), the WordPiece vocabulary
in its phantom-space form (``▁word``, ``piece`` for ``##piece``, brackets kept) with [CLS] as the
bos token and [SEP] as separator and eos, and the encoder's tensors under llama.cpp's names.
Matrices are written in the type asked (F32, F16, Q8_0); vectors (norms, biases) as F32. A
``BertForSequenceClassification`` written as a rank file (``pooling="rank"``) keeps its head as
llama.cpp's ``cls`` (the pooler's dense) and ``cls.output`` (the classifier), with its labels
under ``bert.classifier.output_labels``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

# Hugging Face module (under encoder.layer.N.) -> llama.cpp's block tensor kind.
_BLOCK = {
    "attention.self.query": "attn_q",
    "attention.self.key": "attn_k",
    "attention.self.value": "attn_v",
    "attention.output.dense": "attn_output",
    "attention.output.LayerNorm": "attn_output_norm",
    "intermediate.dense": "ffn_up",
    "output.dense": "ffn_down",
    "output.LayerNorm": "layer_output_norm",
}
_GLOBAL = {
    "embeddings.word_embeddings": "token_embd",
    "embeddings.token_type_embeddings": "token_types",
    "embeddings.position_embeddings": "position_embd",
    "embeddings.LayerNorm": "token_embd_norm",
}
# A sequence classifier's head, in a rank file only.
_HEAD = {"pooler.dense": "cls", "classifier": "cls.output"}
POOLING = {"none": 0, "mean": 1, "cls": 2, "last": 3, "rank": 4}


def gguf_bert_name(hf_name: str, *, rank: bool = False) -> str | None:
    """llama.cpp's name of one BertModel tensor (of a classifier's head too, for a ``rank``
    file); None for what it does not convert."""
    name = hf_name.removeprefix("bert.")
    stem, _, suffix = name.rpartition(".")
    if stem in _GLOBAL:
        return f"{_GLOBAL[stem]}.{suffix}"
    if rank and stem in _HEAD:
        return f"{_HEAD[stem]}.{suffix}"
    parts = stem.split(".")
    if parts[:2] == ["encoder", "layer"] and ".".join(parts[3:]) in _BLOCK:
        return f"blk.{parts[2]}.{_BLOCK['.'.join(parts[3:])]}.{suffix}"
    return None


def phantom(token: str) -> str:
    """llama.cpp's converter's rewrite of a WordPiece token."""
    if token.startswith("[") and token.endswith("]"):
        return token
    return token[2:] if token.startswith("##") else "\u2581" + token


def _vocab(folder: Path) -> list[str]:
    spec = json.loads((folder / "tokenizer.json").read_text())
    vocab: dict[str, int] = spec["model"]["vocab"]
    tokens = [""] * len(vocab)
    for token, index in vocab.items():
        tokens[index] = token
    return tokens


def _encode(w: np.ndarray, kind: str) -> tuple[np.ndarray, Any]:
    from gguf import GGMLQuantizationType, quants

    if w.ndim == 1 or kind == "F32":
        return w.astype(np.float32), None
    if kind == "F16":
        return w.astype(np.float16), None
    qtype = GGMLQuantizationType[kind]
    return quants.quantize(w.astype(np.float32), qtype), qtype


def write_bert_gguf(
    folder: Path,
    out: Path,
    *,
    kind: str = "F32",
    pooling: str = "mean",
    metadata: dict[str, Any] | None = None,
    drop: tuple[str, ...] = (),
    reshape: dict[str, tuple[int, ...]] | None = None,
) -> Path:
    """The BERT in ``folder`` (safetensors, config.json, a WordPiece tokenizer.json) as ``out``.
    ``metadata``: keys written over the converter's; ``drop``: tensors left out; ``reshape``:
    tensors written with another shape (a damaged file)."""
    from safetensors.numpy import load_file

    config = json.loads((folder / "config.json").read_text())
    tensors = {}
    for file in sorted(folder.glob("*.safetensors")):
        for hf_name, array in load_file(str(file)).items():
            name = gguf_bert_name(hf_name, rank=pooling == "rank")
            if name is not None:
                tensors[name] = array
    if pooling == "rank":
        labels = config.get("id2label") or {"0": "LABEL_0"}
        metadata = {"bert.classifier.output_labels": list(labels.values()), **(metadata or {})}
    return write_encoder_gguf(
        out,
        "bert",
        config,
        _vocab(folder),
        tensors,
        kind=kind,
        pooling=pooling,
        metadata=metadata,
        drop=drop,
        reshape=reshape,
    )


def write_encoder_gguf(
    out: Path,
    arch: str,
    config: dict[str, Any],
    tokens: list[str],
    tensors: dict[str, np.ndarray],
    *,
    kind: str = "F32",
    pooling: str = "mean",
    metadata: dict[str, Any] | None = None,
    drop: tuple[str, ...] = (),
    reshape: dict[str, tuple[int, ...]] | None = None,
) -> Path:
    """An encoder file of ``arch`` ("bert", "nomic-bert"): ``config`` (Hugging Face keys) as
    ``<arch>.*``, the WordPiece ``tokens`` in llama.cpp's form, ``tensors`` by GGUF name."""
    import gguf

    writer = gguf.GGUFWriter(str(out), arch)
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_layer_norm_eps(float(config["layer_norm_eps"]))
    if "rope_theta" in config:
        writer.add_rope_freq_base(float(config["rope_theta"]))
    writer.add_causal_attention(False)
    writer.add_pooling_type(gguf.PoolingType(POOLING[pooling]))
    writer.add_file_type(0)
    writer.add_tokenizer_model("bert")
    writer.add_tokenizer_pre("default")
    writer.add_token_list([phantom(t) for t in tokens])
    writer.add_token_types([3 if t.startswith("[") and t.endswith("]") else 1 for t in tokens])
    writer.add_token_type_count(config.get("type_vocab_size", 2))
    ids = {t: i for i, t in enumerate(tokens)}
    writer.add_bos_token_id(ids["[CLS]"])
    writer.add_eos_token_id(ids["[SEP]"])
    writer.add_sep_token_id(ids["[SEP]"])
    writer.add_pad_token_id(ids["[PAD]"])
    writer.add_unk_token_id(ids["[UNK]"])
    writer.add_mask_token_id(ids["[MASK]"])
    writer.add_add_bos_token(True)
    writer.add_add_sep_token(True)
    for key, value in (metadata or {}).items():
        writer.kv_data[0].pop(key, None)
        if isinstance(value, bool):
            writer.add_bool(key, value)
        elif isinstance(value, list):
            writer.add_array(key, value)
        elif isinstance(value, int):
            writer.add_uint32(key, value)
        else:
            writer.add_float32(key, value)
    for name, array in tensors.items():
        if name in drop:
            continue
        w = array.astype(np.float32)
        if reshape and name in reshape:
            w = np.resize(w, reshape[name])
        # The token-type table stays F32, as llama.cpp's converter keeps it: llama.cpp adds its
        # row to the float32 embeddings as it is stored, and has no f32 + f16 addition.
        data, qtype = _encode(w, "F32" if name == "token_types.weight" else kind)
        if qtype is None:
            writer.add_tensor(name, np.ascontiguousarray(data))
        else:
            writer.add_tensor(name, data, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out

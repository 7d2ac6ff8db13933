"""llama.cpp's ``bert`` and ``nomic-bert`` files (embedding models) as the BERT config, tensor
names and pooling our :mod:`pagedllm.models.bert` encoder reads.

llama.cpp's converter writes a BERT encoder with its own names (``token_embd``,
``token_types``, ``position_embd``, ``token_embd_norm``; per block ``attn_q/k/v``,
``attn_output``, ``attn_output_norm``, ``ffn_up``, ``ffn_down``, ``layer_output_norm``), the
hyper-parameters under ``bert.*`` (``attention.causal`` false) and the pooling the
sentence-transformers folder declared as ``bert.pooling_type`` (llama.cpp's enum). No key says
whether to normalise: llama.cpp's server normalises embeddings by default, and so do we.
``nomic-bert`` (nomic-embed-text) is the same post-norm encoder with rotary positions at
``rope.freq_base`` (no ``position_embd``), fused ``attn_qkv`` and a SwiGLU MLP (``ffn_gate``,
``ffn_up``), biases where its tensors have them.

A ``bert`` file whose ``pooling_type`` is 4 (rank) is a cross-encoder: llama.cpp's converter
writes a sequence classifier's head as ``cls`` (BERT's pooler, or RoBERTa's ``classifier.dense``:
dense + tanh on the first token; optional, as llama.cpp applies it only where present) and
``cls.output`` (the classifier, one row per label). They load as our
``BertForSequenceClassification``'s ``pooler.dense`` and ``classifier``, its pooler left out
(``classifier_pooler`` False) where the file has no ``cls``.
"""

from __future__ import annotations

import logging
from typing import Any

from pagedllm.models.gguf.reader import GGUFFile, GGUFFileError
from pagedllm.models.pooling import PoolingConfig, PoolingType
from pagedllm.models.safetensors_reader import CheckpointError

logger = logging.getLogger(__name__)

# GGUF block tensor kind -> (Hugging Face module under encoder.layer.N, our linear module).
BLOCK_TENSORS: dict[str, tuple[str, str | None]] = {
    "attn_q": ("attention.self.query", "attention.self_attn.qkv_proj"),
    "attn_k": ("attention.self.key", "attention.self_attn.qkv_proj"),
    "attn_v": ("attention.self.value", "attention.self_attn.qkv_proj"),
    "attn_output": ("attention.output.dense", "attention.output.dense"),
    "attn_output_norm": ("attention.output.LayerNorm", None),
    "ffn_up": ("intermediate.dense", "intermediate.dense"),
    "ffn_down": ("output.dense", "output.dense"),
    "layer_output_norm": ("output.LayerNorm", None),
}
# nomic-bert's block tensors that differ from bert's: fused q/k/v, the gated MLP's halves.
NOMIC_BLOCK_TENSORS: dict[str, tuple[str, str | None]] = {
    **{k: v for k, v in BLOCK_TENSORS.items() if k not in ("attn_q", "attn_k", "attn_v", "ffn_up")},
    "attn_qkv": ("attention.self_attn.qkv_proj", "attention.self_attn.qkv_proj"),
    "ffn_gate": ("intermediate.gate", "intermediate.dense"),
    "ffn_up": ("intermediate.up", "intermediate.dense"),
}
GLOBAL_TENSORS = {
    "token_embd": "embeddings.word_embeddings",
    "token_types": "embeddings.token_type_embeddings",
    "position_embd": "embeddings.position_embeddings",
    "token_embd_norm": "embeddings.LayerNorm",
}
# A rank file's classifier head (llama.cpp's ``cls``/``cls.output``) -> our linear module.
HEAD_TENSORS = {"cls": "pooler.dense", "cls.output": "classifier"}
# llama.cpp's ``LLAMA_POOLING_TYPE_*``: 0 none (a vector per token), 1 mean, 2 cls, 3 last,
# 4 rank (a cross-encoder's score).
_POOLING = {1: PoolingType.MEAN, 2: PoolingType.CLS, 3: PoolingType.LAST}
_NO_POOLING, _RANK_POOLING = 0, 4
_SUFFIXES = ("weight", "bias")


def encoder_hf_name(gguf_name: str, arch: str) -> tuple[str, str | None]:
    """(Hugging Face tensor name, our linear module's name or None) of one tensor of a ``bert``
    or ``nomic-bert`` (``arch``) file."""
    parts = gguf_name.split(".")
    blocks = NOMIC_BLOCK_TENSORS if arch == "nomic-bert" else BLOCK_TENSORS
    if len(parts) == 4 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in blocks:
        path, module = blocks[parts[2]]
        stem = f"encoder.layer.{parts[1]}"
        return f"{stem}.{path}.{parts[3]}", None if module is None else f"{stem}.{module}"
    head = ".".join(parts[:-1])
    if arch == "bert" and head in HEAD_TENSORS and parts[-1] in _SUFFIXES:
        return f"{HEAD_TENSORS[head]}.{parts[-1]}", HEAD_TENSORS[head]
    rotary = arch == "nomic-bert" and parts[0] == "position_embd"
    if len(parts) == 2 and parts[0] in GLOBAL_TENSORS and not rotary and parts[1] in _SUFFIXES:
        return f"{GLOBAL_TENSORS[parts[0]]}.{parts[1]}", None
    raise CheckpointError(f"tensor {gguf_name!r} has no place in a {arch}")


def encoder_config_values(gguf: GGUFFile) -> dict[str, Any]:
    """The keyword arguments of transformers' ``BertConfig`` for this file (sizes checked
    before by ``encoder_checks``); ``GGUFFileError`` names a key we cannot honour."""
    arch = gguf.architecture
    if gguf.metadata(f"{arch}.attention.causal", False):
        raise GGUFFileError(
            f"{gguf.path}: {arch}.attention.causal is true; a {arch} encoder attends both ways"
        )
    pooling_type(gguf)  # an unknown pooling, or rank in a nomic-bert: refused by name
    heads = int(gguf.metadata(f"{arch}.attention.head_count"))
    tensors = gguf.tensors
    positions = gguf.metadata(f"{arch}.context_length", None)
    if positions is None:
        positions = tensors["position_embd.weight"].shape[0]
    rotary = {}
    if arch == "nomic-bert":
        rotary = {
            "position_embedding_type": "rotary",
            "rope_theta": float(gguf.metadata(f"{arch}.rope.freq_base", 1e4)),
            "gated_mlp": True,
            "attention_bias": "blk.0.attn_qkv.bias" in tensors,
            "mlp_bias": "blk.0.ffn_up.bias" in tensors,
        }
    return {
        "vocab_size": int(tensors["token_embd.weight"].shape[0]),
        "hidden_size": int(gguf.metadata(f"{arch}.embedding_length")),
        "num_hidden_layers": int(gguf.metadata(f"{arch}.block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": heads,  # what the GGUF weight reader asks of every config
        "intermediate_size": int(gguf.metadata(f"{arch}.feed_forward_length")),
        "max_position_embeddings": int(positions),
        "type_vocab_size": int(tensors["token_types.weight"].shape[0]),
        "layer_norm_eps": float(gguf.metadata(f"{arch}.attention.layer_norm_epsilon", 1e-12)),
        "pad_token_id": int(gguf.metadata("tokenizer.ggml.padding_token_id", 0)),
        "hidden_act": "gelu",
        "position_embedding_type": "absolute",
        "tie_word_embeddings": False,
        **rotary,
        **_classifier(gguf),
    }


def is_rank(gguf: GGUFFile) -> bool:
    """Whether the file is a cross-encoder (``pooling_type`` 4, rank)."""
    return gguf.metadata(f"{gguf.architecture}.pooling_type", None) == _RANK_POOLING


def _classifier(gguf: GGUFFile) -> dict[str, Any]:
    """A rank file's config as a sequence classifier's (its head checked by encoder_checks)."""
    if not is_rank(gguf):
        return {}
    return {
        "architectures": ["BertForSequenceClassification"],
        "num_labels": int(gguf.tensors["cls.output.weight"].shape[0]),
        "classifier_pooler": "cls.weight" in gguf.tensors,
    }


def pooling_type(gguf: GGUFFile) -> PoolingType | None:
    """``<arch>.pooling_type`` as ours; None where the file names none (or none at all: a
    vector per token, which the engine does not serve, so the class's default pools)."""
    arch = gguf.architecture
    value = gguf.metadata(f"{arch}.pooling_type", None)
    if value is None:
        return None
    if value == _RANK_POOLING:
        if arch != "bert":
            raise GGUFFileError(
                f"{gguf.path}: {arch}.pooling_type is 4 (rank: a cross-encoder's score), which "
                "only bert files serve here"
            )
        return PoolingType.CLS  # a cross-encoder's head reads the first token
    if value == _NO_POOLING:
        logger.warning(
            "%s: %s.pooling_type is 0 (a vector per token, not served); pooling by the model's "
            "default (pass --pooling to choose)",
            gguf.path.name,
            arch,
        )
        return None
    if value not in _POOLING:
        raise GGUFFileError(
            f"{gguf.path}: {arch}.pooling_type is {value!r} (llama.cpp's 0 none, 1 mean, 2 cls, "
            "3 last, 4 rank)"
        )
    return _POOLING[value]


def gguf_pooling(gguf: GGUFFile, default: PoolingConfig) -> PoolingConfig:
    """An embedder's pooling from a GGUF file: its ``pooling_type`` (else the class's), and
    normalised, as llama.cpp's server answers embeddings."""
    kind = pooling_type(gguf) or default.pooling_type
    return PoolingConfig(kind, normalize=True, dimensions=default.dimensions)

"""A GGUF file's metadata as the transformers config of the same model.

The engine's model classes read Hugging Face configs, so a GGUF file is described to them as
the config its converter started from: ``general.architecture`` picks the family, the
``<arch>.*`` keys the hyper-parameters, ``tokenizer.ggml.*`` the special ids, and the tensors
present settle what metadata does not say (tied embeddings, biases).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pagedllm.models.gguf.encoder import encoder_config_values
from pagedllm.models.gguf.light_config import light_config
from pagedllm.models.gguf.reader import GGUFFile, GGUFFileError


@dataclass(frozen=True)
class Family:
    """How one GGUF architecture maps to ours."""

    model_type: str  # transformers' model_type
    architecture: str  # the class name our model registry knows
    permuted_qk: bool  # llama.cpp's converter interleaved q/k rows for its rotary (llama only)
    norm_plus_one: bool = False  # Gemma's converter stored RMSNorm weights as 1 + w
    # Gemma 2 and 3: a norm after the attention and two around the MLP ("ffn_norm" is the
    # one before it, "post_attention_norm" and "post_ffw_norm" the ones after).
    sandwich_norms: bool = False
    # Whether a file with plain rope gets the light config (light_config.py) instead of
    # transformers' class (Gemma 3's rope settings per layer type come from its class).
    light: bool = True
    # Mixture of experts: stacked expert tensors (``ffn_*_exps``), a router (``ffn_gate_inp``),
    # Qwen2-MoE's shared expert (``ffn_*_shexp``); llama.cpp renormalises the top-k weights.
    moe: bool = False
    renormalize_top_k: bool = False
    # The config field of the expert count, and whether the experts' size is the file's
    # ``feed_forward_length`` (Mixtral, OLMoE: every layer sparse, ``intermediate_size``) rather
    # than ``expert_feed_forward_length`` (Qwen-MoE: ``moe_intermediate_size``).
    experts_field: str = "num_experts"
    experts_sized_by_ffn: bool = False
    # A bidirectional encoder (embedding model): its GGUF architecture ("bert", "nomic-bert"),
    # whose names, checks and config are in encoder.py; "" for the decoders.
    encoder: str = ""


FAMILIES: dict[str, Family] = {
    "llama": Family("llama", "LlamaForCausalLM", permuted_qk=True),
    "mistral": Family("mistral", "MistralForCausalLM", permuted_qk=True),
    "qwen2": Family("qwen2", "Qwen2ForCausalLM", permuted_qk=False),
    "qwen3": Family("qwen3", "Qwen3ForCausalLM", permuted_qk=False),
    "phi3": Family("phi3", "Phi3ForCausalLM", permuted_qk=False),
    "gemma": Family("gemma", "GemmaForCausalLM", permuted_qk=False, norm_plus_one=True),
    "gemma2": Family(
        "gemma2", "Gemma2ForCausalLM", permuted_qk=False, norm_plus_one=True, sandwich_norms=True
    ),
    "gemma3": Family(
        "gemma3_text",
        "Gemma3ForCausalLM",
        permuted_qk=False,
        norm_plus_one=True,
        sandwich_norms=True,
        light=False,
    ),
    "qwen2moe": Family("qwen2_moe", "Qwen2MoeForCausalLM", permuted_qk=False, moe=True),
    "qwen3moe": Family(
        "qwen3_moe", "Qwen3MoeForCausalLM", permuted_qk=False, moe=True, renormalize_top_k=True
    ),
    "olmoe": Family(
        "olmoe", "OlmoeForCausalLM", permuted_qk=False, moe=True, experts_sized_by_ffn=True
    ),
    "bert": Family("bert", "BertModel", permuted_qk=False, light=False, encoder="bert"),
    # nomic-embed-text: a BERT with rotary positions and SwiGLU, as transformers' BertConfig with
    # our own fields (its Hugging Face class is remote code).
    "nomic-bert": Family("bert", "BertModel", permuted_qk=False, light=False, encoder="nomic-bert"),
}
# llama.cpp's converter writes Mixtral as "llama" with expert stacks (as it writes Mistral):
# the family is told by its tensors. Routing always renormalises the top-k (top-2) weights.
MIXTRAL = Family(
    "mixtral",
    "MixtralForCausalLM",
    permuted_qk=True,
    moe=True,
    renormalize_top_k=True,
    experts_field="num_local_experts",
    experts_sized_by_ffn=True,
)

# ``<arch>.<key>`` -> config attribute; every family writes these the same way.
_HYPER_PARAMETERS = {
    "context_length": "max_position_embeddings",
    "embedding_length": "hidden_size",
    "block_count": "num_hidden_layers",
    "feed_forward_length": "intermediate_size",
    "attention.head_count": "num_attention_heads",
    "attention.head_count_kv": "num_key_value_heads",
    "attention.layer_norm_rms_epsilon": "rms_norm_eps",
    "attention.key_length": "head_dim",
    "attention.sliding_window": "sliding_window",
}
_REQUIRED = ("embedding_length", "block_count", "feed_forward_length", "attention.head_count")
_SPECIAL_IDS = {
    "bos_token_id": "tokenizer.ggml.bos_token_id",
    "eos_token_id": "tokenizer.ggml.eos_token_id",
    "pad_token_id": "tokenizer.ggml.padding_token_id",
}


def family_of(gguf: GGUFFile) -> Family:
    arch = gguf.architecture
    if arch == "llama" and _has_experts(gguf):
        return MIXTRAL
    family = FAMILIES.get(arch)
    if family is None:
        raise GGUFFileError(
            f"{gguf.path}: general.architecture {arch!r} is not supported; pagedllm runs GGUF "
            f"files of {', '.join(sorted(FAMILIES))}"
        )
    return family


def _has_experts(gguf: GGUFFile) -> bool:
    """Whether a file has a router or expert stacks in some layer (a llama file: Mixtral)."""
    return any(
        name.startswith("blk.") and (".ffn_gate_inp." in name or "_exps." in name)
        for name in gguf.tensors
    )


def _hyper_parameters(gguf: GGUFFile, arch: str) -> dict[str, Any]:
    values: dict[str, Any] = {}
    for key, attr in _HYPER_PARAMETERS.items():
        value = gguf.metadata(f"{arch}.{key}", None)
        if value is None:
            if key in _REQUIRED:
                gguf.metadata(f"{arch}.{key}")  # raises, naming the field
            continue
        if isinstance(value, list):  # per-layer values (some files): one model-wide value
            if len(set(value)) != 1:
                raise GGUFFileError(
                    f"{gguf.path}: {arch}.{key} differs between layers ({value[:8]}...), "
                    "which the model classes cannot express"
                )
            value = value[0]
        values[attr] = value
    values.setdefault("num_key_value_heads", values["num_attention_heads"])
    if "sliding_window" in values and not values["sliding_window"]:
        del values["sliding_window"]
    return values


def _rope(gguf: GGUFFile, arch: str, values: dict[str, Any]) -> dict[str, Any]:
    """``rope_theta``, ``rope_scaling`` and ``partial_rotary_factor`` from ``<arch>.rope.*``:
    the transformers 4 names, which transformers 5 also takes (into ``rope_parameters``).

    Linear and YaRN scaling are metadata; Llama 3's frequency factors and Phi-3's long-rope
    factors are tensors (``rope_freqs``, ``rope_factors_long/short``), read into the config by
    :func:`hf_config_from_gguf`.
    """
    params: dict[str, Any] = {"rope_theta": float(gguf.metadata(f"{arch}.rope.freq_base", 1e4))}
    kind = gguf.metadata(f"{arch}.rope.scaling.type", "none")
    factor = gguf.metadata(f"{arch}.rope.scaling.factor", None)
    original = gguf.metadata(f"{arch}.rope.scaling.original_context_length", None)
    if kind in ("none", "") or (kind == "linear" and factor in (None, 1.0)):
        params["rope_scaling"] = None
    elif kind in ("linear", "yarn"):
        scaling: dict[str, Any] = {"rope_type": kind, "factor": float(factor or 1.0)}
        if original:
            scaling["original_max_position_embeddings"] = int(original)
        params["rope_scaling"] = scaling
    else:
        raise GGUFFileError(
            f"{gguf.path}: {arch}.rope.scaling.type {kind!r} is not supported (none, linear, yarn)"
        )
    head_dim = values.get("head_dim") or values["hidden_size"] // values["num_attention_heads"]
    rotary = gguf.metadata(f"{arch}.rope.dimension_count", head_dim)
    if rotary != head_dim:
        params["partial_rotary_factor"] = rotary / head_dim
    return params


def _phi3_long_rope(gguf: GGUFFile, params: dict[str, Any], values: dict[str, Any]) -> None:
    if "rope_factors_long.weight" not in gguf.tensors:
        return
    import numpy as np

    long = np.asarray(gguf.tensors["rope_factors_long.weight"].raw, dtype=np.float32)
    short = np.asarray(gguf.tensors["rope_factors_short.weight"].raw, dtype=np.float32)
    original = gguf.metadata("phi3.rope.scaling.original_context_length")
    params["rope_scaling"] = {
        "rope_type": "longrope",
        "long_factor": [float(x) for x in long],
        "short_factor": [float(x) for x in short],
    }
    values["original_max_position_embeddings"] = int(original)


_FLOAT_TYPES = {"F32": "float32", "F16": "float16", "BF16": "bfloat16"}


def stored_dtype(gguf: GGUFFile) -> str:
    """The dtype ``dtype="auto"`` starts from (the device backend has the last word).

    A float file says it: its matrices' type. A quantised one says nothing: llama.cpp widens
    to float32 as it multiplies; here it is bfloat16, which halves the memory and traffic of
    the layers dequantised at load (the embeddings, Q6_K layers of ``*_K_M`` files) and runs
    the 4-bit GEMM on bf16 dot products where the processor has them; the CPU backend keeps
    float32 where bf16 would be slow.
    """
    types = {t.type_name for t in gguf.tensors.values() if len(t.shape) == 2}
    if len(types) == 1 and next(iter(types)) in _FLOAT_TYPES:
        return _FLOAT_TYPES[next(iter(types))]
    return "bfloat16"


def hf_config_from_gguf(gguf: GGUFFile) -> Any:
    """The config of the model in ``gguf``; ``GGUFFileError`` names what's off.

    A file whose rotary embedding is plain (every file llama.cpp writes without rope scaling,
    Llama 3's frequency factors included) gets a :class:`GGUFConfig`: the same attributes with
    the same values as the transformers config class would hold, without importing
    transformers (over a second of a GGUF start; ``tests/models/test_gguf_config.py`` holds the
    two side by side, attribute by attribute). Scaled rope (linear, YaRN, Phi-3's long rope) is
    computed by transformers' own functions, which read its config class: those files get it.
    """
    family, values = config_values(gguf)
    if values.get("rope_scaling") is None and family.light:
        return light_config(gguf, family.model_type, values)
    return transformers_config(gguf, family, values)


def config_values(gguf: GGUFFile) -> tuple[Family, dict[str, Any]]:
    """The family, and the keyword arguments of its transformers config class."""
    family = family_of(gguf)
    arch = gguf.architecture
    if family.encoder:  # an encoder, or a rank file's classifier: encoder.py
        values = encoder_config_values(gguf)
        values.setdefault("architectures", [family.architecture])  # a rank file: its classifier
        values["dtype"] = stored_dtype(gguf)
        return family, values
    values = _hyper_parameters(gguf, arch)
    params = _rope(gguf, arch, values)
    if arch == "phi3":
        _phi3_long_rope(gguf, params, values)
    if "rope_freqs.weight" in gguf.tensors:  # Llama 3's scaling, as factors per frequency
        import numpy as np

        raw = gguf.tensors["rope_freqs.weight"].raw
        values["rope_freq_factors"] = [float(x) for x in np.asarray(raw, dtype=np.float32)]
    vocab = gguf.metadata(f"{arch}.vocab_size", None)
    if vocab is None and "token_embd.weight" in gguf.tensors:
        vocab = gguf.tensors["token_embd.weight"].shape[0]
    if vocab is None:
        raise GGUFFileError(f"{gguf.path}: neither {arch}.vocab_size nor token_embd.weight")
    values["vocab_size"] = int(vocab)
    for attr, key in _SPECIAL_IDS.items():
        value = gguf.metadata(key, None)
        if value is not None:
            values[attr] = int(value)
    values["tie_word_embeddings"] = "output.weight" not in gguf.tensors
    if family.model_type in ("llama", "mistral"):
        values["attention_bias"] = "blk.0.attn_q.bias" in gguf.tensors
    if family.norm_plus_one:  # the Gemma families
        values.setdefault("head_dim", values["hidden_size"] // values["num_attention_heads"])
        values["hidden_activation"] = "gelu_pytorch_tanh"
    if arch == "gemma2":
        _gemma2(gguf, values)
    if arch == "gemma3":
        _gemma3(values)
    if family.moe:
        _experts(gguf, family, values)
    values.update(params)
    values["architectures"] = [family.architecture]
    values["dtype"] = stored_dtype(gguf)
    return family, values


def _expert_rows(gguf: GGUFFile, kind: str) -> int | None:
    """The output rows of the first ``blk.N.<kind>.weight`` (``[E, rows, K]`` for a stack)."""
    for name, tensor in gguf.tensors.items():
        if name.startswith("blk.") and name.endswith(f".{kind}.weight"):
            return int(tensor.shape[-2])
    return None


def _expert_sizes(gguf: GGUFFile, family: Family, values: dict[str, Any], experts: int) -> None:
    """The experts' width, from the metadata or the stacks' shapes, checked against every
    stack (each holds all ``experts``)."""
    arch = gguf.architecture
    rows = _expert_rows(gguf, "ffn_gate_exps")
    if family.experts_sized_by_ffn:
        size = values["intermediate_size"]
        if rows is not None and rows != size:
            raise GGUFFileError(
                f"{gguf.path}: expert stacks have {rows} rows where {arch}.feed_forward_length "
                f"says {size}"
            )
    else:
        size = gguf.metadata(f"{arch}.expert_feed_forward_length", None) or rows
        if size is None:
            raise GGUFFileError(
                f"{gguf.path}: {arch}.expert_feed_forward_length is missing and no "
                "ffn_gate_exps tensor gives it"
            )
        values["moe_intermediate_size"] = int(size)
    for name, tensor in gguf.tensors.items():  # every stack holds every expert
        if name.startswith("blk.") and "_exps." in name and tensor.shape[0] != experts:
            raise GGUFFileError(
                f"{gguf.path}: tensor {name!r} stacks {tensor.shape[0]} experts where "
                f"{arch}.expert_count says {experts}"
            )


def _experts(gguf: GGUFFile, family: Family, values: dict[str, Any]) -> None:
    """Expert count, top-k, sizes and routing of a MoE file.

    Qwen-MoE sizes come from ``expert_feed_forward_length`` /
    ``expert_shared_feed_forward_length`` (what llama.cpp's converter writes), else from the
    stacks' shapes, and layers without a router are dense (``mlp_only_layers``); Mixtral's and
    OLMoE's experts are ``feed_forward_length`` wide and every layer routes. llama.cpp
    renormalises the top-k weights of Qwen3-MoE and Mixtral, not Qwen2-MoE's or OLMoE's unless
    ``expert_weights_norm`` says so.
    """
    arch = gguf.architecture
    experts = int(gguf.metadata(f"{arch}.expert_count"))
    values[family.experts_field] = experts
    values["num_experts_per_tok"] = int(gguf.metadata(f"{arch}.expert_used_count"))
    _expert_sizes(gguf, family, values, experts)
    dense = [
        i
        for i in range(values["num_hidden_layers"])
        if f"blk.{i}.ffn_gate_inp.weight" not in gguf.tensors
    ]
    norm = gguf.metadata(f"{arch}.expert_weights_norm", None)
    if family.experts_sized_by_ffn:  # every layer routes (llama.cpp's rule for these files)
        if dense:
            raise GGUFFileError(
                f"{gguf.path}: tensor 'blk.{dense[0]}.ffn_gate_inp.weight' is missing: every "
                f"layer of a {family.model_type} file routes to experts"
            )
        if family.model_type == "olmoe":
            values["norm_topk_prob"] = bool(norm)
            clamp = gguf.metadata(f"{arch}.attention.clamp_kqv", None)
            if clamp is not None:
                values["clip_qkv"] = float(clamp)
        return
    shared = gguf.metadata(f"{arch}.expert_shared_feed_forward_length", None) or _expert_rows(
        gguf, "ffn_gate_shexp"
    )
    if shared is not None:
        values["shared_expert_intermediate_size"] = int(shared)
    values["norm_topk_prob"] = family.renormalize_top_k if norm is None else bool(norm)
    values["decoder_sparse_step"] = 1
    values["mlp_only_layers"] = dense


# Gemma 2 27B: the one size whose query scale is not head_dim's (llama.cpp tells it by its
# 46 layers; Google's config gives it query_pre_attn_scalar = hidden / heads = 144).
_GEMMA2_27B_LAYERS = 46


def _gemma2(gguf: GGUFFile, values: dict[str, Any]) -> None:
    """Gemma 2's soft caps (llama.cpp's converter writes both; the released models' 50 and 30
    where a file is silent) and query scale."""
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        value = gguf.metadata(f"gemma2.{key}", None)
        if value is not None:
            if not isinstance(value, int | float) or not 0 < value < float("inf"):
                raise GGUFFileError(f"{gguf.path}: gemma2.{key} must be > 0, got {value!r}")
            values[key] = float(value)
    values["query_pre_attn_scalar"] = _gemma_query_scalar(values, _GEMMA2_27B_LAYERS)


# Gemma 3 27B's layers, and the base of its local layers' rotation, which llama.cpp holds as a
# constant rather than a key (the global base is rope.freq_base).
_GEMMA3_27B_LAYERS = 62
_GEMMA3_LOCAL_ROPE_BASE = 10_000.0


def _gemma3(values: dict[str, Any]) -> None:
    """Gemma 3 as llama.cpp reads it: five local layers to one global (its class's default
    pattern), the local ones rotating at 10,000, the query scale by the same rule as Gemma 2's;
    no soft caps (the class's nulls)."""
    values["rope_local_base_freq"] = _GEMMA3_LOCAL_ROPE_BASE
    values["query_pre_attn_scalar"] = _gemma_query_scalar(values, _GEMMA3_27B_LAYERS)


def _gemma_query_scalar(values: dict[str, Any], layers_27b: int) -> int:
    """llama.cpp's query scale for Gemma 2 and 3 (no GGUF key holds it): ``head_dim``, or
    ``hidden / heads`` on the 27B, which it tells by its layer count."""
    if values["num_hidden_layers"] == layers_27b:
        return values["hidden_size"] // values["num_attention_heads"]
    return values["head_dim"]


def transformers_config(gguf: GGUFFile, family: Family, values: dict[str, Any]) -> Any:
    from transformers import AutoConfig

    try:
        return AutoConfig.for_model(family.model_type, **values)
    except (ValueError, TypeError) as exc:
        raise GGUFFileError(
            f"{gguf.path}: metadata does not make a valid {family.model_type} config "
            f"({' '.join(str(exc).split())})"
        ) from exc

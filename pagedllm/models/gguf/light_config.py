"""A GGUF file's config without transformers: what its config class would hold, as plain data.

Building a transformers config imports the whole transformers package (its lazy module scans
every model folder at import): over a second of a start that is otherwise torch, the file and
the weights. The model classes only read attributes, so :func:`light_config` gives them those
attributes with the values transformers' class for the family would give for the same keyword
arguments: its defaults where the metadata is silent, its ``__post_init__`` rules (Qwen's
sliding window only with ``use_sliding_window``, ``layer_types`` per layer, a derived
``head_dim``, the MoE classes' expert-count aliases), and the rotary settings in transformers
5's ``rope_parameters`` shape.
``tests/models/test_gguf_config.py`` builds both from the same files and compares them
attribute by attribute, including every attribute the engine's code reads from a config.
"""

from __future__ import annotations

from typing import Any

from pagedllm.models.gguf.reader import GGUFFile, GGUFFileError

# Per family: the class defaults of the attributes the metadata may leave out, and the fields
# the class declares that the model code reads (transformers 5's LlamaConfig, MistralConfig,
# Qwen2Config, Qwen3Config, Phi3Config, GemmaConfig, Gemma2Config, and the MoE classes below).
_SILU = {"hidden_act": "silu"}
_SPECIAL_1_2 = {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": None}
_QWEN = {
    **_SILU,
    "max_position_embeddings": 32768,
    "rms_norm_eps": 1e-6,
    "bos_token_id": None,
    "eos_token_id": None,
    "pad_token_id": None,
    "use_sliding_window": False,
    "sliding_window": 4096,
    "max_window_layers": 28,
}
_DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": {
        **_SILU,
        **_SPECIAL_1_2,
        "max_position_embeddings": 2048,
        "rms_norm_eps": 1e-6,
        "attention_bias": False,
        "mlp_bias": False,
    },
    "mistral": {
        **_SILU,
        **_SPECIAL_1_2,
        "max_position_embeddings": 4096 * 32,
        "rms_norm_eps": 1e-6,
        "sliding_window": 4096,
    },
    "qwen2": _QWEN,
    "qwen3": {**_QWEN, "head_dim": 128, "attention_bias": False},
    "phi3": {
        **_SILU,
        "max_position_embeddings": 4096,
        "original_max_position_embeddings": 4096,
        "rms_norm_eps": 1e-5,
        "bos_token_id": 1,
        "eos_token_id": 32000,
        "pad_token_id": 32000,
        "sliding_window": None,
    },
    "gemma": {
        "hidden_act": "gelu_pytorch_tanh",
        "max_position_embeddings": 8192,
        "rms_norm_eps": 1e-6,
        "pad_token_id": 0,
        "eos_token_id": 1,
        "bos_token_id": 2,
        "attention_bias": False,
        "head_dim": 256,
    },
}
_DEFAULTS["gemma2"] = {
    **{k: v for k, v in _DEFAULTS["gemma"].items() if k != "hidden_act"},
    "hidden_activation": "gelu_pytorch_tanh",
    "query_pre_attn_scalar": 256,
    "sliding_window": 4096,
    "final_logit_softcapping": 30.0,
    "attn_logit_softcapping": 50.0,
}
# The mixture-of-experts classes (Qwen2MoeConfig, Qwen3MoeConfig, MixtralConfig, OlmoeConfig).
_QWEN_MOE = {
    **{k: v for k, v in _QWEN.items() if k != "max_window_layers"},
    "decoder_sparse_step": 1,
    "norm_topk_prob": False,
    "mlp_only_layers": [],
    "moe_intermediate_size": 1408,
}
_DEFAULTS["qwen2_moe"] = {
    **_QWEN_MOE,
    "max_window_layers": 28,
    "qkv_bias": True,
    "shared_expert_intermediate_size": 5632,
    "num_experts": 60,
}
_DEFAULTS["qwen3_moe"] = {
    **_QWEN_MOE,
    "sliding_window": None,
    "attention_bias": False,
    "moe_intermediate_size": 768,
    "num_experts": 128,
}
_DEFAULTS["mixtral"] = {
    **_SILU,
    **_SPECIAL_1_2,
    "max_position_embeddings": 4096 * 32,
    "rms_norm_eps": 1e-5,
    "head_dim": None,
    "sliding_window": None,
    "num_local_experts": 8,
}
_DEFAULTS["olmoe"] = {
    **_SILU,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-5,
    "pad_token_id": 1,
    "bos_token_id": None,
    "eos_token_id": 50279,
    "attention_bias": False,
    "clip_qkv": None,
    "norm_topk_prob": False,
    "num_experts": 64,
}
# The classes' ``attribute_map``: one value under two names (the stored one first).
_ALIASES = {
    "qwen3_moe": ("num_experts", "num_local_experts"),
    "mixtral": ("num_local_experts", "num_experts"),
    "olmoe": ("num_experts", "num_local_experts"),
}
_DERIVED_HEAD_DIM = ("llama", "mistral")  # head_dim None -> hidden_size // num_attention_heads
_DTYPES = ("float32", "float16", "bfloat16")


class GGUFConfig:
    """Plain attributes in place of a transformers config (picklable, for worker processes)."""

    def __init__(self, **values: Any) -> None:
        self.__dict__.update(values)

    @property
    def rope_scaling(self) -> dict[str, Any]:
        """transformers 5's alias of ``rope_parameters``."""
        return self.rope_parameters

    @property
    def torch_dtype(self) -> Any:
        """transformers' older name of ``dtype``."""
        return self.dtype

    def __repr__(self) -> str:
        body = ", ".join(f"{k}={v!r}" for k, v in sorted(vars(self).items()))
        return f"GGUFConfig({body})"


def light_config(gguf: GGUFFile, model_type: str, values: dict[str, Any]) -> GGUFConfig:
    """The config of a file with plain rope from the keyword arguments that
    ``AutoConfig.for_model(model_type, **values)`` would take."""
    values = dict(values)
    if values.pop("rope_scaling", None) is not None:
        raise ValueError("light_config: scaled rope takes transformers' config class")
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": values.pop("rope_theta")}
    if "partial_rotary_factor" in values:
        rope["partial_rotary_factor"] = values["partial_rotary_factor"]
        if model_type != "phi3":  # Phi3Config alone also keeps it as an attribute
            del values["partial_rotary_factor"]
    elif model_type == "phi3":
        rope["partial_rotary_factor"] = 1.0
    out = {**_DEFAULTS[model_type], **values, "model_type": model_type, "rope_parameters": rope}
    if out.get("head_dim") is None and model_type in _DERIVED_HEAD_DIM:
        out["head_dim"] = out["hidden_size"] // out["num_attention_heads"]
    if model_type in _ALIASES:
        stored, alias = _ALIASES[model_type]
        out[alias] = out[stored] = out.pop(alias, out[stored])
    if model_type == "qwen2_moe":  # its own window rules: 0 when off, odd layers when on
        if not out["use_sliding_window"]:
            out["sliding_window"] = 0
        out["layer_types"] = [
            "sliding_attention"
            if (i + 1) % 2 and i < out["max_window_layers"] and out["use_sliding_window"]
            else "full_attention"
            for i in range(out["num_hidden_layers"])
        ]
    if model_type == "qwen3_moe" and not out["use_sliding_window"]:
        out["sliding_window"] = None
    if model_type in ("qwen2", "qwen3"):
        if not out["use_sliding_window"]:
            out["sliding_window"] = None
        out["layer_types"] = [
            "sliding_attention"
            if out["sliding_window"] is not None and i >= out["max_window_layers"]
            else "full_attention"
            for i in range(out["num_hidden_layers"])
        ]
    if model_type == "gemma2":  # local (windowed) attention on even layers, global on odd
        out["layer_types"] = [
            "sliding_attention" if i % 2 == 0 else "full_attention"
            for i in range(out["num_hidden_layers"])
        ]
    _check(gguf, model_type, out)
    import torch

    out["dtype"] = getattr(torch, out["dtype"])
    return GGUFConfig(**out)


def _check(gguf: GGUFFile, model_type: str, values: dict[str, Any]) -> None:
    """What transformers' validation would refuse, as the one-line error the loader gives."""
    problems = []
    for key in ("hidden_size", "num_hidden_layers", "intermediate_size", "vocab_size"):
        if not isinstance(values[key], int) or values[key] <= 0:
            problems.append(f"{key} must be a positive integer, got {values[key]!r}")
    heads, kv = values["num_attention_heads"], values["num_key_value_heads"]
    if not isinstance(heads, int) or heads <= 0 or not isinstance(kv, int) or kv <= 0:
        problems.append(f"head counts must be positive integers, got {heads!r} and {kv!r}")
    elif heads % kv:
        problems.append(f"num_attention_heads {heads} is not a multiple of {kv} KV heads")
    if values["dtype"] not in _DTYPES:
        problems.append(f"dtype {values['dtype']!r}")
    if problems:
        raise GGUFFileError(
            f"{gguf.path}: metadata does not make a valid {model_type} config "
            f"({'; '.join(problems)})"
        )

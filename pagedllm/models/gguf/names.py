"""GGUF tensor names -> the Hugging Face names our models load, and which linear module each
tensor fills (llama.cpp's ``blk.N.<kind>`` per layer, ``token_embd``/``output``/``output_norm``
for the tables), per family: Phi-3's fused gate/up, Gemma 2/3's sandwich norms, MoE tensors.
"""

from __future__ import annotations

import re

from pagedllm.models.gguf.config import Family
from pagedllm.models.gguf.encoder import encoder_hf_name
from pagedllm.models.safetensors_reader import CheckpointError

# GGUF tensor kind -> (Hugging Face module path under model.layers.N, our fused module's name).
_LAYER_TENSORS: dict[str, tuple[str, str | None]] = {
    "attn_q": ("self_attn.q_proj", "self_attn.qkv_proj"),
    "attn_k": ("self_attn.k_proj", "self_attn.qkv_proj"),
    "attn_v": ("self_attn.v_proj", "self_attn.qkv_proj"),
    "attn_qkv": ("self_attn.qkv_proj", "self_attn.qkv_proj"),
    "attn_output": ("self_attn.o_proj", "self_attn.o_proj"),
    "ffn_gate": ("mlp.gate_proj", "mlp.gate_up_proj"),
    "ffn_up": ("mlp.up_proj", "mlp.gate_up_proj"),
    "ffn_down": ("mlp.down_proj", "mlp.down_proj"),
    "attn_norm": ("input_layernorm", None),
    "ffn_norm": ("post_attention_layernorm", None),  # Gemma 2: pre_feedforward_layernorm
    "post_attention_norm": ("post_attention_layernorm", None),  # Gemma 2/3's norms on outputs
    "post_ffw_norm": ("post_feedforward_layernorm", None),
    "attn_q_norm": ("self_attn.q_norm", None),
    "attn_k_norm": ("self_attn.k_norm", None),
    # Mixture of experts: the router, Qwen2-MoE's shared expert and its gate.
    "ffn_gate_inp": ("mlp.gate", None),
    "ffn_gate_shexp": ("mlp.shared_expert.gate_proj", "mlp.shared_expert.gate_up_proj"),
    "ffn_up_shexp": ("mlp.shared_expert.up_proj", "mlp.shared_expert.gate_up_proj"),
    "ffn_down_shexp": ("mlp.shared_expert.down_proj", "mlp.shared_expert.down_proj"),
    "ffn_gate_inp_shexp": ("mlp.shared_expert_gate", None),
}
# Stacked expert tensors ``[E, N, K]`` -> the projection each expert's slice is.
EXPERT_STACKS = {
    "ffn_gate_exps": "gate_proj",
    "ffn_up_exps": "up_proj",
    "ffn_down_exps": "down_proj",
}
_MOE_ONLY = (
    "ffn_gate_inp",
    "ffn_gate_shexp",
    "ffn_up_shexp",
    "ffn_down_shexp",
    "ffn_gate_inp_shexp",
)
_SANDWICH_ONLY = ("post_attention_norm", "post_ffw_norm")
_GLOBAL_TENSORS = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
# The tables that may stay quantised, by GGUF name -> our module's name.
_TABLE_MODULES = {"token_embd": "embed_tokens", "output": "lm_head"}
# Tensors that configure rather than weigh (read by the config, or unused by the reference).
NOT_WEIGHTS = ("rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight")
BLOCK_NAME = re.compile(r"^blk\.(\d+)\.([a-z_]+)\.(weight|bias)$")
# One expert's tensor, as llama.cpp's converter wrote Mixtral before it stacked them (2024).
_SPLIT_EXPERT = re.compile(r"^blk\.\d+\.ffn_(gate|up|down)\.\d+\.weight$")


def hf_name(gguf_name: str, family: Family) -> tuple[str, str | None]:
    """(Hugging Face tensor name, our linear module's name or None) of one GGUF tensor."""
    if family.encoder:
        return encoder_hf_name(gguf_name, family.encoder)
    match = BLOCK_NAME.match(gguf_name)
    if match:
        layer, kind, suffix = match.groups()
        if family.moe and kind in EXPERT_STACKS:  # split per expert: GGUFWeights._experts
            return f"model.layers.{layer}.mlp.experts.{kind}.{suffix}", None
        if kind not in _LAYER_TENSORS or (kind in _MOE_ONLY and not family.moe):
            raise CheckpointError(f"tensor {gguf_name!r} has no place in a {family.model_type}")
        path, module = _LAYER_TENSORS[kind]
        if family.model_type == "phi3" and kind == "ffn_up":
            path, module = "mlp.gate_up_proj", "mlp.gate_up_proj"  # Phi-3 fuses gate and up
        if family.sandwich_norms and kind == "ffn_norm":
            path = "pre_feedforward_layernorm"  # its post_attention_norm takes Llama's name
        elif kind in _SANDWICH_ONLY and not family.sandwich_norms:
            raise CheckpointError(f"tensor {gguf_name!r} has no place in a {family.model_type}")
        module_name = None if module is None else f"layers.{layer}.{module}"
        return f"model.layers.{layer}.{path}.{suffix}", module_name
    stem, _, suffix = gguf_name.rpartition(".")
    if stem in _GLOBAL_TENSORS:
        return f"{_GLOBAL_TENSORS[stem]}.{suffix}", _TABLE_MODULES.get(stem)
    if _SPLIT_EXPERT.match(gguf_name):
        raise CheckpointError(
            f"tensor {gguf_name!r} is one expert of an early-2024 file (one tensor per expert, "
            "which llama.cpp no longer reads either): convert the model again for stacked "
            "ffn_*_exps tensors"
        )
    raise CheckpointError(f"tensor {gguf_name!r} has no place in a {family.model_type}")


def is_expert_stack(gguf_name: str) -> bool:
    match = BLOCK_NAME.match(gguf_name)
    return match is not None and match.group(2) in EXPERT_STACKS

"""GGUF files for tests, written with ggml's own ``gguf`` package from tiny Hugging Face models.

What llama.cpp's converter does, for our tiny models: metadata under ``<arch>.*``, the
tokenizer as ``tokenizer.ggml.*`` (byte-level BPE: tokens, types, merges, special ids, chat
template), Llama's q/k rows interleaved for llama.cpp's rotary, Gemma's norms stored as
``1 + w`` (Gemma 2's four a layer under their llama.cpp names, its caps and window as keys).
Each tensor is written in the type a recipe names: types the ``gguf`` package quantises (F32,
F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, TQ1_0, TQ2_0) from the model's weights; the others
(the K-quants, the IQ types, MXFP4), which it only reads, as random valid blocks of a similar
magnitude (the reference is transformers reading the same file, so any valid weights serve).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import numpy as np
import torch

CHAT_TEMPLATE = (
    "{% for m in messages %}<s>{{ m['role'] }}\n{{ m['content'] }}</s>\n{% endfor %}"
    "{% if add_generation_prompt %}<s>assistant\n{% endif %}"
)
K_TYPES = ("Q4_K", "Q5_K", "Q6_K")

# Hugging Face name (under model.layers.N.) -> GGUF kind.
_LAYER_NAMES = {
    "self_attn.q_proj": "attn_q",
    "self_attn.qkv_proj": "attn_qkv",  # Phi-3's fused projections
    "mlp.gate_up_proj": "ffn_up",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    # Mixture of experts: the router (Mixtral's under its block's name), Qwen2-MoE's shared
    # expert and its gate.
    "mlp.gate": "ffn_gate_inp",
    "block_sparse_moe.gate": "ffn_gate_inp",
    "mlp.shared_expert.gate_proj": "ffn_gate_shexp",
    "mlp.shared_expert.up_proj": "ffn_up_shexp",
    "mlp.shared_expert.down_proj": "ffn_down_shexp",
    "mlp.shared_expert_gate": "ffn_gate_inp_shexp",
}
# Per-expert projections, stacked [E, N, K] into one tensor each as llama.cpp's converter does.
# Mixtral's block is ``block_sparse_moe`` and its projections w1 (gate), w3 (up), w2 (down).
_EXPERT = re.compile(
    r"^model\.layers\.(\d+)\.(?:mlp|block_sparse_moe)\.experts\.(\d+)"
    r"\.(gate_proj|up_proj|down_proj|w1|w3|w2)\.weight$"
)
_EXPERT_PROJ = {
    "gate_proj": "gate",
    "w1": "gate",
    "up_proj": "up",
    "w3": "up",
    "down_proj": "down",
    "w2": "down",
}
_GLOBAL_NAMES = {
    "model.embed_tokens": "token_embd",
    "model.norm": "output_norm",
    "lm_head": "output",
}


_SANDWICH = ("gemma2", "gemma3")
# Gemma 2 and 3's four norms a layer, as llama.cpp's converter names them.
_GEMMA2_NORMS = {
    "post_attention_layernorm": "post_attention_norm",
    "pre_feedforward_layernorm": "ffn_norm",
    "post_feedforward_layernorm": "post_ffw_norm",
}


def gguf_name(hf_name: str, arch: str = "llama") -> str:
    stem, _, suffix = hf_name.rpartition(".")
    if stem.startswith("model.layers."):
        _, _, layer, rest = stem.split(".", 3)
        names = {**_LAYER_NAMES, **_GEMMA2_NORMS} if arch in _SANDWICH else _LAYER_NAMES
        return f"blk.{layer}.{names[rest]}.{suffix}"
    return f"{_GLOBAL_NAMES[stem]}.{suffix}"


_PERMUTED = ("llama", "mistral")  # the families whose q/k rows llama.cpp's converter interleaves


def permute_rows(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's converter's q/k interleave (the inverse of our loader's ``unpermute_rows``)."""
    return (
        w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
    )


def _random_k_blocks(kind: str, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """Random valid K-quant blocks ``[rows, cols/256 * type_size]`` with weights of ~0.1."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    qtype = GGMLQuantizationType[kind]
    type_size = GGML_QUANT_SIZES[qtype][1]
    blocks = rng.integers(0, 256, size=(rows, cols // 256, type_size), dtype=np.uint8)
    if kind == "Q6_K":  # int8 scales then float16 d at the end
        scales = rng.integers(-48, 48, size=(rows, cols // 256, 16)).astype(np.int8)
        blocks[..., 192:208] = scales.view(np.uint8)
        blocks[..., 208:210] = _f16_bytes(rows, cols, 0.08 / (24 * 16), rng)
    else:
        levels = 15 if kind == "Q4_K" else 31
        blocks[..., 0:2] = _f16_bytes(rows, cols, 0.16 / (32 * levels), rng)  # d
        blocks[..., 2:4] = _f16_bytes(rows, cols, 0.08 / 32, rng)  # dmin
    return blocks.reshape(rows, -1)


# The types ggml's package reads but cannot write beyond the K-quants above, and where each keeps
# its fp16 factors (byte offsets in a block). IQ1_M spreads its one fp16 over the top nibbles of
# four uint16 (bytes 48-55); MXFP4 has a power-of-two exponent byte (E8M0) at 0.
_F16_FIELDS: dict[str, tuple[int, ...]] = {
    "Q2_K": (80, 82),
    "Q3_K": (108,),
    "IQ4_NL": (0,),
    "IQ4_XS": (0,),
    "IQ3_S": (0,),
    "IQ3_XXS": (0,),
    "IQ2_S": (0,),
    "IQ2_XS": (0,),
    "IQ2_XXS": (0,),
    "IQ1_S": (0,),
    "IQ1_M": (),
    "MXFP4": (),
}
READ_ONLY_TYPES = (*K_TYPES, *_F16_FIELDS)
# A type ggml has and pagedllm does not read (Nvidia's FP4, new in ggml), for the refusal test.
REFUSED_TYPES = ("NVFP4",)


def _set_factors(kind: str, blocks: np.ndarray, factors: np.ndarray) -> None:
    """Write ``factors [rows, blocks]`` (float32) into every fp16 factor field of ``blocks``."""
    half = factors.astype(np.float16)
    if kind == "IQ1_M":
        bits = half.view(np.uint16)
        scales = np.ascontiguousarray(blocks[..., 48:56]).view(np.uint16)  # [rows, blocks, 4]
        for i in range(4):  # nibble i of the fp16 in the top nibble of scale word i
            nibble = (bits >> np.uint16(4 * i)) & np.uint16(0xF)
            scales[..., i] = (scales[..., i] & np.uint16(0x0FFF)) | (nibble << np.uint16(12))
        blocks[..., 48:56] = scales.view(np.uint8)
        return
    if kind == "MXFP4":  # the nearest power of two: exponent byte e means 2^(e - 128)
        exponent = np.clip(np.round(np.log2(factors)) + 128, 1, 254)
        blocks[..., 0] = exponent.astype(np.uint8)
        return
    for start in _F16_FIELDS[kind]:
        blocks[..., start : start + 2] = half[..., None].view(np.uint8)


def _random_read_only_blocks(
    kind: str, rows: int, cols: int, rng: np.random.Generator
) -> np.ndarray:
    """Random valid blocks ``[rows, cols/block * type_size]`` of a type ggml's package only
    reads, with weights of ~0.05 RMS: random bytes, and factors scaled so (every dequantised
    weight is proportional to its block's factors)."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, quants

    qtype = GGMLQuantizationType[kind]
    block, type_size = GGML_QUANT_SIZES[qtype]
    blocks = rng.integers(0, 256, size=(rows, cols // block, type_size), dtype=np.uint8)
    ones = np.ones((rows, cols // block), dtype=np.float32)
    _set_factors(kind, blocks, ones)
    unit = quants.dequantize(blocks.reshape(rows, -1), qtype).reshape(rows, -1, block)
    rms = np.sqrt((unit.astype(np.float64) ** 2).mean(axis=-1)) + 1e-12
    _set_factors(kind, blocks, (0.05 / rms * rng.uniform(0.5, 1.5, size=rms.shape)))
    return blocks.reshape(rows, -1)


def _f16_bytes(rows: int, cols: int, scale: float, rng: np.random.Generator) -> np.ndarray:
    values = (rng.uniform(0.5, 1.5, size=(rows, cols // 256)) * scale).astype(np.float16)
    return values[..., None].view(np.uint8).reshape(rows, cols // 256, 2)


def _encode(
    name: str, w: np.ndarray, kind: str, rng: np.random.Generator
) -> tuple[np.ndarray, Any]:
    from gguf import GGMLQuantizationType, quants

    qtype = GGMLQuantizationType[kind]
    if kind == "F32":
        return w.astype(np.float32), qtype
    if kind == "F16":
        return w.astype(np.float16), qtype
    if kind in K_TYPES:
        return _random_k_blocks(kind, w.shape[0], w.shape[1], rng), qtype
    if kind in READ_ONLY_TYPES:
        return _random_read_only_blocks(kind, w.shape[0], w.shape[1], rng), qtype
    if kind in REFUSED_TYPES:  # bytes pagedllm never reads: it refuses the type by name
        from gguf import GGML_QUANT_SIZES

        block, type_size = GGML_QUANT_SIZES[qtype]
        size = (w.shape[0], w.shape[1] // block * type_size)
        return rng.integers(0, 256, size=size, dtype=np.uint8), qtype
    return quants.quantize(w.astype(np.float32), qtype), qtype


def write_gguf(
    hf_folder: Path,
    out: Path,
    *,
    recipe: dict[str, str] | None = None,
    default: str = "F32",
    arch: str | None = None,
    seed: int = 0,
    with_tokenizer: bool = True,
    metadata: dict[str, Any] | None = None,
    drop_keys: tuple[str, ...] = (),
    split_experts: bool = False,
) -> Path:
    """Write the model in ``hf_folder`` as the GGUF file ``out``.

    ``recipe``: GGUF kind (``attn_q``, ``ffn_down``, ``token_embd``, ``ffn_gate_exps``...) ->
    tensor type for the 2-D weights and expert stacks; others get ``default``; 1-D tensors
    (norms, biases) are always F32, as llama.cpp keeps them. ``metadata``: keys added, or
    written in place of the converter's; ``drop_keys``: the converter's keys left out;
    ``split_experts``: one tensor per expert (``blk.N.ffn_gate.E.weight``), as llama.cpp's
    converter wrote Mixtral before it stacked experts (early 2024), typed as the stack would be.
    """
    import gguf
    from safetensors.torch import load_file
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(str(hf_folder))
    # llama.cpp's converter writes Mistral models as "llama" (same tensors, same rotary).
    arch = arch or {
        "mistral": "llama",
        "gemma3_text": "gemma3",
        "qwen2_moe": "qwen2moe",
        "qwen3_moe": "qwen3moe",
        "mixtral": "llama",  # Mixtral too: a llama file with expert stacks
    }.get(config.model_type, config.model_type)
    writer = gguf.GGUFWriter(str(out), arch)
    _write_metadata(writer, config, arch)
    if with_tokenizer:
        _write_tokenizer(writer, hf_folder)
    for key, value in (metadata or {}).items():  # added, or in place of the converter's
        writer.kv_data[0].pop(key, None)
        _add_value(writer, key, value)
    for key in drop_keys:  # a file that lacks a key the converter writes
        del writer.kv_data[0][key]
    tensors = {}
    for file in sorted(hf_folder.glob("*.safetensors")):
        tensors.update(load_file(str(file)))
    rng = np.random.default_rng(seed)
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    tensors = _split_experts(tensors) if split_experts else _stack_experts(tensors)
    for name, tensor in tensors.items():
        if config.tie_word_embeddings and name == "lm_head.weight":
            continue
        w = tensor.float().numpy()
        if name.endswith("shared_expert_gate.weight"):
            w = w.reshape(-1)  # llama.cpp keeps the shared expert's gate as a vector
        target = name if name.startswith("blk.") else gguf_name(name, arch)
        kind = target.split(".")[-2]
        if kind.isdigit():  # one expert of a split stack: the stack's type
            kind = f"{target.split('.')[-3]}_exps"
        if arch in _PERMUTED and kind in ("attn_q", "attn_k"):
            w = permute_rows(w, heads if kind == "attn_q" else kv_heads)
        if arch in ("gemma", *_SANDWICH) and target.endswith("norm.weight"):
            w = w + 1.0
        ttype = (recipe or {}).get(kind, default) if w.ndim >= 2 else "F32"
        if w.ndim == 3:  # an expert stack: encoded as [E * N, K] rows
            data, qtype = _encode(target, w.reshape(-1, w.shape[-1]), ttype, rng)
            data = data.reshape(*w.shape[:2], -1)
        else:
            data, qtype = _encode(target, w, ttype, rng)
        if data.dtype == np.uint8:
            writer.add_tensor(target, data, raw_dtype=qtype)
        else:
            writer.add_tensor(target, np.ascontiguousarray(data))
    factors = llama3_rope_factors(config)
    if factors is not None:  # the converter's form of Llama 3's rope scaling: a tensor
        writer.add_tensor("rope_freqs.weight", factors)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def _split_experts(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Per-expert tensors under llama.cpp's old per-expert names ``blk.N.ffn_gate.E.weight``."""
    out: dict[str, torch.Tensor] = {}
    for name, tensor in tensors.items():
        m = _EXPERT.match(name)
        if m is None:
            out[name] = tensor
        else:
            layer, expert, proj = m.groups()
            out[f"blk.{layer}.ffn_{_EXPERT_PROJ[proj]}.{expert}.weight"] = tensor
    return out


def _stack_experts(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Per-expert tensors -> ``blk.N.ffn_{gate,up,down}_exps.weight`` stacks, in expert order."""
    out: dict[str, torch.Tensor] = {}
    stacks: dict[str, dict[int, torch.Tensor]] = {}
    for name, tensor in tensors.items():
        m = _EXPERT.match(name)
        if m is None:
            out[name] = tensor
            continue
        layer, expert, proj = m.groups()
        stacks.setdefault(f"blk.{layer}.ffn_{_EXPERT_PROJ[proj]}_exps.weight", {})[int(expert)] = (
            tensor
        )
    for name, experts in stacks.items():
        out[name] = torch.stack([experts[e] for e in range(len(experts))])
    return out


def llama3_rope_factors(config: Any) -> np.ndarray | None:
    """Per-frequency divisors for ``rope_type: llama3``, as llama.cpp's converter computes them:
    1 for short wavelengths, ``factor`` for long ones, a smooth blend between."""
    import math

    rope = getattr(config, "rope_parameters", None) or {}
    if rope.get("rope_type") != "llama3":
        return None
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    base, factor = rope["rope_theta"], rope["factor"]
    low, high = rope["low_freq_factor"], rope["high_freq_factor"]
    old = rope["original_max_position_embeddings"]
    out = []
    for i in range(0, head_dim, 2):
        wavelen = 2 * math.pi / (1.0 / base ** (i / head_dim))
        if wavelen < old / high:
            out.append(1.0)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


def _add_value(writer: Any, key: str, value: Any) -> None:
    if isinstance(value, bool):
        writer.add_bool(key, value)
    elif isinstance(value, int):
        writer.add_uint32(key, value)
    elif isinstance(value, float):
        writer.add_float32(key, value)
    elif isinstance(value, str):
        writer.add_string(key, value)
    else:
        writer.add_array(key, value)


def _write_metadata(writer: Any, config: Any, arch: str) -> None:
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    rope = getattr(config, "rope_parameters", None) or {}
    if arch == "gemma3":  # the global layers' settings; the local base is llama.cpp's 10,000
        assert rope["sliding_attention"]["rope_theta"] == 1e4, "llama.cpp's fixed local base"
        rope = rope["full_attention"]
        if rope.get("rope_type") == "linear":
            from gguf import RopeScalingType

            writer.add_rope_scaling_type(RopeScalingType.LINEAR)
            writer.add_rope_scaling_factor(rope["factor"])
    theta = rope.get("rope_theta", 10000.0)
    partial = rope.get("partial_rotary_factor") or getattr(config, "partial_rotary_factor", 1.0)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_rope_freq_base(float(theta))
    writer.add_rope_dimension_count(int(head_dim * (partial or 1.0)))
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_vocab_size(config.vocab_size)
    writer.add_file_type(0)
    if arch in _SANDWICH:
        writer.add_sliding_window(config.sliding_window)
    experts = getattr(config, "num_local_experts", None) or getattr(config, "num_experts", None)
    if experts:  # what llama.cpp's converter adds for the MoE families
        writer.add_expert_count(experts)
        writer.add_expert_used_count(config.num_experts_per_tok)
    if arch in ("qwen2moe", "qwen3moe"):  # their experts' size apart from the dense MLP's
        writer.add_expert_feed_forward_length(config.moe_intermediate_size)
        if arch == "qwen2moe":
            writer.add_expert_shared_feed_forward_length(config.shared_expert_intermediate_size)
    if getattr(config, "clip_qkv", None) is not None:  # OLMoE
        writer.add_clamp_kqv(float(config.clip_qkv))
    if arch == "gemma2":  # what llama.cpp's converter adds for Gemma 2
        writer.add_attn_logit_softcapping(config.attn_logit_softcapping)
        writer.add_final_logit_softcapping(config.final_logit_softcapping)


def _write_tokenizer(writer: Any, hf_folder: Path) -> None:
    """Byte-level BPE as llama.cpp's converter writes a ``gpt2``-model tokenizer."""
    spec = json.loads((hf_folder / "tokenizer.json").read_text())
    vocab: dict[str, int] = spec["model"]["vocab"]
    added = {t["content"]: t["id"] for t in spec.get("added_tokens", [])}
    size = max([*vocab.values(), *added.values()]) + 1
    tokens = [""] * size
    types = [1] * size
    for token, index in vocab.items():
        tokens[index] = token
    for token, index in added.items():
        tokens[index] = token
        types[index] = 3  # control
    merges = [m if isinstance(m, str) else " ".join(m) for m in spec["model"]["merges"]]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    writer.add_bos_token_id(added["<s>"])
    writer.add_eos_token_id(added["</s>"])
    writer.add_pad_token_id(added["<pad>"])
    writer.add_add_bos_token(False)
    writer.add_chat_template(CHAT_TEMPLATE)


def dequantised_source(path: Path, source: Path, out: Path) -> Path:
    """The model ``path`` was written from, with every weight replaced by the file's, as ggml's
    ``gguf`` package dequantises it: a Hugging Face folder (the source's config and tokenizer)
    for transformers to run where its own GGUF reader lacks the family (Mixtral, OLMoE). The
    writer's steps are undone here: names, expert stacks, q/k interleave, Gemma's ``1 + w``."""
    import shutil

    from gguf import GGUFReader
    from gguf.quants import dequantize
    from safetensors.torch import load_file, save_file
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(str(source))
    arch = GGUFReader(str(path)).fields["general.architecture"].contents()
    stored = {}
    for t in GGUFReader(str(path)).tensors:
        values = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32)
        stored[t.name] = values.reshape(tuple(int(d) for d in reversed(t.shape.tolist())))
    out.mkdir(parents=True, exist_ok=True)
    weights: dict[str, torch.Tensor] = {}
    for file in sorted(source.glob("*.safetensors")):
        for name, tensor in load_file(str(file)).items():
            m = _EXPERT.match(name)
            if m is not None:
                layer, expert, proj = m.groups()
                w = stored[f"blk.{layer}.ffn_{_EXPERT_PROJ[proj]}_exps.weight"][int(expert)]
            elif config.tie_word_embeddings and name == "lm_head.weight":
                continue
            else:
                target = gguf_name(name, arch)
                w = stored[target]
                kind = target.split(".")[-2]
                if arch in _PERMUTED and kind in ("attn_q", "attn_k"):
                    heads = config.num_attention_heads
                    n = heads if kind == "attn_q" else config.num_key_value_heads
                    w = w.reshape(n, -1, 2, w.shape[-1]).swapaxes(1, 2).reshape(w.shape)
                if arch in ("gemma", *_SANDWICH) and target.endswith("norm.weight"):
                    w = w - 1.0
            weights[name] = torch.from_numpy(np.array(w, dtype=np.float32)).reshape(tensor.shape)
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    for file in source.iterdir():
        if file.suffix != ".safetensors" and file.is_file():
            shutil.copy(file, out / file.name)
    return out


def hf_gguf_greedy(
    path: Path,
    prompts: list[list[int]],
    max_new_tokens: int,
    dtype: torch.dtype = torch.float32,
    config_from: Path | None = None,
) -> list[Any]:
    """transformers' own GGUF loading (dequantised to ``dtype``), greedy: the reference;
    ``config_from``: the source folder whose config it builds the model from."""
    from tests.hf_reference import hf_greedy

    name = str(dtype).removeprefix("torch.")
    return hf_greedy(
        path.parent,
        prompts,
        max_new_tokens,
        dtype=name,
        gguf_file=path.name,
        config_from=config_from,
    )


LOGIT_IDS = [5, 9, 17, 33, 65, 7, 11, 13, 3, 21, 40, 41, 42, 43, 44, 45, 46, 47, 48, 49]


def llama_cpp_vs_source(source: Path, path: Path) -> float:
    """Largest gap between llama.cpp's float32 logits on ``path`` (float32 KV cache, as
    transformers keeps) and transformers' on the model ``path`` was written from, over
    :data:`LOGIT_IDS`. Needs llama-cpp-python (callers skip without it)."""
    import llama_cpp
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        str(source), dtype=torch.float32, attn_implementation="eager"
    ).eval()
    with torch.no_grad():
        want = model(torch.tensor([LOGIT_IDS])).logits[0].numpy()
    f32 = 0  # GGML_TYPE_F32
    llm = llama_cpp.Llama(
        str(path), n_ctx=64, logits_all=True, verbose=False, n_threads=2, type_k=f32, type_v=f32
    )
    llm.eval(LOGIT_IDS)
    return float(np.abs(np.asarray(llm.scores[: len(LOGIT_IDS)]) - want).max())

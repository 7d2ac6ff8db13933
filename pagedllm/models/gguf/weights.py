"""A GGUF file's tensors as the named checkpoint tensors our models load.

Each ``blk.N.<kind>`` tensor gets its Hugging Face name. What it becomes depends on the layer's
plan (:func:`plan_layers`): a linear layer in a type some group-wise format of
:mod:`pagedllm.layers.quantization.groupwise` holds exactly (``KEPT_AS``: Q4_0, Q4_1, Q4_K as
int4; Q8_0, Q5_0, IQ4_NL, IQ4_XS as 8-bit groups; Q6_K, Q3_K as q6_k; Q5_K as q5_k) stays
quantised when the device runs that format natively (a fused layer whose parts are in
different formats keeps each part in its own, a part in none dequantised alone); everything
else is dequantised by ggml's own
``gguf.quants`` to float32 here and rounded to the compute dtype as it is copied in. llama.cpp's
converter interleaves the q/k rows of Llama-family models for its rotary kernel; the rows are
put back (a row permutation, so it applies to quantised rows too).
"""

from __future__ import annotations

import logging
import re
from collections import Counter
from collections.abc import Callable, Iterator

import numpy as np
import torch

from pagedllm.layers.quantization.groupwise_parts import DENSE
from pagedllm.models.gguf.config import Family
from pagedllm.models.gguf.reader import GGUFFile, GGUFTensor
from pagedllm.models.safetensors_reader import CheckpointError

logger = logging.getLogger(__name__)

# A device backend's kernel for int4_groups, int8_groups and q6_k_groups: (blocks uint8
# [N, row bytes], type name) -> their arrays as torch tensors, bit for bit.
BlockDecoder = Callable[[torch.Tensor, str], tuple[torch.Tensor, ...]]

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
# The part each tensor of a fused layer fills (its shard id in the model's weight mapper).
_FUSED_PARTS = {
    "attn_q": 0, "attn_k": 1, "attn_v": 2, "ffn_gate": 0, "ffn_up": 1,
    "ffn_gate_shexp": 0, "ffn_up_shexp": 1,
}  # fmt: skip
# Tensors that configure rather than weigh (read by the config, or unused by the reference).
NOT_WEIGHTS = ("rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight")
_BLOCK = re.compile(r"^blk\.(\d+)\.([a-z_]+)\.(weight|bias)$")
# One expert's tensor, as llama.cpp's converter wrote Mixtral before it stacked them (2024).
_SPLIT_EXPERT = re.compile(r"^blk\.\d+\.ffn_(gate|up|down)\.\d+\.weight$")

INT4_TYPES = ("Q4_0", "Q4_1", "Q4_K")
# Kept as int8 q times a float32 scale per 32 weights, exactly (each weight the float32 that
# ggml's dequantisation gives): Q8_0 (q * d), Q5_0 ((q - 16) * d), IQ4_NL (d * kv[q]) and
# IQ4_XS ((d * (ls - 32)) * kv[q]), kv being ggml's 16 non-linear int8 levels: one format for
# every device's 8-bit group kernels (Q5_0 at 8.5 bits a weight, half of a 16-bit copy); the
# CPU backend packs the IQ4 levels back to 4-bit indices (``groupwise_linear.iq4_levels``).
INT8_GROUP_TYPES = ("Q8_0", "Q5_0", "IQ4_NL", "IQ4_XS")
# Kept as q6_k (int8 q times d * sc per 16 weights, sc a signed byte): Q6_K, and Q3_K, whose q in
# -4..3 and 6-bit sc - 32 are the same product (6.625 bits a weight where q is packed at 6).
Q6_K_TYPES = ("Q6_K", "Q3_K")
# Kept as q5_k: Q5_K's 5-bit q (0..31) as int8, times d * sc, plus -dmin * m, per 32 weights.
Q5_K_TYPES = ("Q5_K",)
# Dequantised at load to the compute dtype by ggml's own ``gguf.quants`` (every type it reads).
DEQUANTIZED_TYPES = (
    "F32", "F16", "BF16", "Q5_1", "Q2_K", "IQ3_S", "IQ3_XXS", "IQ2_S", "IQ2_XS",
    "IQ2_XXS", "IQ1_M", "IQ1_S", "TQ1_0", "TQ2_0", "MXFP4",
)  # fmt: skip
SUPPORTED_TYPES = INT4_TYPES + INT8_GROUP_TYPES + Q6_K_TYPES + Q5_K_TYPES + DEQUANTIZED_TYPES


def hf_name(gguf_name: str, family: Family) -> tuple[str, str | None]:
    """(Hugging Face tensor name, our linear module's name or None) of one GGUF tensor."""
    match = _BLOCK.match(gguf_name)
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


# GGUF type -> the group-wise format it is kept in, where the device runs that format.
KEPT_AS = {
    **dict.fromkeys(INT4_TYPES, "int4"),
    **dict.fromkeys(INT8_GROUP_TYPES, "q8_0"),
    **dict.fromkeys(Q6_K_TYPES, "q6_k"),
    **dict.fromkeys(Q5_K_TYPES, "q5_k"),
}


def _format_of(types: set[str]) -> str | None:
    formats = {KEPT_AS.get(t) for t in types}
    return formats.pop() if len(formats) == 1 else None


# A layer's plan: one format, or one per part of a fused layer whose parts differ.
LayerFormat = str | tuple[str, ...]


def _part_of(gguf_name: str) -> int:
    """The part (shard) a tensor fills in its fused layer; 0 for an unfused one."""
    match = _BLOCK.match(gguf_name)
    return _FUSED_PARTS.get(match.group(2), 0) if match else 0


def plan_layers(gguf: GGUFFile, family: Family, native: frozenset[str]) -> dict[str, LayerFormat]:
    """``{module name: "int4" | "q8_0" | "q6_k" | "q5_k"}`` for the linear layers (and tables)
    that stay quantised.

    A fused layer (q/k/v, gate/up) whose parts share a format the device runs (``native``)
    stays in it; one whose parts differ gets a tuple of formats, one per part (Q4_K_M files
    keep Q6_K ``attn_v`` rows next to Q4_K q and k: :mod:`pagedllm.layers.quantization.
    groupwise_parts`), ``dense`` for a part in no native format (dequantised alone: IQ4_XS
    files' Q5_K ``attn_v``). Layers not named are dequantised to the compute dtype.
    """
    types: dict[str, dict[int, set[str]]] = {}
    for name, tensor in gguf.tensors.items():
        if name in NOT_WEIGHTS or not name.endswith(".weight"):
            continue
        try:
            _, module = hf_name(name, family)
        except CheckpointError as exc:  # the first look at every name: say which file
            raise CheckpointError(f"{gguf.path}: {exc}") from None
        if module is not None:
            parts = types.setdefault(module, {})
            parts.setdefault(_part_of(name), set()).add(tensor.type_name)
    plan: dict[str, LayerFormat] = {}
    for module, parts in types.items():
        fmt = _format_of(set().union(*parts.values()))
        if fmt is not None and fmt in native:
            plan[module] = fmt
            continue
        if len(parts) < 2 or sorted(parts) != list(range(len(parts))):
            continue  # one tensor (whole) in a format the device does not run
        kept = tuple(_format_of(parts[i]) for i in range(len(parts)))
        formats = tuple(f if f is not None and f in native else DENSE for f in kept)
        if any(f != DENSE for f in formats):  # the others dequantised, as a dense run
            plan[module] = formats  # type: ignore[assignment]
    return plan


# Expert stack kind -> the FusedMoE stack it fills.
STACK_OF = {
    "ffn_gate_exps": "w13_weight",
    "ffn_up_exps": "w13_weight",
    "ffn_down_exps": "w2_weight",
}


def plan_experts(gguf: GGUFFile, family: Family, native: frozenset[str]) -> dict[str, str]:
    """``{"layers.N.mlp.experts.<w13_weight|w2_weight>": format}`` for the expert stacks that
    stay quantised: gate and up (one stack here) when both are in one native format, down
    alone. A 30B-A3B file's experts are 90% of its bytes: dequantised they would not fit."""
    if not family.moe:
        return {}
    types: dict[str, set[str]] = {}
    for name, tensor in gguf.tensors.items():
        match = _BLOCK.match(name)
        if match is None or match.group(2) not in STACK_OF or match.group(3) != "weight":
            continue
        stack = f"layers.{match.group(1)}.mlp.experts.{STACK_OF[match.group(2)]}"
        types.setdefault(stack, set()).add(tensor.type_name)
    plan = {}
    for stack, kinds in types.items():
        fmt = _format_of(kinds)
        if fmt is not None and fmt in native:
            plan[stack] = fmt
    return plan


def tensor_format(plan: dict[str, LayerFormat], gguf_name: str, module: str | None) -> str | None:
    """The group-wise format one tensor is kept in (its part's, in a fused layer of several
    formats), or None where it is dequantised."""
    fmt = plan.get(module or "")
    if isinstance(fmt, tuple):
        part = fmt[_part_of(gguf_name)]
        return None if part == DENSE else part
    return fmt


def check_types(gguf: GGUFFile) -> Counter[str]:
    """Tensor counts per type; a type we cannot read is refused, naming the tensor."""
    counts: Counter[str] = Counter()
    for name, tensor in gguf.tensors.items():
        if tensor.type_name not in SUPPORTED_TYPES:
            raise CheckpointError(
                f"{gguf.path}: tensor {name!r} has type {tensor.type_name}, which pagedllm does "
                f"not read (supported: {', '.join(SUPPORTED_TYPES)})"
            )
        counts[tensor.type_name] += 1
    return counts


def _blocks(tensor: GGUFTensor, type_size: int) -> np.ndarray:
    """The raw bytes as ``[rows, blocks, type_size]`` uint8."""
    rows = int(np.prod(tensor.shape[:-1])) if len(tensor.shape) > 1 else 1
    return tensor.read().view(np.uint8).reshape(rows, -1, type_size)


def _f16(blocks: np.ndarray, start: int) -> np.ndarray:
    """The float16 at byte ``start`` of every block, widened: ``[rows, blocks]`` float32."""
    return (
        np.ascontiguousarray(blocks[..., start : start + 2])
        .view(np.float16)[..., 0]
        .astype(np.float32)
    )


def _nibbles_low_high(qs: np.ndarray) -> np.ndarray:
    """ggml's 4-bit order (16 bytes: elements 0-15 low nibbles, 16-31 high) -> ``[..., 32]``."""
    return np.concatenate((qs & 0x0F, qs >> 4), axis=-1)


def int4_groups(tensor: GGUFTensor) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A Q4_0 / Q4_1 / Q4_K tensor -> (nibbles uint8 ``[N, K/2]`` in the layout of
    :func:`~pagedllm.layers.quantization.groupwise.pack_nibbles`, scale, offset ``[N, K/32]``).

    ``q * scale + offset`` is ggml's dequantisation, rounding included: each product here is
    exact in float32, so the same single rounding happens in the sum.
    """
    kind = tensor.type_name
    if kind == "Q4_0":
        blocks = _blocks(tensor, 18)
        d = _f16(blocks, 0)
        q = _nibbles_low_high(blocks[..., 2:])
        scale, offset = d, d * np.float32(-8)
    elif kind == "Q4_1":
        blocks = _blocks(tensor, 20)
        scale, offset = _f16(blocks, 0), _f16(blocks, 2)
        q = _nibbles_low_high(blocks[..., 4:])
    elif kind == "Q4_K":
        from gguf.quants import Q4_K

        blocks = _blocks(tensor, 144)
        rows, supers = blocks.shape[:2]
        d, dmin = _f16(blocks, 0), _f16(blocks, 2)
        sc, mins = Q4_K.get_scale_min(blocks[..., 4:16].reshape(-1, 12))
        sc = sc.reshape(rows, supers, 8).astype(np.float32)
        mins = mins.reshape(rows, supers, 8).astype(np.float32)
        scale = (d[..., None] * sc).reshape(rows, -1)
        offset = -(dmin[..., None] * mins).reshape(rows, -1)
        # 128 bytes per super-block: 4 runs of 32 bytes, low nibbles then high nibbles.
        qs = blocks[..., 16:].reshape(rows, supers, 4, 1, 32)
        q = np.concatenate((qs & 0x0F, qs >> 4), axis=3)  # [rows, supers, 4, 2, 32]
    else:
        raise CheckpointError(f"tensor {tensor.name!r}: {kind} is not a 4-bit group type")
    rows = blocks.shape[0]
    q = q.reshape(rows, -1)
    packed = q[:, 0::2] | (q[:, 1::2] << 4)  # numpy: ~20x PyTorch's strided uint8 ops
    return packed, scale.reshape(rows, -1), offset.reshape(rows, -1)


# ggml's IQ4_NL / IQ4_XS levels (``kvalues_iq4nl``).
_IQ4_LEVELS = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113])
_IQ4_LEVELS = _IQ4_LEVELS.astype(np.int8)


def int8_groups(tensor: GGUFTensor) -> tuple[np.ndarray, np.ndarray]:
    """A Q8_0 / Q5_0 / IQ4_NL / IQ4_XS tensor -> (q int8 ``[N, K]``, scale ``[N, K/32]``).

    ``q * scale`` is ggml's dequantisation, rounding included: Q8_0 and Q5_0 are ``q * d``,
    IQ4_NL ``d * kv[q]``, IQ4_XS ``dl * kv[q]`` with ``dl = d * (ls - 32)`` exact in float32.
    """
    kind = tensor.type_name
    if kind == "Q8_0":
        blocks = _blocks(tensor, 34)
        q = np.ascontiguousarray(blocks[..., 2:]).view(np.int8)
        scale = _f16(blocks, 0)
    elif kind == "Q5_0":  # d, 32 high bits (one per weight), 16 bytes of low nibbles
        blocks = _blocks(tensor, 22)
        scale = _f16(blocks, 0)
        qh = np.ascontiguousarray(blocks[..., 2:6]).view(np.uint32)  # [rows, blocks, 1]
        high = ((qh >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8)  # weight j: bit j
        q = (_nibbles_low_high(blocks[..., 6:]) | (high << 4)).astype(np.int8) - np.int8(16)
    elif kind == "IQ4_NL":  # d, 16 bytes of level indices
        blocks = _blocks(tensor, 18)
        scale = _f16(blocks, 0)
        q = _IQ4_LEVELS[_nibbles_low_high(blocks[..., 2:])]
    elif kind == "IQ4_XS":  # per 256: d, ls' high bits, ls' low nibbles, 8 groups x 16 bytes
        blocks = _blocks(tensor, 136)
        rows, supers = blocks.shape[:2]
        d = _f16(blocks, 0)
        high = np.ascontiguousarray(blocks[..., 2:4]).view(np.uint16)  # group j: bits 2j, 2j+1
        high = (high >> (2 * np.arange(8, dtype=np.uint16))) & 3  # [rows, supers, 8]
        low = blocks[..., 4:8]  # group 2i: low nibble of byte i, 2i + 1: high nibble
        low = np.stack((low & 0x0F, low >> 4), axis=-1).reshape(rows, supers, 8)
        ls = (low | (high.astype(np.uint8) << 4)).astype(np.float32) - np.float32(32)
        scale = (d[..., None] * ls).reshape(rows, -1)  # exact: 11 by 6 significant bits
        q = _IQ4_LEVELS[_nibbles_low_high(blocks[..., 8:].reshape(rows, supers, 8, 16))]
    else:
        raise CheckpointError(f"tensor {tensor.name!r}: {kind} is not an 8-bit group type")
    rows = q.shape[0]
    return np.ascontiguousarray(q).reshape(rows, -1), scale.reshape(rows, -1)


_Q6_K_BYTES = 210  # ql 128, qh 64, sc 16 (int8), d 2 (fp16) per super-block of 256
_Q6_K_ROWS = 4096  # rows decoded at a time: an LM head's uint8 temporaries stay ~100 MB


def q6_k_groups(tensor: GGUFTensor) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A Q6_K tensor -> (q - 32 int8 ``[N, K]``, scale ``d * sc`` ``[N, K/16]``, d ``[N, K/256]``);
    a Q3_K one in the same form (:func:`q3_k_groups`).

    ggml's dequantisation is ``fl32(d * sc) * (q - 32)``: ``d * sc`` is exact in float32 (11 by
    8 significant bits), so ``dequantize_int8_groups(q, scale)`` rounds as ggml does.
    """
    if tensor.type_name == "Q3_K":
        return q3_k_groups(tensor)
    blocks = _blocks(tensor, _Q6_K_BYTES)
    rows, supers = blocks.shape[:2]
    d = _f16(blocks, 208)  # [rows, supers]
    sc = np.ascontiguousarray(blocks[..., 192:208]).view(np.int8).astype(np.float32)
    scale = (d[..., None] * sc).reshape(rows, -1)
    q = np.empty((rows, supers * 256), dtype=np.int8)
    for r0 in range(0, rows, _Q6_K_ROWS):
        q[r0 : r0 + _Q6_K_ROWS] = _q6_k_values(blocks[r0 : r0 + _Q6_K_ROWS])
    return q, scale, d


_Q5_K_BYTES = 176  # d, dmin (fp16), 12 bytes of 6-bit sc and m, qh 32, qs 128 per 256


def q5_k_groups(tensor: GGUFTensor) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A Q5_K tensor -> (q int8 ``[N, K]`` in 0..31, scale ``d * sc``, offset ``-dmin * m``
    ``[N, K/32]``): ggml's dequantisation ``(d * sc) * q - dmin * m`` with both products exact
    in float32 (11 + 6 + 5 significant bits), so ``q * scale + offset`` rounds as it does.

    Group ``g`` (of 8 per super-block) and weight ``i``: the low nibble of qs byte
    ``32 (g // 2) + i`` (odd groups: the high nibble), its fifth bit at bit ``g`` of qh byte
    ``i``; sc and m packed as Q4_K's.
    """
    from gguf.quants import Q4_K

    blocks = _blocks(tensor, _Q5_K_BYTES)
    rows, supers = blocks.shape[:2]
    d, dmin = _f16(blocks, 0), _f16(blocks, 2)
    sc, mins = Q4_K.get_scale_min(blocks[..., 4:16].reshape(-1, 12))
    scale = (d[..., None] * sc.reshape(rows, supers, 8).astype(np.float32)).reshape(rows, -1)
    offset = -(dmin[..., None] * mins.reshape(rows, supers, 8).astype(np.float32))
    qs = blocks[..., 48:].reshape(rows, supers, 4, 1, 32)
    low = (qs >> np.array([[0], [4]], dtype=np.uint8)) & 0x0F  # [.., 4, 2, 32]: g = 2 j + h
    qh = blocks[..., 16:48].reshape(rows, supers, 1, 1, 32)
    high = (qh >> np.arange(8, dtype=np.uint8).reshape(4, 2, 1)) & 1
    q = (low | (high << 4)).astype(np.int8).reshape(rows, -1)
    return q, scale, offset.reshape(rows, -1)


_Q3_K_BYTES = 110  # hmask 32, qs 64, 12 bytes of 6-bit scales, d 2 (fp16) per 256


def q3_k_groups(tensor: GGUFTensor) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A Q3_K tensor in :func:`q6_k_groups`' form: (q int8 ``[N, K]`` in -4..3, scale
    ``d * (sc - 32)`` ``[N, K/16]``, d ``[N, K/256]``); ggml's dequantisation is
    ``fl32(d * (sc - 32)) * q``, the product exact in float32 as Q6_K's.

    Element ``e`` of a super-block (``i = e % 32``, ``j = e // 32``): its low two bits at bits
    ``2 (j % 4)`` of qs byte ``32 (j // 4) + i``, and 4 subtracted unless bit ``j`` of hmask
    byte ``i`` is set. Scale ``s`` (of 16): its low nibble in byte ``s % 8`` (``s >= 8``: the high
    nibble), its top two bits at bits ``2 (s // 4)`` of byte ``8 + s % 4``.
    """
    blocks = _blocks(tensor, _Q3_K_BYTES)
    rows, supers = blocks.shape[:2]
    d = _f16(blocks, 108)
    packed = blocks[..., 96:108]
    low = (packed[..., None, :8] >> np.array([[0], [4]], dtype=np.uint8)) & 0x0F  # [.., 2, 8]
    high = (packed[..., None, 8:] >> np.array([[0], [2], [4], [6]], dtype=np.uint8)) & 0x03
    sc = low.reshape(rows, supers, 16) | (high.reshape(rows, supers, 16) << 4)
    scale = (d[..., None] * (sc.astype(np.float32) - np.float32(32))).reshape(rows, -1)
    q = np.empty((rows, supers * 256), dtype=np.int8)
    shifts = np.array([0, 2, 4, 6], dtype=np.uint8).reshape(4, 1)
    for r0 in range(0, rows, _Q6_K_ROWS):
        part = blocks[r0 : r0 + _Q6_K_ROWS]
        n = part.shape[0]
        qs = part[..., 32:96].reshape(n, supers, 2, 1, 32)
        two = (qs >> shifts) & 0x03  # [.., half, 4, 32]: e = 128 half + 32 (j % 4) + i
        hmask = part[..., :32].reshape(n, supers, 1, 1, 32)
        bit = (hmask >> np.arange(8, dtype=np.uint8).reshape(2, 4, 1)) & 1  # j = 4 half + ..
        values = two.astype(np.int8) - ((bit ^ 1) << 2).astype(np.int8)
        q[r0 : r0 + _Q6_K_ROWS] = values.reshape(n, -1)
    return q, scale, d


def _q6_k_values(blocks: np.ndarray) -> np.ndarray:
    """``[rows, supers, 210]`` -> int8 ``[rows, supers * 256]``: q - 32 in element order.

    Each half super-block (128 elements) takes 64 bytes of ql and 32 of qh: element
    ``32 j + i`` (j in 0..3, i in 0..31) has its low nibble in ql byte ``32 (j % 2) + i``
    (j < 2: low nibble, else high) and its top two bits at bits ``2 j`` of qh byte ``i``.
    """
    rows, supers = blocks.shape[:2]
    ql = blocks[..., :128].reshape(rows, supers, 2, 1, 64)  # [.., half, 1, 64]
    low = (ql >> np.array([0, 4], dtype=np.uint8).reshape(2, 1)) & 0x0F  # [.., half, 2, 64]
    low = low.reshape(rows, supers, 2, 4, 32)  # j = 2 * (nibble) + byte // 32
    qh = blocks[..., 128:192].reshape(rows, supers, 2, 1, 32)
    high = (qh >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(4, 1)) & 0x03
    q = (low | (high << 4)).astype(np.int8) - np.int8(32)  # [.., half, 4, 32]
    return q.reshape(rows, -1)


def dequantized(tensor: GGUFTensor) -> np.ndarray:
    """float32 in the tensor's PyTorch shape, by ggml's own dequantisation."""
    from gguf.quants import dequantize

    values = dequantize(tensor.read(), tensor.qtype)
    return np.asarray(values, dtype=np.float32).reshape(tensor.shape)


def _read_interleaved(gate: GGUFTensor, up: GGUFTensor) -> np.ndarray:
    """Raw blocks ``[E, 2I, row bytes]``: each expert's gate rows, then its up rows, read from
    the file straight into place (a concatenation would be one more round of fresh memory)."""
    experts, rows = gate.shape[0], gate.shape[1]
    if gate.path is None or up.path is None:  # in-memory tensors
        pair = (gate.read().reshape(experts, rows, -1), up.read().reshape(experts, rows, -1))
        return np.concatenate(pair, axis=1)
    row_bytes = gate.raw.nbytes // (experts * rows)
    out = np.empty((experts, 2 * rows, row_bytes), dtype=np.uint8)
    with gate.path.open("rb", buffering=0) as f:
        for half, t in enumerate((gate, up)):
            for e in range(experts):
                t.read_into(f, e * rows * row_bytes, out[e, half * rows : (half + 1) * rows])
    return out


# What ``_decoded`` returns per format: the q (``.weight``) and its factors, by name suffix.
_GROUPWISE_SUFFIXES = {
    "int4": ("", "_scale", "_offset"),
    "q5_k": ("", "_scale", "_offset"),
    "q8_0": ("", "_scale"),
    "q6_k": ("", "_scale", "_super"),
}


def _is_expert_stack(gguf_name: str) -> bool:
    match = _BLOCK.match(gguf_name)
    return match is not None and match.group(2) in EXPERT_STACKS


def unpermute_rows(t: torch.Tensor, heads: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row interleave: within each head, rows ``2i`` and ``2i+1`` go back
    to ``i`` and ``i + head_dim/2`` (the Hugging Face "rotate half" order)."""
    rows = t.shape[0]
    half = rows // heads // 2
    return t.reshape(heads, half, 2, *t.shape[1:]).transpose(1, 2).reshape(t.shape)


class GGUFWeights:
    """Iterates a GGUF file's tensors as (Hugging Face name, tensor) for ``load_weights``."""

    def __init__(
        self,
        gguf: GGUFFile,
        family: Family,
        hf_config: object,
        plan: dict[str, LayerFormat],
        *,
        block_decoder: BlockDecoder | None = None,
        expert_plan: dict[str, str] | None = None,
    ):
        self.gguf, self.family, self.plan = gguf, family, plan
        self.expert_plan = expert_plan or {}
        self.block_decoder = block_decoder
        self.heads = int(hf_config.num_attention_heads)  # type: ignore[attr-defined]
        self.kv_heads = int(hf_config.num_key_value_heads)  # type: ignore[attr-defined]

    def _permute(self, gguf_name: str, t: torch.Tensor) -> torch.Tensor:
        if not self.family.permuted_qk:
            return t
        if ".attn_q." in gguf_name:
            return unpermute_rows(t, self.heads)
        if ".attn_k." in gguf_name:
            return unpermute_rows(t, self.kv_heads)
        return t

    def _decoded(self, tensor: GGUFTensor) -> tuple[torch.Tensor, ...]:
        """``int4_groups``, ``int8_groups`` or ``q6_k_groups`` of ``tensor``, by the device's
        kernel if any (Q8_0 too: numpy's strided copy of its q and scales was a third of a 1B
        Q8_0 file's start-up on a Xeon, the threaded pass a tenth of that)."""
        kind = tensor.type_name
        numpy_definition = {
            "int4": int4_groups,
            "q8_0": int8_groups,
            "q6_k": q6_k_groups,
            "q5_k": q5_k_groups,
        }[KEPT_AS[kind]]
        if self.block_decoder is None:
            return tuple(torch.from_numpy(a) for a in numpy_definition(tensor))
        rows = int(np.prod(tensor.shape[:-1])) if len(tensor.shape) > 1 else 1
        blocks = torch.from_numpy(tensor.read().view(np.uint8).reshape(rows, -1))
        return self.block_decoder(blocks, tensor.type_name)

    def _experts(self, gguf_name: str, tensor: GGUFTensor) -> Iterator[tuple[str, torch.Tensor]]:
        """A stack ``[E, N, K]`` as each expert's ``[N, K]`` under its Hugging Face name: its
        group-wise tensors where the plan keeps the stack quantised, else dequantised, one
        expert at a time (a whole stack in float32 would be ~4-8x its bytes)."""
        from gguf.quants import dequantize

        match = _BLOCK.match(gguf_name)
        assert match is not None
        layer, kind, _ = match.groups()
        fmt = self.expert_plan.get(f"layers.{layer}.mlp.experts.{STACK_OF[kind]}")
        if len(tensor.shape) != 3:
            raise CheckpointError(
                f"{self.gguf.path}: tensor {gguf_name!r} has shape {list(tensor.shape)}; "
                "an expert stack is [experts, rows, columns]"
            )
        experts, rows, cols = (int(d) for d in tensor.shape)
        if fmt is not None:
            if kind == "ffn_up_exps":
                return  # decoded with its gate stack, into one [E, 2I, ...] stack
            yield from self._groupwise_stack(gguf_name, tensor, fmt, layer, kind)
            return
        raw = tensor.read().reshape(experts, rows, -1)
        for e in range(experts):
            values = np.asarray(dequantize(raw[e], tensor.qtype), dtype=np.float32)
            stem = f"model.layers.{layer}.mlp.experts.{e}.{EXPERT_STACKS[kind]}"
            yield f"{stem}.weight", torch.from_numpy(values.reshape(rows, cols))

    def _groupwise_stack(
        self, gguf_name: str, tensor: GGUFTensor, fmt: str, layer: str, kind: str
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """A group-wise stack decoded in one pass as the whole ``FusedMoE`` stack: down as it
        is, gate with its up stack (``[E, 2I]`` rows). The decoder's output then becomes the
        parameter: no per-expert copies into a second stack (each round of fresh memory cost
        ~1 ms a MB on first touch on these hosts)."""
        experts, rows, cols = (int(d) for d in tensor.shape)

        def decoded(t: GGUFTensor) -> list[torch.Tensor]:
            raw = t.read().reshape(experts * rows, -1)
            whole = GGUFTensor(t.name, t.type_name, (experts * rows, cols), raw, t.qtype)
            return [a.reshape(experts, rows, -1) for a in self._decoded(whole)]

        stack = "w2_weight"
        if kind == "ffn_gate_exps":
            up = self.gguf.tensors.get(gguf_name.replace("ffn_gate_exps", "ffn_up_exps"))
            if up is None or up.shape != tensor.shape:
                raise CheckpointError(
                    f"{self.gguf.path}: {gguf_name!r} has no ffn_up_exps stack of its shape"
                )
            stack = "w13_weight"
            if up.type_name == tensor.type_name:  # one pass over both stacks' blocks
                raw = _read_interleaved(tensor, up)
                both = GGUFTensor(gguf_name, tensor.type_name, (2 * rows, cols), raw, tensor.qtype)
                rows *= 2
                arrays = decoded(both)
            else:  # two types of one format (Q4_0 gate, Q4_1 up): decoded apart, then joined
                arrays = [
                    torch.cat(p, dim=1) for p in zip(decoded(tensor), decoded(up), strict=True)
                ]
        else:
            arrays = decoded(tensor)
        for suffix, array in zip(_GROUPWISE_SUFFIXES[fmt], arrays, strict=True):
            yield f"model.layers.{layer}.mlp.experts.{stack}{suffix}", array

    def _groupwise(
        self, stem: str, fmt: str, tensor: GGUFTensor, gguf_name: str = ""
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """A tensor kept in group-wise format ``fmt``: its q (``.weight``) and factors."""
        arrays = self._decoded(tensor)
        for suffix, array in zip(_GROUPWISE_SUFFIXES[fmt], arrays, strict=True):
            yield f"{stem}.weight{suffix}", self._permute(gguf_name, array)

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        for gguf_name, tensor in self.gguf.tensors.items():
            if gguf_name in NOT_WEIGHTS:
                continue
            if self.family.moe and _is_expert_stack(gguf_name):
                yield from self._experts(gguf_name, tensor)
                continue
            name, module = hf_name(gguf_name, self.family)
            fmt = tensor_format(self.plan, gguf_name, module)
            if fmt is not None and name.endswith(".weight"):
                yield from self._groupwise(name.removesuffix(".weight"), fmt, tensor, gguf_name)
                continue
            values = torch.from_numpy(dequantized(tensor))
            if gguf_name.endswith(".ffn_gate_inp_shexp.weight"):
                values = values.reshape(1, -1)  # a vector in the file, a [1, H] layer here
            if self.family.norm_plus_one and name.endswith("norm.weight"):
                values = values - 1.0
            yield name, self._permute(gguf_name, values).contiguous()

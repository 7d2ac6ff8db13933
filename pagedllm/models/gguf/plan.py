"""Which format each layer of a GGUF file is kept in: a group-wise format the device runs
natively, one per part of a fused layer whose parts differ, or dequantised.

A linear layer in a type some group-wise format of :mod:`pagedllm.layers.quantization.groupwise`
holds exactly (``KEPT_AS``: Q4_0, Q4_1, Q4_K as int4; Q8_0, Q5_0, IQ4_NL, IQ4_XS as 8-bit
groups; Q6_K, Q3_K as q6_k; Q5_K as q5_k) stays quantised when the device runs that format
natively (a fused layer whose parts are in different formats keeps each part in its own, a part
in none dequantised alone); everything else is dequantised.
"""

from __future__ import annotations

from collections import Counter

from pagedllm.layers.quantization.groupwise_parts import DENSE
from pagedllm.models.gguf.config import Family
from pagedllm.models.gguf.names import BLOCK_NAME, NOT_WEIGHTS, hf_name
from pagedllm.models.gguf.reader import GGUFFile, GGUFFileError
from pagedllm.models.safetensors_reader import CheckpointError

# The part each tensor of a fused layer fills (its shard id in the model's weight mapper).
_FUSED_PARTS = {
    "attn_q": 0, "attn_k": 1, "attn_v": 2, "ffn_gate": 0, "ffn_up": 1,
    "ffn_gate_shexp": 0, "ffn_up_shexp": 1,
}  # fmt: skip
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
    match = BLOCK_NAME.match(gguf_name)
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
            raise GGUFFileError(f"{gguf.path}: {exc}") from None
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
        match = BLOCK_NAME.match(name)
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
            raise GGUFFileError(
                f"{gguf.path}: tensor {name!r} has type {tensor.type_name}, which pagedllm does "
                f"not read (supported: {', '.join(SUPPORTED_TYPES)})"
            )
        counts[tensor.type_name] += 1
    return counts

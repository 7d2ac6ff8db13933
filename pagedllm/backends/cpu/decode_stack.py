"""The decode stack: a Llama-shaped model's decode steps through every layer in one C++ call.

At one sequence a small model's decode step spent about as much time in the Python around its
kernels as in the kernels' own memory traffic (~2.2 of 7.8 ms on the 30-layer demo model: a
dozen calls per layer, each parsing its arguments and checking its inputs). The installer here
binds, once at ``prepare_model``, everything each kernel call of a layer needs (the norm
weights, the packed panels the layers' ``fast_linear`` already multiply, the rotary tables, the
attention's scale and window) into a ``DecodeStack`` (``csrc/decode_stack.cpp``), and puts a
step function into the model's ``fast_decode`` slot. The model calls it only for decode-only
steps (one query token per sequence); it declines (None: the layer loop runs) for tensors the
kernels would not take.

It covers a model completely or not at all: every layer group-wise packed (a fused layer may
keep its parts in their own formats, as a Q4_K_M file's Q4_K q/k beside a Q6_K v: each part's
GEMM into its columns, as the layer loop's ``make_parts_linear`` runs them), the C++ norm, rotary
and attention kernels installed (the stack calls the same functions, so its outputs equal the
layer loop's bit for bit), no LoRA wrapper, no bias after a row-parallel layer. Anything else
keeps the layer loop, which ``PAGEDLLM_DECODE_STACK=0`` also forces (the reference path).

Where the model's ends are plain too (``decode_stack_ends()``: the embedding read back from
group-wise panels, a tied head's or an untied table's own, or a dense table; the C++ final
RMSNorm; a group-wise packed LM head), the stack also fills ``fast_decode_logits``: from the
scheduler's lists (token ids, positions, block tables) to logits in the one call, the step's
index tensors built in C++ and, for plain greedy rows, each row's first maximum and its
log-probability (``sample_rows``, as the sampler's greedy path calls it). The Python between
the stack and those calls ran on caches the layers' weights had just flushed: on the demo
model it was two thirds of a one-sequence step's host time.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from types import ModuleType
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from pagedllm.backends.base import FP8_DTYPES, AttentionMetadata
from pagedllm.backends.cpu import dense_gemm
from pagedllm.backends.cpu.linear_kernel import LinearKernel
from pagedllm.config import env_decode_stack

if TYPE_CHECKING:
    from pagedllm.backends.cpu.groupwise_pack import PackedGroupwise

logger = logging.getLogger(__name__)

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_CACHE_DTYPES = (*_DTYPES, *FP8_DTYPES)


class NotCovered(ValueError):
    """Why a model's layers cannot run as one stack (logged; the layer loop runs them)."""


def _packed(
    ops: ModuleType, module: nn.Module, what: str, *, bias_ok: bool, dtype: torch.dtype
) -> Any:
    """The ``StackLinear`` of one layer: the panels its ``fast_linear`` multiplies, or a fused
    layer's parts in their own formats (``mixed``: each part group-wise packed), side by side;
    each takes the step's dot flag where its own GEMM takes the dot path for ``dtype`` rows."""
    kernel = getattr(module, "fast_linear_packed", None)
    parts = kernel.parts if isinstance(kernel, LinearKernel) else ()
    if not isinstance(kernel, LinearKernel) or (kernel.groupwise is None and not parts):
        raise NotCovered(f"{what} is not group-wise packed GEMMs ({type(module).__name__})")
    if any(part.groupwise is None for part in parts):
        raise NotCovered(f"{what} has a part that is not group-wise packed")
    if kernel.fn is not module.fast_linear:
        raise NotCovered(f"{what}'s fast_linear is not its packed GEMM")
    bias = getattr(module, "bias", None)
    if bias is not None and not bias_ok:
        raise NotCovered(f"{what} has a bias added after the GEMM")
    bias32 = None if bias is None else bias.detach().float().contiguous()
    if not parts:
        return _stack_linear(ops, kernel.groupwise, bias32, bool(kernel.dot_rows.get(dtype)))
    stacked, start = [], 0
    for part in parts:
        pw = part.groupwise
        part_bias = None if bias32 is None else bias32[start : start + pw.n].contiguous()
        stacked.append(_stack_linear(ops, pw, part_bias, bool(part.dot_rows.get(dtype))))
        start += pw.n
    return ops.StackLinear.of_parts(stacked)


def _stack_linear(
    ops: ModuleType, pw: PackedGroupwise, bias32: torch.Tensor | None, takes_dot: bool = False
) -> Any:
    """One packed layer's ``StackLinear``: the arguments ``groupwise_gemm`` takes for it, and
    whether the step's dot flag reaches it."""
    return ops.StackLinear(
        pw.packed,
        pw.n,
        pw.bits,
        pw.half_scales,
        pw.with_offset,
        pw.factored,
        pw.levels,
        bias32,
        takes_dot,
    )


def _norm_weight(norm: nn.Module, dtype: torch.dtype, what: str) -> torch.Tensor:
    weight = norm.weight.detach()
    if norm.fast_norm is None or norm.offset != 0.0:
        raise NotCovered(f"{what} is not the C++ RMSNorm")
    if weight.dtype != dtype or not weight.is_cpu or not weight.is_contiguous():
        raise NotCovered(f"{what}'s weight is not a contiguous {dtype} CPU tensor")
    return weight


def _stack_layer(ops: ModuleType, layer: nn.Module, dtype: torch.dtype, i: int) -> Any:
    attn_module = layer.self_attn
    attn = attn_module.attn
    rotary = attn_module.rotary
    mlp = layer.mlp
    if rotary.fast_rotary is None:
        raise NotCovered(f"layer {i}: the rotary embedding is not the C++ kernel")
    cos, sin = rotary.cos, rotary.sin
    if not all(t.dtype == torch.float32 and t.is_cpu and t.is_contiguous() for t in (cos, sin)):
        raise NotCovered(f"layer {i}: rotary tables are not contiguous float32 CPU tensors")
    if mlp.act.fast_act is None:
        raise NotCovered(f"layer {i}: the activation is not the C++ kernel")
    backend = attn.backend
    if getattr(backend, "name", None) != "cpp" or backend.vector_path != ops.built_isa():
        raise NotCovered(f"layer {i}: attention is not the C++ kernel of this build")
    return ops.StackLayer(
        _norm_weight(layer.input_layernorm, dtype, f"layer {i} input_layernorm"),
        float(layer.input_layernorm.eps),
        _norm_weight(layer.post_attention_layernorm, dtype, f"layer {i} post_attention_layernorm"),
        float(layer.post_attention_layernorm.eps),
        _packed(ops, attn_module.qkv_proj, f"layer {i} qkv_proj", bias_ok=True, dtype=dtype),
        _packed(ops, attn_module.o_proj, f"layer {i} o_proj", bias_ok=False, dtype=dtype),
        _packed(ops, mlp.gate_up_proj, f"layer {i} gate_up_proj", bias_ok=True, dtype=dtype),
        _packed(ops, mlp.down_proj, f"layer {i} down_proj", bias_ok=False, dtype=dtype),
        cos,
        sin,
        int(rotary.rotary_dim),
        float(attn.scale),
        int(attn.sliding_window or 0),
        float(attn.k_scale),
        float(attn.v_scale),
    )


def _dot_rows(layers: Sequence[nn.Module]) -> Mapping[torch.dtype, int]:
    """Up to how many rows each dtype takes the dot path: the stack passes one flag per step
    (rows up to these), which reaches the layers whose own GEMM takes the dot path (each
    ``StackLinear``'s ``takes_dot``; a Q6_K layer beside 4-bit ones may not). Layers that
    take it up to different row counts cannot share one flag."""
    seen: dict[torch.dtype, set[int]] = {}
    for layer in layers:
        for lin in (
            layer.self_attn.qkv_proj,
            layer.self_attn.o_proj,
            layer.mlp.gate_up_proj,
            layer.mlp.down_proj,
        ):
            kernel = lin.fast_linear_packed
            for part in (kernel, *kernel.parts):
                for dtype, rows in part.dot_rows.items():
                    seen.setdefault(dtype, set()).add(rows)
    if any(len(rows - {0}) > 1 for rows in seen.values()):
        raise NotCovered("layers take the dot path up to different batch sizes")
    return {dtype: max(rows) for dtype, rows in seen.items()}


def build_stack(ops: ModuleType, model: nn.Module) -> tuple[Any, torch.dtype, Mapping]:
    """(the DecodeStack, its activations' dtype, dot rows per dtype); NotCovered says why not."""
    layers = model.decode_stack_layers() if hasattr(model, "decode_stack_layers") else None
    if not layers:
        raise NotCovered(f"{type(model).__name__} offers no plain Llama-shaped layers")
    dtype = layers[0].input_layernorm.weight.dtype
    if dtype not in _DTYPES:
        raise NotCovered(f"activations in {dtype}")
    first = layers[0].self_attn
    stack = ops.DecodeStack(first.num_heads, first.num_kv_heads, first.head_size, 0.0)
    for i, layer in enumerate(layers):
        stack.add_layer(_stack_layer(ops, layer, dtype, i))
    return stack, dtype, _dot_rows(layers)


def bind_ends(ops: ModuleType, model: nn.Module, stack: Any, dtype: torch.dtype) -> Mapping:
    """Binds the model's embedding, final norm and LM head to ``stack`` (``set_ends``); returns
    the head's dot rows per dtype. NotCovered where an end is not the plain one the stack
    reproduces (the model's ``decode_stack_ends()`` says which modules they are)."""
    ends = model.decode_stack_ends() if hasattr(model, "decode_stack_ends") else None
    if ends is None:
        raise NotCovered(f"{type(model).__name__} offers no plain embedding, norm and head")
    embedding, norm, head = ends
    kernel = getattr(head, "fast_linear_packed", None)
    if not isinstance(kernel, LinearKernel) or kernel.groupwise is None:
        raise NotCovered("the LM head is not one group-wise packed GEMM")
    if kernel.fn is not head.fast_linear or getattr(head, "bias", None) is not None:
        raise NotCovered("the LM head's fast_linear is not its packed GEMM alone")
    rows = None
    table = torch.empty(0, dtype=dtype)
    if getattr(embedding, "fast_rows", None) is not None:
        panels = getattr(embedding, "fast_rows_packed", None)
        if panels is None:
            raise NotCovered("the embedding's rows come from no group-wise panels")
        if getattr(embedding, "compute_dtype", dtype) != dtype:
            raise NotCovered("the embedding's rows are not in the activations' dtype")
        rows = _stack_linear(ops, panels, None)
    else:
        if embedding.quant_method is not None:
            raise NotCovered("the embedding is neither group-wise panels nor a dense table")
        table = embedding.weight.detach()
        if (
            table.dtype != dtype
            or not table.is_cpu
            or not table.is_contiguous()
            or table.dim() != 2
            or table.shape[0] < head.vocab_size
        ):
            raise NotCovered(f"the embedding table is not a whole contiguous {dtype} CPU tensor")
    stack.set_ends(
        table,
        rows,
        _norm_weight(norm, dtype, "the final norm"),
        float(norm.eps),
        _packed(ops, head, "the LM head", bias_ok=False, dtype=dtype),
        int(head.vocab_size),
    )
    return dict(kernel.dot_rows)


def _index(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return t if t.dtype == dtype and t.is_contiguous() else t.to(dtype).contiguous()


def decode_step(stack: Any, dtype: torch.dtype, dot_rows: Mapping[torch.dtype, int]):
    """The model's ``fast_decode``: the stack on a decode step's tensors, or None for tensors
    the layer loop would hand to another path (another device or dtype, a strided cache)."""

    def step(
        hidden: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        cache = kv_caches[0] if kv_caches else None
        if (
            cache is None
            or hidden.dtype != dtype
            or not hidden.is_cpu
            or hidden.dim() != 2
            or not hidden.is_contiguous()
            or not positions.is_cpu
            or not cache.is_cpu
            or cache.dtype not in _CACHE_DTYPES
            or not cache.is_contiguous()
            or meta.num_seqs == 0
        ):
            return None
        return stack.run(
            hidden,
            _index(positions, torch.long),
            kv_caches,
            _index(meta.block_tables, torch.int32),
            _index(meta.seq_lens, torch.int32),
            _index(meta.query_start_loc, torch.int32),
            _index(meta.slot_mapping, torch.long),
            hidden.shape[0] <= dot_rows.get(dtype, 0),
        )

    return step


def decode_logits_step(
    stack: Any, dtype: torch.dtype, dot_rows: Mapping[torch.dtype, int], head_dot_rows: Mapping
):
    """The model's ``fast_decode_logits``: a decode step's logits (and its greedy rows) from
    the scheduler's lists in one call, the step's index tensors built in C++; None for a cache
    the stack would not take (the runner then runs the model)."""
    dot_limit = dot_rows.get(dtype, 0)
    head_limit = head_dot_rows.get(dtype, 0)

    def step(
        token_ids: list[int],
        positions: list[int],
        block_tables: list[list[int]],
        block_size: int,
        kv_caches: list[torch.Tensor],
        greedy: bool,
    ) -> tuple[torch.Tensor, list[int], list[float]] | None:  # causal_lm.DecodeLogits
        cache = kv_caches[0] if kv_caches else None
        if (
            cache is None
            or not cache.is_cpu
            or cache.dtype not in _CACHE_DTYPES
            or not cache.is_contiguous()
        ):
            return None
        n = len(token_ids)
        return stack.run_decode(
            token_ids,
            positions,
            block_tables,
            block_size,
            kv_caches,
            n <= dot_limit,
            n <= head_limit,
            greedy,
        )

    return step


def install_decode_stack(model: nn.Module, *, int8_activations: bool = False) -> str:
    """The registry's installer (op ``decode_stack``): fills ``model.fast_decode`` where the
    stack covers the whole model; returns e.g. ``"decode_stack: cpp x30 layers"`` ("" for
    none, with the reason logged)."""
    del int8_activations  # each layer's own kernel already decided (its dot_rows)
    if not hasattr(model, "fast_decode") or not env_decode_stack():
        return ""
    ops = dense_gemm.gemm_ops()
    if ops is None or not hasattr(ops, "DecodeStack"):
        return ""
    try:
        stack, dtype, dot_rows = build_stack(ops, model)
    except NotCovered as e:
        logger.info("decode stack not used: %s", e)
        return ""
    model.fast_decode = decode_step(stack, dtype, dot_rows)
    if not hasattr(model, "fast_decode_logits"):
        return f"decode_stack: cpp x{stack.num_layers} layers"
    try:
        head_dot_rows = bind_ends(ops, model, stack, dtype)
    except NotCovered as e:
        logger.info("decode stack runs the layers only: %s", e)
        return f"decode_stack: cpp x{stack.num_layers} layers"
    model.fast_decode_logits = decode_logits_step(stack, dtype, dot_rows, head_dot_rows)
    return f"decode_stack: cpp x{stack.num_layers} layers + embedding, norm, head"

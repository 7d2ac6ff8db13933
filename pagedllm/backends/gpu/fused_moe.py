"""Triton fused-MoE kernels: grouped expert GEMMs over a step's tokens sorted by expert.

The (token, choice) pairs of a step are sorted by expert once (``argsort``) and each expert's run
is padded to a multiple of ``BLOCK_M`` rows, so every row block of the sorted list belongs to one
expert (``block_expert``; -1 for blocks past the end). Two kernels then walk the row blocks:

1. ``_moe_gate_up_kernel``: rows of ``x`` gathered by token, times the expert's gate and up
   projections (two float32 accumulators over the same loaded rows), ``silu(gate) * up`` stored
   per pair: ``[T * top_k, I]``.
2. ``_moe_down_kernel``: those rows times the expert's down projection, scaled by the pair's
   routing weight, stored per pair: ``[T * top_k, H]``; the ``top_k`` rows of a token are summed.

Padding rows carry the sentinel pair id ``T * top_k`` and are masked. The sort, padding and block
map are built with tensor ops only (no host synchronisation): the padded length is bounded by
``T * top_k + E * (BLOCK_M - 1)``. Under expert parallelism pairs routed to other ranks' experts
are left out (their rows stay zero). Importing this module imports triton.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

# fmt: off


@triton.jit
def _moe_gate_up_kernel(
    x_ptr, w_ptr, out_ptr, sorted_ptr, block_expert_ptr,
    num_pairs, top_k, hidden, inter,
    stride_xt, stride_we, stride_wn, stride_ot,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """One program per (row block, tile of I): ``silu(x W_gate^T) * (x W_up^T)``."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    expert = tl.load(block_expert_ptr + pid_m)
    if expert < 0:
        return
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(sorted_ptr + offs_m)
    row_ok = pair < num_pairs
    token = tl.where(row_ok, pair // top_k, 0).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = offs_n < inter
    offs_k = tl.arange(0, BLOCK_K)
    w_base = w_ptr + expert.to(tl.int64) * stride_we
    acc_gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, hidden, BLOCK_K):
        k_ok = (k0 + offs_k) < hidden
        a = tl.load(x_ptr + token[:, None] * stride_xt + (k0 + offs_k)[None, :],
                    mask=row_ok[:, None] & k_ok[None, :], other=0.0)  # [M, K]
        w_mask = k_ok[:, None] & col_ok[None, :]
        w_gate = tl.load(w_base + offs_n[None, :] * stride_wn + (k0 + offs_k)[:, None],
                         mask=w_mask, other=0.0)  # [K, N]
        w_up = tl.load(w_base + (inter + offs_n)[None, :] * stride_wn + (k0 + offs_k)[:, None],
                       mask=w_mask, other=0.0)  # [K, N]
        acc_gate += tl.dot(a, w_gate, input_precision=DOT_PRECISION)
        acc_up += tl.dot(a, w_up, input_precision=DOT_PRECISION)
    h = acc_gate / (1.0 + tl.exp(-acc_gate)) * acc_up
    dst = out_ptr + pair.to(tl.int64)[:, None] * stride_ot + offs_n[None, :]
    tl.store(dst, h.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


@triton.jit
def _moe_down_kernel(
    h_ptr, w_ptr, weight_ptr, out_ptr, sorted_ptr, block_expert_ptr,
    num_pairs, hidden, inter,
    stride_ht, stride_we, stride_wn, stride_ot,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """One program per (row block, tile of H): ``weight * (h W_down^T)`` per pair."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    expert = tl.load(block_expert_ptr + pid_m)
    if expert < 0:
        return
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(sorted_ptr + offs_m)
    row_ok = pair < num_pairs
    safe_pair = tl.where(row_ok, pair, 0).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = offs_n < hidden
    offs_k = tl.arange(0, BLOCK_K)
    w_base = w_ptr + expert.to(tl.int64) * stride_we
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, inter, BLOCK_K):
        k_ok = (k0 + offs_k) < inter
        a = tl.load(h_ptr + safe_pair[:, None] * stride_ht + (k0 + offs_k)[None, :],
                    mask=row_ok[:, None] & k_ok[None, :], other=0.0)  # [M, K]
        w = tl.load(w_base + offs_n[None, :] * stride_wn + (k0 + offs_k)[:, None],
                    mask=k_ok[:, None] & col_ok[None, :], other=0.0)  # [K, N]
        acc += tl.dot(a, w, input_precision=DOT_PRECISION)
    routed = tl.load(weight_ptr + safe_pair, mask=row_ok, other=0.0).to(tl.float32)  # [M]
    acc = acc * routed[:, None]
    dst = out_ptr + safe_pair[:, None] * stride_ot + offs_n[None, :]
    tl.store(dst, acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


# fmt: on


def align_by_expert(
    topk_ids: torch.Tensor,  # [T, k]
    num_local_experts: int,
    expert_start: int,
    block_m: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(sorted pair ids [R], block_expert [R // block_m])``, padded per expert to ``block_m``.

    Padding rows hold ``T * k`` (masked by the kernels); blocks past the last expert's rows hold
    -1. Everything stays on the device: ``R`` is the bound ``T * k + E * (block_m - 1)``.
    """
    num_pairs = topk_ids.numel()
    e = num_local_experts
    device = topk_ids.device
    key = topk_ids.reshape(-1).to(torch.int64) - expert_start  # [P]
    key = key.masked_fill((key < 0) | (key >= e), e)  # other ranks' experts sort last
    counts = torch.bincount(key, minlength=e + 1)[:e]  # [E]
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = torch.cumsum(padded, 0)  # [E]
    padded_start = padded_end - padded
    start = torch.cumsum(counts, 0) - counts
    order = torch.argsort(key, stable=True)  # [P]
    sorted_key = key[order]
    valid = sorted_key < e
    expert = sorted_key.clamp(max=e - 1)
    dest = padded_start[expert] + torch.arange(num_pairs, device=device) - start[expert]
    rows = -(-(num_pairs + e * (block_m - 1)) // block_m) * block_m
    sorted_ids = torch.full((rows,), num_pairs, dtype=torch.int32, device=device)
    sorted_ids[dest[valid]] = order[valid].to(torch.int32)
    block_start = torch.arange(0, rows, block_m, device=device)
    block_expert = torch.searchsorted(padded_end, block_start, right=True)
    block_expert = torch.where(block_expert < e, block_expert, -1).to(torch.int32)
    return sorted_ids, block_expert


def _check(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, ids: torch.Tensor) -> None:
    if x.device.type != "cuda" and not isinstance(_moe_down_kernel, InterpretedFunction):
        raise RuntimeError(
            f"fused MoE kernels got {x.device.type} tensors: they need a CUDA device, or "
            "TRITON_INTERPRET=1 set before triton is first imported"
        )
    if x.dim() != 2 or w13.dim() != 3 or w2.dim() != 3:
        raise ValueError(
            f"x [T, H], w13 [E, 2I, H], w2 [E, H, I] expected, got "
            f"{tuple(x.shape)}, {tuple(w13.shape)}, {tuple(w2.shape)}"
        )
    e, two_i, h = w13.shape
    if x.shape[1] != h or w2.shape != (e, h, two_i // 2) or two_i % 2:
        raise ValueError(
            f"shapes disagree: x {tuple(x.shape)}, w13 {tuple(w13.shape)}, w2 {tuple(w2.shape)}"
        )
    if not (x.dtype == w13.dtype == w2.dtype):
        raise ValueError(f"dtypes differ: x {x.dtype}, w13 {w13.dtype}, w2 {w2.dtype}")
    if x.stride(-1) != 1 or w13.stride(-1) != 1 or w2.stride(-1) != 1:
        raise ValueError("x, w13 and w2 must be contiguous in their last dimension")
    if ids.dim() != 2 or ids.shape[0] != x.shape[0]:
        raise ValueError(f"topk_ids must be [T, k] with T = {x.shape[0]}, got {tuple(ids.shape)}")


def fused_moe(
    x: torch.Tensor,  # [T, H]
    w13: torch.Tensor,  # [E, 2I, H]
    w2: torch.Tensor,  # [E, H, I]
    topk_weights: torch.Tensor,  # [T, k]
    topk_ids: torch.Tensor,  # [T, k]
    *,
    expert_start: int = 0,
    block_m: int = 64,
    block_n: int = 64,
    block_k: int = 32,
) -> torch.Tensor:  # [T, H]: this rank's sum over its experts
    """Routed-weighted sum of the chosen (local) experts' SiLU-gated MLPs, for every token."""
    _check(x, w13, w2, topk_ids)
    num_tokens, top_k = topk_ids.shape
    e, two_i, hidden = w13.shape
    inter = two_i // 2
    if num_tokens == 0:
        return torch.zeros_like(x)
    sorted_ids, block_expert = align_by_expert(topk_ids, e, expert_start, block_m)
    num_pairs = num_tokens * top_k
    h = torch.empty(num_pairs, inter, dtype=x.dtype, device=x.device)
    out_pairs = torch.zeros(num_pairs, hidden, dtype=x.dtype, device=x.device)
    weights = topk_weights.reshape(-1).contiguous()
    precision = "ieee" if x.dtype == torch.float32 else "tf32"
    num_blocks = block_expert.shape[0]
    _moe_gate_up_kernel[(num_blocks, triton.cdiv(inter, block_n))](
        x, w13, h, sorted_ids, block_expert,
        num_pairs, top_k, hidden, inter,
        x.stride(0), w13.stride(0), w13.stride(1), h.stride(0),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, DOT_PRECISION=precision,
    )  # fmt: skip
    _moe_down_kernel[(num_blocks, triton.cdiv(hidden, block_n))](
        h, w2, weights, out_pairs, sorted_ids, block_expert,
        num_pairs, hidden, inter,
        h.stride(0), w2.stride(0), w2.stride(1), out_pairs.stride(0),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, DOT_PRECISION=precision,
    )  # fmt: skip
    return out_pairs.view(num_tokens, top_k, hidden).float().sum(1).to(x.dtype)


def install_fused_moe(model: torch.nn.Module, *, int8_activations: bool = False) -> str:
    """Put these kernels into the ``fast_moe`` slot of every float or 16-bit MoE layer (int8 and
    group-wise experts keep the layer's PyTorch path). Returns "": the linear path stays the
    layers' own."""
    import functools

    from pagedllm.layers.fused_moe import FusedMoE

    del int8_activations  # no int8-activation kernel here
    for layer in model.modules():
        if isinstance(layer, FusedMoE) and not (layer.is_int8 or layer.groupwise):
            layer.fast_moe = functools.partial(_run_fused_moe, layer)
            layer.path = "triton"
    return ""


def _run_fused_moe(
    layer: torch.nn.Module,
    x: torch.Tensor,  # [T, H]
    topk_weights: torch.Tensor,  # [T, k]
    topk_ids: torch.Tensor,  # [T, k]
) -> torch.Tensor:
    return fused_moe(
        x, layer.w13_weight, layer.w2_weight, topk_weights, topk_ids,
        expert_start=layer.expert_start,
    )  # fmt: skip

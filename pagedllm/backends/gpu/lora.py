"""Triton segmented GEMMs for multi-LoRA (the Punica / S-LoRA shrink and expand).

The step's adapter tokens are sorted by device slot once per step (``LoRAMapping``: ``perm``,
``seg_slot``, ``seg_start``); one kernel serves both halves, one program per (segment, row block,
column tile), each program multiplying its rows by its segment's slot weights:

- shrink: rows of ``x`` gathered through ``perm`` times ``A_s^T`` -> ``s`` in slot order;
- expand: rows of ``s`` times ``B_s^T`` added into ``y`` at ``perm`` (each token appears once,
  so the read-add-write needs no atomics).

Row blocks past a segment's end return at once; the grid's row extent is the longest segment.
Importing this module imports triton.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

from pagedllm.lora.ops import LoRAMapping

# fmt: off


@triton.jit
def _sgmv_kernel(
    x_ptr, w_ptr, out_ptr, perm_ptr, seg_slot_ptr, seg_start_ptr,
    n_out, k_in,
    stride_xt, stride_ws, stride_wn, stride_ot,
    GATHER: tl.constexpr, SCATTER_ADD: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """``out[rows] (+)= x[rows] @ W[slot]^T`` for one segment's row block and column tile."""
    seg = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_n = tl.program_id(2)
    start = tl.load(seg_start_ptr + seg)
    end = tl.load(seg_start_ptr + seg + 1)
    row0 = start + pid_m * BLOCK_M
    if row0 >= end:
        return
    slot = tl.load(seg_slot_ptr + seg).to(tl.int64)
    rows = row0 + tl.arange(0, BLOCK_M)
    row_ok = rows < end
    token = tl.load(perm_ptr + rows, mask=row_ok, other=0).to(tl.int64)
    src = token if GATHER else rows.to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = offs_n < n_out
    offs_k = tl.arange(0, BLOCK_K)
    w_base = w_ptr + slot * stride_ws
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, k_in, BLOCK_K):
        k_ok = (k0 + offs_k) < k_in
        a = tl.load(x_ptr + src[:, None] * stride_xt + (k0 + offs_k)[None, :],
                    mask=row_ok[:, None] & k_ok[None, :], other=0.0)  # [M, K]
        w = tl.load(w_base + offs_n[None, :] * stride_wn + (k0 + offs_k)[:, None],
                    mask=k_ok[:, None] & col_ok[None, :], other=0.0)  # [K, N]
        acc += tl.dot(a, w, input_precision=DOT_PRECISION)
    mask = row_ok[:, None] & col_ok[None, :]
    if SCATTER_ADD:
        dst = out_ptr + token[:, None] * stride_ot + offs_n[None, :]
        prev = tl.load(dst, mask=mask, other=0.0)
        tl.store(dst, (prev.to(tl.float32) + acc).to(out_ptr.dtype.element_ty), mask=mask)
    else:
        dst = out_ptr + rows.to(tl.int64)[:, None] * stride_ot + offs_n[None, :]
        tl.store(dst, acc.to(out_ptr.dtype.element_ty), mask=mask)


# fmt: on


def _check(x: torch.Tensor, w: torch.Tensor, mapping: LoRAMapping) -> None:
    if x.device.type != "cuda" and not isinstance(_sgmv_kernel, InterpretedFunction):
        raise RuntimeError(
            f"LoRA kernels got {x.device.type} tensors: they need a CUDA device, or "
            "TRITON_INTERPRET=1 set before triton is first imported"
        )
    if x.dim() != 2 or w.dim() != 3 or x.shape[1] != w.shape[2]:
        raise ValueError(
            f"x [T, K] and w [slots, N, K] expected, got {tuple(x.shape)}, {tuple(w.shape)}"
        )
    if x.dtype != w.dtype:
        raise ValueError(f"dtypes differ: x {x.dtype}, w {w.dtype}")
    if x.stride(-1) != 1 or w.stride(-1) != 1:
        raise ValueError("x and w must be contiguous in their last dimension")
    if mapping.perm.device != x.device:
        raise ValueError(f"mapping on {mapping.perm.device}, tensors on {x.device}")


def _launch(
    x: torch.Tensor,
    w: torch.Tensor,
    out: torch.Tensor,
    mapping: LoRAMapping,
    *,
    gather: bool,
    scatter_add: bool,
    block_m: int = 16,
    block_n: int = 64,
    block_k: int = 32,
) -> None:
    _check(x, w, mapping)
    n_out, k_in = w.shape[1], w.shape[2]
    grid = (
        len(mapping.segments),
        triton.cdiv(mapping.max_seg_len, block_m),
        triton.cdiv(n_out, block_n),
    )
    precision = "ieee" if x.dtype == torch.float32 else "tf32"
    _sgmv_kernel[grid](
        x, w, out, mapping.perm, mapping.seg_slot, mapping.seg_start,
        n_out, k_in,
        x.stride(0), w.stride(0), w.stride(1), out.stride(0),
        GATHER=gather, SCATTER_ADD=scatter_add,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, DOT_PRECISION=precision,
    )  # fmt: skip


class TritonLoRAOps:
    """The ``LoRAKernel`` of the GPU backend (same contract as ``TorchLoRAOps``)."""

    name = "triton"

    def __call__(
        self,
        y: torch.Tensor,
        x: torch.Tensor,
        lora_a: torch.Tensor,
        lora_b: torch.Tensor,
        mapping: LoRAMapping,
    ) -> None:
        self.expand(y, self.shrink(x, lora_a, mapping), lora_b, mapping)

    def shrink(
        self,
        x: torch.Tensor,  # [num_tokens, in]
        lora_a: torch.Tensor,  # [max_loras, k, in]
        mapping: LoRAMapping,
    ) -> torch.Tensor:  # [num_lora_tokens, k] in slot order
        out = torch.empty(mapping.num_lora_tokens, lora_a.shape[1], dtype=x.dtype, device=x.device)
        _launch(x, lora_a, out, mapping, gather=True, scatter_add=False, block_n=32)
        return out

    def expand(
        self,
        y: torch.Tensor,  # [num_tokens, out], updated in place
        s: torch.Tensor,  # [num_lora_tokens, k]
        lora_b: torch.Tensor,  # [max_loras, out, k]
        mapping: LoRAMapping,
    ) -> None:
        if y.stride(-1) != 1:
            raise ValueError("y must be contiguous in its last dimension")
        _launch(s, lora_b, y, mapping, gather=False, scatter_add=True, block_k=16)

"""Triton kernels for the paged KV cache: cache write, split-K decode, prefill over cached context.

Cache layout of one layer (``[2, num_blocks, num_kv_heads, block_size, head_size]``): for every
(block, KV head) the ``block_size x head_size`` tile is one contiguous chunk, so a program that
serves one KV head streams whole contiguous tiles instead of strided rows. Dim 0 is K/V and dim 1
the physical block, as the :mod:`pagedllm.backends.base` contract requires.

Every kernel reads the cache token by token through the block table (``slot -> block, offset``),
so any block size works and a tile of keys may straddle several cache blocks. Softmax runs online
in base 2 (scores are pre-multiplied by ``scale * log2(e)``), accumulating in float32 whatever the
storage dtype. GQA is handled by letting one program serve all query heads of one KV head: the
heads of a group become extra rows of the query tile, so each key is loaded once per group.

Importing this module imports triton; callers import it lazily (see ``attention.py``). Under
``TRITON_INTERPRET=1`` (set by the tests before triton is imported) the kernels run on CPU tensors.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

from pagedllm.backends.gpu.checks import (
    check_attention_inputs,
    check_cache,
    check_index,
    check_tokens,
    sliding_window_arg,
)

_LOG2E = 1.4426950408889634

# Kernel and launch argument lists are kept compact (grouped by role) rather than one per line.
# fmt: off


# --------------------------------------------------------------------------------------------
# Kernels
# --------------------------------------------------------------------------------------------


@triton.jit
def _pow2_f32(e):
    """2**e as float32 for an int32 tensor ``e`` in the normal range, built from its bits."""
    return ((e + 127) << 23).to(tl.float32, bitcast=True)


@triton.jit
def _round_to_fp8(x, MANTISSA: tl.constexpr, MIN_EXP: tl.constexpr, MAX_VALUE: tl.constexpr,
                  AS_BYTES: tl.constexpr):
    """float32 ``x`` saturated to +-MAX_VALUE and rounded (half to even) to the fp8 grid.

    Returns the rounded float32 (its cast to fp8 is then exact), or with ``AS_BYTES`` the fp8
    byte itself, for GPUs without fp8 conversion instructions (before sm_89). Rounding here
    rather than in the cast gives the reference's bytes on every target: Triton's interpreter
    mis-rounds casts whose mantissa carries into the exponent (7.97 -> 4.0 instead of 8.0).
    Only exact operations (scaling by powers of 2, integer bits), so fused multiply-adds and
    approximate division cannot change a byte; the sign is copied as a bit, so tiny negatives
    stay -0 as in the reference (a negation can be lowered as 0 - r, which gives +0).
    """
    bits = x.to(tl.int32, bitcast=True)
    a = tl.minimum(tl.abs(x), MAX_VALUE)
    exp = (a.to(tl.int32, bitcast=True) >> 23) - 127  # floor(log2(a)), exact
    exp = tl.maximum(exp, MIN_EXP)  # subnormals share the smallest normal exponent's step
    magic = 12582912.0  # 1.5 * 2^23: adding and subtracting it rounds y < 2^22 half to even
    steps = (a * _pow2_f32(MANTISSA - exp) + magic) - magic  # a / ulp, rounded: <= 2^(M+1)
    if AS_BYTES:
        # Biased exponent (exp - MIN_EXP + 1) and mantissa in one sum: steps holds the implicit
        # leading 1, and a carry into the next binade (steps == 2^(M+1)) lands right as well.
        code = ((exp - MIN_EXP) << MANTISSA) + steps.to(tl.int32)
        out = (code | ((bits >> 24) & 128)).to(tl.uint8)
    else:
        r = steps * _pow2_f32(exp - MANTISSA)
        out = (r.to(tl.int32, bitcast=True) | ((bits >> 31) << 31)).to(tl.float32, bitcast=True)
    return out  # one return: the compiler types every return statement, taken or not


@triton.jit
def _fp8_byte_value(b, MANTISSA: tl.constexpr, MIN_EXP: tl.constexpr):
    """The float32 value of fp8 bytes ``b`` (uint8), by integer arithmetic: what a GPU without
    fp8 conversions reads. Never-written bytes that would be NaN/inf read as finite values;
    they are masked out of every softmax, as on the native path."""
    b = b.to(tl.int32)
    e = (b >> MANTISSA) & ((1 << (7 - MANTISSA)) - 1)
    m = b & ((1 << MANTISSA) - 1)
    mant = tl.where(e == 0, m, m + (1 << MANTISSA)).to(tl.float32)
    v = mant * _pow2_f32(tl.maximum(e, 1) + (MIN_EXP - 1 - MANTISSA))
    return tl.where(b >= 128, -v, v)


@triton.jit
def _cache_values(x, scale, FP8_MANTISSA: tl.constexpr, FP8_MIN_EXP: tl.constexpr,
                  FP8_MAX: tl.constexpr, FP8_BYTES: tl.constexpr):
    """What the cache stores, before the cast: ``x``, or for fp8 ``x / scale`` rounded as
    above (``FP8_MANTISSA`` 0 means a 16/32-bit cache). The division is IEEE (``div_rn``), as
    the reference's; Triton's ``/`` on float32 may be approximate."""
    if FP8_MANTISSA > 0:
        x = _round_to_fp8(
            tl.div_rn(x.to(tl.float32), scale), FP8_MANTISSA, FP8_MIN_EXP, FP8_MAX, FP8_BYTES
        )
    return x


@triton.jit
def _cached_values(x, scale, dtype: tl.constexpr, FP8_MANTISSA: tl.constexpr,
                   FP8_MIN_EXP: tl.constexpr, FP8_BYTES: tl.constexpr):
    """Loaded K or V in the compute ``dtype``: fp8 dequantised (times its scale) on the way."""
    if FP8_MANTISSA > 0:
        if FP8_BYTES:
            x = _fp8_byte_value(x, FP8_MANTISSA, FP8_MIN_EXP)
        x = (x.to(tl.float32) * scale).to(dtype)
    return x


@triton.jit
def _reshape_and_cache_kernel(
    key_ptr, value_ptr, cache_ptr, slot_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_c0, stride_cb, stride_ch, stride_cs,
    num_kv_heads, head_size, k_scale, v_scale,
    BLOCK_SIZE: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
    FP8_MANTISSA: tl.constexpr, FP8_MIN_EXP: tl.constexpr, FP8_MAX: tl.constexpr,
    FP8_BYTES: tl.constexpr,
):
    """One program per token: its [num_kv_heads, head_size] keys and values go to its slot."""
    tok = tl.program_id(0)
    slot = tl.load(slot_ptr + tok).to(tl.int64)
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    # A negative slot marks a padding token that must not be stored: it gets no heads.
    valid_heads = tl.where(slot >= 0, num_kv_heads, 0)
    mask = (offs_h[:, None] < valid_heads) & (offs_d[None, :] < head_size)
    safe_slot = tl.maximum(slot, 0)
    block = safe_slot // BLOCK_SIZE
    offset = safe_slot % BLOCK_SIZE
    dst = block * stride_cb + offset * stride_cs + offs_h[:, None] * stride_ch + offs_d[None, :]
    k = tl.load(
        key_ptr + tok * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :], mask=mask
    )
    v = tl.load(
        value_ptr + tok * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :], mask=mask
    )
    k = _cache_values(k, k_scale, FP8_MANTISSA, FP8_MIN_EXP, FP8_MAX, FP8_BYTES)
    v = _cache_values(v, v_scale, FP8_MANTISSA, FP8_MIN_EXP, FP8_MAX, FP8_BYTES)
    tl.store(cache_ptr + dst, k.to(cache_ptr.dtype.element_ty), mask=mask)
    tl.store(cache_ptr + stride_c0 + dst, v.to(cache_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _tanh(x):
    """tanh of float32 ``x`` from one exp of a non-positive argument, so it never overflows.
    ``tl`` has no tanh and libdevice's does not run under the interpreter."""
    t = tl.exp2(tl.abs(x) * -2.8853900817779268)  # exp(-2|x|)
    y = (1.0 - t) / (1.0 + t)
    return tl.where(x < 0, -y, y)


@triton.jit
def _attend_range(
    q, acc, m_i, l_i,
    q_pos,  # [M] int: absolute position of each query row
    kv_lo, kv_hi,  # key positions [kv_lo, kv_hi) of this sequence to visit
    table_ptr, k_base, v_base, stride_cb, stride_cs,
    offs_d, d_mask,
    qk_scale, cap_log2e, k_scale, v_scale,
    SLIDING_WINDOW: tl.constexpr, SOFT_CAP: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    TILE_N: tl.constexpr, DOT_PRECISION: tl.constexpr,
    FP8_MANTISSA: tl.constexpr, FP8_MIN_EXP: tl.constexpr, FP8_BYTES: tl.constexpr,
):
    """Online softmax of query rows ``q`` [M, D] over keys kv_lo..kv_hi, TILE_N keys at a time.

    With ``SOFT_CAP`` (Gemma 2) ``qk_scale`` is ``scale / cap``, the tanh's argument, and
    ``cap_log2e`` brings the capped score to base 2; without it ``qk_scale`` is already
    ``scale * log2(e)`` and ``cap_log2e`` is unused.

    An fp8 cache (``FP8_MANTISSA`` > 0) is dequantised as it is loaded: times its scale, in q's
    dtype; with ``FP8_BYTES`` it is read as bytes and converted by integer arithmetic.
    """
    for start in range(kv_lo, kv_hi, TILE_N):
        offs_n = start + tl.arange(0, TILE_N)
        n_mask = offs_n < kv_hi
        block = tl.load(table_ptr + offs_n // BLOCK_SIZE, mask=n_mask, other=0).to(tl.int64)
        tok_off = block * stride_cb + (offs_n % BLOCK_SIZE) * stride_cs  # [TILE_N]
        kv_mask = n_mask[:, None] & d_mask[None, :]
        k = tl.load(k_base + tok_off[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
        k = _cached_values(k, k_scale, q.dtype, FP8_MANTISSA, FP8_MIN_EXP, FP8_BYTES)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale  # [M, TILE_N]
        if SOFT_CAP:
            s = _tanh(s) * cap_log2e  # before the mask: masked scores must stay -inf
        allowed = (offs_n[None, :] <= q_pos[:, None]) & n_mask[None, :]
        if SLIDING_WINDOW > 0:
            allowed = allowed & (offs_n[None, :] > q_pos[:, None] - SLIDING_WINDOW)
        s = tl.where(allowed, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        # Rows with nothing visible yet keep m = -inf; shift by 0 so no inf - inf appears.
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(v_base + tok_off[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
        v = _cached_values(v, v_scale, q.dtype, FP8_MANTISSA, FP8_MIN_EXP, FP8_BYTES)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new
    return acc, m_i, l_i


@triton.jit
def _decode_partition_kernel(
    q_ptr, out_ptr, cache_ptr, table_ptr, seq_lens_ptr,
    part_out_ptr, part_max_ptr, part_sum_ptr,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_c0, stride_cb, stride_ch, stride_cs, stride_tb,
    stride_pt, stride_ph, stride_pp,  # partial outputs [seq, head, part, D]
    stride_mt, stride_mh,  # partial max / sum [seq, head, part]
    qk_scale, cap_log2e, k_scale, v_scale, group, head_size,
    SLIDING_WINDOW: tl.constexpr, SOFT_CAP: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    TILE_N: tl.constexpr, PARTITION: tl.constexpr, SPLIT: tl.constexpr,
    BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr, DOT_PRECISION: tl.constexpr,
    FP8_MANTISSA: tl.constexpr, FP8_MIN_EXP: tl.constexpr, FP8_BYTES: tl.constexpr,
):
    """Grid (decode seq, KV head, partition): one context partition for one group of heads.

    With ``SPLIT`` the unnormalised output, running max and sum go to the partial buffers for
    :func:`_decode_reduce_kernel`; without it (one partition covers every context) the
    normalised output is written directly.
    """
    seq = tl.program_id(0)
    kvh = tl.program_id(1)
    part = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)
    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    g_mask = offs_g < group
    d_mask = offs_d < head_size
    heads = kvh * group + offs_g  # [BLOCK_G] query heads served by this KV head
    q_mask = g_mask[:, None] & d_mask[None, :]
    q = tl.load(
        q_ptr + seq * stride_qt + heads[:, None] * stride_qh + offs_d[None, :],
        mask=q_mask, other=0.0,
    )
    lo = part * PARTITION
    if SLIDING_WINDOW > 0:
        lo = tl.maximum(lo, seq_len - SLIDING_WINDOW)
    hi = tl.minimum(part * PARTITION + PARTITION, seq_len)
    acc = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)
    m_i = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
    q_pos = tl.zeros([BLOCK_G], dtype=tl.int32) + (seq_len - 1)
    k_base = cache_ptr + kvh * stride_ch
    acc, m_i, l_i = _attend_range(
        q, acc, m_i, l_i, q_pos, lo, hi,
        table_ptr + seq * stride_tb, k_base, k_base + stride_c0, stride_cb, stride_cs,
        offs_d, d_mask, qk_scale, cap_log2e, k_scale, v_scale,
        SLIDING_WINDOW, SOFT_CAP, BLOCK_SIZE, TILE_N, DOT_PRECISION,
        FP8_MANTISSA, FP8_MIN_EXP, FP8_BYTES,
    )
    if SPLIT:
        row = seq * stride_mt + heads * stride_mh + part
        tl.store(part_max_ptr + row, m_i, mask=g_mask)
        tl.store(part_sum_ptr + row, l_i, mask=g_mask)
        p_off = seq * stride_pt + heads[:, None] * stride_ph + part * stride_pp + offs_d[None, :]
        tl.store(part_out_ptr + p_off, acc, mask=q_mask)
    else:
        out = acc / l_i[:, None]
        o_off = seq * stride_ot + heads[:, None] * stride_oh + offs_d[None, :]
        tl.store(out_ptr + o_off, out.to(out_ptr.dtype.element_ty), mask=q_mask)


@triton.jit
def _decode_reduce_kernel(
    out_ptr, seq_lens_ptr, part_out_ptr, part_max_ptr, part_sum_ptr,
    stride_ot, stride_oh, stride_pt, stride_ph, stride_pp, stride_mt, stride_mh,
    head_size,
    SLIDING_WINDOW: tl.constexpr, PARTITION: tl.constexpr,
    BLOCK_P: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """Grid (decode seq, query head): rescale each partition to the global max and combine."""
    seq = tl.program_id(0)
    head = tl.program_id(1)
    seq_len = tl.load(seq_lens_ptr + seq)
    num_parts = tl.cdiv(seq_len, PARTITION)
    first = 0
    if SLIDING_WINDOW > 0:
        first = tl.maximum(seq_len - SLIDING_WINDOW, 0) // PARTITION
    offs_p = tl.arange(0, BLOCK_P)
    p_mask = (offs_p >= first) & (offs_p < num_parts)
    row = seq * stride_mt + head * stride_mh
    m_all = tl.load(part_max_ptr + row + offs_p, mask=p_mask, other=float("-inf"))
    m_glob = tl.max(m_all, axis=0)
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < head_size
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    total = 0.0
    base = part_out_ptr + seq * stride_pt + head * stride_ph
    for p in range(first, num_parts):
        w = tl.exp2(tl.load(part_max_ptr + row + p) - m_glob)
        total += tl.load(part_sum_ptr + row + p) * w
        acc += tl.load(base + p * stride_pp + offs_d, mask=d_mask, other=0.0) * w
    out = acc / total
    tl.store(
        out_ptr + seq * stride_ot + head * stride_oh + offs_d,
        out.to(out_ptr.dtype.element_ty), mask=d_mask,
    )


@triton.jit
def _prefill_kernel(
    q_ptr, out_ptr, cache_ptr, table_ptr, seq_lens_ptr, query_start_ptr,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_c0, stride_cb, stride_ch, stride_cs, stride_tb,
    qk_scale, cap_log2e, k_scale, v_scale, group, head_size,
    SLIDING_WINDOW: tl.constexpr, SOFT_CAP: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    TILE_N: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    FP8_MANTISSA: tl.constexpr, FP8_MIN_EXP: tl.constexpr, FP8_BYTES: tl.constexpr,
):
    """Grid (query tile, prefill seq, KV head): BLOCK_Q new tokens x the heads of one group.

    Row ``r`` of the tile is token ``r // BLOCK_G`` and head ``r % BLOCK_G`` of the group. The new
    tokens sit at positions ``context_len ..`` and are already in the cache, so cached context and
    new keys are read the same way, through the block table.
    """
    tile = tl.program_id(0)
    seq = tl.program_id(1)
    kvh = tl.program_id(2)
    q_start = tl.load(query_start_ptr + seq)
    q_len = tl.load(query_start_ptr + seq + 1) - q_start
    if tile * BLOCK_Q < q_len:
        seq_len = tl.load(seq_lens_ptr + seq)
        context_len = seq_len - q_len
        rows = tl.arange(0, BLOCK_Q * BLOCK_G)
        tok = tile * BLOCK_Q + rows // BLOCK_G  # index among this sequence's new tokens
        g = rows % BLOCK_G
        offs_d = tl.arange(0, BLOCK_D)
        d_mask = offs_d < head_size
        row_mask = (tok < q_len) & (g < group)
        q_mask = row_mask[:, None] & d_mask[None, :]
        heads = kvh * group + g
        q_off = (q_start + tok)[:, None] * stride_qt + heads[:, None] * stride_qh + offs_d[None, :]
        q = tl.load(q_ptr + q_off, mask=q_mask, other=0.0)
        q_pos = context_len + tok
        hi = tl.minimum(context_len + tile * BLOCK_Q + BLOCK_Q, seq_len)
        lo = 0
        if SLIDING_WINDOW > 0:
            lo = tl.maximum(context_len + tile * BLOCK_Q - SLIDING_WINDOW + 1, 0)
        acc = tl.zeros([BLOCK_Q * BLOCK_G, BLOCK_D], dtype=tl.float32)
        m_i = tl.full([BLOCK_Q * BLOCK_G], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_Q * BLOCK_G], dtype=tl.float32)
        k_base = cache_ptr + kvh * stride_ch
        acc, m_i, l_i = _attend_range(
            q, acc, m_i, l_i, q_pos, lo, hi,
            table_ptr + seq * stride_tb, k_base, k_base + stride_c0, stride_cb, stride_cs,
            offs_d, d_mask, qk_scale, cap_log2e, k_scale, v_scale,
            SLIDING_WINDOW, SOFT_CAP, BLOCK_SIZE, TILE_N, DOT_PRECISION,
            FP8_MANTISSA, FP8_MIN_EXP, FP8_BYTES,
        )
        # Padding rows (g >= group, tok >= q_len) have l = 0; keep them finite, they are masked.
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        o_off = (q_start + tok)[:, None] * stride_ot + heads[:, None] * stride_oh + offs_d[None, :]
        tl.store(out_ptr + o_off, out.to(out_ptr.dtype.element_ty), mask=q_mask)


# --------------------------------------------------------------------------------------------
# Launchers: validate, pick tile sizes, launch
# --------------------------------------------------------------------------------------------


def _pow2(n: int, floor: int = 1) -> int:
    return max(floor, triton.next_power_of_2(n))


def interpreted() -> bool:
    """Whether the kernels run under Triton's interpreter (TRITON_INTERPRET=1 at import)."""
    return isinstance(_prefill_kernel, InterpretedFunction)


def _check_runnable(device: torch.device) -> None:
    """Off CUDA the kernels only run interpreted; say so instead of failing deep in triton."""
    if device.type != "cuda" and not interpreted():
        raise RuntimeError(
            f"Triton kernels got {device.type} tensors: they need a CUDA device, or "
            "TRITON_INTERPRET=1 set before triton is first imported (tests, CPU debugging)"
        )


def _dot_precision(dtype: torch.dtype) -> str:
    # float32 stays exact ("ieee"); tf32 would cost ~1e-3 relative error. Halves ignore it.
    return "ieee" if dtype == torch.float32 else "tf32"


# fp8 formats: (mantissa bits, smallest normal exponent, largest finite value).
_FP8_FORMATS = {torch.float8_e4m3fn: (3, -6, 448.0), torch.float8_e5m2: (2, -14, 57344.0)}


def fp8_as_bytes(device: torch.device) -> bool:
    """Whether the kernels handle an fp8 cache on ``device`` as bytes, converting with integer
    arithmetic: GPUs before sm_89 (A100) have no fp8 conversion instructions, and Triton 3.6
    lowers even e5m2 to them there (ptxas then refuses the kernel). sm_89+ and the interpreter
    convert natively."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) < (8, 9)


def _fp8_args(
    kv_cache: torch.Tensor, fp8_bytes: bool | None
) -> tuple[torch.Tensor, dict[str, Any]]:
    """The cache as the kernels take it and its fp8 constexprs (mantissa 0: not fp8).
    ``fp8_bytes`` None: :func:`fp8_as_bytes` for the cache's device; tests force either path."""
    fmt = _FP8_FORMATS.get(kv_cache.dtype)
    if fmt is None:
        return kv_cache, {"FP8_MANTISSA": 0, "FP8_MIN_EXP": 0, "FP8_BYTES": False}
    as_bytes = fp8_as_bytes(kv_cache.device) if fp8_bytes is None else fp8_bytes
    cache = kv_cache.view(torch.uint8) if as_bytes else kv_cache
    return cache, {"FP8_MANTISSA": fmt[0], "FP8_MIN_EXP": fmt[1], "FP8_BYTES": as_bytes}


def _score_args(scale: float, logits_soft_cap: float | None) -> tuple[float, float, bool]:
    """(qk_scale, cap_log2e, SOFT_CAP) for :func:`_attend_range`. Uncapped, the scores keep
    exactly the arithmetic they had before the cap existed (one multiply by scale * log2(e))."""
    if logits_soft_cap is None:
        return scale * _LOG2E, 0.0, False
    # `not >` also refuses NaN; an infinite cap would turn every score into 0 * inf.
    if isinstance(logits_soft_cap, bool) or not (0 < logits_soft_cap < math.inf):
        raise ValueError(
            f"logits_soft_cap must be a positive finite number or None, got {logits_soft_cap!r}"
        )
    cap = float(logits_soft_cap)
    return scale / cap, cap * _LOG2E, True


def reshape_and_cache(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_size]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_size]
    kv_cache: torch.Tensor,  # [2, num_blocks, num_kv_heads, block_size, head_size]
    slot_mapping: torch.Tensor,  # [num_tokens] int; -1 skips a token
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    *,
    fp8_bytes: bool | None = None,
) -> None:
    """Write each token's keys and values at ``slot = block * block_size + offset``.

    An fp8 cache stores ``key / k_scale`` and ``value / v_scale``, saturated and rounded half
    to even (the bytes of ``kv_layout.to_cache_dtype``); the scales are ignored otherwise.
    ``fp8_bytes``: see :func:`_fp8_args`.
    """
    kvh, block_size, head_size = check_cache(kv_cache, key.device)
    check_tokens("key", key, kvh, head_size)
    check_tokens("value", value, kvh, head_size)
    check_index("slot_mapping", slot_mapping, 1, key.device)
    if value.shape[0] != key.shape[0] or slot_mapping.shape[0] != key.shape[0]:
        raise ValueError(
            f"key/value/slot_mapping lengths differ: {key.shape[0]}, {value.shape[0]}, "
            f"{slot_mapping.shape[0]}"
        )
    if key.shape[0] == 0:
        return
    _check_runnable(key.device)
    cache, fp8 = _fp8_args(kv_cache, fp8_bytes)
    _reshape_and_cache_kernel[(key.shape[0],)](
        key, value, cache, slot_mapping,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3),
        kvh, head_size, float(k_scale), float(v_scale),
        BLOCK_SIZE=block_size, BLOCK_H=_pow2(kvh), BLOCK_D=_pow2(head_size),
        FP8_MAX=_FP8_FORMATS.get(kv_cache.dtype, (0, 0, 0.0))[2], **fp8,
    )


def decode_partition_size(
    max_seq_len: int, num_seqs: int, num_kv_heads: int, device: torch.device
) -> int:
    """Context tokens per decode program: enough programs to fill the GPU twice over.

    A batch with few (sequence, KV head) pairs but long contexts would leave most SMs idle with
    one program per pair; splitting each context into partitions fixes that, at the price of a
    small reduction. Powers of 2 from 64 to 512; 512 off the GPU (nothing to fill).
    """
    if device.type != "cuda":
        return 512
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    parts = max(1, math.ceil(2 * sms / max(1, num_seqs * num_kv_heads)))
    return min(512, max(64, triton.next_power_of_2(math.ceil(max_seq_len / parts))))


def paged_decode_attention(
    query: torch.Tensor,  # [num_seqs, num_heads, head_size], one token per sequence
    kv_cache: torch.Tensor,  # [2, num_blocks, num_kv_heads, block_size, head_size]
    block_tables: torch.Tensor,  # [num_seqs, max_blocks_per_seq]
    seq_lens: torch.Tensor,  # [num_seqs] int32, the query token included
    max_seq_len: int,
    scale: float,
    *,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
    partition_size: int | None = None,
    tile_n: int = 64,
    out: torch.Tensor | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    fp8_bytes: bool | None = None,
) -> torch.Tensor:  # [num_seqs, num_heads, head_size]
    """Decode attention; contexts over ``partition_size`` tokens are split across programs.

    ``max_seq_len`` (a Python int the scheduler already knows) sizes the grid without reading
    ``seq_lens`` back from the device. ``partition_size=None`` picks one for the device
    (:func:`decode_partition_size`). ``logits_soft_cap``: each score ``s`` becomes
    ``cap * tanh(s / cap)`` before the mask and the softmax (Gemma 2).
    """
    kvh, block_size, head_size, group = check_attention_inputs(
        query, kv_cache, block_tables, seq_lens
    )
    window = sliding_window_arg(sliding_window)
    qk_scale, cap_log2e, soft_cap = _score_args(scale, logits_soft_cap)
    if partition_size is None:
        partition_size = decode_partition_size(max_seq_len, seq_lens.shape[0], kvh, query.device)
    tile = min(tile_n, partition_size)
    if tile < 16 or tile & (tile - 1) or partition_size % tile:
        raise ValueError(f"partition_size {partition_size} must be a multiple of a power-of-2 "
                         f"tile >= 16 (tile_n={tile_n})")
    num_seqs, num_heads, _ = query.shape
    if seq_lens.shape[0] != num_seqs:
        raise ValueError(f"decode takes one query token per sequence: {num_seqs} tokens for "
                         f"{seq_lens.shape[0]} sequences")
    out = torch.empty_like(query) if out is None else out
    check_tokens("out", out, num_heads, head_size)
    if num_seqs == 0:
        return out
    _check_runnable(query.device)
    num_parts = max(1, math.ceil(max_seq_len / partition_size))
    split = num_parts > 1
    block_d = _pow2(head_size, 16)
    if split:
        part_out = torch.empty(
            (num_seqs, num_heads, num_parts, head_size), dtype=torch.float32, device=query.device
        )
        part_max = torch.empty((num_seqs, num_heads, num_parts), dtype=torch.float32,
                               device=query.device)
        part_sum = torch.empty_like(part_max)
    else:  # unused but must be valid pointers
        part_out = part_max = part_sum = out
    cache, fp8 = _fp8_args(kv_cache, fp8_bytes)
    _decode_partition_kernel[(num_seqs, kvh, num_parts)](
        query, out, cache, block_tables, seq_lens,
        part_out, part_max, part_sum,
        query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3),
        block_tables.stride(0),
        part_out.stride(0), part_out.stride(1), part_out.stride(2) if split else 0,
        part_max.stride(0), part_max.stride(1),
        qk_scale, cap_log2e, float(k_scale), float(v_scale), group, head_size,
        SLIDING_WINDOW=window, SOFT_CAP=soft_cap, BLOCK_SIZE=block_size, TILE_N=tile,
        PARTITION=partition_size, SPLIT=split,
        BLOCK_G=_pow2(group, 16), BLOCK_D=block_d, DOT_PRECISION=_dot_precision(query.dtype),
        **fp8,
        num_warps=4,
    )
    if split:
        _decode_reduce_kernel[(num_seqs, num_heads)](
            out, seq_lens, part_out, part_max, part_sum,
            out.stride(0), out.stride(1),
            part_out.stride(0), part_out.stride(1), part_out.stride(2),
            part_max.stride(0), part_max.stride(1),
            head_size,
            SLIDING_WINDOW=window, PARTITION=partition_size,
            BLOCK_P=_pow2(num_parts), BLOCK_D=block_d,
            num_warps=4,
        )
    return out


def prefill_attention(
    query: torch.Tensor,  # [num_tokens, num_heads, head_size], sequences packed
    kv_cache: torch.Tensor,  # [2, num_blocks, num_kv_heads, block_size, head_size]
    block_tables: torch.Tensor,  # [num_seqs, max_blocks_per_seq]
    seq_lens: torch.Tensor,  # [num_seqs] int32, cached + new tokens
    query_start_loc: torch.Tensor,  # [num_seqs + 1] int32, starting at 0
    max_query_len: int,
    scale: float,
    *,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
    block_m: int = 64,
    tile_n: int = 64,
    out: torch.Tensor | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    fp8_bytes: bool | None = None,
) -> torch.Tensor:  # [num_tokens, num_heads, head_size]
    """Causal attention of new tokens over their cached context and themselves.

    The new tokens' keys and values must already be in the cache (``reshape_and_cache`` first).
    ``logits_soft_cap``: as in :func:`paged_decode_attention`.
    """
    kvh, block_size, head_size, group = check_attention_inputs(
        query, kv_cache, block_tables, seq_lens
    )
    window = sliding_window_arg(sliding_window)
    qk_scale, cap_log2e, soft_cap = _score_args(scale, logits_soft_cap)
    check_index("query_start_loc", query_start_loc, 1, query.device)
    num_seqs = seq_lens.shape[0]
    if query_start_loc.shape[0] != num_seqs + 1:
        raise ValueError(f"query_start_loc has {query_start_loc.shape[0]} entries, "
                         f"expected {num_seqs + 1}")
    if tile_n < 16 or tile_n & (tile_n - 1) or block_m < 16 or block_m & (block_m - 1):
        raise ValueError(f"block_m {block_m} and tile_n {tile_n} must be powers of 2 >= 16")
    out = torch.empty_like(query) if out is None else out
    check_tokens("out", out, query.shape[1], head_size)
    if num_seqs == 0 or max_query_len == 0:
        return out
    _check_runnable(query.device)
    block_g = _pow2(group)
    block_q = max(1, block_m // block_g)
    grid = (triton.cdiv(max_query_len, block_q), num_seqs, kvh)
    cache, fp8 = _fp8_args(kv_cache, fp8_bytes)
    _prefill_kernel[grid](
        query, out, cache, block_tables, seq_lens, query_start_loc,
        query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3),
        block_tables.stride(0),
        qk_scale, cap_log2e, float(k_scale), float(v_scale), group, head_size,
        SLIDING_WINDOW=window, SOFT_CAP=soft_cap, BLOCK_SIZE=block_size, TILE_N=tile_n,
        BLOCK_Q=block_q, BLOCK_G=block_g, BLOCK_D=_pow2(head_size, 16),
        DOT_PRECISION=_dot_precision(query.dtype), **fp8,
        num_warps=4,
    )
    return out

"""Triton device code for paged attention: split-K decode, its reduction, and prefill.

Cache layout of one layer (``[2, num_blocks, num_kv_heads, block_size, head_size]``): for every
(block, KV head) the ``block_size x head_size`` tile is one contiguous chunk, so a program that
serves one KV head streams whole contiguous tiles instead of strided rows. Dim 0 is K/V and dim 1
the physical block, as the :mod:`pagedllm.backends.base` contract requires.

Every kernel reads the cache token by token through the block table (``slot -> block, offset``),
so any block size works and a tile of keys may straddle several cache blocks. Softmax runs online
in base 2 (scores are pre-multiplied by ``scale * log2(e)``), accumulating in float32 whatever the
storage dtype. GQA is handled by letting one program serve all query heads of one KV head: the
heads of a group become extra rows of the query tile, so each key is loaded once per group.

Decode and prefill share one inner loop (:func:`_attend_range`), so they live together, apart
from the host code in ``triton_ops`` that validates inputs and sizes the grids. Importing this
module imports triton.
"""

from __future__ import annotations

import triton
import triton.language as tl

from pagedllm.backends.gpu.triton_cache_kernels import cached_values

# Kernel argument lists are kept compact (grouped by role) rather than one per line.
# fmt: off


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
        k = cached_values(k, k_scale, q.dtype, FP8_MANTISSA, FP8_MIN_EXP, FP8_BYTES)
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
        v = cached_values(v, v_scale, q.dtype, FP8_MANTISSA, FP8_MIN_EXP, FP8_BYTES)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new
    return acc, m_i, l_i


@triton.jit
def decode_partition_kernel(
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
    :func:`decode_reduce_kernel`; without it (one partition covers every context) the
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
def decode_reduce_kernel(
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
def prefill_kernel(
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

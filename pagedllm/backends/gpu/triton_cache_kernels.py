"""Triton device code for what the paged KV cache stores: the cache write and the fp8 codec.

An fp8 cache is written here (scaled, saturated, rounded half to even to the reference's bytes)
and read back by the attention kernels through :func:`cached_values`; keeping both directions of
the codec in one module keeps the write and the read of one format from drifting apart. GPUs
before sm_89 have no fp8 conversion instructions, so either direction can also run on the raw
bytes with integer arithmetic (``FP8_BYTES``).

The launcher that checks inputs and picks the constexprs is ``triton_ops.reshape_and_cache``;
importing this module imports triton.
"""

from __future__ import annotations

import triton
import triton.language as tl

# Kernel argument lists are kept compact (grouped by role) rather than one per line.
# fmt: off


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
def cached_values(x, scale, dtype: tl.constexpr, FP8_MANTISSA: tl.constexpr,
                   FP8_MIN_EXP: tl.constexpr, FP8_BYTES: tl.constexpr):
    """Loaded K or V in the compute ``dtype``: fp8 dequantised (times its scale) on the way."""
    if FP8_MANTISSA > 0:
        if FP8_BYTES:
            x = _fp8_byte_value(x, FP8_MANTISSA, FP8_MIN_EXP)
        x = (x.to(tl.float32) * scale).to(dtype)
    return x


@triton.jit
def reshape_and_cache_kernel(
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

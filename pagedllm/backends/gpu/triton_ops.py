"""Launchers for the paged-KV-cache Triton kernels: cache write, split-K decode, prefill.

The kernels index raw pointers with the strides and constexprs they are given, so the host side
decides everything they cannot check: inputs are validated (``checks``), tile sizes and the
decode partition picked for the device, the fp8 constexprs chosen for the cache's format, and
the grids sized. The device code is in ``triton_attention_kernels`` (the attention kernels and
their shared online-softmax loop) and ``triton_cache_kernels`` (the cache write and fp8 codec).

Importing this module imports triton; callers import it lazily (see ``attention.py``). Under
``TRITON_INTERPRET=1`` (set by the tests before triton is imported) the kernels run on CPU tensors.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import triton
from triton.runtime.interpreter import InterpretedFunction

from pagedllm.backends.gpu.checks import (
    check_attention_inputs,
    check_cache,
    check_index,
    check_tokens,
    sliding_window_arg,
)
from pagedllm.backends.gpu.triton_attention_kernels import (
    decode_partition_kernel,
    decode_reduce_kernel,
    prefill_kernel,
)
from pagedllm.backends.gpu.triton_cache_kernels import reshape_and_cache_kernel

_LOG2E = 1.4426950408889634

# Launch argument lists are kept compact (grouped by role) rather than one per line.
# fmt: off


def _pow2(n: int, floor: int = 1) -> int:
    return max(floor, triton.next_power_of_2(n))


def interpreted() -> bool:
    """Whether the kernels run under Triton's interpreter (TRITON_INTERPRET=1 at import)."""
    return isinstance(prefill_kernel, InterpretedFunction)


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
    """(qk_scale, cap_log2e, SOFT_CAP) for the kernels' ``_attend_range``. Uncapped, the scores
    keep exactly the arithmetic they had before the cap existed (one multiply by scale * log2(e)).
    """
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
    reshape_and_cache_kernel[(key.shape[0],)](
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
    decode_partition_kernel[(num_seqs, kvh, num_parts)](
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
        decode_reduce_kernel[(num_seqs, num_heads)](
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
    prefill_kernel[grid](
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

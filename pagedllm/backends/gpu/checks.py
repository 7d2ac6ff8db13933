"""Input validation shared by the Triton launchers (torch only, no triton import).

The kernels index raw pointers with the strides they are given, so a wrong shape, dtype or a
non-unit innermost stride would read garbage silently; every launcher checks first.
"""

from __future__ import annotations

import torch

FP8_CACHE_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)  # read dequantised, any compute
CACHE_DTYPES = (torch.float16, torch.bfloat16, torch.float32, *FP8_CACHE_DTYPES)


def check_cache(kv_cache: torch.Tensor, device: torch.device) -> tuple[int, int, int]:
    """Validate a layer cache; return (num_kv_heads, block_size, head_size)."""
    if kv_cache.dim() != 5 or kv_cache.shape[0] != 2:
        raise ValueError(
            "kv_cache must be [2, num_blocks, num_kv_heads, block_size, head_size], "
            f"got {tuple(kv_cache.shape)}"
        )
    if kv_cache.dtype not in CACHE_DTYPES:
        raise ValueError(f"kv_cache dtype {kv_cache.dtype} not in {CACHE_DTYPES}")
    if kv_cache.stride(-1) != 1:
        raise ValueError("kv_cache must be contiguous in head_size (stride(-1) == 1)")
    if kv_cache.device != device:
        raise ValueError(f"kv_cache on {kv_cache.device}, inputs on {device}")
    _, _, num_kv_heads, block_size, head_size = kv_cache.shape
    return num_kv_heads, block_size, head_size


def check_tokens(name: str, x: torch.Tensor, heads: int | None, head_size: int) -> None:
    if x.dim() != 3 or x.shape[2] != head_size or (heads is not None and x.shape[1] != heads):
        raise ValueError(
            f"{name} must be [num_tokens, {heads if heads is not None else 'num_heads'}, "
            f"{head_size}], got {tuple(x.shape)}"
        )
    if x.stride(-1) != 1:
        raise ValueError(f"{name} must be contiguous in head_size (stride(-1) == 1)")


def check_index(name: str, x: torch.Tensor, dim: int, device: torch.device) -> None:
    if x.dim() != dim or x.dtype not in (torch.int32, torch.int64) or x.device != device:
        raise ValueError(
            f"{name} must be a {dim}-d int32/int64 tensor on {device}, "
            f"got {x.dim()}-d {x.dtype} on {x.device}"
        )
    if dim == 2 and x.stride(1) != 1:
        raise ValueError(f"{name} must be contiguous along its last dim")


def check_attention_inputs(
    query: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor
) -> tuple[int, int, int, int]:
    """Shared checks; returns (num_kv_heads, block_size, head_size, group)."""
    kvh, block_size, head_size = check_cache(kv_cache, query.device)
    check_tokens("query", query, None, head_size)
    if query.dtype != kv_cache.dtype and kv_cache.dtype not in FP8_CACHE_DTYPES:
        raise ValueError(f"query dtype {query.dtype} != kv_cache dtype {kv_cache.dtype}")
    if query.shape[1] % kvh:
        raise ValueError(f"num_heads {query.shape[1]} is not a multiple of num_kv_heads {kvh}")
    check_index("block_tables", block_tables, 2, query.device)
    check_index("seq_lens", seq_lens, 1, query.device)
    if block_tables.shape[0] != seq_lens.shape[0]:
        raise ValueError(f"{block_tables.shape[0]} block tables for {seq_lens.shape[0]} seqs")
    return kvh, block_size, head_size, query.shape[1] // kvh


def sliding_window_arg(sliding_window: int | None) -> int:
    if sliding_window is not None and sliding_window <= 0:
        raise ValueError(f"sliding_window must be positive, got {sliding_window}")
    return sliding_window or 0

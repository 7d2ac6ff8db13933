"""Where IPEX's paged-attention ops come from and what they accept, apart from ``attention.py``.

``attention.py`` decides which op each of a step's rows goes to and works around the ops' gaps;
this is what holds for every call alike: intel_extension_for_pytorch is imported only when the
backend is constructed (so ``import pagedllm`` works without it, and a failed import says what to
install), the fp8 format and compute dtype the ops read, and the checks that refuse, by name,
inputs the ops would misread, since they index raw memory. The facts these encode (IPEX 2.8) are
in ``attention.py``'s module doc.
"""

from __future__ import annotations

import importlib
from typing import Any

import torch

from pagedllm.backends.base import FP8_DTYPES, KV_CACHE_DTYPES, AttentionMetadata

#: The one fp8 format IPEX's ops store and read, and the only compute dtype they read it with.
FP8_NAME = "fp8_e5m2"
FP8_COMPUTE_DTYPE = torch.bfloat16
FP8_WHY = "IPEX's paged-attention ops store fp8 only as e5m2 and read it only with bfloat16 queries"
CACHE_DTYPES = (torch.float32, torch.bfloat16, torch.float16, KV_CACHE_DTYPES[FP8_NAME])

_INSTALL_HINT = (
    "pip install intel-extension-for-pytorch (the release matching your torch version, e.g. "
    "torch==2.8.0 with intel-extension-for-pytorch==2.8.0; see ci/requirements-xpu.txt)"
)


def load_ipex_paged_attention() -> Any:
    """Import IPEX and return its ``PagedAttention`` op namespace, or explain what to install.

    Any import failure is reported, not only ImportError: IPEX refuses to load against a torch of
    another minor version and, in 2.8, against transformers 5 (a NameError inside IPEX).
    """
    try:
        ipex = importlib.import_module("intel_extension_for_pytorch")
        return ipex.llm.modules.PagedAttention
    except Exception as exc:
        raise ImportError(
            f"attention_backend='ipex' needs intel-extension-for-pytorch, which could not be "
            f"loaded ({type(exc).__name__}: {exc}); {_INSTALL_HINT}"
        ) from exc


def check_cache(kv_cache: torch.Tensor, head_size: int, num_kv_heads: int | None) -> None:
    """The IPEX ops index raw memory: refuse a cache whose layout they would misread."""
    if kv_cache.dim() != 5 or kv_cache.shape[0] != 2:
        raise ValueError(
            "IPEX KV cache must be [2, num_blocks, num_kv_heads, block_size, head_size], "
            f"got {tuple(kv_cache.shape)}"
        )
    if kv_cache.shape[4] != head_size:
        raise ValueError(f"head_size {head_size} != KV cache head size {kv_cache.shape[4]}")
    if num_kv_heads is not None and kv_cache.shape[2] != num_kv_heads:
        raise ValueError(f"{num_kv_heads} KV heads != KV cache's {kv_cache.shape[2]}")
    if not kv_cache[0].is_contiguous():
        raise ValueError("IPEX KV cache must be contiguous")
    if kv_cache.dtype not in CACHE_DTYPES:
        raise ValueError(
            f"IPEX KV cache dtype {kv_cache.dtype} is not one of {list(CACHE_DTYPES)} "
            f"(kv_cache_dtype: {FP8_WHY})"
        )


def check_forward(
    query: torch.Tensor,  # [num_tokens, num_heads, head_size]
    kv_cache: torch.Tensor,
    meta: AttentionMetadata,
    *,
    sliding_window: int | None,
    logits_soft_cap: float | None,
) -> None:
    """Shapes, dtypes and settings the ops would misread, refused with what was expected."""
    if query.dim() != 3:
        raise ValueError(f"query must be [num_tokens, num_heads, head_size], got {query.shape}")
    check_cache(kv_cache, query.shape[2], None)
    num_heads, num_kv_heads = query.shape[1], kv_cache.shape[2]
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads={num_heads} is not a multiple of kv heads={num_kv_heads}")
    if kv_cache.dtype in FP8_DTYPES:
        if query.dtype != FP8_COMPUTE_DTYPE:
            raise ValueError(
                f"query dtype {query.dtype} over a {kv_cache.dtype} KV cache: {FP8_WHY}"
            )
    elif query.dtype != kv_cache.dtype:
        raise ValueError(f"query dtype {query.dtype} != KV cache dtype {kv_cache.dtype}")
    if query.shape[0] != meta.num_tokens:
        raise ValueError(f"query has {query.shape[0]} tokens, metadata {meta.num_tokens}")
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"sliding_window must be >= 1, got {sliding_window}")
    # `not > 0` so that NaN fails too. IPEX reads only -1 as "none": 0 or -2 silently give
    # other numbers (IPEX 2.8, CPU), so a bad cap must never reach it.
    if logits_soft_cap is not None and not logits_soft_cap > 0:
        raise ValueError(f"logits_soft_cap must be None or > 0, got {logits_soft_cap}")

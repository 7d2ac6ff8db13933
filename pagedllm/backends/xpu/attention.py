"""Paged attention through intel-extension-for-pytorch (``attention_backend="ipex"``).

IPEX ships vLLM-style paged-attention ops in ``ipex.llm.modules.PagedAttention`` for both Intel
GPUs (XPU) and CPUs; the op picks its implementation from the device of its tensors, so the same
class serves the XPU device and, on CPU tensors, the CPU engine (which is how it is tested on
machines without an Intel GPU).

Cache layout of one layer: ``[2, num_blocks, num_kv_heads, block_size, head_size]``; ``cache[0]``
and ``cache[1]`` are the ``[num_blocks, num_kv_heads, block_size, head_size]`` key and value
caches the IPEX ops read and write.

Ops and the conventions checked against ``backends/reference.py`` (IPEX 2.8, CPU):

* ``reshape_and_cache``: writes new tokens at their slots. On CPU it does not skip slot -1
  (a padding token) but writes out of bounds, so ``write_kv`` drops such tokens first;
* ``single_query_cached_kv_attention``: decodes; ``window_size`` equals our ``sliding_window``
  (the query itself plus ``sliding_window - 1`` earlier tokens);
* ``flash_attn_varlen_func`` with ``block_tables``: prompt chunks, reading every key from the
  paged cache, so chunks with cached context (chunked prefill, prefix caching) need no gather.
  Its causal mask is aligned bottom-right (query ``i`` of a chunk of ``q`` over ``k`` keys sits
  at position ``k - q + i``), and ``window_size_left`` counts earlier tokens only, i.e. it is
  ``sliding_window - 1``. One gap: ``window_size_left=0`` is read as "no window", so a prompt
  chunk with ``sliding_window == 1`` is computed here instead; each token then attends only to
  itself, so its output is exactly its own value row, read back from the cache.

intel_extension_for_pytorch is imported when the backend is constructed, never at module import,
so ``import pagedllm`` works without it.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any

import torch

from pagedllm.backends.base import AttentionBackend, AttentionMetadata, build_attention_metadata

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


@dataclass
class IpexAttentionMetadata(AttentionMetadata):
    """Adds the cumulative key lengths of the prompt chunks, built once per step, not per layer."""

    prefill_cu_seqlens_kv: torch.Tensor | None = None  # [num_prefills + 1] int32


def _prefill_cu_seqlens_kv(meta: AttentionMetadata) -> torch.Tensor:
    """``[0, seq_len_0, seq_len_0 + seq_len_1, ...]`` over the prompt chunks, int32."""
    cu = torch.zeros(meta.num_prefills + 1, dtype=torch.int32, device=meta.seq_lens.device)
    torch.cumsum(meta.seq_lens[: meta.num_prefills], dim=0, out=cu[1:])
    return cu


class IpexPagedAttention(AttentionBackend):
    """Prompt chunks go to IPEX's varlen flash attention, decodes to its paged decode kernel."""

    name = "ipex"
    # IPEX's ops take the cache in the query's dtype; its fp8 cache path is not wired up here.
    supported_kv_cache_dtypes = ("float32", "bfloat16", "float16")
    kv_cache_dtype_follows_compute = True

    def __init__(self) -> None:
        self._ops = load_ipex_paged_attention()
        # (num_heads, num_kv_heads, device) -> [num_heads] int32 query head -> KV head.
        self._head_mappings: dict[tuple[int, int, torch.device], torch.Tensor] = {}

    def build_metadata(self, **kwargs: object) -> AttentionMetadata:
        base = build_attention_metadata(**kwargs)  # type: ignore[arg-type]
        fields = {name: getattr(base, name) for name in base.__dataclass_fields__}
        return IpexAttentionMetadata(**fields, prefill_cu_seqlens_kv=_prefill_cu_seqlens_kv(base))

    def write_kv(
        self,
        key: torch.Tensor,  # [num_tokens, num_kv_heads, head_size]
        value: torch.Tensor,  # [num_tokens, num_kv_heads, head_size]
        kv_cache: torch.Tensor,  # [2, num_blocks, num_kv_heads, block_size, head_size]
        slot_mapping: torch.Tensor,  # [num_tokens] int64
    ) -> None:
        _check_cache(kv_cache, key.shape[-1], key.shape[-2])
        if key.shape != value.shape or key.shape[0] != slot_mapping.shape[0]:
            raise ValueError(
                f"write_kv: key {tuple(key.shape)}, value {tuple(value.shape)} and slot_mapping "
                f"{tuple(slot_mapping.shape)} disagree on the number of tokens"
            )
        # Slot -1 marks a padding token that must not be stored. IPEX's CPU op writes it out of
        # bounds (heap corruption), so such tokens are dropped here; on CPU the check is cheap.
        on_cpu = slot_mapping.device.type == "cpu"
        if on_cpu and slot_mapping.numel() and int(slot_mapping.min()) < 0:
            keep = slot_mapping >= 0
            key, value, slot_mapping = key[keep], value[keep], slot_mapping[keep]
        if key.shape[0] == 0:
            return
        self._ops.reshape_and_cache(
            key.to(kv_cache.dtype).contiguous(),
            value.to(kv_cache.dtype).contiguous(),
            kv_cache[0],
            kv_cache[1],
            slot_mapping,
        )

    def forward(
        self,
        query: torch.Tensor,  # [num_tokens, num_heads, head_size]
        kv_cache: torch.Tensor,  # [2, num_blocks, num_kv_heads, block_size, head_size]
        meta: AttentionMetadata,
        scale: float,
        *,
        sliding_window: int | None = None,
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_size]
        if query.dim() != 3:
            raise ValueError(f"query must be [num_tokens, num_heads, head_size], got {query.shape}")
        _check_cache(kv_cache, query.shape[2], None)
        num_heads, num_kv_heads = query.shape[1], kv_cache.shape[2]
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads={num_heads} is not a multiple of kv heads={num_kv_heads}")
        if query.dtype != kv_cache.dtype:
            raise ValueError(f"query dtype {query.dtype} != KV cache dtype {kv_cache.dtype}")
        if query.shape[0] != meta.num_tokens:
            raise ValueError(f"query has {query.shape[0]} tokens, metadata {meta.num_tokens}")
        if sliding_window is not None and sliding_window < 1:
            raise ValueError(f"sliding_window must be >= 1, got {sliding_window}")
        query = query.contiguous()
        out = torch.empty_like(query)
        p = meta.num_prefill_tokens
        if meta.num_prefills:
            # Leading rows of a contiguous tensor: a contiguous view the op can write into.
            self._prefill(query[:p], kv_cache, meta, scale, sliding_window, out[:p])
        if meta.num_decode_tokens:
            self._decode(query[p:], kv_cache, meta, scale, sliding_window, out[p:])
        return out

    def _head_mapping(
        self, num_heads: int, num_kv_heads: int, device: torch.device
    ) -> torch.Tensor:  # [num_heads] int32
        key = (num_heads, num_kv_heads, device)
        if key not in self._head_mappings:
            group = num_heads // num_kv_heads
            self._head_mappings[key] = torch.arange(
                num_kv_heads, dtype=torch.int32, device=device
            ).repeat_interleave(group)
        return self._head_mappings[key]

    def _prefill(
        self,
        query: torch.Tensor,  # [num_prefill_tokens, num_heads, head_size]
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        sliding_window: int | None,
        out: torch.Tensor,  # [num_prefill_tokens, num_heads, head_size], written in place
    ) -> None:
        n = meta.num_prefills
        if sliding_window == 1:
            out.copy_(_own_values(kv_cache, meta.slot_mapping[: query.shape[0]], query.shape[1]))
            return
        cu_kv = getattr(meta, "prefill_cu_seqlens_kv", None)
        if cu_kv is None:
            cu_kv = _prefill_cu_seqlens_kv(meta)
        self._ops.flash_attn_varlen_func(
            out,
            query,
            kv_cache[0],
            kv_cache[1],
            meta.query_start_loc[: n + 1],
            cu_kv,
            max(meta.query_lens_list[:n]),
            max(meta.seq_lens_list[:n]),
            scale,
            True,  # causal, aligned bottom-right over cached + new tokens
            meta.block_tables[:n],
            None,  # alibi slopes
            -1 if sliding_window is None else sliding_window - 1,
            -1 if sliding_window is None else 0,
        )

    def _decode(
        self,
        query: torch.Tensor,  # [num_decodes, num_heads, head_size]
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        sliding_window: int | None,
        out: torch.Tensor,  # [num_decodes, num_heads, head_size], written in place
    ) -> None:
        n = meta.num_prefills
        self._ops.single_query_cached_kv_attention(
            out,
            query,
            kv_cache[0],
            kv_cache[1],
            self._head_mapping(query.shape[1], kv_cache.shape[2], query.device),
            scale,
            meta.block_tables[n:],
            meta.seq_lens[n:],
            meta.block_size,
            max(meta.seq_lens_list[n:]),
            None,  # alibi slopes
            -1 if sliding_window is None else sliding_window,
        )


def _check_cache(kv_cache: torch.Tensor, head_size: int, num_kv_heads: int | None) -> None:
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


def _own_values(
    kv_cache: torch.Tensor,  # [2, num_blocks, num_kv_heads, block_size, head_size]
    slots: torch.Tensor,  # [n] int64, slots of the query tokens (already written)
    num_heads: int,
) -> torch.Tensor:  # [n, num_heads, head_size]
    """Attention of each token over itself alone is its own value, broadcast over its group."""
    block_size = kv_cache.shape[3]
    blocks = torch.div(slots, block_size, rounding_mode="floor")
    values = kv_cache[1][blocks, :, slots % block_size]  # [n, num_kv_heads, head_size]
    return values.repeat_interleave(num_heads // kv_cache.shape[2], dim=1)

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

Gemma 2's ``logits_soft_cap`` (each score ``s = scale * q.k`` becomes ``cap * tanh(s / cap)``
before the mask and the softmax) is the ``softcap`` argument of both attention ops, which in
IPEX 2.8 (CPU) means exactly that, ``scale`` inside the tanh, in every compute dtype. Two gaps:

* only -1 means "no cap" (0 or -2 silently give other numbers), so ``forward`` refuses a cap
  that is not > 0 and passes -1 for None;
* the decode op refuses a window together with a cap ("Expected !(window_size > 0 &&
  use_softcap == true)"), which is Gemma 2's local layers. Those decodes go to the varlen op
  instead, each as a one-token chunk over its ``seq_len`` keys (the bottom-right causal mask
  puts the query last), which takes a window and a cap together and still reads the paged
  cache; window 1 there has the gap above and is computed here alike.

The ``sliding_window == 1`` path needs nothing for the cap: a softmax over one score is 1 whatever
the cap makes of it, so the output is still the token's own value.

fp8 KV cache (``kv_cache_dtype="fp8_e5m2"``, with bfloat16 compute only). What IPEX 2.8's CPU
ops do with 8-bit caches, and so what this class does around them:

* only ``torch.float8_e5m2`` caches; an e4m3 cache is refused by every op ("only float8_e5m2
  supported", "not supported kv_cahce_dtype"), so "fp8"/"fp8_e4m3" are refused by name here;
* the decode op reads e5m2 only with bfloat16 queries (float32 and float16 fail with "expected
  scalar type ... but found Float8_e5m2"), hence bfloat16 compute only;
* ``k_scale``/``v_scale`` are accepted and ignored, and the store is a plain cast (out-of-range
  values become inf). So ``write_kv`` quantises with ``to_cache_dtype`` (``x / scale``,
  saturated, the reference's bytes) and hands IPEX values bfloat16 holds exactly, and
  ``forward`` folds ``k_scale`` into the softmax scale and multiplies the output by ``v_scale``;
  the ops always get scales of 1, so a build that does honour them cannot apply them twice;
* torch 2.8 has no CPU gather for fp8 tensors, so block copies and swaps move byte views;
* the varlen prompt kernel over an e5m2 cache crashed (a segfault in its fp8-to-bf16
  conversion) on an AVX-512/AMX Xeon with ``head_size`` 16 and ``block_size`` 8, where 32 and
  more ran correctly (on an AVX2 EPYC 16 had passed). Below ``head_size`` 32 prompt chunks read
  a bfloat16 copy of the cache instead, which holds every e5m2 value exactly, so the numbers
  are the same; only models that small (tests) pay for the copy.

intel_extension_for_pytorch is imported when the backend is constructed, never at module import,
so ``import pagedllm`` works without it; that import, the fp8 names and the input checks every
call passes are in ``ipex_ops.py``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedllm.backends.base import (
    FP8_DTYPES,
    KV_CACHE_DTYPES,
    AttentionBackend,
    AttentionMetadata,
    build_attention_metadata,
    byte_view,
    to_cache_dtype,
)
from pagedllm.backends.xpu.ipex_ops import (
    FP8_COMPUTE_DTYPE,
    FP8_NAME,
    FP8_WHY,
    check_cache,
    check_forward,
    load_ipex_paged_attention,
)

#: The smallest head size whose e5m2 cache IPEX's varlen prompt kernel reads (module doc).
FP8_VARLEN_MIN_HEAD_SIZE = 32


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
    """Prompt chunks go to IPEX's varlen flash attention, decodes to its paged decode kernel
    (or, windowed and soft-capped, to the varlen op as one-token chunks: see the module doc)."""

    name = "ipex"
    # A 16/32-bit cache in the query's dtype, or e5m2 under bfloat16 compute (see the module doc).
    supported_kv_cache_dtypes = ("float32", "bfloat16", "float16", FP8_NAME)
    kv_cache_dtype_follows_compute = True

    def __init__(self) -> None:
        self._ops = load_ipex_paged_attention()
        # (num_heads, num_kv_heads, device) -> [num_heads] int32 query head -> KV head.
        self._head_mappings: dict[tuple[int, int, torch.device], torch.Tensor] = {}

    def resolve_kv_cache_dtype(
        self, kv_cache_dtype: str, compute_dtype: torch.dtype
    ) -> torch.dtype:
        """The compute dtype, or e5m2 under bfloat16 compute; anything else is refused by name."""
        if kv_cache_dtype == "auto":
            return compute_dtype
        wanted = KV_CACHE_DTYPES.get(kv_cache_dtype)
        if wanted == compute_dtype and kv_cache_dtype in self.supported_kv_cache_dtypes:
            return compute_dtype
        if kv_cache_dtype == FP8_NAME and compute_dtype == FP8_COMPUTE_DTYPE:
            return KV_CACHE_DTYPES[FP8_NAME]
        works = ["auto", *[n for n, d in KV_CACHE_DTYPES.items() if d == compute_dtype]]
        if compute_dtype == FP8_COMPUTE_DTYPE:
            works.append(FP8_NAME)
        why = ""
        if wanted in FP8_DTYPES:
            why = f" ({FP8_WHY}: use kv_cache_dtype={FP8_NAME!r} with dtype='bfloat16')"
        raise ValueError(
            f"kv_cache_dtype: {kv_cache_dtype!r} cannot run on the {self.name!r} attention backend "
            f"with dtype {str(compute_dtype).removeprefix('torch.')}; this backend supports "
            f"{works}{why}"
        )

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
        *,
        k_scale: float = 1.0,
        v_scale: float = 1.0,
    ) -> None:
        check_cache(kv_cache, key.shape[-1], key.shape[-2])
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
        fp8 = kv_cache.dtype in FP8_DTYPES
        if fp8:
            # IPEX ignores the scales and casts without saturating: quantise here (the
            # reference's bytes); bfloat16 holds every e5m2 value, so its cast stores them as is.
            key = to_cache_dtype(key, kv_cache.dtype, k_scale).to(FP8_COMPUTE_DTYPE)
            value = to_cache_dtype(value, kv_cache.dtype, v_scale).to(FP8_COMPUTE_DTYPE)
        else:
            key, value = key.to(kv_cache.dtype), value.to(kv_cache.dtype)
        self._ops.reshape_and_cache(
            key.contiguous(),
            value.contiguous(),
            kv_cache[0],
            kv_cache[1],
            slot_mapping,
            FP8_NAME if fp8 else "auto",
        )

    def forward(
        self,
        query: torch.Tensor,  # [num_tokens, num_heads, head_size]
        kv_cache: torch.Tensor,  # [2, num_blocks, num_kv_heads, block_size, head_size]
        meta: AttentionMetadata,
        scale: float,
        *,
        sliding_window: int | None = None,
        logits_soft_cap: float | None = None,
        k_scale: float = 1.0,
        v_scale: float = 1.0,
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_size]
        """fp8 caches: ``q . (k * k_scale) = (q . k) * k_scale`` and the output is linear in
        the values, so the ops see scales of 1 and the layer's scales are applied around them
        (``k_scale`` folded into ``scale`` lands inside the soft cap's tanh, where it belongs)."""
        check_forward(
            query, kv_cache, meta, sliding_window=sliding_window, logits_soft_cap=logits_soft_cap
        )
        softcap = -1.0 if logits_soft_cap is None else float(logits_soft_cap)
        fp8 = kv_cache.dtype in FP8_DTYPES
        if fp8:
            scale = scale * k_scale
        query = query.contiguous()
        out = torch.empty_like(query)
        p = meta.num_prefill_tokens
        if meta.num_prefills:
            # Leading rows of a contiguous tensor: a contiguous view the op can write into.
            self._prefill(query[:p], kv_cache, meta, scale, sliding_window, softcap, out[:p])
        if meta.num_decode_tokens:
            self._decode(query[p:], kv_cache, meta, scale, sliding_window, softcap, out[p:])
        if fp8 and v_scale != 1.0:
            out.mul_(v_scale)
        return out

    def copy_blocks(self, kv_caches: list[torch.Tensor], pairs: torch.Tensor) -> None:
        """The generic copy on byte views: torch 2.8 has no CPU gather for fp8 tensors."""
        super().copy_blocks([byte_view(c) for c in kv_caches], pairs)

    def swap_blocks(self, src: torch.Tensor, dst: torch.Tensor, pairs: torch.Tensor) -> None:
        """The generic swap on byte views (fp8 caches, as in :meth:`copy_blocks`)."""
        if src.dtype != dst.dtype:
            raise ValueError(f"swap_blocks: {src.dtype} pool -> {dst.dtype} pool")
        super().swap_blocks(byte_view(src), byte_view(dst), pairs)

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
        softcap: float,  # -1: none
        out: torch.Tensor,  # [num_prefill_tokens, num_heads, head_size], written in place
    ) -> None:
        n = meta.num_prefills
        if sliding_window == 1:
            # One score per query: its softmax is 1, capped or not, so softcap changes nothing.
            out.copy_(_own_values(kv_cache, meta.slot_mapping[: query.shape[0]], query.shape[1]))
            return
        cu_kv = getattr(meta, "prefill_cu_seqlens_kv", None)
        if cu_kv is None:
            cu_kv = _prefill_cu_seqlens_kv(meta)
        self._varlen(
            query,
            kv_cache,
            meta.query_start_loc[: n + 1],
            cu_kv,
            max(meta.query_lens_list[:n]),
            max(meta.seq_lens_list[:n]),
            meta.block_tables[:n],
            scale,
            sliding_window,
            softcap,
            out,
        )

    def _decode(
        self,
        query: torch.Tensor,  # [num_decodes, num_heads, head_size]
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        sliding_window: int | None,
        softcap: float,  # -1: none
        out: torch.Tensor,  # [num_decodes, num_heads, head_size], written in place
    ) -> None:
        n = meta.num_prefills
        if sliding_window is not None and softcap > 0:
            # IPEX 2.8's CPU decode op refuses a window with a soft cap ("Expected
            # !(window_size > 0 && use_softcap == true)"); the varlen op takes both, and a
            # decode is a one-token chunk to it (see the module doc).
            self._decode_as_chunks(query, kv_cache, meta, scale, sliding_window, softcap, out)
            return
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
            softcap=softcap,
        )

    def _decode_as_chunks(
        self,
        query: torch.Tensor,  # [num_decodes, num_heads, head_size]
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        sliding_window: int,
        softcap: float,
        out: torch.Tensor,  # [num_decodes, num_heads, head_size], written in place
    ) -> None:
        """Decodes through the varlen op, each a chunk of one query over its ``seq_len`` keys
        (the bottom-right causal mask puts it last); window 1 has the varlen op's gap."""
        n, d = meta.num_prefills, query.shape[0]
        if sliding_window == 1:
            slots = meta.slot_mapping[meta.num_prefill_tokens :]
            out.copy_(_own_values(kv_cache, slots, query.shape[1]))
            return
        device = query.device
        cu_q = torch.arange(d + 1, dtype=torch.int32, device=device)
        cu_kv = torch.zeros(d + 1, dtype=torch.int32, device=device)
        torch.cumsum(meta.seq_lens[n:], dim=0, out=cu_kv[1:])
        self._varlen(
            query,
            kv_cache,
            cu_q,
            cu_kv,
            1,
            max(meta.seq_lens_list[n:]),
            meta.block_tables[n:],
            scale,
            sliding_window,
            softcap,
            out,
        )

    def _varlen(
        self,
        query: torch.Tensor,  # [num_query_tokens, num_heads, head_size]
        kv_cache: torch.Tensor,
        cu_seqlens_q: torch.Tensor,  # [num_seqs + 1] int32, from 0
        cu_seqlens_kv: torch.Tensor,  # [num_seqs + 1] int32, from 0
        max_seqlen_q: int,
        max_seqlen_kv: int,
        block_tables: torch.Tensor,  # [num_seqs, max_blocks] int32
        scale: float,
        sliding_window: int | None,  # not 1: window_size_left=0 reads as "no window"
        softcap: float,  # -1: none
        out: torch.Tensor,  # [num_query_tokens, num_heads, head_size], written in place
    ) -> None:
        """Causal chunks over the paged cache through IPEX's varlen flash attention."""
        fp8 = kv_cache.dtype in FP8_DTYPES
        if fp8 and kv_cache.shape[-1] < FP8_VARLEN_MIN_HEAD_SIZE:
            kv_cache, fp8 = kv_cache.to(FP8_COMPUTE_DTYPE), False  # see the module doc
        self._ops.flash_attn_varlen_func(
            out,
            query,
            kv_cache[0],
            kv_cache[1],
            cu_seqlens_q,
            cu_seqlens_kv,
            max_seqlen_q,
            max_seqlen_kv,
            scale,
            True,  # causal, aligned bottom-right over cached + new tokens
            block_tables,
            None,  # alibi slopes
            -1 if sliding_window is None else sliding_window - 1,
            -1 if sliding_window is None else 0,
            kv_cache_dtype=FP8_NAME if fp8 else "auto",
            softcap=softcap,
        )


def _own_values(
    kv_cache: torch.Tensor,  # [2, num_blocks, num_kv_heads, block_size, head_size]
    slots: torch.Tensor,  # [n] int64, slots of the query tokens (already written)
    num_heads: int,
) -> torch.Tensor:  # [n, num_heads, head_size]
    """Attention of each token over itself alone is its own value, broadcast over its group.

    Read through a byte view (torch 2.8 cannot gather fp8), and unscaled: ``forward`` applies
    ``v_scale`` to every output row alike.
    """
    block_size = kv_cache.shape[3]
    blocks = torch.div(slots, block_size, rounding_mode="floor")
    rows = byte_view(kv_cache[1])[blocks, :, slots % block_size]  # [n, num_kv_heads, head_size]
    return rows.repeat_interleave(num_heads // kv_cache.shape[2], dim=1).view(kv_cache.dtype)

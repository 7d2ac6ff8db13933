"""Paged attention in batched PyTorch ops: the CPU fallback when the C++ kernel cannot be built.

Cache layout (every kernel's and the reference's): ``[2, num_blocks, num_kv_heads, block_size,
head_size]``. Decodes gather their blocks through the padded block table in one indexing op;
prompt chunks run SDPA per sequence, over the fresh keys alone (no cached context) or over the
gathered context with an explicit causal/window mask.

Any cache dtype (fp8 with its per-layer scales): K/V are widened to float32 before the math
(then to the query's dtype for SDPA). Decodes read whole blocks, so the tail of a sequence's last
block (never written, possibly NaN, or stale) enters the batched ops: its scores are replaced by
-inf and its values by 0 with selects, never multiplied by a zero probability, which a NaN would
survive.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pagedllm.backends.base import (
    KV_CACHE_DTYPES,
    AttentionBackend,
    AttentionMetadata,
    byte_view,
    from_cache_dtype,
    to_cache_dtype,
)


def _seq_kv(
    kv_cache: torch.Tensor, table: torch.Tensor, seq_len: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence's first ``seq_len`` keys and values, each ``[kvh, seq_len, d]`` as stored."""
    _, _, kvh, bs, d = kv_cache.shape
    blocks = table[: (seq_len + bs - 1) // bs].long()
    # [n, kvh, bs, d] -> [kvh, n * bs, d]
    k = kv_cache[0][blocks].transpose(0, 1).reshape(kvh, -1, d)[:, :seq_len]
    v = kv_cache[1][blocks].transpose(0, 1).reshape(kvh, -1, d)[:, :seq_len]
    return k, v


def _capped_attention(
    q: torch.Tensor,  # [1, h, q_len, d] float32
    k: torch.Tensor,  # [1, kvh, seq_len, d]
    v: torch.Tensor,
    mask: torch.Tensor,  # [q_len, seq_len] bool: what each query sees
    scale: float,
    cap: float,
) -> torch.Tensor:  # [1, h, q_len, d]
    """Attention whose scores are soft-capped (``cap * tanh(s / cap)``) before the mask."""
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    scores = torch.einsum("bhqd,bhkd->bhqk", q, k) * scale
    scores = (torch.tanh(scores / cap) * cap).masked_fill(~mask, float("-inf"))
    return torch.einsum("bhqk,bhkd->bhqd", torch.softmax(scores, dim=-1), v)


class TorchPagedAttention(AttentionBackend):
    """Vectorised over the decode batch; per sequence only for prompt chunks."""

    name = "torch"
    supported_kv_cache_dtypes = tuple(KV_CACHE_DTYPES)
    kv_cache_dtype_follows_compute = False

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
        keep = slot_mapping >= 0  # -1: a padding token, never stored
        slot_mapping, key, value = slot_mapping[keep], key[keep], value[keep]
        bs = kv_cache.shape[3]
        blocks, offsets = slot_mapping // bs, slot_mapping % bs
        # fp8 through byte views: torch has no fp8 index_put kernel.
        k = byte_view(to_cache_dtype(key, kv_cache.dtype, k_scale))
        v = byte_view(to_cache_dtype(value, kv_cache.dtype, v_scale))
        byte_view(kv_cache[0])[blocks, :, offsets] = k
        byte_view(kv_cache[1])[blocks, :, offsets] = v

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
        out = torch.empty_like(query)
        scales = (k_scale, v_scale)
        cap = logits_soft_cap
        if meta.num_prefills:
            self._prefill(query, kv_cache, meta, scale, sliding_window, out, scales, cap)
        if meta.num_decode_tokens:
            p = meta.num_prefill_tokens
            out[p:] = self._decode(query[p:], kv_cache, meta, scale, sliding_window, scales, cap)
        return out

    def _prefill(
        self,
        query: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        sliding_window: int | None,
        out: torch.Tensor,
        scales: tuple[float, float],
        cap: float | None = None,
    ) -> None:
        start = 0
        for i in range(meta.num_prefills):
            q_len, seq_len = meta.query_lens_list[i], meta.seq_lens_list[i]
            mask = None
            if q_len != seq_len or sliding_window is not None or cap is not None:
                q_pos = torch.arange(seq_len - q_len, seq_len, device=query.device)[:, None]
                k_pos = torch.arange(seq_len, device=query.device)[None, :]
                mask = k_pos <= q_pos  # [q_len, seq_len]
                if sliding_window is not None:
                    mask &= k_pos > q_pos - sliding_window
            # A plain prompt runs in the query's dtype; masked chunks in float32, as the kernels.
            dtype = query.dtype if mask is None else torch.float32
            q = query[start : start + q_len].transpose(0, 1).unsqueeze(0).to(dtype)  # [1,h,q,d]
            k, v = _seq_kv(kv_cache, meta.block_tables[i], seq_len)
            k = from_cache_dtype(k, scales[0]).to(dtype).unsqueeze(0)  # [1, kvh, seq_len, d]
            v = from_cache_dtype(v, scales[1]).to(dtype).unsqueeze(0)
            if cap is None:
                o = F.scaled_dot_product_attention(
                    q, k, v, attn_mask=mask, is_causal=mask is None, scale=scale, enable_gqa=True
                )
            else:  # SDPA has no soft cap: the scores spelled out
                assert mask is not None
                o = _capped_attention(q, k, v, mask, scale, cap)
            out[start : start + q_len] = o[0].transpose(0, 1).to(out.dtype)
            start += q_len

    def _decode(
        self,
        query: torch.Tensor,  # [num_decodes, num_heads, d]
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        sliding_window: int | None,
        scales: tuple[float, float],
        cap: float | None = None,
    ) -> torch.Tensor:
        p = meta.num_prefills
        tables = meta.block_tables[p:].long()  # [b, max_blocks]
        seq_lens = meta.seq_lens[p:].long()  # [b]
        b, heads, d = query.shape
        _, _, kvh, bs, _ = kv_cache.shape
        max_blocks = (max(meta.seq_lens_list[p:]) + bs - 1) // bs
        tables = tables[:, :max_blocks]
        length = max_blocks * bs

        def gather(cache: torch.Tensor, s: float) -> torch.Tensor:
            # [b, n, kvh, bs, d] -> [b, kvh, L, d] in float32; the last block's tail is junk.
            blocks = from_cache_dtype(cache[tables], s)
            return blocks.transpose(1, 2).reshape(b, kvh, length, d)

        k, v = gather(kv_cache[0], scales[0]), gather(kv_cache[1], scales[1])
        pos = torch.arange(length, device=query.device)[None, :]
        invalid = pos >= seq_lens[:, None]  # [b, L]
        if sliding_window is not None:
            invalid |= pos < (seq_lens[:, None] - sliding_window)
        v = v.masked_fill(invalid[:, None, :, None], 0.0)  # a select: NaN junk becomes 0
        group = heads // kvh
        q = query.float().view(b, kvh, group, d)
        scores = torch.einsum("bkgd,bkld->bkgl", q, k) * scale  # [b, kvh, g, L]
        if cap is not None:
            scores = torch.tanh(scores / cap) * cap
        scores.masked_fill_(invalid[:, None, None, :], float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        out = torch.einsum("bkgl,bkld->bkgd", probs, v).reshape(b, heads, d)
        return out.to(query.dtype)

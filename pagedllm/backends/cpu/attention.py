"""Paged attention in batched PyTorch ops: the CPU fallback when the C++ kernel cannot be built.

Cache layout (same as the reference): ``[2, num_blocks, block_size, num_kv_heads, head_size]``.
Decodes gather their blocks through the padded block table in one indexing op; prompts with no
cached context skip the cache entirely and run SDPA on the fresh keys and values.

Any cache dtype (fp8 with its per-layer scales): K/V are widened to float32 before the math.
Decodes read whole blocks, so the tail of a sequence's last block (never written, possibly NaN,
or stale) enters the batched ops: its scores are replaced by -inf and its values by 0 with
selects, never multiplied by a zero probability, which a NaN would survive.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pagedllm.backends.base import AttentionMetadata, byte_view, from_cache_dtype, to_cache_dtype
from pagedllm.backends.reference import ReferenceAttention, attend, gather_seq_kv


class TorchPagedAttention(ReferenceAttention):
    """Vectorised over the decode batch; per sequence only for prompt chunks."""

    name = "torch"
    supported_kv_cache_dtypes = ReferenceAttention.supported_kv_cache_dtypes
    kv_cache_dtype_follows_compute = False

    def write_kv(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
        *,
        k_scale: float = 1.0,
        v_scale: float = 1.0,
    ) -> None:
        _, _, _, kvh, d = kv_cache.shape
        keep = slot_mapping >= 0  # -1: a padding token, never stored
        slot_mapping, key, value = slot_mapping[keep], key[keep], value[keep]
        k = byte_view(to_cache_dtype(key, kv_cache.dtype, k_scale))
        v = byte_view(to_cache_dtype(value, kv_cache.dtype, v_scale))
        byte_view(kv_cache[0]).view(-1, kvh, d).index_copy_(0, slot_mapping, k)
        byte_view(kv_cache[1]).view(-1, kvh, d).index_copy_(0, slot_mapping, v)

    def forward(
        self,
        query: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        *,
        sliding_window: int | None = None,
        k_scale: float = 1.0,
        v_scale: float = 1.0,
    ) -> torch.Tensor:
        out = torch.empty_like(query)
        scales = (k_scale, v_scale)
        if meta.num_prefills:
            self._prefill(query, kv_cache, meta, scale, sliding_window, out, scales)
        if meta.num_decode_tokens:
            p = meta.num_prefill_tokens
            out[p:] = self._decode(query[p:], kv_cache, meta, scale, sliding_window, scales)
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
    ) -> None:
        start = 0
        for i in range(meta.num_prefills):
            q_len, seq_len = meta.query_lens_list[i], meta.seq_lens_list[i]
            q = query[start : start + q_len]
            table = meta.block_tables[i].tolist()
            k, v = gather_seq_kv(kv_cache, table, seq_len)
            k, v = from_cache_dtype(k, scales[0]), from_cache_dtype(v, scales[1])
            if q_len == seq_len and sliding_window is None:
                k, v = k.to(q.dtype), v.to(q.dtype)
                # [1, heads, q_len, d] layout for SDPA; GQA handled by the op.
                o = F.scaled_dot_product_attention(
                    q.transpose(0, 1).unsqueeze(0),
                    k.transpose(0, 1).unsqueeze(0),
                    v.transpose(0, 1).unsqueeze(0),
                    is_causal=True,
                    scale=scale,
                    enable_gqa=True,
                )
                out[start : start + q_len] = o[0].transpose(0, 1)
            else:
                out[start : start + q_len] = attend(q, k, v, seq_len - q_len, scale, sliding_window)
            start += q_len

    def _decode(
        self,
        query: torch.Tensor,  # [num_decodes, num_heads, d]
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        sliding_window: int | None,
        scales: tuple[float, float],
    ) -> torch.Tensor:
        p = meta.num_prefills
        tables = meta.block_tables[p:].long()  # [b, max_blocks]
        seq_lens = meta.seq_lens[p:].long()  # [b]
        b, heads, d = query.shape
        _, _, bs, kvh, _ = kv_cache.shape
        max_blocks = (max(meta.seq_lens_list[p:]) + bs - 1) // bs
        tables = tables[:, :max_blocks]
        # [b, L, kvh, d] in float32; L covers whole blocks, so the last block's tail is junk.
        k = from_cache_dtype(kv_cache[0][tables], scales[0]).reshape(b, max_blocks * bs, kvh, d)
        v = from_cache_dtype(kv_cache[1][tables], scales[1]).reshape(b, max_blocks * bs, kvh, d)
        pos = torch.arange(max_blocks * bs, device=query.device)[None, :]
        invalid = pos >= seq_lens[:, None]  # [b, L]
        if sliding_window is not None:
            invalid |= pos < (seq_lens[:, None] - sliding_window)
        v = v.masked_fill(invalid[:, :, None, None], 0.0)  # a select: NaN junk becomes 0
        group = heads // kvh
        q = query.float().view(b, kvh, group, d)
        scores = torch.einsum("bkgd,blkd->bkgl", q, k) * scale  # [b, kvh, g, L]
        scores.masked_fill_(invalid[:, None, None, :], float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        out = torch.einsum("bkgl,blkd->bkgd", probs, v).reshape(b, heads, d)
        return out.to(query.dtype)

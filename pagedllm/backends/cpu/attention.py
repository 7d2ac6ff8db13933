"""Paged attention in batched PyTorch ops: the CPU fallback when the C++ kernel cannot be built.

Cache layout (same as the reference): ``[2, num_blocks, block_size, num_kv_heads, head_size]``.
Decodes gather their blocks through the padded block table in one indexing op; prompts with no
cached context skip the cache entirely and run SDPA on the fresh keys and values.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pagedllm.backends.base import AttentionMetadata
from pagedllm.backends.reference import ReferenceAttention, attend, gather_seq_kv


class TorchPagedAttention(ReferenceAttention):
    """Vectorised over the decode batch; per sequence only for prompt chunks."""

    name = "torch"

    def write_kv(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:
        _, _, _, kvh, d = kv_cache.shape
        kv_cache[0].view(-1, kvh, d).index_copy_(0, slot_mapping, key.to(kv_cache.dtype))
        kv_cache[1].view(-1, kvh, d).index_copy_(0, slot_mapping, value.to(kv_cache.dtype))

    def forward(
        self,
        query: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        *,
        sliding_window: int | None = None,
    ) -> torch.Tensor:
        out = torch.empty_like(query)
        if meta.num_prefills:
            self._prefill(query, kv_cache, meta, scale, sliding_window, out)
        if meta.num_decode_tokens:
            p = meta.num_prefill_tokens
            out[p:] = self._decode(query[p:], kv_cache, meta, scale, sliding_window)
        return out

    def _prefill(
        self,
        query: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        sliding_window: int | None,
        out: torch.Tensor,
    ) -> None:
        start = 0
        for i in range(meta.num_prefills):
            q_len, seq_len = meta.query_lens_list[i], meta.seq_lens_list[i]
            q = query[start : start + q_len]
            table = meta.block_tables[i].tolist()
            k, v = gather_seq_kv(kv_cache, table, seq_len)
            if q_len == seq_len and sliding_window is None:
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
    ) -> torch.Tensor:
        p = meta.num_prefills
        tables = meta.block_tables[p:].long()  # [b, max_blocks]
        seq_lens = meta.seq_lens[p:].long()  # [b]
        b, heads, d = query.shape
        _, _, bs, kvh, _ = kv_cache.shape
        max_blocks = (max(meta.seq_lens_list[p:]) + bs - 1) // bs
        tables = tables[:, :max_blocks]
        k = kv_cache[0][tables].reshape(b, max_blocks * bs, kvh, d)  # [b, L, kvh, d]
        v = kv_cache[1][tables].reshape(b, max_blocks * bs, kvh, d)
        group = heads // kvh
        q = query.view(b, kvh, group, d)
        scores = torch.einsum("bkgd,blkd->bkgl", q, k) * scale  # [b, kvh, g, L]
        pos = torch.arange(max_blocks * bs, device=query.device)[None, :]
        invalid = pos >= seq_lens[:, None]
        if sliding_window is not None:
            invalid |= pos < (seq_lens[:, None] - sliding_window)
        scores.masked_fill_(invalid[:, None, None, :], float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        return torch.einsum("bkgl,blkd->bkgd", probs, v).reshape(b, heads, d)

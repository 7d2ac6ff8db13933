"""Plain-PyTorch paged attention: the oracle every backend's kernels are tested against.

It walks each sequence's block table in Python and does textbook attention, so it is slow and
obviously right. Layout of one layer's cache, the one every kernel reads: ``[2, num_blocks,
num_kv_heads, block_size, head_size]`` (a (block, KV head) tile is one contiguous
``[block_size, head_size]`` panel), so a test hands the very same cache to a kernel and to the
oracle. Any cache dtype: keys and values are widened to float32 (fp8 times its scale)
before the math, which is float32 throughout; the output has the query's dtype. Only the
``seq_len`` written tokens of a sequence are ever read, and masking is a select (-inf before the
softmax), so never-written slots cannot leak into an output whatever they hold.
"""

from __future__ import annotations

import torch

from pagedllm.backends.base import (
    AttentionBackend,
    AttentionMetadata,
    byte_view,
    from_cache_dtype,
    to_cache_dtype,
)


def gather_seq_kv(
    kv_cache: torch.Tensor, block_table: list[int], seq_len: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values of the first ``seq_len`` tokens of one sequence, each [seq_len, kvh, d]."""
    _, _, kv_heads, block_size, head_size = kv_cache.shape
    num_blocks = (seq_len + block_size - 1) // block_size
    idx = torch.tensor(block_table[:num_blocks], dtype=torch.long, device=kv_cache.device)
    # [n, kvh, block_size, d] -> [n, block_size, kvh, d] -> token rows. Gathered as bytes: some
    # torch builds (2.8, which IPEX pins) have no fp8 gather kernel on the CPU.
    raw = byte_view(kv_cache)
    k = raw[0, idx].transpose(1, 2).reshape(-1, kv_heads, head_size)[:seq_len]
    v = raw[1, idx].transpose(1, 2).reshape(-1, kv_heads, head_size)[:seq_len]
    return k.view(kv_cache.dtype), v.view(kv_cache.dtype)


def attend(
    q: torch.Tensor,  # [q_len, num_heads, d]
    k: torch.Tensor,  # [seq_len, kv_heads, d]
    v: torch.Tensor,  # [seq_len, kv_heads, d]
    context_len: int,
    scale: float,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
) -> torch.Tensor:  # [q_len, num_heads, d]
    """Causal attention of queries at positions ``context_len..`` over all ``seq_len`` keys;
    with ``logits_soft_cap`` each score becomes ``cap * tanh(score / cap)`` first (Gemma 2)."""
    q_len, num_heads, _ = q.shape
    seq_len, kv_heads, _ = k.shape
    group = num_heads // kv_heads
    k = k.repeat_interleave(group, dim=1).float()
    v = v.repeat_interleave(group, dim=1).float()
    scores = torch.einsum("qhd,khd->hqk", q.float(), k) * scale  # [h, q_len, seq_len]
    if logits_soft_cap is not None:
        scores = torch.tanh(scores / logits_soft_cap) * logits_soft_cap
    q_pos = torch.arange(context_len, context_len + q_len, device=q.device)[:, None]
    k_pos = torch.arange(seq_len, device=q.device)[None, :]
    allowed = k_pos <= q_pos
    if sliding_window is not None:
        allowed &= k_pos > q_pos - sliding_window
    scores = scores.masked_fill(~allowed, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    return torch.einsum("hqk,khd->qhd", probs, v).to(q.dtype)


class ReferenceAttention(AttentionBackend):
    """The oracle. Also usable inside the engine (``attention_backend="reference"``)."""

    name = "reference"
    supported_kv_cache_dtypes = ("float32", "bfloat16", "float16", "fp8", "fp8_e4m3", "fp8_e5m2")
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
        keep = slot_mapping >= 0  # -1: a padding token, never stored
        slot_mapping, key, value = slot_mapping[keep], key[keep], value[keep]
        block_size = kv_cache.shape[3]
        blocks = torch.div(slot_mapping, block_size, rounding_mode="floor")
        offsets = slot_mapping % block_size
        # Advanced indices around a slice: the indexed view is [num_tokens, kvh, d].
        kv_cache[0, blocks, :, offsets] = to_cache_dtype(key, kv_cache.dtype, k_scale)
        kv_cache[1, blocks, :, offsets] = to_cache_dtype(value, kv_cache.dtype, v_scale)

    def forward(
        self,
        query: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        *,
        sliding_window: int | None = None,
        logits_soft_cap: float | None = None,
        k_scale: float = 1.0,
        v_scale: float = 1.0,
    ) -> torch.Tensor:
        out = torch.empty_like(query)
        tables = meta.block_tables.tolist()
        start = 0
        for i, (q_len, seq_len) in enumerate(
            zip(meta.query_lens_list, meta.seq_lens_list, strict=True)
        ):
            k, v = gather_seq_kv(kv_cache, tables[i], seq_len)
            k, v = from_cache_dtype(k, k_scale), from_cache_dtype(v, v_scale)
            q = query[start : start + q_len]
            out[start : start + q_len] = attend(
                q, k, v, seq_len - q_len, scale, sliding_window, logits_soft_cap
            )
            start += q_len
        return out

"""What the KV cache stores and where each token of a step lives in it.

The ``kv_cache_dtype`` names and the conversions every kernel and the reference share (fp8
holds ``x / scale``), and :class:`AttentionMetadata`, built once per step from the scheduler's
per-sequence lists. Re-exported by ``backends/base.py``, the seams' module.
"""

from __future__ import annotations

import array
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from pagedllm import names

#: ``kv_cache_dtype`` names (besides "auto", the compute dtype) and what the cache stores.
KV_CACHE_DTYPES: dict[str, torch.dtype] = {
    name: getattr(torch, attr) for name, attr in names.KV_CACHE_DTYPES.items() if attr is not None
}
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


def to_cache_dtype(x: torch.Tensor, dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
    """``x`` as the cache stores it: fp8 holds ``x / scale`` saturated to the format's range."""
    if dtype in FP8_DTYPES:
        bound = torch.finfo(dtype).max
        return (x.float() / scale).clamp(-bound, bound).to(dtype)
    return x.to(dtype)


def from_cache_dtype(x: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
    """Cached values as float32 (fp8: times its scale): what every kernel computes with."""
    if x.dtype in FP8_DTYPES:
        return x.float() * scale
    return x.float()


def byte_view(cache: torch.Tensor) -> torch.Tensor:
    """fp8 caches as uint8, for the indexing ops torch has no fp8 kernel for (index_copy_)."""
    return cache.view(torch.uint8) if cache.dtype in FP8_DTYPES else cache


_ARRAY_CODES = {torch.int32: "i", torch.int64: "q"}


def host_tensor(values: Sequence[int], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``torch.tensor(values, dtype=dtype, device=device)`` for a step's lists of Python ints
    (int32 or int64), about 3x faster: the list goes into a C array in one pass, which the
    tensor then wraps, where ``torch.tensor`` inspects each element (at 16 decodes a step's
    block tables alone were ~40 us of it on a 2-core EPYC)."""
    if not values:
        return torch.empty(0, dtype=dtype, device=device)
    return torch.frombuffer(array.array(_ARRAY_CODES[dtype], values), dtype=dtype).to(device)


@dataclass
class AttentionMetadata:
    """Where each token of a flat batch lives in the paged cache, and what it attends to.

    Sequence ``i`` contributes query tokens ``query_start_loc[i]:query_start_loc[i+1]``; they sit
    at positions ``context_lens[i] .. seq_lens[i]-1`` and attend causally to every cached token of
    that sequence, the new ones included. The first ``num_prefills`` sequences are prompt chunks
    (any query length, earlier tokens possibly cached already); the rest are decodes (one query
    token each).
    """

    num_prefills: int
    num_prefill_tokens: int
    num_decode_tokens: int
    slot_mapping: torch.Tensor  # [num_tokens] int64
    seq_lens: torch.Tensor  # [num_seqs] int32, cached + new tokens after this step
    context_lens: torch.Tensor  # [num_seqs] int32, tokens already cached before this step
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32
    block_tables: torch.Tensor  # [num_seqs, max_blocks_per_seq] int32, padded with 0
    seq_lens_list: list[int]
    query_lens_list: list[int]
    max_query_len: int
    max_seq_len: int
    block_size: int

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_list)

    @property
    def num_decodes(self) -> int:
        return self.num_seqs - self.num_prefills

    @property
    def num_tokens(self) -> int:
        return self.num_prefill_tokens + self.num_decode_tokens


def build_attention_metadata(
    *,
    num_prefills: int,
    seq_lens: Sequence[int],
    query_lens: Sequence[int],
    slot_mapping: Sequence[int],
    block_tables: Sequence[Sequence[int]],
    block_size: int,
    device: torch.device,
) -> AttentionMetadata:
    """Turn per-sequence Python lists into the tensors every kernel reads.

    The int32 fields are views of one tensor made from one flat list (block tables first, so
    that they start where its storage does): a tensor per field and a copy per block-table row
    made this a tenth of a small model's decode step at one sequence, and a row copy per
    sequence grows with the batch.
    """
    num_seqs = len(seq_lens)
    width = max(max((len(t) for t in block_tables), default=0), 1)
    qsl = [0]
    for q in query_lens:
        qsl.append(qsl[-1] + q)
    flat: list[int] = []
    for table in block_tables:
        flat.extend(table)
        flat.extend([0] * (width - len(table)))
    flat.extend(seq_lens)
    flat.extend([s - q for s, q in zip(seq_lens, query_lens, strict=True)])
    flat.extend(qsl)
    ints = host_tensor(flat, torch.int32, device)
    tables, seq_t, context_t, qsl_t = ints.split_with_sizes(
        [num_seqs * width, num_seqs, num_seqs, num_seqs + 1]
    )
    num_prefill_tokens = qsl[num_prefills]
    return AttentionMetadata(
        num_prefills=num_prefills,
        num_prefill_tokens=num_prefill_tokens,
        num_decode_tokens=qsl[-1] - num_prefill_tokens,
        slot_mapping=host_tensor(slot_mapping, torch.int64, device),
        seq_lens=seq_t,
        context_lens=context_t,
        query_start_loc=qsl_t,
        block_tables=tables.view(num_seqs, width),
        seq_lens_list=list(seq_lens),
        query_lens_list=list(query_lens),
        max_query_len=max(query_lens, default=0),
        max_seq_len=max(seq_lens, default=0),
        block_size=block_size,
    )

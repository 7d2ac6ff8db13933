"""Paged attention through the C++ CPU kernels (``attention_backend="cpp"``).

Cache layout of one layer: ``[2, num_blocks, num_kv_heads, block_size, head_size]`` (K then V).
It differs from the reference's ``[2, num_blocks, block_size, num_kv_heads, head_size]`` on
purpose: the keys of one (block, kv head) pair are one contiguous ``[block_size, head_size]``
panel, so the kernel streams each block in a single run and every token row is a contiguous
vector load. ``kv_cache.transpose(2, 3)`` is the reference layout as a view, which is how the
tests feed the same cache to the oracle and how the PyTorch fallback reads it.

The kernels (``csrc/``) run float32 on CPU tensors; they handle any head size (vector bodies plus
a scalar tail), any block size, GQA/MQA and sliding windows, and one call serves a whole mixed
batch: prompt chunks with or without cached context and single-token decodes alike, with an online
softmax so no score buffer grows with the context. Anything else (another dtype, a non-CPU
tensor) goes to :class:`TorchPagedAttention` on the transposed view, so the engine never needs to
know which path ran.
"""

from __future__ import annotations

from pathlib import Path

import torch

from pagedllm.backends.base import AttentionBackend, AttentionMetadata
from pagedllm.backends.cpu._ops import load_ops, resolve_isa
from pagedllm.backends.cpu.attention import TorchPagedAttention


def _kernel_ok(*tensors: torch.Tensor) -> bool:
    """Whether the C++ kernels accept these tensors (float32, CPU, unit inner stride)."""
    return all(
        t.dtype == torch.float32 and t.device.type == "cpu" and t.stride(-1) == 1 for t in tensors
    )


class CppPagedAttention(AttentionBackend):
    """The CPU backend's default attention; construction builds or loads the extension.

    Raises ``RuntimeError``/``ImportError``/``OSError`` when the extension cannot be built, which
    the CPU backend turns into a fallback to :class:`TorchPagedAttention`.
    """

    name = "cpp"

    def __init__(self, *, build_root: Path | None = None, isa: str | None = None) -> None:
        # isa=None: PAGEDLLM_CPU_ISA or the best level this CPU runs; tests force each level.
        self.isa = resolve_isa(isa)
        self._ops = load_ops(build_root, isa=self.isa)
        self._fallback = TorchPagedAttention()

    @property
    def uses_avx2(self) -> bool:
        """True when the loaded build runs the AVX2/FMA code path."""
        return bool(self._ops.built_with_avx2())

    def kv_cache_shape(
        self, num_blocks: int, block_size: int, num_kv_heads: int, head_size: int
    ) -> tuple[int, ...]:
        return (2, num_blocks, num_kv_heads, block_size, head_size)

    def write_kv(
        self,
        key: torch.Tensor,  # [num_tokens, num_kv_heads, head_size]
        value: torch.Tensor,  # [num_tokens, num_kv_heads, head_size]
        kv_cache: torch.Tensor,  # [2, num_blocks, num_kv_heads, block_size, head_size]
        slot_mapping: torch.Tensor,  # [num_tokens] int64
    ) -> None:
        if (
            _kernel_ok(key, value, kv_cache)
            and kv_cache.is_contiguous()
            and slot_mapping.device.type == "cpu"
        ):
            self._ops.reshape_and_cache(
                key, value, kv_cache, slot_mapping.to(torch.int64).contiguous()
            )
            return
        # Scatter through the reference-layout view; writes land in kv_cache's storage.
        view = kv_cache.transpose(2, 3)  # [2, num_blocks, block_size, num_kv_heads, head_size]
        block_size = kv_cache.shape[3]
        blocks = torch.div(slot_mapping, block_size, rounding_mode="floor")
        offsets = slot_mapping % block_size
        view[0, blocks, offsets] = key.to(kv_cache.dtype)
        view[1, blocks, offsets] = value.to(kv_cache.dtype)

    def forward(
        self,
        query: torch.Tensor,  # [num_tokens, num_heads, head_size]
        kv_cache: torch.Tensor,  # [2, num_blocks, num_kv_heads, block_size, head_size]
        meta: AttentionMetadata,
        scale: float,
        *,
        sliding_window: int | None = None,
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_size]
        if not (_kernel_ok(query, kv_cache) and kv_cache.is_contiguous()):
            return self._fallback.forward(
                query, kv_cache.transpose(2, 3), meta, scale, sliding_window=sliding_window
            )
        if meta.num_seqs == 0:
            return torch.empty_like(query)
        return self._ops.paged_attention(
            query,
            kv_cache,
            meta.block_tables.to(torch.int32).contiguous(),
            meta.seq_lens.to(torch.int32).contiguous(),
            meta.query_start_loc.to(torch.int32).contiguous(),
            float(scale),
            int(sliding_window or 0),
        )

    def copy_blocks(self, kv_caches: list[torch.Tensor], pairs: torch.Tensor) -> None:
        """Copy-on-write in every layer with one parallel memcpy pass (any dtype)."""
        if pairs.numel() == 0 or not kv_caches:
            return
        if all(c.device.type == "cpu" and c.is_contiguous() for c in kv_caches):
            self._ops.copy_blocks(kv_caches, pairs.to("cpu", torch.int64).contiguous())
        else:
            super().copy_blocks(kv_caches, pairs)

    def swap_blocks(self, src: torch.Tensor, dst: torch.Tensor, pairs: torch.Tensor) -> None:
        """Block moves between two CPU pools by memcpy; other devices take the generic path."""
        if pairs.numel() == 0:
            return
        if (
            src.device.type == "cpu"
            and dst.device.type == "cpu"
            and src.is_contiguous()
            and dst.is_contiguous()
            and src.dtype == dst.dtype
        ):
            self._ops.swap_blocks(src, dst, pairs.to("cpu", torch.int64).contiguous())
        else:
            super().swap_blocks(src, dst, pairs)

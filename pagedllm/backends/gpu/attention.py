"""Paged attention through our own Triton kernels (``attention_backend="triton"``).

Cache layout of one layer: ``[2, num_blocks, num_kv_heads, block_size, head_size]`` (see
``triton_ops``): a (block, KV head) tile is contiguous. On CUDA tensors the kernels are compiled;
on CPU tensors they run only under Triton's interpreter (``TRITON_INTERPRET=1`` set before triton
is first imported), which is how the tests and the CPU engine exercise them.

triton is imported when the backend is constructed, not when this module is imported, so that
``import pagedllm`` and the registry work on machines without it.
"""

from __future__ import annotations

import importlib
from types import ModuleType

import torch

from pagedllm.backends.base import AttentionBackend, AttentionMetadata
from pagedllm.backends.kv_layout import KV_CACHE_DTYPES

FP8_NAMES = tuple(name for name in KV_CACHE_DTYPES if name.startswith("fp8"))


def _load_ops() -> ModuleType:
    try:
        return importlib.import_module("pagedllm.backends.gpu.triton_ops")
    except ImportError as exc:
        raise ImportError(
            f"attention_backend='triton' needs the triton package ({exc}); "
            "install it with `pip install -r ci/requirements-gpu.txt`"
        ) from exc


class TritonPagedAttention(AttentionBackend):
    """Prefill chunks go to the prefill kernel, decodes to the split-K decode kernel.

    ``partition_size`` is the number of context tokens one decode program covers: contexts longer
    than that are split across programs and combined by a reduction kernel, which keeps the GPU
    busy when the batch is small but the contexts are long. ``None`` lets the launcher size it
    from the batch and the device's SM count.
    """

    name = "triton"
    # The kernels load K/V in the query's dtype (tl.dot of matching types): a 16/32-bit cache
    # in the compute dtype, or fp8 with a per-layer scale, dequantised to it as it is loaded.
    supported_kv_cache_dtypes = ("float32", "bfloat16", "float16", *FP8_NAMES)
    kv_cache_dtype_follows_compute = True
    #: Used when no ``partition_size`` is given (the engine constructs the backend without
    #: arguments); engine-level tests set it to engage split-K on short contexts.
    default_partition_size: int | None = None
    #: fp8 caches as bytes converted by integer arithmetic (True) or by fp8 casts (False); None:
    #: as the device needs (``triton_ops.fp8_as_bytes``: bytes before sm_89). Tests force both.
    fp8_bytes: bool | None = None

    def __init__(
        self, *, partition_size: int | None = None, prefill_block_m: int = 64, tile_n: int = 64
    ) -> None:
        self._ops = _load_ops()
        self.partition_size = partition_size or self.default_partition_size
        self.prefill_block_m = prefill_block_m
        self.tile_n = tile_n

    def check_device(self, device: torch.device) -> None:
        if device.type != "cuda" and not self._ops.interpreted():
            raise ValueError(
                f"attention_backend: 'triton' on device {device.type!r} runs only under Triton's "
                "interpreter (TRITON_INTERPRET=1 set before triton is first imported); its "
                "compiled kernels need device='cuda'"
            )

    def resolve_kv_cache_dtype(
        self, kv_cache_dtype: str, compute_dtype: torch.dtype
    ) -> torch.dtype:
        """fp8 (either format, any GPU: before sm_89 the kernels convert its bytes themselves)
        with any compute dtype; a 16/32-bit cache only in the compute dtype."""
        if kv_cache_dtype in FP8_NAMES:
            return KV_CACHE_DTYPES[kv_cache_dtype]
        try:
            return super().resolve_kv_cache_dtype(kv_cache_dtype, compute_dtype)
        except ValueError:
            same = [n for n, d in KV_CACHE_DTYPES.items() if d == compute_dtype]
            works = ["auto", *[n for n in same if n in self.supported_kv_cache_dtypes], *FP8_NAMES]
            raise ValueError(
                f"kv_cache_dtype: {kv_cache_dtype!r} cannot run on the {self.name!r} attention "
                f"backend with dtype {str(compute_dtype).removeprefix('torch.')}; this backend "
                f"supports {works}"
            ) from None

    def write_kv(
        self,
        key: torch.Tensor,  # [num_tokens, num_kv_heads, head_size]
        value: torch.Tensor,  # [num_tokens, num_kv_heads, head_size]
        kv_cache: torch.Tensor,
        slot_mapping: torch.Tensor,  # [num_tokens] int64
        k_scale: float = 1.0,
        v_scale: float = 1.0,
    ) -> None:
        self._ops.reshape_and_cache(
            key, value, kv_cache, slot_mapping, k_scale, v_scale, fp8_bytes=self.fp8_bytes
        )

    def forward(
        self,
        query: torch.Tensor,  # [num_tokens, num_heads, head_size]
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        *,
        sliding_window: int | None = None,
        logits_soft_cap: float | None = None,
        k_scale: float = 1.0,
        v_scale: float = 1.0,
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_size]
        out = torch.empty_like(query)
        p, p_tok = meta.num_prefills, meta.num_prefill_tokens
        if p:
            self._ops.prefill_attention(
                query[:p_tok],
                kv_cache,
                meta.block_tables[:p],
                meta.seq_lens[:p],
                meta.query_start_loc[: p + 1],
                max(meta.query_lens_list[:p]),
                scale,
                sliding_window=sliding_window,
                logits_soft_cap=logits_soft_cap,
                block_m=self.prefill_block_m,
                tile_n=self.tile_n,
                out=out[:p_tok],
                k_scale=k_scale,
                v_scale=v_scale,
                fp8_bytes=self.fp8_bytes,
            )
        if meta.num_decode_tokens:
            self._ops.paged_decode_attention(
                query[p_tok:],
                kv_cache,
                meta.block_tables[p:],
                meta.seq_lens[p:],
                max(meta.seq_lens_list[p:]),
                scale,
                sliding_window=sliding_window,
                logits_soft_cap=logits_soft_cap,
                partition_size=self.partition_size,
                tile_n=self.tile_n,
                out=out[p_tok:],
                k_scale=k_scale,
                v_scale=v_scale,
                fp8_bytes=self.fp8_bytes,
            )
        return out

    def swap_blocks(self, src: torch.Tensor, dst: torch.Tensor, pairs: torch.Tensor) -> None:
        """One copy per (block, K/V): each is contiguous, so host<->device is a plain DMA.

        ``non_blocking`` makes the copies asynchronous when the host side is pinned; the CUDA
        cache engine runs them on a side stream and orders the next forward after them.
        """
        if pairs.numel() == 0:
            return
        for a, b in pairs.tolist():
            for kv in (0, 1):  # dst[:, b] spans K and V: not one contiguous chunk
                dst[kv, b].copy_(src[kv, a], non_blocking=True)

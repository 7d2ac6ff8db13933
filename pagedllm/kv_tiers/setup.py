"""The worker's side of building the lower KV tiers: fingerprint, slab size, disk folder."""

from __future__ import annotations

import logging
import math
from typing import TYPE_CHECKING

import torch

from pagedllm.kv_tiers.disk import DiskTier
from pagedllm.kv_tiers.fingerprint import compute_fingerprint
from pagedllm.kv_tiers.host import HostSlab
from pagedllm.kv_tiers.store import TieredBlockStore

if TYPE_CHECKING:
    from pagedllm.backends.base import AttentionBackend, CacheSpec, DeviceBackend
    from pagedllm.config import EngineConfig

logger = logging.getLogger(__name__)

# Staging for blocks in flight where there is no host tier (the CPU): enough for two prompts of
# max_model_len, at most this many bytes (pages are touched only when used).
STAGING_MAX_BYTES = 512 << 20
STAGING_MIN_SLOTS = 16


def block_layout(spec: CacheSpec, attention: AttentionBackend) -> dict[str, object]:
    """What one block file holds: per layer, the cache's ``[2, ...]`` of one block."""
    shape = attention.kv_cache_shape(1, spec.block_size, spec.num_kv_heads, spec.head_size)
    return {
        "dtype": str(spec.dtype).removeprefix("torch."),
        "shape": [spec.num_layers, shape[0], *shape[2:]],
    }


def payload_nbytes(spec: CacheSpec, attention: AttentionBackend) -> int:
    shape = attention.kv_cache_shape(1, spec.block_size, spec.num_kv_heads, spec.head_size)
    itemsize = torch.empty((), dtype=spec.dtype).element_size()
    return spec.num_layers * math.prod(shape) * itemsize


def slab_slots(config: EngineConfig, nbytes: int, offload_bytes: int) -> int:
    """The host tier's blocks, and at least a staging area for two max-length prompts."""
    cache, sched = config.cache, config.scheduler
    prompt_blocks = -(-sched.max_model_len // cache.block_size)
    staging = max(STAGING_MIN_SLOTS, min(2 * prompt_blocks, STAGING_MAX_BYTES // nbytes))
    return max(offload_bytes // nbytes, staging)


def open_store(
    config: EngineConfig,
    spec: CacheSpec,
    *,
    attention: AttentionBackend,
    backend: DeviceBackend,
    compute_dtype: torch.dtype,
    rank: int = 0,
) -> TieredBlockStore | None:
    """The worker's tiered store, or None when no tier can work (each reason logged once)."""
    cache = config.cache
    host_tier = not backend.kv_pool_in_host_memory
    if cache.kv_offload_space and not host_tier:
        logger.warning(
            "kv_offload_space: ignored on %s, whose KV pool is host memory already", backend.name
        )
    offload = cache.kv_offload_bytes(host_tier=host_tier)
    nbytes = payload_nbytes(spec, attention)
    disk = None
    if cache.kv_cache_dir is not None:
        fingerprint = compute_fingerprint(
            model=config.model.model,
            tokenizer=config.model.tokenizer,
            settings={
                "dtype": str(compute_dtype).removeprefix("torch."),
                "kv_cache_dtype": str(spec.dtype).removeprefix("torch."),
                "quantization": config.model.quantization,
                "block_size": spec.block_size,
                "num_layers": spec.num_layers,
                "num_kv_heads": spec.num_kv_heads,
                "head_size": spec.head_size,
                "device": backend.name,
                "tp_rank": rank,
                "tp_size": config.parallel.tensor_parallel_size,
            },
        )
        disk = DiskTier(
            cache.kv_cache_dir,
            fingerprint,
            capacity_bytes=cache.kv_disk_bytes,
            payload_nbytes=nbytes,
            layout=block_layout(spec, attention),
        )
        if not disk.readable:
            disk = None
    if disk is None and offload == 0:
        logger.warning("lower KV tiers: neither a usable disk folder nor host memory; off")
        return None
    slots = slab_slots(config, nbytes, offload)
    slab = HostSlab(slots, nbytes, pin_memory=backend.pin_host_tier)
    logger.info(
        "lower KV tiers: host %s (%d blocks of %d KiB), disk %s",
        "tier" if offload else "staging",
        slots,
        nbytes >> 10,
        disk.folder if disk is not None else "off",
    )
    return TieredBlockStore(slab, disk, keep_saved=offload > 0)

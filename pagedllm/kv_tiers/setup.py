"""The worker's side of building the lower KV tiers: fingerprint, slab size, disk folder."""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import os
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from pagedllm.kv_tiers.disk import DiskTier
from pagedllm.kv_tiers.fingerprint import compute_fingerprint, unhashed_bytes
from pagedllm.kv_tiers.hashes import HashCache, HashingStopped
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
# Weights not hashed before, up to this many bytes, are hashed before the tier opens (about a
# second per GB); more are hashed in the background, the disk tier off until they are.
SYNC_HASH_BYTES = 2 << 30


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
    disk, pending = None, None
    if cache.kv_cache_dir is not None:
        make_disk = functools.partial(
            _disk_tier,
            config,
            spec,
            attention,
            backend,
            compute_dtype,
            rank,
            nbytes,
            cache.kv_cache_dir,
        )
        with contextlib.suppress(OSError):  # else DiskTier says why, once
            os.makedirs(cache.kv_cache_dir, exist_ok=True)
        hashes = HashCache(cache.kv_cache_dir)
        unknown = unhashed_bytes(config.model.model, hashes)
        if unknown <= SYNC_HASH_BYTES:
            disk = make_disk(hashes, None)
        else:
            logger.warning(
                "disk KV tier: off until the weights are hashed (%.1f GB not seen before, hashed "
                "in the background once; the fingerprint covers every byte)",
                unknown / 1e9,
            )
            pending = functools.partial(make_disk, hashes)
    if disk is None and offload == 0 and pending is None:
        logger.warning("lower KV tiers: neither a usable disk folder nor host memory; off")
        return None
    slots = slab_slots(config, nbytes, offload)
    slab = HostSlab(slots, nbytes, pin_memory=backend.pin_host_tier)
    logger.info(
        "lower KV tiers: host %s (%d blocks of %d KiB), disk %s",
        "tier" if offload else "staging",
        slots,
        nbytes >> 10,
        disk.folder if disk is not None else "hashing" if pending is not None else "off",
    )
    store = TieredBlockStore(slab, disk, keep_saved=offload > 0)
    if pending is not None:
        threading.Thread(
            target=_attach_when_hashed, args=(store, pending), name="kv-tier-hash", daemon=True
        ).start()
    return store


def _attach_when_hashed(
    store: TieredBlockStore, make_disk: Callable[[threading.Event], DiskTier | None]
) -> None:
    try:
        disk = make_disk(store.closing)
    except HashingStopped:
        return
    except Exception as exc:  # a background thread: say why, once; serving goes on
        logger.warning("disk KV tier: hashing the weights failed (%s); off", exc)
        return
    if disk is not None and store.attach_disk(disk):
        logger.info("disk KV tier: weights hashed; on (%s)", disk.folder)


def _disk_tier(
    config: EngineConfig,
    spec: CacheSpec,
    attention: AttentionBackend,
    backend: DeviceBackend,
    compute_dtype: torch.dtype,
    rank: int,
    nbytes: int,
    folder: str,
    hashes: HashCache,
    stop: threading.Event | None,
) -> DiskTier | None:
    """The disk tier of this model's fingerprint (hashing what ``hashes`` does not know), or
    None when its folder cannot be read."""
    cache = config.cache
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
        hashes=hashes,
        stop=stop,
    )
    disk = DiskTier(
        folder,
        fingerprint,
        capacity_bytes=cache.kv_disk_bytes,
        payload_nbytes=nbytes,
        layout=block_layout(spec, attention),
    )
    return disk if disk.readable else None

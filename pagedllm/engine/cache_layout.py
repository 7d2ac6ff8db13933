"""How ``LLMEngine``'s KV cache is cut, and the schedulers built over it, at start-up.

Sizing is the one part of building an engine that depends on what the workers measured (free
memory, every stage's sliding window) and that changes the configuration (``max_model_len``
fitted to the blocks); the block managers and schedulers then follow from the layout alone.
Kept apart from the engine, whose job is requests and steps, so that this order of decisions
reads in one place.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from pagedllm.config import EngineConfig
from pagedllm.core.block_manager import BlockSpaceManager, window_block_count
from pagedllm.core.scheduler import Scheduler
from pagedllm.core.speculation import LookaheadPlanner
from pagedllm.engine.admission import fit_context
from pagedllm.engine.pooling import PoolingInfo
from pagedllm.engine.virtual_engines import VirtualBlockManagers, VirtualSchedulers

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class CacheLayout:
    """How the KV cache is cut: blocks per virtual engine, and the block sliding window.

    ``window``: the one window every layer slides by (None if any layer does not, or they
    differ). ``lazy``: blocks behind it are freed and a prompt gets its blocks chunk by chunk,
    so a sequence of any length runs in ``window_blocks`` blocks (vLLM's block sliding window).
    """

    num_device: int
    num_host: int
    num_virtual: int
    window: int | None
    lazy: bool
    window_blocks: int | None


def size_cache(
    config: EngineConfig,
    executor: Any,
    pooling: PoolingInfo,
    *,
    explicit_max_model_len: bool,
) -> tuple[EngineConfig, CacheLayout]:
    """Count the KV blocks, fit the context to them, and allocate the cache on the workers.

    Under pipeline parallelism each virtual engine gets its own share of the blocks. Returns
    ``config`` with the fitted context.
    """
    num_virtual = config.parallel.num_virtual_engines
    if not pooling.uses_kv_cache:  # an encoder: no block to count, nothing to fit
        executor.initialize_cache(0, 0, num_virtual)
        logger.info("KV cache: none (the model keeps no KV cache)")
        return config, CacheLayout(0, 0, num_virtual, None, False, None)
    num_device, num_host = executor.determine_num_blocks()
    num_device, num_host = num_device // num_virtual, num_host // num_virtual
    windows = set(executor.collective_rpc("uniform_sliding_window"))  # every stage's
    window = windows.pop() if len(windows) == 1 else None
    lazy = (
        window is not None
        and config.scheduler.enable_chunked_prefill
        and not config.cache.enable_prefix_caching
    )
    block_size = config.cache.block_size
    window_blocks = window_block_count(window, block_size) if lazy else None
    config = fit_context(
        config,
        num_device,
        window=window,
        window_blocks=window_blocks,
        explicit=explicit_max_model_len,
    )
    executor.initialize_cache(num_device, num_host, num_virtual)
    logger.info(
        "KV cache: %d device blocks (%d tokens), %d host blocks for swapping%s",
        num_device,
        num_device * block_size,
        num_host,
        f", in each of {num_virtual} virtual engines" if num_virtual > 1 else "",
    )
    return config, CacheLayout(num_device, num_host, num_virtual, window, lazy, window_blocks)


def build_schedulers(
    config: EngineConfig,
    layout: CacheLayout,
    *,
    kv_tiers: Any,
    seq_ids: Iterator[int],
) -> tuple[list[Scheduler], Any, Any]:
    """One block manager and scheduler per virtual engine: ``(schedulers, scheduler,
    block_manager)``, the last two seeing them as one (the engine's ``scheduler`` and
    ``block_manager``). Every scheduler numbers its sequences from ``seq_ids``."""
    cache, spec = config.cache, config.speculative
    managers = [
        BlockSpaceManager(
            cache.block_size,
            layout.num_device,
            layout.num_host,
            watermark=cache.watermark,
            enable_caching=cache.enable_prefix_caching,
            sliding_window=layout.window,
            lazy_prompt_blocks=layout.lazy,
            tier=kv_tiers,
        )
        for _ in range(layout.num_virtual)
    ]
    schedulers = [
        Scheduler(
            config.scheduler,
            manager,
            next_seq_id=lambda: next(seq_ids),
            lookahead=None
            if spec is None
            else LookaheadPlanner(spec, max_model_len=config.scheduler.max_model_len),
            max_loras=config.lora.max_loras if config.lora else None,
        )
        for manager in managers
    ]
    if layout.num_virtual > 1:
        return schedulers, VirtualSchedulers(schedulers), VirtualBlockManagers(managers)
    return schedulers, schedulers[0], managers[0]

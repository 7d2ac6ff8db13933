"""A worker owns one device: the model shard, its KV cache, and the runner that uses both."""

from __future__ import annotations

import dataclasses
import functools
import gc
import logging
from pathlib import Path
from typing import Any

import torch

from pagedllm.backends.base import CacheEngine, CacheSpec
from pagedllm.backends.registry import get_backend
from pagedllm.config import EngineConfig
from pagedllm.core.interfaces import ModelRunnerOutput, SchedulerOutput
from pagedllm.executors.model_runner import ModelRunner
from pagedllm.layers.attention import Attention
from pagedllm.layers.parallel import SINGLE, WHOLE_MODEL, PPContext, TPContext
from pagedllm.models.model_loader import load_model, resolve_dtype

logger = logging.getLogger(__name__)


def attention_layers(model: torch.nn.Module) -> list[Attention]:
    """The model's paged-attention layers, in order (one KV tensor each)."""
    return [m for m in model.modules() if isinstance(m, Attention)]


def kv_geometry(model: torch.nn.Module) -> tuple[int, int, int]:
    """``(num_layers, num_kv_heads, head_size)`` of the KV cache, from the attention layers.

    The heads are this rank's (after tensor-parallel sharding or replication), as the layers
    write them. One cache tensor shape serves every layer, so layers that differ are refused.
    """
    layers = attention_layers(model)
    shapes = sorted({(m.num_kv_heads, m.head_size) for m in layers})
    if len(shapes) != 1:
        raise ValueError(
            f"model: attention layers differ in (num_kv_heads, head_size): {shapes or 'none'}; "
            "the paged KV cache needs one shape for every layer"
        )
    return len(layers), *shapes[0]


class Worker:
    def __init__(
        self,
        config: EngineConfig,
        hf_config: Any,
        *,
        rank: int = 0,
        tp: TPContext = SINGLE,
        pp: PPContext = WHOLE_MODEL,
    ) -> None:
        self.config = config
        self.hf_config = hf_config
        self.rank = rank
        self.tp = tp
        self.pp = pp
        self.backend = get_backend(config.device)
        self.device = self.backend.device(rank)
        self.attention = self.backend.attention(config.model.attention_backend)
        self.dtype = resolve_dtype(config.model.dtype, hf_config, self.backend.default_dtype)
        # ValueError here, at engine construction, when the backend cannot read the choice.
        self.kv_cache_dtype = self.attention.resolve_kv_cache_dtype(
            config.cache.kv_cache_dtype, self.dtype
        )
        self.cache_engine: CacheEngine | None = None
        # One per virtual engine (pipeline parallelism): each scheduler's blocks are its own.
        self.cache_engines: list[CacheEngine] = []
        self.runner: ModelRunner | None = None
        self.spec: Any = None  # spec_decode.verify.SpecDecodeRunner under speculative decoding
        self.lora_manager: Any = None  # a LoRAManager once the model loads with LoRA enabled
        self.kv_tiers: Any = None  # a kv_tiers.TieredBlockStore with lower KV tiers

    def release(self) -> None:
        """Drop the model, the KV caches and the adapters, and hand the device memory back.

        For in-process executors, whose process outlives the engine: on a GPU the next engine
        sizes its KV cache from what the card has free (``gpu_memory_utilization`` of the whole
        card minus all in use), so whatever this one still held would be taken from it.
        Idempotent; the worker serves nothing afterwards.
        """
        self.cache_engine = None
        self.cache_engines = []
        self.runner = None
        self.spec = None
        self.lora_manager = None
        gc.collect()  # a model's modules can hold reference cycles
        self.backend.empty_cache(self.rank)

    def load_model(self) -> None:
        tp = self.tp
        if self.config.parallel.enable_expert_parallel:
            tp = dataclasses.replace(tp, expert_parallel=True)  # read by MoE layers only
        kernel = self.backend.kernel
        packed_dir = self.config.model.packed_cache_dir
        # Layers whose packed form the backend holds are not decoded at load; not under LoRA,
        # whose wrappers rename the layers before the backend packs them.
        packed_layers = None
        if packed_dir is not None and self.config.lora is None:
            packed_layers = functools.partial(
                self.backend.preload_packed_layers,
                int8_activations=self.config.model.int8_activations,
            )
        model = load_model(
            self.config.model.model,
            self.hf_config,
            attn_backend=self.attention,
            device=self.device,
            dtype=self.dtype,
            tp=tp,
            pp=self.pp,
            quantization=self.config.model.quantization,
            # The device's load-time kernels, None where it has none (the PyTorch/numpy
            # definitions run), and the formats its linear kernel multiplies as stored.
            quantizer=kernel("int8_quantize").value,
            gguf_block_decoder=kernel("gguf_decode").value,
            native_formats=kernel("linear").formats,
            packed_cache=None if packed_dir is None else Path(packed_dir),
            packed_layers=packed_layers,
            # --task embed loads a causal LM's decoder as an embedder; "score" and "auto" take
            # the checkpoint's class (the engine checks the pair: engine/pooling.py).
            task={"generate": "generate", "embed": "embed"}.get(self.config.model.task),
        )
        lora = self.config.lora
        if lora is not None:
            from pagedllm.lora.manager import LoRAManager

            self.lora_manager = LoRAManager(
                model,
                kernel=kernel("lora").require(),
                max_loras=lora.max_loras,
                max_lora_rank=lora.max_lora_rank,
                max_cpu_loras=lora.host_capacity,
                dtype=self.dtype,
                device=self.device,
            )
        # After the wrappers read the layers' shapes: a backend may repack the base weights.
        self.backend.prepare_model(
            model,
            int8_activations=self.config.model.int8_activations,
            enforce_eager=self.config.model.enforce_eager,
        )
        self.runner = ModelRunner(
            model,
            self.attention,
            device=self.device,
            block_size=self.config.cache.block_size,
            seed=self.config.model.seed,
            lora=self.lora_manager,
            sample_kernel=kernel("sample").value,
            pipeline=self._stage_link(),
            pooling=self.config.model.pooling,
        )
        if self.config.speculative is not None:
            from pagedllm.spec_decode.setup import build_spec_runner

            self.spec = build_spec_runner(self)
        logger.info(
            "model on %s in %s with %s attention (%s), KV cache in %s",
            self.device,
            self.dtype,
            self.attention.name,
            self.attention.describe(),
            self.kv_cache_dtype,
        )

    def _stage_link(self) -> Any:
        if self.pp.size == 1:
            return None
        from pagedllm.executors.pipeline import StageLink

        return StageLink(
            self.pp, hidden_size=self.hf_config.hidden_size, dtype=self.dtype, device=self.device
        )

    # -- LoRA adapters (the engine checks enable_lora first) ----------------------------------
    def add_lora(self, request: Any, weights: Any = None) -> str | None:
        """Read and pack an adapter; its error message when it is bad (returned, not raised,
        so a tensor-parallel executor does not take a bad folder for a dead worker)."""
        assert self.lora_manager is not None
        try:
            self.lora_manager.add(request, weights)
        except ValueError as exc:
            return str(exc)
        return None

    def remove_lora(self, lora_id: int) -> bool:
        assert self.lora_manager is not None
        return self.lora_manager.remove(lora_id)

    def uniform_sliding_window(self) -> int | None:
        """The window when every attention layer slides by the same; None otherwise."""
        assert self.runner is not None
        windows = {m.sliding_window for m in attention_layers(self.runner.model)}
        return windows.pop() if len(windows) == 1 else None

    def attention_name(self) -> str:
        return self.attention.name

    def _uses_kv_cache(self) -> bool:
        return bool(getattr(self.runner.model if self.runner else None, "uses_kv_cache", True))

    def pooling_info(self) -> dict[str, Any]:
        """What the loaded model is for the engine's task (``engine/pooling.py``): a pooling
        model's ``task``, whether it keeps a KV cache, and its pooling defaults."""
        assert self.runner is not None
        return self.runner.pooler.facts()

    def linear_path(self) -> str:
        """Which GEMM each kind of linear layer got (the backend's choice), for logs and JSON."""
        model = self.runner.model if self.runner is not None else None
        return str(getattr(model, "linear_path", "") or "F.linear")

    def layer_kernels(self) -> str:
        """Which norm/activation/rotary kernels the backend installed ("none": the PyTorch ops)."""
        model = self.runner.model if self.runner is not None else None
        return str(getattr(model, "layer_kernels", "") or "none")

    def cache_spec(self) -> CacheSpec:
        """What one token stores, read off the loaded model's attention layers (this rank's)."""
        assert self.runner is not None, "cache_spec needs the model loaded"
        if not self._uses_kv_cache():  # a bidirectional encoder: no layer stores anything
            return CacheSpec(0, 1, 1, self.config.cache.block_size, self.kv_cache_dtype)
        num_layers, num_kv_heads, head_size = kv_geometry(self.runner.model)
        return CacheSpec(
            num_layers=num_layers,
            num_kv_heads=num_kv_heads,
            head_size=head_size,
            block_size=self.config.cache.block_size,
            dtype=self.kv_cache_dtype,
        )

    def determine_num_blocks(self) -> tuple[int, int]:
        """Device blocks from the memory budget left after a profiling pass; host from swap."""
        if not self._uses_kv_cache():  # an encoder: the engine reserves no block for it
            return 0, 0
        spec = self.cache_spec()
        per_block = CacheEngine.bytes_per_block(spec)
        if self.spec is not None:  # a draft model's cache has as many blocks
            from pagedllm.spec_decode.setup import draft_bytes_per_block

            per_block += draft_bytes_per_block(self, self.spec)
        cache = self.config.cache
        budget = self.backend.kv_cache_budget_bytes(
            profile=self._profile_run,
            gpu_memory_utilization=cache.gpu_memory_utilization,
            cpu_kv_cache_bytes=cache.kv_cache_bytes,
            rank=self.rank,
        )
        num_device = cache.num_kv_blocks or max(0, budget // per_block)
        num_host = cache.swap_bytes // per_block
        return int(num_device), int(num_host)

    def _profile_run(self) -> None:
        sched = self.config.scheduler
        num_tokens = min(sched.token_budget, sched.max_num_seqs * sched.max_model_len)
        num_seqs = min(sched.max_num_seqs, num_tokens)
        blocks = num_tokens // self.config.cache.block_size + num_seqs + 1
        spec = self.cache_spec()
        scratch = self.backend.make_cache_engine(
            spec, blocks, 0, attention=self.attention, rank=self.rank
        )
        assert self.runner is not None
        self.runner.dummy_run(num_tokens, num_seqs, scratch.kv_caches)
        del scratch
        self.backend.synchronize(self.rank)

    def initialize_cache(
        self, num_device_blocks: int, num_host_blocks: int, num_virtual_engines: int = 1
    ) -> None:
        """Block counts are per virtual engine: each gets a cache of its own, so that block ids
        of different schedulers never meet."""
        self.cache_engines = [
            self.backend.make_cache_engine(
                self.cache_spec(),
                num_device_blocks,
                num_host_blocks,
                attention=self.attention,
                rank=self.rank,
            )
            for _ in range(num_virtual_engines)
        ]
        self.cache_engine = self.cache_engines[0]
        if self.spec is not None:
            from pagedllm.spec_decode.setup import init_draft_cache

            init_draft_cache(self, self.spec, num_device_blocks, num_host_blocks)
        if self.config.cache.kv_tiers_enabled:
            from pagedllm.kv_tiers.setup import open_store

            self.kv_tiers = open_store(
                self.config,
                self.cache_spec(),
                attention=self.attention,
                backend=self.backend,
                compute_dtype=self.dtype,
                rank=self.rank,
            )

    # -- lower KV tiers (one in-process worker: the engine holds the same store) ------------------
    def kv_tier_store(self) -> Any:
        """The store, handed to the block manager as its lower tier (None: tiers off)."""
        return self.kv_tiers

    def apply_kv_transfer(self, transfer: Any) -> None:
        """A step's tier traffic outside a forward pass (saves before loads)."""
        assert self.cache_engine is not None
        if self.kv_tiers is not None and transfer is not None:
            self.kv_tiers.apply_saves(transfer, self.cache_engine.kv_caches)
            self.kv_tiers.apply_loads(transfer, self.cache_engine.kv_caches)

    def close_kv_tiers(self, transfer: Any, timeout: float = 60.0) -> None:
        """At shutdown: save ``transfer`` (the pool's cached blocks), finish writing, stop."""
        if self.kv_tiers is None:
            return
        assert self.cache_engine is not None
        if transfer is not None:
            self.kv_tiers.save_all(self.cache_engine.kv_caches, transfer.saves, timeout)
        self.kv_tiers.close(timeout)
        self.kv_tiers = None

    def execute_model(self, sched_out: SchedulerOutput) -> ModelRunnerOutput:
        assert self.cache_engines and self.runner is not None
        cache = self.cache_engines[sched_out.virtual_engine]
        if (
            self.spec is None
            and sched_out.kv_transfer is None
            and not sched_out.blocks_to_swap_out
            and not sched_out.blocks_to_swap_in
            and not sched_out.blocks_to_copy
        ):
            # No block moves: the runner takes inference mode where it needs it (a decode
            # step's one backend call takes its own), which saves the step torch's Python
            # context manager, run cold after the kernels.
            return self.runner.execute(sched_out, cache.kv_caches)
        with torch.inference_mode():
            return self._execute_with_moves(sched_out, cache)

    def _execute_with_moves(self, sched_out: SchedulerOutput, cache: Any) -> ModelRunnerOutput:
        tiers, transfer = self.kv_tiers, sched_out.kv_transfer
        if tiers is not None and transfer is not None:
            # Blocks evicted while this step was planned may be written by any move below.
            tiers.apply_saves(transfer, cache.kv_caches)
        cache.swap_out(sched_out.blocks_to_swap_out)
        cache.swap_in(sched_out.blocks_to_swap_in)
        if tiers is not None and transfer is not None:
            tiers.apply_loads(transfer, cache.kv_caches)
        cache.copy(sched_out.blocks_to_copy)
        if self.spec is not None:
            return self.spec.execute(sched_out, cache.kv_caches)
        return self.runner.execute(sched_out, cache.kv_caches)

"""LLMEngine, the one engine: requests in, one batched step at a time, outputs out.

``pagedllm.Engine`` (``factory.py``) builds it, or the replicated engine when asked for replicas.
"""

from __future__ import annotations

import itertools
import logging
import os
import time
from collections.abc import Sequence as Seq
from dataclasses import replace
from typing import Any

from pagedllm.backends.registry import resolve_device
from pagedllm.config import EngineConfig
from pagedllm.core.pooling_params import PoolingParams
from pagedllm.core.sampling_params import SamplingParams
from pagedllm.core.sequence import Sequence, SequenceGroup
from pagedllm.engine.admission import EngineLimits, check_request, default_max_tokens
from pagedllm.engine.cache_layout import CacheLayout, build_schedulers, size_cache
from pagedllm.engine.collector import with_collector_paused
from pagedllm.engine.guided import GuidedRequests
from pagedllm.engine.lora_registry import LoRARegistry, lora_cache_root
from pagedllm.engine.output_processor import OutputProcessor
from pagedllm.engine.pooling import (
    admit_pooling,
    model_context,
    prefill_only,
    resolve_task,
    special_frame,
)
from pagedllm.engine.pooling_api import PoolingMixin
from pagedllm.engine.prompts import (
    PromptType,
    batch_inputs,
    eos_ids_of,
    load_tokenizer,
    tokenize_prompt,
)
from pagedllm.engine.sampling_defaults import default_sampling_params, sampling_defaults
from pagedllm.engine.step_loop import EngineCounters, StepLoop, StepParts
from pagedllm.engine_args import EngineArgs
from pagedllm.executors.base import create_executor
from pagedllm.lora.request import LoRARequest
from pagedllm.models.model_loader import load_hf_config
from pagedllm.outputs import RequestOutput
from pagedllm.spec_decode.metrics import SpecDecodeMetrics

__all__ = ["EngineCounters", "LLMEngine", "PromptType"]

logger = logging.getLogger(__name__)


class LLMEngine(PoolingMixin):
    """The synchronous engine; ``AsyncEngine`` wraps it for the server.

    ``LLMEngine(model, device="auto", **engine_args)`` with vLLM's argument names: ``dtype``,
    ``block_size``, ``max_model_len``, ``max_num_seqs``, ``max_num_batched_tokens``,
    ``kv_cache_space`` (GiB, CPU), ``gpu_memory_utilization``, ``swap_space`` (GiB),
    ``preemption_mode``, ``seed``, ``num_kv_blocks``, ``enable_prefix_caching``,
    ``enable_chunked_prefill``, ``attention_backend`` and others listed in ``EngineArgs``.
    """

    @with_collector_paused  # a full collection mid-build frees nothing: engine/collector.py
    def __init__(self, model: str, device: str = "auto", **engine_args: Any) -> None:
        args = EngineArgs.from_kwargs(model, device=device, **engine_args)
        if isinstance(args.data_parallel_size, int) and args.data_parallel_size > 1:
            raise ValueError(
                "data_parallel_size: LLMEngine is one engine; pagedllm.Engine(...) builds the "
                "replicated one"
            )
        self._explicit_max_model_len = args.max_model_len is not None
        self.hf_config = load_hf_config(model)
        self.config: EngineConfig = args.create_config(
            model_max_len=model_context(model, self.hf_config), device=resolve_device(device)
        )
        # Without a tokenizer prompts must be token ids and outputs carry no text.
        self.tokenizer = (
            None if args.skip_tokenizer_init else load_tokenizer(self.config.model.tokenizer)
        )
        self.eos_token_ids = frozenset(eos_ids_of(model, self.hf_config, self.tokenizer))
        model_cfg = self.config.model
        self.sampling_defaults = sampling_defaults(
            model, model_cfg.generation_config, dict(model_cfg.sampling_overrides)
        )
        if self.sampling_defaults:
            logger.info("sampling defaults (generation_config): %s", self.sampling_defaults)
        self.executor = create_executor(self.config, self.hf_config)
        self.pooling = resolve_task(
            model_cfg.task,
            self.executor.collective_rpc("pooling_info")[-1],  # the last stage's model
            embed_dim=getattr(self.hf_config, "hidden_size", None),
        )
        self.config, layout = size_cache(
            self.config,
            self.executor,
            self.pooling,
            explicit_max_model_len=self._explicit_max_model_len,
        )
        # Lower KV tiers: the one in-process worker's store (config.py refuses other executors).
        self.kv_tiers = (
            self.executor.collective_rpc("kv_tier_store")[0]
            if self.config.cache.kv_tiers_enabled
            else None
        )
        if self.pooling.is_pooling and self.config.speculative is not None:
            self.executor.shutdown()
            raise ValueError("speculative_config: a pooling model generates no tokens to draft")
        self._fit_budget_to_whole_prompts()
        # [CLS] ... [SEP]: what an encoder's truncated input keeps (engine/pooling.py).
        self._special_frame = special_frame(self.tokenizer) if self.pooling.is_pooling else ((), ())
        self._seq_ids = itertools.count()
        schedulers, self.scheduler, self.block_manager = build_schedulers(
            self.config, layout, kv_tiers=self.kv_tiers, seq_ids=self._seq_ids
        )
        self.spec_metrics = SpecDecodeMetrics()
        self.loras = LoRARegistry(self.config.lora, self.executor)
        self.output_processor = OutputProcessor(
            tokenizer=self.tokenizer,
            eos_token_ids=self.eos_token_ids,
            max_model_len=self.config.scheduler.max_model_len,
            tables=self.scheduler,
        )
        self.vocab_size = int(self.hf_config.vocab_size)
        self.limits = self._limits(args.max_logprobs, layout)
        self.counters = EngineCounters()
        self.guided = GuidedRequests(
            self.tokenizer, vocab_size=self.vocab_size, eos_token_ids=self.eos_token_ids
        )
        self.loop = StepLoop(self.scheduler, schedulers, self._step_parts())
        self._cache_salt = os.urandom(16)  # adapters' prefix-cache roots: this run's only

    def _fit_budget_to_whole_prompts(self) -> None:
        """A model that pools every position runs each prompt in one step, so the default
        step budget (chunked prefill's 256 tokens) would refuse a BERT's 512-token inputs that
        its positions allow; a budget the user set stays and is checked at admission."""
        sched = self.config.scheduler
        info = self.pooling
        whole = info.is_pooling and (info.whole_prompt or not info.uses_kv_cache)
        if (
            whole
            and sched.max_num_batched_tokens is None
            and sched.token_budget < sched.max_model_len
        ):
            self.config = replace(
                self.config,
                scheduler=replace(sched, max_num_batched_tokens=sched.max_model_len),
            )

    def _step_parts(self) -> StepParts:
        """What the step loop drives: the same objects this engine holds."""
        return StepParts(
            executor=self.executor,
            guided=self.guided,
            output_processor=self.output_processor,
            counters=self.counters,
            spec_metrics=self.spec_metrics,
            kv_tiers=self.kv_tiers,
            block_size=self.config.cache.block_size,
            max_model_len=self.config.scheduler.max_model_len,
        )

    def _limits(self, max_logprobs: int, layout: CacheLayout) -> EngineLimits:
        sched = self.config.scheduler
        return EngineLimits(
            vocab_size=self.vocab_size,
            max_model_len=sched.max_model_len,
            max_num_seqs=sched.max_num_seqs,
            max_logprobs=max_logprobs,
            block_size=self.config.cache.block_size,
            usable_blocks=layout.num_device - self.block_manager.watermark_blocks,
            window_blocks=layout.window_blocks,
        )

    # -- requests --------------------------------------------------------------------------
    def add_request(
        self,
        request_id: str,
        prompt: PromptType,
        sampling_params: SamplingParams | PoolingParams | None = None,
        *,
        priority: int = 0,
        arrival_time: float | None = None,
        lora_request: LoRARequest | None = None,
    ) -> None:
        """Queue a request; a ValueError naming the field if anything about it is invalid.

        ``PoolingParams`` make it a pooling request (embedding, score): prefill only, one vector.

        ``lora_request`` runs it under an adapter, read and checked here on first use.
        ``sampling_params`` None: the model's defaults (``get_default_sampling_params``).
        """
        if not isinstance(request_id, str) or not request_id:
            raise ValueError("request_id: must be a non-empty string")
        if request_id in self.loop.requests:
            raise ValueError(f"request_id: {request_id!r} is already in use")
        if isinstance(sampling_params, PoolingParams):
            self._add_pooling(request_id, prompt, sampling_params, priority, arrival_time)
            return
        if self.pooling.is_pooling:
            raise ValueError(f"task: this model serves {self.pooling.task}, not generation")
        given = sampling_params is not None
        params = sampling_params if given else self.get_default_sampling_params()
        if not isinstance(params, SamplingParams):
            raise ValueError("sampling_params: must be a SamplingParams")
        if not isinstance(priority, int) or abs(priority) > self.limits.max_priority:
            raise ValueError("priority: must be an integer that fits in 64 bits")
        text, token_ids = tokenize_prompt(prompt, self.tokenizer, self.vocab_size)
        max_len = self.config.scheduler.max_model_len
        if params.max_tokens is None:  # the room left (at most the model's default length)
            room = default_max_tokens(len(token_ids), max_len)
            cap = None if given else self.sampling_defaults.get("max_tokens")
            params = params.clone(max_tokens=room if cap is None else min(room, cap))
        check_request(params, len(token_ids), self.limits)
        self.loras.ensure(lora_request)
        block_size = self.config.cache.block_size
        seq = Sequence(next(self._seq_ids), token_ids, block_size)
        seq.cache_root = lora_cache_root(lora_request, self._cache_salt)
        group = SequenceGroup(
            request_id=request_id,
            seqs=[seq],
            sampling_params=params,
            arrival_time=time.monotonic() if arrival_time is None else arrival_time,
            prompt=text,
            priority=priority,
            eos_token_ids=self.eos_token_ids,
            lora_request=lora_request,
        )
        schedulable = self.guided.admit(group)  # a known-bad constraint raises here
        self.loop.admit(group, schedulable=schedulable)

    def _add_pooling(
        self,
        request_id: str,
        prompt: PromptType,
        params: PoolingParams,
        priority: int,
        arrival_time: float | None,
    ) -> None:
        """A prefill-only request: one vector comes back, its blocks freed as it finishes."""
        if not isinstance(priority, int) or abs(priority) > self.limits.max_priority:
            raise ValueError("priority: must be an integer that fits in 64 bits")
        text, token_ids = tokenize_prompt(prompt, self.tokenizer, self.vocab_size)
        if isinstance(prompt, dict) and prompt.get("token_type_ids") is not None:
            params = params.clone(token_type_ids=tuple(prompt["token_type_ids"]))
        sched = self.config.scheduler
        params, token_ids = admit_pooling(
            params,
            token_ids,
            self.pooling,
            max_model_len=sched.max_model_len,
            token_budget=sched.token_budget,
            frame=self._special_frame,
        )
        seq = Sequence(next(self._seq_ids), token_ids, self.config.cache.block_size)
        group = SequenceGroup(
            request_id=request_id,
            seqs=[seq],
            sampling_params=prefill_only(),
            arrival_time=time.monotonic() if arrival_time is None else arrival_time,
            prompt=text,
            priority=priority,
            pooling_params=params,
        )
        self.loop.admit(group, schedulable=True)

    def abort_request(self, request_id: str | Seq[str]) -> None:
        """Stop requests wherever they are; their KV blocks are freed now, an output follows."""
        self.loop.abort([request_id] if isinstance(request_id, str) else list(request_id))

    def has_unfinished_requests(self) -> bool:
        return self.loop.has_unfinished()

    def get_num_unfinished_requests(self) -> int:
        return self.scheduler.num_unfinished()

    def get_tokenizer(self) -> Any:
        return self.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """What ``generate`` / ``add_request`` use when given no ``SamplingParams``: the model's
        defaults (``generation_config``); an explicit ``SamplingParams`` is never changed."""
        return default_sampling_params(self.sampling_defaults)

    # -- the loop ----------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Schedule, run one forward pass, and report every request that changed."""
        return self.loop.step()

    def generate(
        self,
        prompts: PromptType | list[PromptType],
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        *,
        use_tqdm: bool = True,
        lora_request: LoRARequest | list[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Offline batch: every prompt runs to completion; outputs come back in input order.

        ``lora_request``: one adapter for every prompt, or one (or None) per prompt.
        """
        from tqdm.auto import tqdm

        prompts, params_list, loras = batch_inputs(prompts, sampling_params, lora_request)
        ids = [f"generate-{next(self._seq_ids)}" for _ in prompts]
        for params in params_list:  # offline: an invalid constraint raises before anything runs
            if params is not None and params.guided_decoding is not None:
                self.guided.submit(params.guided_decoding).result()
        try:
            for rid, prompt, params, lora in zip(ids, prompts, params_list, loras, strict=True):
                self.add_request(rid, prompt, params, lora_request=lora)
        except ValueError:
            self.abort_request([r for r in ids if r in self.loop.requests])
            self.loop.pending.clear()
            raise
        return self._run_to_completion(
            ids, tqdm(total=len(ids), disable=not use_tqdm, desc="Processed prompts", unit="req")
        )

    def _run_to_completion(self, ids: list[str], bar: Any) -> list[RequestOutput]:
        done: dict[str, RequestOutput] = {}
        start = time.perf_counter()
        gen0, prompt0 = self.counters.generation_tokens, self.counters.prompt_tokens
        wanted = set(ids)
        while len(done) < len(ids) and self.has_unfinished_requests():
            for out in self.step():
                if out.finished and out.request_id in wanted:
                    done[out.request_id] = out
                    bar.update(1)
            elapsed = max(time.perf_counter() - start, 1e-9)
            bar.set_postfix_str(
                f"in {(self.counters.prompt_tokens - prompt0) / elapsed:.0f} tok/s, "
                f"out {(self.counters.generation_tokens - gen0) / elapsed:.0f} tok/s",
                refresh=False,
            )
        bar.close()
        return [done[i] for i in ids]

    # -- LoRA adapters ----------------------------------------------------------------------
    def add_lora(self, lora_request: LoRARequest, weights: Any = None) -> None:
        """Read and check an adapter now (a ValueError naming it if bad); kept in host memory.

        ``weights`` (``pagedllm.lora.adapter.read_adapter``'s result) skips the reading: the
        server reads a new adapter on a thread of its own, so the engine only packs it.
        """
        self.loras.add(lora_request, weights)

    def remove_lora(self, lora_id: int) -> bool:
        """Forget an adapter; requests already running under it finish first. False: unknown."""
        return self.loras.remove(lora_id)

    def list_loras(self) -> list[LoRARequest]:
        return self.loras.list()

    # -- introspection ----------------------------------------------------------------------
    def get_stats(self) -> dict[str, float]:
        s, c, bm = self.scheduler, self.counters, self.block_manager
        return {
            "num_requests_running": len(s.running),
            "num_requests_waiting": len(s.waiting),
            "num_requests_swapped": len(s.swapped),
            "kv_cache_usage_perc": bm.usage(),
            "num_free_device_blocks": bm.get_num_free_device_blocks(),
            "num_device_blocks": bm.num_device_blocks,
            "num_free_host_blocks": bm.get_num_free_host_blocks(),
            "num_host_blocks": bm.num_host_blocks,
            "cpu_cache_usage_perc": (
                1.0 - bm.get_num_free_host_blocks() / bm.num_host_blocks
                if bm.num_host_blocks
                else 0.0
            ),
            "prompt_tokens_total": c.prompt_tokens,
            "generation_tokens_total": c.generation_tokens,
            "pooling_requests_embed": c.embed_requests,
            "pooling_requests_classify": c.classify_requests,
            "num_preemptions_total": s.stats.preemptions,
            "num_preemptions_recompute": s.stats.preemptions_recompute,
            "num_preemptions_swap": s.stats.preemptions_swap,
            "chunked_prefill_steps": s.stats.chunked_prefill_steps,
            "prefix_cache_queries": bm.prefix_stats.queries,
            "prefix_cache_hits": bm.prefix_stats.hits,
            **self.spec_metrics.as_stats(),
            **(self.kv_tiers.stats() if self.kv_tiers is not None else {}),
        }

    def shutdown(self) -> None:
        self.guided.shutdown()
        if self.kv_tiers is not None:
            # The disk tier keeps what the device pool holds, for the next start.
            self.kv_tiers = self.loop.parts.kv_tiers = None
            self.executor.collective_rpc("close_kv_tiers", self.block_manager.flush_transfer())
        self.executor.shutdown()

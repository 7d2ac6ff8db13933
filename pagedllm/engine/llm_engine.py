"""LLMEngine (exported as ``Engine``): requests in, one batched step at a time, outputs out."""

from __future__ import annotations

import dataclasses
import itertools
import logging
import os
import time
from collections.abc import Sequence as Seq
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pagedllm.backends.registry import resolve_device
from pagedllm.config import EngineConfig
from pagedllm.core.block_manager import BlockSpaceManager, window_block_count
from pagedllm.core.interfaces import SchedulerOutput
from pagedllm.core.sampling_params import SamplingParams
from pagedllm.core.scheduler import Scheduler
from pagedllm.core.sequence import Sequence, SequenceGroup
from pagedllm.core.speculation import LookaheadPlanner
from pagedllm.engine.admission import (
    EngineLimits,
    check_request,
    default_max_tokens,
    fit_max_model_len,
)
from pagedllm.engine.containment import EngineBrokenError, execute_contained, without
from pagedllm.engine.guided import GuidedRequests
from pagedllm.engine.lora_registry import (
    LoRARegistry,
    lora_cache_root,
    per_prompt_loras,
)
from pagedllm.engine.output_processor import OutputProcessor
from pagedllm.engine.virtual_engines import PipelineLoop, VirtualBlockManagers, VirtualSchedulers
from pagedllm.engine_args import EngineArgs
from pagedllm.executors.base import create_executor
from pagedllm.lora.request import LoRARequest
from pagedllm.models.gguf.reader import gguf_path_of
from pagedllm.models.model_loader import load_hf_config, max_model_len_of
from pagedllm.outputs import RequestOutput
from pagedllm.spec_decode.metrics import SpecDecodeMetrics

logger = logging.getLogger(__name__)

PromptType = str | dict[str, Any] | list[int]


@dataclass
class EngineCounters:
    prompt_tokens: int = 0
    generation_tokens: int = 0
    requests_finished: int = 0
    kv_slots_allocated: int = 0  # summed over steps, for KV waste
    kv_slots_used: int = 0


def load_tokenizer(path: str) -> Any:
    """The tokenizer of a model folder, or the one a GGUF file carries."""
    from transformers import AutoTokenizer

    gguf_path = gguf_path_of(path)
    if gguf_path is not None:
        from pagedllm.models.gguf.loading import gguf_tokenizer

        return gguf_tokenizer(gguf_path)
    try:
        return AutoTokenizer.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError) as exc:
        raise ValueError(f"tokenizer: cannot load a tokenizer from {path!r} ({exc})") from exc


def eos_ids_of(model: str, hf_config: Any, tokenizer: Any) -> set[int]:
    """EOS ids as transformers' generate sees them: generation_config first, then config."""
    ids: Any = None
    if (Path(model) / "generation_config.json").exists():
        from transformers import GenerationConfig

        ids = GenerationConfig.from_pretrained(model, local_files_only=True).eos_token_id
    if ids is None:
        ids = getattr(hf_config, "eos_token_id", None)
    if ids is None and tokenizer is not None:
        ids = tokenizer.eos_token_id
    if ids is None:
        return set()
    return {int(i) for i in ids} if isinstance(ids, (list, tuple)) else {int(ids)}


def batch_inputs(
    prompts: Any, sampling_params: Any, lora_request: Any
) -> tuple[list[Any], list[SamplingParams], list[Any]]:
    """``generate``'s arguments as one list each: a single prompt (text, a dict, or token ids)
    becomes a batch of one; one ``SamplingParams`` (or None) and one adapter apply to all."""
    if isinstance(prompts, (str, dict)) or (
        isinstance(prompts, list) and prompts and isinstance(prompts[0], int)
    ):
        prompts = [prompts]
    prompts = list(prompts)
    if isinstance(sampling_params, list):
        if len(sampling_params) != len(prompts):
            raise ValueError("sampling_params: the list must be as long as prompts")
        params_list = sampling_params
    else:
        params_list = [sampling_params or SamplingParams()] * len(prompts)
    return prompts, params_list, per_prompt_loras(lora_request, len(prompts))


class LLMEngine:
    """The synchronous engine; ``AsyncEngine`` wraps it for the server.

    ``Engine(model, device="auto", **engine_args)`` with vLLM's argument names: ``dtype``,
    ``block_size``, ``max_model_len``, ``max_num_seqs``, ``max_num_batched_tokens``,
    ``kv_cache_space`` (GiB, CPU), ``gpu_memory_utilization``, ``swap_space`` (GiB),
    ``preemption_mode``, ``seed``, ``num_kv_blocks``, ``enable_prefix_caching``,
    ``enable_chunked_prefill``, ``attention_backend`` and others listed in ``EngineArgs``.
    """

    def __new__(cls, model: str = "", device: str = "auto", **engine_args: Any) -> Any:
        """``data_parallel_size`` > 1: a :class:`DataParallelEngine` over that many replicas."""
        replicas = engine_args.get("data_parallel_size")
        if cls is LLMEngine and isinstance(replicas, int) and replicas > 1:  # else: validated
            from pagedllm.engine.dp_engine import DataParallelEngine

            return DataParallelEngine(model, device, **engine_args)
        return super().__new__(cls)

    def __init__(self, model: str, device: str = "auto", **engine_args: Any) -> None:
        args = EngineArgs.from_kwargs(model, device=device, **engine_args)
        self._explicit_max_model_len = args.max_model_len is not None
        self.hf_config = load_hf_config(model)
        self.config: EngineConfig = args.create_config(
            model_max_len=max_model_len_of(self.hf_config), device=resolve_device(device)
        )
        # Without a tokenizer prompts must be token ids and outputs carry no text.
        self.tokenizer = (
            None if args.skip_tokenizer_init else load_tokenizer(self.config.model.tokenizer)
        )
        self.eos_token_ids = frozenset(eos_ids_of(model, self.hf_config, self.tokenizer))
        self.executor = create_executor(self.config, self.hf_config)
        num_device, num_host = self.executor.determine_num_blocks()
        cache = self.config.cache
        # Pipeline parallelism: each virtual engine gets its own share of the KV cache.
        num_virtual = self.config.parallel.num_virtual_engines
        num_device, num_host = num_device // num_virtual, num_host // num_virtual
        # Block sliding window: when every layer slides, blocks behind the window are freed, and
        # with chunked prefill a prompt gets blocks chunk by chunk (vLLM's block sliding window).
        windows = set(self.executor.collective_rpc("uniform_sliding_window"))  # every stage's
        window = windows.pop() if len(windows) == 1 else None
        sched_cfg = self.config.scheduler
        lazy = (
            window is not None
            and sched_cfg.enable_chunked_prefill
            and not self.config.cache.enable_prefix_caching
        )
        window_blocks = window_block_count(window, cache.block_size) if lazy else None
        self._fit_context(num_device, window_blocks, window)
        cache = self.config.cache
        self.executor.initialize_cache(num_device, num_host, num_virtual)
        logger.info(
            "KV cache: %d device blocks (%d tokens), %d host blocks for swapping%s",
            num_device,
            num_device * cache.block_size,
            num_host,
            f", in each of {num_virtual} virtual engines" if num_virtual > 1 else "",
        )
        # Lower KV tiers: the one in-process worker's store (config.py refuses other executors).
        self.kv_tiers = (
            self.executor.collective_rpc("kv_tier_store")[0] if cache.kv_tiers_enabled else None
        )
        managers = [
            BlockSpaceManager(
                cache.block_size,
                num_device,
                num_host,
                watermark=cache.watermark,
                enable_caching=cache.enable_prefix_caching,
                sliding_window=window,
                lazy_prompt_blocks=lazy,
                tier=self.kv_tiers,
            )
            for _ in range(num_virtual)
        ]
        self._seq_ids = itertools.count()
        spec = self.config.speculative
        schedulers = [
            Scheduler(
                self.config.scheduler,
                manager,
                next_seq_id=lambda: next(self._seq_ids),
                lookahead=None
                if spec is None
                else LookaheadPlanner(spec, max_model_len=self.config.scheduler.max_model_len),
                max_loras=self.config.lora.max_loras if self.config.lora else None,
            )
            for manager in managers
        ]
        self.block_manager: Any = managers[0]
        self.scheduler: Any = schedulers[0]
        self.pipeline: PipelineLoop | None = None  # the step under virtual engines
        if num_virtual > 1:
            self.block_manager = VirtualBlockManagers(managers)
            self.scheduler = VirtualSchedulers(schedulers)
            self.pipeline = PipelineLoop(self, self.scheduler)
        self.spec_metrics = SpecDecodeMetrics()
        self.loras = LoRARegistry(self.config.lora, self.executor)
        self.output_processor = OutputProcessor(
            tokenizer=self.tokenizer,
            eos_token_ids=self.eos_token_ids,
            max_model_len=self.config.scheduler.max_model_len,
            tables=self.scheduler,
        )
        self.vocab_size = int(self.hf_config.vocab_size)
        sched = self.config.scheduler
        self.limits = EngineLimits(
            vocab_size=self.vocab_size,
            max_model_len=sched.max_model_len,
            max_num_seqs=sched.max_num_seqs,
            max_logprobs=args.max_logprobs,
            block_size=cache.block_size,
            usable_blocks=num_device - self.block_manager.watermark_blocks,
            window_blocks=window_blocks,
        )
        self.counters = EngineCounters()
        self.guided = GuidedRequests(
            self.tokenizer, vocab_size=self.vocab_size, eos_token_ids=self.eos_token_ids
        )
        self._requests: dict[str, SequenceGroup] = {}
        self._pending_outputs: list[RequestOutput] = []
        self._cache_salt = os.urandom(16)  # adapters' prefix-cache roots: this run's only

    def _fit_context(self, num_device: int, window_blocks: int | None, window: int | None) -> None:
        """Refuse to start, or lower max_model_len, when the cache cannot hold one sequence.

        Under a block sliding window (``window_blocks`` given) a sequence of any length runs in
        ``window_blocks`` blocks, so a cache that holds them keeps max_model_len as it is.
        """
        cache, sched = self.config.cache, self.config.scheduler
        usable = num_device - int(cache.watermark * num_device)
        if (
            window is not None
            and window_blocks is None
            and usable * cache.block_size < sched.max_model_len
        ):
            logger.warning(
                "every layer slides over %d tokens, but a prompt is computed whole (holding all "
                "its blocks) without enable_chunked_prefill or with prefix caching; with chunked "
                "prefill a sequence of any length runs in %d blocks",
                window,
                window_block_count(window, cache.block_size),
            )
        new_len = fit_max_model_len(
            sched.max_model_len,
            usable_blocks=usable,
            block_size=cache.block_size,
            explicit=self._explicit_max_model_len,
            window_blocks=window_blocks,
        )
        if new_len == sched.max_model_len:
            return
        self.config = dataclasses.replace(
            self.config,
            model=dataclasses.replace(self.config.model, max_model_len=new_len),
            scheduler=dataclasses.replace(sched, max_model_len=new_len),
        )

    # -- requests --------------------------------------------------------------------------
    def add_request(
        self,
        request_id: str,
        prompt: PromptType,
        sampling_params: SamplingParams | None = None,
        *,
        priority: int = 0,
        arrival_time: float | None = None,
        lora_request: LoRARequest | None = None,
    ) -> None:
        """Queue a request; a ValueError naming the field if anything about it is invalid.

        ``lora_request`` runs it under an adapter, read and checked here on first use.
        """
        if not isinstance(request_id, str) or not request_id:
            raise ValueError("request_id: must be a non-empty string")
        if request_id in self._requests:
            raise ValueError(f"request_id: {request_id!r} is already in use")
        params = sampling_params if sampling_params is not None else SamplingParams()
        if not isinstance(params, SamplingParams):
            raise ValueError("sampling_params: must be a SamplingParams")
        if not isinstance(priority, int) or abs(priority) > self.limits.max_priority:
            raise ValueError("priority: must be an integer that fits in 64 bits")
        text, token_ids = self._tokenize(prompt)
        max_len = self.config.scheduler.max_model_len
        if params.max_tokens is None:
            params = params.clone(max_tokens=default_max_tokens(len(token_ids), max_len))
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
        self._requests[request_id] = group
        if schedulable:
            self.scheduler.add(group)

    def _tokenize(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        if self.tokenizer is None and not (
            isinstance(prompt, list) or (isinstance(prompt, dict) and "prompt_token_ids" in prompt)
        ):
            raise ValueError("prompt: token ids are required when skip_tokenizer_init is set")
        if isinstance(prompt, str):
            text, ids = prompt, self.tokenizer.encode(prompt)
        elif isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            text, ids = prompt.get("prompt"), prompt["prompt_token_ids"]
        elif isinstance(prompt, dict) and isinstance(prompt.get("prompt"), str):
            text = prompt["prompt"]
            ids = self.tokenizer.encode(text)
        elif isinstance(prompt, list):
            text, ids = None, prompt
        else:
            raise ValueError("prompt: must be a string or {'prompt_token_ids': [...]}")
        if not isinstance(ids, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) for t in ids
        ):
            raise ValueError("prompt_token_ids: must be a list of integers")
        if not ids:
            raise ValueError("prompt: must not be empty")
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(
                f"prompt_token_ids: token id {bad[0]} is outside the vocabulary "
                f"[0, {self.vocab_size})"
            )
        return text, list(ids)

    def abort_request(self, request_id: str | Seq[str]) -> None:
        """Stop requests wherever they are; their KV blocks are freed now, an output follows."""
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        for group in self.scheduler.abort(ids) + self.guided.abort(ids):
            self._requests.pop(group.request_id, None)
            self.guided.release(group.request_id)
            self._pending_outputs.append(self.output_processor.make_output(group))

    def has_unfinished_requests(self) -> bool:
        return (
            self.scheduler.has_unfinished()
            or bool(self._pending_outputs)
            or self.guided.num_waiting() > 0
        )

    def get_num_unfinished_requests(self) -> int:
        return self.scheduler.num_unfinished()

    def get_tokenizer(self) -> Any:
        return self.tokenizer

    # -- the loop ----------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Schedule, run one forward pass, and report every request that changed."""
        if self.pipeline is not None:  # virtual engines: micro-batches overlap in the stages
            return self.pipeline.step()
        outputs, self._pending_outputs = self._pending_outputs, []
        self._admit_compiled(outputs)
        sched_out = self.scheduler.schedule()
        self._report_ignored(self.scheduler, outputs)
        if sched_out.is_empty:
            if sched_out.kv_transfer is not None:
                self.executor.collective_rpc("apply_kv_transfer", sched_out.kv_transfer)
            # Only requests waiting for their grammar or for a read from disk, if any.
            if self.kv_tiers is not None:
                self.kv_tiers.wait_for_reads(timeout=0.005)
            self.guided.wait(timeout=0.005)
            return outputs
        sched_out = self.guided.with_bitmask(sched_out)
        runner_out, ran = self._execute(sched_out, outputs)
        self._process_step(self.scheduler, ran, runner_out, outputs)
        return outputs

    def _report_ignored(self, scheduler: Scheduler, outputs: list[RequestOutput]) -> None:
        for group in scheduler.take_ignored():
            self._requests.pop(group.request_id, None)
            self.guided.release(group.request_id)
            outputs.append(self.output_processor.make_output(group, error=self._why(group)))

    def _process_step(
        self,
        scheduler: Scheduler,
        ran: SchedulerOutput,
        runner_out: Any,
        outputs: list[RequestOutput],
    ) -> None:
        """Record what step ``ran`` (planned by ``scheduler``) produced, and report it."""
        self._count(ran)
        self.spec_metrics.observe(runner_out.spec_stats)
        self.counters.generation_tokens += sum(len(t) for t in runner_out.spec_tokens.values())
        touched = scheduler.update_from_output(ran, runner_out)
        for group in touched:
            self.counters.generation_tokens -= self.output_processor.process(group)
            self.guided.advance(group)
        finished = {g.request_id for g in scheduler.free_finished()}
        for group in touched:
            outputs.append(self.output_processor.make_output(group))
            if group.request_id in finished:
                self._requests.pop(group.request_id, None)
                self.guided.release(group.request_id)
                self.counters.requests_finished += 1

    def _admit_compiled(self, outputs: list[RequestOutput]) -> None:
        """Requests whose grammar finished compiling go to the scheduler (or end with its error)."""
        for group, error in self.guided.ready():
            if error is None:
                self.scheduler.add(group)
                continue
            self._requests.pop(group.request_id, None)
            outputs.append(self.output_processor.make_output(group, error=error, failed=True))

    def _execute(
        self, sched_out: SchedulerOutput, outputs: list[RequestOutput]
    ) -> tuple[Any, SchedulerOutput]:
        """Run the step; if it fails, end only the requests that make it fail (containment).

        Returns the runner's output and the step as it finally ran (without any culprits).
        """
        try:
            return self.executor.execute_model(sched_out), sched_out
        except Exception as exc:
            try:
                runner_out, culprits = execute_contained(
                    self.executor.execute_model, sched_out, exc
                )
            except EngineBrokenError:
                # Not one request's fault: end the step's requests (their blocks are freed and
                # an "abort" output follows) and let the caller see the error.
                self.abort_request(sorted({s.request_id for s in sched_out.seqs}))
                raise
        for group in self.scheduler.abort(list(culprits)):
            self._requests.pop(group.request_id, None)
            self.guided.release(group.request_id)
            outputs.append(
                self.output_processor.make_output(
                    group, error=culprits[group.request_id], failed=True
                )
            )
        return runner_out, without(sched_out, set(culprits))

    def _why(self, group: SequenceGroup) -> str:
        n = len(group.prompt_token_ids)
        limit = self.config.scheduler.max_model_len
        if n > limit:
            return f"prompt has {n} tokens, more than max_model_len ({limit})"
        return f"prompt of {n} tokens needs more KV blocks than the cache holds"

    def _count(self, sched_out: Any) -> None:
        c = self.counters
        for s in sched_out.seqs:
            if s.is_prompt:
                c.prompt_tokens += len(s.token_ids)
            if s.do_sample:
                c.generation_tokens += 1
        bs = self.config.cache.block_size
        c.kv_slots_allocated += sum(len(s.block_table) for s in sched_out.seqs) * bs
        c.kv_slots_used += sum(s.start_pos + len(s.token_ids) for s in sched_out.seqs)

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
            self.abort_request([r for r in ids if r in self._requests])
            self._pending_outputs.clear()
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
            self.kv_tiers = None
            self.executor.collective_rpc("close_kv_tiers", self.block_manager.flush_transfer())
        self.executor.shutdown()


Engine = LLMEngine

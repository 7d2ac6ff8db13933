"""``EngineArgs``: the engine's keyword arguments as vLLM users know them, and the CLI's flags.

Each field is declared once, with its default, help text and choices (:func:`engine_arg`); the
CLI generates a ``--flag`` per field and ``EngineArgs.create_config`` turns the whole into the
validated, frozen :class:`~pagedllm.config.EngineConfig`. The choices come from the tables the
config classes check against (:mod:`pagedllm.names`, ``core/policy.py``). Like ``config.py``,
this module imports nothing heavy (no torch), so ``pagedllm --help`` answers at once.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from pagedllm.config import (
    MODEL_TASKS,
    CacheConfig,
    EngineConfig,
    LoRAConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    env_cpu_kv_cache_space,
    env_packed_cache_dir,
)
from pagedllm.config_parts import require
from pagedllm.core.policy import POLICIES
from pagedllm.engine.sampling_defaults import parse_generation_config
from pagedllm.names import (
    DTYPES,
    EXECUTOR_BACKENDS,
    KV_CACHE_DTYPES,
    PREEMPTION_MODES,
    QUANTIZATION_METHODS,
    ROUTERS,
)
from pagedllm.spec_decode.config import SpeculativeConfig, parse_speculative_config


def _device_names() -> list[str]:
    from pagedllm.backends.registry import device_names  # lazily: no torch for the CLI's help

    return device_names()


def engine_arg(default: Any, help: str, *, choices: Any = None, cli: bool = True) -> Any:
    """An :class:`EngineArgs` field with what its command-line flag needs.

    The CLI builds ``--field-name`` from the field (type from its annotation, ``help``,
    ``choices``: a sequence or a callable returning one); ``cli=False`` keeps a field off the
    command line (set by the server itself, or not for users). A new engine argument is one field
    here; the CLI and ``EngineArgs.from_kwargs`` pick it up.
    """
    meta = {"help": help, "choices": choices, "cli": cli}
    return dataclasses.field(default=default, metadata=meta)


@dataclass
class EngineArgs:
    """Keyword arguments as vLLM users know them, turned into an :class:`EngineConfig`."""

    model: str = engine_arg(dataclasses.MISSING, "Hugging Face model folder", cli=False)
    tokenizer: str | None = engine_arg(None, "tokenizer folder (default: the model's)")
    device: str = engine_arg(
        "auto",
        "device to run on (default: auto = cuda, then xpu, then cpu)",
        choices=_device_names,
    )
    dtype: str = engine_arg(
        "auto", "weight and activation dtype (default: auto, from the model)", choices=DTYPES
    )
    block_size: int = engine_arg(16, "tokens per KV block (default 16)")
    kv_cache_dtype: str = engine_arg(
        "auto",
        "KV-cache storage dtype (default: auto = the model's dtype)",
        choices=tuple(KV_CACHE_DTYPES),
    )
    max_model_len: int | None = engine_arg(None, "context window (default: the model's)")
    max_num_seqs: int = engine_arg(256, "max sequences per batch (default 256)")
    max_num_batched_tokens: int | None = engine_arg(
        None,
        "max tokens per step (default: max(256, max_num_seqs) with chunked prefill, else "
        "max(max_model_len, 2048))",
    )
    kv_cache_space: float | None = engine_arg(
        None, "GiB of KV cache on the CPU (default: $PAGEDLLM_CPU_KVCACHE_SPACE or 4)"
    )
    gpu_memory_utilization: float = engine_arg(
        0.9, "fraction of GPU memory the engine may use (default 0.9)"
    )
    swap_space: float = engine_arg(1.0, "GiB of host memory for swapping (default 1)")
    preemption_mode: str | None = engine_arg(
        None,
        "how to preempt when blocks run out (default: swap groups, else recompute)",
        choices=PREEMPTION_MODES,
    )
    seed: int = engine_arg(0, "random seed (default 0)")
    num_kv_blocks: int | None = engine_arg(None, "fix the number of KV blocks (testing)")
    enable_prefix_caching: bool = engine_arg(False, "reuse KV blocks of shared prompt prefixes")
    enable_chunked_prefill: bool = engine_arg(
        True,
        "decodes first in each step's token budget, prompt chunks fill the rest "
        "(--no-enable-chunked-prefill: a step is all prompts or all decodes)",
    )
    scheduler_delay_factor: float = engine_arg(
        0.0, "hold prompts back this many last-prompt latencies to batch more of them"
    )
    scheduling_policy: str = engine_arg(
        "fcfs", "order of waiting requests", choices=tuple(POLICIES)
    )
    attention_backend: str | None = engine_arg(
        None, "attention kernel family to use (default: the device's best)"
    )
    served_model_name: str | None = engine_arg(None, "name clients use", cli=False)
    task: str = engine_arg(
        "auto",
        "what the model serves: generate (completions, chat), embed (/v1/embeddings) or score "
        "(/v1/score, /v1/rerank); auto: what the checkpoint is",
        choices=MODEL_TASKS,
    )
    pooling: str | None = engine_arg(
        None,
        "an embedding model's pooling instead of the checkpoint's: mean, cls or last (a causal "
        "LM served with --task embed pools its last token unless told otherwise)",
    )
    tensor_parallel_size: int = engine_arg(1, "number of tensor-parallel workers")
    distributed_executor_backend: str | None = engine_arg(
        None, "how tensor-parallel workers run", choices=EXECUTOR_BACKENDS
    )
    pipeline_parallel_size: int = engine_arg(
        1, "number of pipeline stages (contiguous layer ranges), each with its TP group"
    )
    virtual_engines: int | None = engine_arg(
        None, "pipeline micro-batches in flight (default: one per stage)", cli=False
    )
    trust_remote_code: bool = engine_arg(False, "never honoured: remote code is not run", cli=False)
    skip_tokenizer_init: bool = engine_arg(False, "prompts are token ids, no text", cli=False)
    max_logprobs: int = engine_arg(
        20, "the most logprobs / prompt_logprobs one request may ask for", cli=False
    )
    quantization: str | None = engine_arg(
        None,
        "quantization of linear layers at load: int8 (weight-only, per channel), w8a8 (int8 "
        "weights and dynamic per-token int8 activations) or int4 (weight-only, groups of 32)",
        choices=QUANTIZATION_METHODS,
    )
    int8_activations: bool = engine_arg(
        False,
        "4-/8-bit group-wise layers (GGUF, int4) round bf16/fp16 activations (decode and prefill) "
        "to int8 per group of 32 and use integer dot products, as llama.cpp does: faster, logits "
        "further from the unquantised activations' (CPU; never the LM head)",
    )
    enforce_eager: bool = engine_arg(
        False,
        "run every decode step through the model's layers one by one (the reference path): no "
        "CUDA graphs on a GPU, no C++ decode stack on the CPU",
    )
    disable_packed_cache: bool = engine_arg(
        False,
        "pack a GGUF's weights at every start instead of mapping the packed form an earlier "
        "start kept (CPU; also PAGEDLLM_PACKED_CACHE=0)",
    )
    enable_expert_parallel: bool = engine_arg(
        False, "place whole experts of mixture-of-experts layers on the tensor-parallel ranks"
    )
    cpu_threads: int | None = engine_arg(
        None,
        "intra-op threads of the CPU device, shared by tensor-parallel ranks (default: the "
        "physical cores)",
    )

    # A dict from Python, a JSON object string from the command line.
    speculative_config: str | None = engine_arg(
        None,
        'speculative decoding as JSON: {"method": "ngram" | "draft_model", '
        '"num_speculative_tokens": k, "prompt_lookup_max": n, "prompt_lookup_min": m, '
        '"model": DRAFT_FOLDER}',
    )
    # A dict from Python, a JSON object string from the command line.
    generation_config: str = engine_arg(
        "auto",
        "defaults of the sampling fields a request leaves out: auto (the model's "
        "generation_config.json, a GGUF file's own or else llama.cpp's), none (temperature 1, "
        'no top-k/top-p), or a JSON object over the model\'s, e.g. {"temperature": 0.6}',
    )
    enable_lora: bool = engine_arg(False, "serve LoRA adapters over the base model")
    max_loras: int = engine_arg(1, "LoRA adapters one batch may mix (device slots, default 1)")
    max_lora_rank: int = engine_arg(16, "largest LoRA rank served (default 16)")
    max_cpu_loras: int | None = engine_arg(
        None, "LoRA adapters kept in host memory (default: max_loras)"
    )
    kv_cache_dir: str | None = engine_arg(
        None,
        "folder for a disk tier under the prefix cache: evicted KV blocks are written there and "
        "read back instead of recomputed, across restarts (needs --enable-prefix-caching)",
    )
    kv_disk_space: float = engine_arg(10.0, "GiB the disk tier may use (default 10)")
    kv_offload_space: float | None = engine_arg(
        None,
        "GiB of pinned host memory for evicted KV blocks on GPU/XPU (default: 4 with "
        "--kv-cache-dir, else 0; the CPU's KV pool is host memory already)",
    )

    data_parallel_size: int = engine_arg(
        1,
        "engine replicas behind one endpoint, each with its own KV cache (Ray actors, or "
        "local processes without Ray or with --distributed-executor-backend mp)",
    )
    router: str = engine_arg(
        "prefix",
        "how requests are spread over the replicas: prefix (to the replica holding the "
        "prompt's leading blocks, balanced by load), least_loaded or round_robin",
        choices=ROUTERS,
    )

    @classmethod
    def from_kwargs(cls, model: str, **kwargs: Any) -> EngineArgs:
        names = {f.name for f in dataclasses.fields(cls)} - {"model"}
        unknown = sorted(set(kwargs) - names)
        if unknown:
            raise ValueError(
                f"{unknown[0]}: unknown engine argument; known ones are {sorted(names)}"
            )
        return cls(model=model, **kwargs)

    def create_config(self, *, model_max_len: int, device: str) -> EngineConfig:
        """``model_max_len`` comes from the model's config; ``device`` is already resolved."""
        require(
            isinstance(self.max_logprobs, int) and 0 <= self.max_logprobs <= 1 << 20,
            "max_logprobs",
            f"must be an integer >= 0, got {self.max_logprobs!r}",
        )
        max_len = self.max_model_len or model_max_len
        require(
            max_len <= model_max_len,
            "max_model_len",
            f"({max_len}) exceeds the model's context window ({model_max_len})",
        )
        speculative = parse_speculative_config(self.speculative_config)
        self._check_combinations(speculative)
        mode, overrides = parse_generation_config(self.generation_config)
        return EngineConfig(
            model=self._model_config(max_len, mode, tuple(overrides.items())),
            cache=self._cache_config(),
            scheduler=self._scheduler_config(max_len),
            parallel=self._parallel_config(),
            device=device,
            speculative=speculative,
            lora=self._lora_config(),
        )

    def _model_config(
        self, max_len: int, generation: str, overrides: tuple[tuple[str, Any], ...]
    ) -> ModelConfig:
        return ModelConfig(
            model=self.model,
            tokenizer=self.tokenizer or self.model,
            dtype=self.dtype,
            max_model_len=max_len,
            seed=self.seed,
            served_model_name=self.served_model_name,
            attention_backend=self.attention_backend,
            trust_remote_code=self.trust_remote_code,
            quantization=self.quantization,
            int8_activations=self.int8_activations,
            enforce_eager=self.enforce_eager,
            packed_cache_dir=None if self.disable_packed_cache else env_packed_cache_dir(),
            generation_config=generation,
            sampling_overrides=overrides,
            task=self.task,
            pooling=self.pooling,
        )

    def _cache_config(self) -> CacheConfig:
        kv_space = self.kv_cache_space
        return CacheConfig(
            block_size=self.block_size,
            kv_cache_space=env_cpu_kv_cache_space() if kv_space is None else kv_space,
            gpu_memory_utilization=self.gpu_memory_utilization,
            swap_space=self.swap_space,
            num_kv_blocks=self.num_kv_blocks,
            enable_prefix_caching=self.enable_prefix_caching,
            kv_cache_dtype=self.kv_cache_dtype,
            kv_cache_dir=self.kv_cache_dir,
            kv_disk_space=self.kv_disk_space,
            kv_offload_space=self.kv_offload_space,
        )

    def _scheduler_config(self, max_len: int) -> SchedulerConfig:
        return SchedulerConfig(
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens,
            max_model_len=max_len,
            preemption_mode=self.preemption_mode,
            enable_chunked_prefill=self.enable_chunked_prefill,
            delay_factor=self.scheduler_delay_factor,
            policy=self.scheduling_policy,
        )

    def _parallel_config(self) -> ParallelConfig:
        return ParallelConfig(
            tensor_parallel_size=self.tensor_parallel_size,
            distributed_executor_backend=self.distributed_executor_backend,
            pipeline_parallel_size=self.pipeline_parallel_size,
            virtual_engines=self.virtual_engines,
            enable_expert_parallel=self.enable_expert_parallel,
            cpu_threads=self.cpu_threads,
            data_parallel_size=self.data_parallel_size,
            router=self.router,
        )

    def _lora_config(self) -> LoRAConfig | None:
        if not self.enable_lora:
            return None
        return LoRAConfig(self.max_loras, self.max_lora_rank, self.max_cpu_loras)

    def _check_combinations(self, speculative: SpeculativeConfig | None) -> None:
        """Settings each valid alone that do not run together (yet)."""
        require(
            speculative is None or self.tensor_parallel_size == 1,
            "speculative_config",
            "not supported with tensor_parallel_size > 1 yet",
        )
        self._check_pipeline(speculative)
        require(
            speculative is None or not self.enable_lora,
            "speculative_config",
            "not supported together with enable_lora yet (the verifying pass has no adapters)",
        )
        self._check_kv_tiers(speculative)

    def _check_pipeline(self, speculative: SpeculativeConfig | None) -> None:
        """What pipeline stages do not run yet: each needs the whole model in one worker."""
        if self.pipeline_parallel_size == 1:
            return
        for name, used in (
            ("speculative_config", speculative is not None),
            ("enable_lora", self.enable_lora),
        ):
            require(not used, name, "not supported with pipeline_parallel_size > 1 yet")

    def _check_kv_tiers(self, speculative: SpeculativeConfig | None) -> None:
        """The lower KV tiers sit under the prefix cache of one in-process worker."""
        offload = self.kv_offload_space
        if self.kv_cache_dir is None and not (isinstance(offload, (int, float)) and offload > 0):
            return  # (a bad value is CacheConfig's to refuse)
        name = "kv_cache_dir" if self.kv_cache_dir is not None else "kv_offload_space"
        require(
            self.enable_prefix_caching,
            name,
            "lower KV tiers hold prefix-cache blocks: set enable_prefix_caching",
        )
        require(
            self.tensor_parallel_size == 1
            and self.pipeline_parallel_size == 1
            and self.distributed_executor_backend in (None, "uni"),
            name,
            "lower KV tiers need one in-process worker (tensor_parallel_size 1) for now",
        )
        require(
            speculative is None or speculative.method != "draft_model",
            name,
            "not supported with a draft model (its own cache is not tiered)",
        )

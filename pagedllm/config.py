"""Engine configuration: frozen dataclasses validated once, at the edge.

This module imports only the standard library at import time so that ``core/`` can read the
scheduler and cache settings without pulling in torch. It is also the one place that reads
environment variables.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Any

from pagedllm.spec_decode.config import SpeculativeConfig, parse_speculative_config

_DTYPES = ("auto", "float32", "float16", "bfloat16")
# "auto": the model's compute dtype; "fp8" is "fp8_e4m3", as in vLLM.
_KV_CACHE_DTYPES = ("auto", "float32", "bfloat16", "float16", "fp8", "fp8_e4m3", "fp8_e5m2")
_PREEMPTION_MODES = (None, "recompute", "swap")
_POLICIES = ("fcfs", "priority")
_ROUTERS = ("prefix", "least_loaded", "round_robin")  # engine/router.py
_GiB = 1 << 30
_QUANTIZATIONS = (None, "int8", "w8a8", "int4")


def _require(cond: bool, name: str, message: str) -> None:
    if not cond:
        raise ValueError(f"{name}: {message}")


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _positive_int(value: Any, name: str, *, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    _require(
        isinstance(value, int) and not isinstance(value, bool) and value > 0,
        name,
        f"must be a positive integer, got {value!r}",
    )


@dataclass(frozen=True)
class ModelConfig:
    model: str
    tokenizer: str
    dtype: str = "auto"
    max_model_len: int | None = None
    seed: int = 0
    served_model_name: str | None = None
    attention_backend: str | None = None
    trust_remote_code: bool = False
    quantization: str | None = None  # None, "int8" (weight-only), "w8a8" or "int4" (groups)
    # Group-wise (4-bit / Q8_0) layers round bf16/fp16 rows (decode and prefill) to int8 per
    # group of 32 (llama.cpp's arithmetic), where the device has that kernel.
    int8_activations: bool = False

    def __post_init__(self) -> None:
        _require(self.dtype in _DTYPES, "dtype", f"must be one of {_DTYPES}, got {self.dtype!r}")
        _require(
            self.quantization in _QUANTIZATIONS,
            "quantization",
            f"must be one of {_QUANTIZATIONS}, got {self.quantization!r}",
        )
        _positive_int(self.max_model_len, "max_model_len", allow_none=True)
        _require(isinstance(self.seed, int), "seed", f"must be an integer, got {self.seed!r}")
        _require(not self.trust_remote_code, "trust_remote_code", "remote code is never run")
        _require(
            isinstance(self.int8_activations, bool),
            "int8_activations",
            f"must be true or false, got {self.int8_activations!r}",
        )


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = 16
    kv_cache_space: float = 4.0  # GiB of KV cache on the CPU
    gpu_memory_utilization: float = 0.9
    swap_space: float = 1.0  # GiB of host memory for swapped-out blocks
    num_kv_blocks: int | None = None
    enable_prefix_caching: bool = False
    watermark: float = 0.01
    kv_cache_dtype: str = "auto"
    # Lower KV tiers under the prefix cache (pagedllm/kv_tiers/): a folder of block files kept
    # across restarts, its size in GiB, and GiB of host memory (GPU/XPU; None: 4 with a folder).
    kv_cache_dir: str | None = None
    kv_disk_space: float = 10.0
    kv_offload_space: float | None = None

    def __post_init__(self) -> None:
        _require(
            self.kv_cache_dtype in _KV_CACHE_DTYPES,
            "kv_cache_dtype",
            f"must be one of {_KV_CACHE_DTYPES}, got {self.kv_cache_dtype!r}",
        )
        _require(
            self.block_size in (1, 2, 4, 8, 16, 32, 64, 128),
            "block_size",
            f"must be a power of two up to 128, got {self.block_size!r}",
        )
        _require(self.kv_cache_space > 0, "kv_cache_space", "must be > 0 GiB")
        _require(
            0 < self.gpu_memory_utilization <= 1,
            "gpu_memory_utilization",
            "must be in (0, 1]",
        )
        _require(self.swap_space >= 0, "swap_space", "must be >= 0 GiB")
        _positive_int(self.num_kv_blocks, "num_kv_blocks", allow_none=True)
        _require(0 <= self.watermark < 1, "watermark", "must be in [0, 1)")
        _require(
            self.kv_cache_dir is None or (isinstance(self.kv_cache_dir, str) and self.kv_cache_dir),
            "kv_cache_dir",
            f"must be a folder path, got {self.kv_cache_dir!r}",
        )
        _require(
            _is_number(self.kv_disk_space) and self.kv_disk_space > 0,
            "kv_disk_space",
            f"must be > 0 GiB, got {self.kv_disk_space!r}",
        )
        _require(
            self.kv_offload_space is None
            or (_is_number(self.kv_offload_space) and self.kv_offload_space >= 0),
            "kv_offload_space",
            f"must be >= 0 GiB, got {self.kv_offload_space!r}",
        )

    @property
    def kv_tiers_enabled(self) -> bool:
        """A disk folder, or host memory asked for explicitly."""
        return self.kv_cache_dir is not None or bool(self.kv_offload_space)

    @property
    def kv_disk_bytes(self) -> int:
        return int(self.kv_disk_space * _GiB)

    def kv_offload_bytes(self, *, host_tier: bool) -> int:
        """Bytes of the host tier: 0 where the device pool is host memory (the CPU)."""
        if not host_tier:
            return 0
        if self.kv_offload_space is None:
            return 4 * _GiB if self.kv_cache_dir is not None else 0
        return int(self.kv_offload_space * _GiB)

    @property
    def kv_cache_bytes(self) -> int:
        return int(self.kv_cache_space * _GiB)

    @property
    def swap_bytes(self) -> int:
        return int(self.swap_space * _GiB)


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None
    max_model_len: int = 2048
    preemption_mode: str | None = None  # None: swap multi-sequence groups, recompute the rest
    enable_chunked_prefill: bool = False
    delay_factor: float = 0.0
    policy: str = "fcfs"

    def __post_init__(self) -> None:
        _positive_int(self.max_num_seqs, "max_num_seqs")
        _positive_int(self.max_num_batched_tokens, "max_num_batched_tokens", allow_none=True)
        _positive_int(self.max_model_len, "max_model_len")
        _require(
            self.preemption_mode in _PREEMPTION_MODES,
            "preemption_mode",
            f"must be 'recompute' or 'swap', got {self.preemption_mode!r}",
        )
        _require(self.delay_factor >= 0, "delay_factor", "must be >= 0")
        _require(self.policy in _POLICIES, "policy", f"must be one of {_POLICIES}")
        if self.max_num_batched_tokens is not None and not self.enable_chunked_prefill:
            _require(
                self.max_num_batched_tokens >= self.max_model_len,
                "max_num_batched_tokens",
                f"({self.max_num_batched_tokens}) must be >= max_model_len "
                f"({self.max_model_len}) unless chunked prefill is on, or long prompts never run",
            )

    @property
    def token_budget(self) -> int:
        if self.max_num_batched_tokens is not None:
            return self.max_num_batched_tokens
        if self.enable_chunked_prefill:
            return max(512, self.max_num_seqs)
        return max(self.max_model_len, 2048)


@dataclass(frozen=True)
class ParallelConfig:
    tensor_parallel_size: int = 1
    distributed_executor_backend: str | None = None  # None | "mp" | "ray"
    # Contiguous layer ranges on this many stages; global rank = stage * TP size + TP rank.
    pipeline_parallel_size: int = 1
    # Schedulers with a micro-batch each in flight under pipeline parallelism (None: one per
    # stage, so every stage has work; 1: one scheduler, the stages take turns).
    virtual_engines: int | None = None
    # MoE layers place whole experts on ranks (instead of slicing every expert)
    enable_expert_parallel: bool = False
    # intra-op threads of a CPU engine, shared by its ranks; None: the device decides
    cpu_threads: int | None = None
    # engine replicas behind one front end (engine/dp_client.py), and how requests are routed
    data_parallel_size: int = 1
    router: str = "prefix"

    def __post_init__(self) -> None:
        _positive_int(self.tensor_parallel_size, "tensor_parallel_size")
        _positive_int(self.pipeline_parallel_size, "pipeline_parallel_size")
        _positive_int(self.virtual_engines, "virtual_engines", allow_none=True)
        _positive_int(self.cpu_threads, "cpu_threads", allow_none=True)
        _positive_int(self.data_parallel_size, "data_parallel_size")
        _require(self.router in _ROUTERS, "router", f"must be one of {', '.join(_ROUTERS)}")
        _require(
            isinstance(self.enable_expert_parallel, bool),
            "enable_expert_parallel",
            f"must be true or false, got {self.enable_expert_parallel!r}",
        )
        _require(
            self.distributed_executor_backend in (None, "uni", "mp", "ray"),
            "distributed_executor_backend",
            "must be 'uni', 'mp' or 'ray'",
        )
        _require(
            self.pipeline_parallel_size == 1 or self.distributed_executor_backend != "uni",
            "pipeline_parallel_size",
            "needs one process per stage: distributed_executor_backend 'mp' or 'ray', not 'uni'",
        )

    @property
    def world_size(self) -> int:
        """Ranks in all: a tensor-parallel group of ``tensor_parallel_size`` per stage."""
        return self.tensor_parallel_size * self.pipeline_parallel_size

    @property
    def num_virtual_engines(self) -> int:
        """Schedulers (each with its share of the KV blocks); 1 without pipeline parallelism."""
        if self.pipeline_parallel_size == 1:
            return 1
        return self.virtual_engines or self.pipeline_parallel_size


@dataclass(frozen=True)
class LoRAConfig:
    """Multi-LoRA serving: device slots, the largest rank they hold, adapters kept on the host."""

    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None  # default: max_loras

    def __post_init__(self) -> None:
        _positive_int(self.max_loras, "max_loras")
        _positive_int(self.max_lora_rank, "max_lora_rank")
        _positive_int(self.max_cpu_loras, "max_cpu_loras", allow_none=True)
        _require(
            self.max_cpu_loras is None or self.max_cpu_loras >= self.max_loras,
            "max_cpu_loras",
            f"({self.max_cpu_loras}) must be >= max_loras ({self.max_loras})",
        )

    @property
    def host_capacity(self) -> int:
        return self.max_cpu_loras or self.max_loras


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig
    cache: CacheConfig
    scheduler: SchedulerConfig
    parallel: ParallelConfig
    device: str  # resolved: "cpu" | "cuda" | "xpu"
    speculative: SpeculativeConfig | None = None
    lora: LoRAConfig | None = None  # None: LoRA adapters are refused


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
        "auto", "weight and activation dtype (default: auto, from the model)", choices=_DTYPES
    )
    block_size: int = engine_arg(16, "tokens per KV block (default 16)")
    kv_cache_dtype: str = engine_arg(
        "auto",
        "KV-cache storage dtype (default: auto = the model's dtype)",
        choices=_KV_CACHE_DTYPES,
    )
    max_model_len: int | None = engine_arg(None, "context window (default: the model's)")
    max_num_seqs: int = engine_arg(256, "max sequences per batch (default 256)")
    max_num_batched_tokens: int | None = engine_arg(None, "max tokens per step")
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
        choices=_PREEMPTION_MODES[1:],
    )
    seed: int = engine_arg(0, "random seed (default 0)")
    num_kv_blocks: int | None = engine_arg(None, "fix the number of KV blocks (testing)")
    enable_prefix_caching: bool = engine_arg(False, "reuse KV blocks of shared prompt prefixes")
    enable_chunked_prefill: bool = engine_arg(
        False, "split long prefills and batch them with decodes"
    )
    scheduler_delay_factor: float = engine_arg(
        0.0, "hold prompts back this many last-prompt latencies to batch more of them"
    )
    scheduling_policy: str = engine_arg("fcfs", "order of waiting requests", choices=_POLICIES)
    attention_backend: str | None = engine_arg(
        None, "attention kernel family to use (default: the device's best)"
    )
    served_model_name: str | None = engine_arg(None, "name clients use", cli=False)
    tensor_parallel_size: int = engine_arg(1, "number of tensor-parallel workers")
    distributed_executor_backend: str | None = engine_arg(
        None, "how tensor-parallel workers run", choices=("uni", "mp", "ray")
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
        choices=_QUANTIZATIONS[1:],
    )
    int8_activations: bool = engine_arg(
        False,
        "4-/8-bit group-wise layers (GGUF, int4) round bf16/fp16 activations (decode and prefill) "
        "to int8 per group of 32 and use integer dot products, as llama.cpp does: faster, logits "
        "further from the unquantised activations' (CPU; never the LM head)",
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
        choices=_ROUTERS,
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
        _require(
            isinstance(self.max_logprobs, int) and 0 <= self.max_logprobs <= 1 << 20,
            "max_logprobs",
            f"must be an integer >= 0, got {self.max_logprobs!r}",
        )
        max_len = self.max_model_len or model_max_len
        _require(
            max_len <= model_max_len,
            "max_model_len",
            f"({max_len}) exceeds the model's context window ({model_max_len})",
        )
        speculative = parse_speculative_config(self.speculative_config)
        _require(
            speculative is None or self.tensor_parallel_size == 1,
            "speculative_config",
            "not supported with tensor_parallel_size > 1 yet",
        )
        self._check_pipeline(speculative)
        _require(
            speculative is None or not self.enable_lora,
            "speculative_config",
            "not supported together with enable_lora yet (the verifying pass has no adapters)",
        )
        self._check_kv_tiers(speculative)
        kv_space = self.kv_cache_space
        if kv_space is None:
            kv_space = float(os.environ.get("PAGEDLLM_CPU_KVCACHE_SPACE", "4"))
        return EngineConfig(
            model=ModelConfig(
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
            ),
            cache=CacheConfig(
                block_size=self.block_size,
                kv_cache_space=kv_space,
                gpu_memory_utilization=self.gpu_memory_utilization,
                swap_space=self.swap_space,
                num_kv_blocks=self.num_kv_blocks,
                enable_prefix_caching=self.enable_prefix_caching,
                kv_cache_dtype=self.kv_cache_dtype,
                kv_cache_dir=self.kv_cache_dir,
                kv_disk_space=self.kv_disk_space,
                kv_offload_space=self.kv_offload_space,
            ),
            scheduler=SchedulerConfig(
                max_num_seqs=self.max_num_seqs,
                max_num_batched_tokens=self.max_num_batched_tokens,
                max_model_len=max_len,
                preemption_mode=self.preemption_mode,
                enable_chunked_prefill=self.enable_chunked_prefill,
                delay_factor=self.scheduler_delay_factor,
                policy=self.scheduling_policy,
            ),
            parallel=ParallelConfig(
                tensor_parallel_size=self.tensor_parallel_size,
                distributed_executor_backend=self.distributed_executor_backend,
                pipeline_parallel_size=self.pipeline_parallel_size,
                virtual_engines=self.virtual_engines,
                enable_expert_parallel=self.enable_expert_parallel,
                cpu_threads=self.cpu_threads,
                data_parallel_size=self.data_parallel_size,
                router=self.router,
            ),
            device=device,
            speculative=speculative,
            lora=(
                LoRAConfig(self.max_loras, self.max_lora_rank, self.max_cpu_loras)
                if self.enable_lora
                else None
            ),
        )

    def _check_pipeline(self, speculative: SpeculativeConfig | None) -> None:
        """What pipeline stages do not run yet: each needs the whole model in one worker."""
        if self.pipeline_parallel_size == 1:
            return
        for name, used in (
            ("speculative_config", speculative is not None),
            ("enable_lora", self.enable_lora),
        ):
            _require(not used, name, "not supported with pipeline_parallel_size > 1 yet")

    def _check_kv_tiers(self, speculative: SpeculativeConfig | None) -> None:
        """The lower KV tiers sit under the prefix cache of one in-process worker."""
        offload = self.kv_offload_space
        if self.kv_cache_dir is None and not (isinstance(offload, (int, float)) and offload > 0):
            return  # (a bad value is CacheConfig's to refuse)
        name = "kv_cache_dir" if self.kv_cache_dir is not None else "kv_offload_space"
        _require(
            self.enable_prefix_caching,
            name,
            "lower KV tiers hold prefix-cache blocks: set enable_prefix_caching",
        )
        _require(
            self.tensor_parallel_size == 1
            and self.pipeline_parallel_size == 1
            and self.distributed_executor_backend in (None, "uni"),
            name,
            "lower KV tiers need one in-process worker (tensor_parallel_size 1) for now",
        )
        _require(
            speculative is None or speculative.method != "draft_model",
            name,
            "not supported with a draft model (its own cache is not tiered)",
        )


def env_api_key() -> str | None:
    """The server's API key from the environment, when ``--api-key`` is not given."""
    return os.environ.get("PAGEDLLM_API_KEY") or None


# How long an idle OpenMP thread of the engine core spins before it sleeps (GNU OpenMP's
# iterations of its pause loop: about 3 ms of CPU on the 2-core EPYC these sessions run on;
# libgomp's own default, 300,000, spins about 13 ms, i.e. through a whole step's Python).
CORE_GOMP_SPINCOUNT = 30_000


def core_openmp_env() -> dict[str, str]:
    """OpenMP settings for the engine core process, set before torch loads, unless the user
    chose a policy: threads spin briefly, then sleep.

    A step is a chain of parallel regions separated by microseconds of Python; a thread that
    sleeps between them (``OMP_WAIT_POLICY=PASSIVE``) pays a futex wake-up per region, and a
    thread that spins for long holds a core that the API server needs between steps. Worse,
    when the kernel parks one of the core's threads to run the server, its partner spinning at
    the barrier keeps the only other core busy, so nobody progresses until the spin ends. A
    short spin bridges the gaps inside a step and yields the core within a few milliseconds.
    Measured on 2 cores with the server and 16 or 64 streaming clients (docs/serving.md): as fast
    as libgomp's long default and faster than PASSIVE at 16 clients. (The offline ``Engine`` lives
    in the user's process, whose OpenMP runtime may be loaded before pagedllm is imported.)
    """
    if any(k in os.environ for k in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "KMP_BLOCKTIME")):
        return {}
    return {"GOMP_SPINCOUNT": str(CORE_GOMP_SPINCOUNT)}


def replica_actor_env(package_root: str) -> dict[str, str]:
    """The environment of a Ray replica actor (``engine/dp_ray.py``): the core's OpenMP
    settings, and this package's folder first on ``PYTHONPATH``, so an actor on this machine
    imports the pagedllm the server runs (a source checkout too); on another machine a missing
    folder is skipped and the installed package is used."""
    env = core_openmp_env()
    paths = [package_root, *os.environ.get("PYTHONPATH", "").split(os.pathsep)]
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(p for p in paths if p))
    return env


def prefer_huge_pages() -> None:
    """Ask PyTorch to back its large CPU tensors (2 MiB and up) with transparent huge pages,
    unless the user set ``THP_MEM_ALLOC_ENABLE`` themselves.

    Why: loading a model touches gigabytes of fresh memory (read buffers, weights converted to
    another dtype, packed copies), and each first touch of a 4 KiB page is a fault, a zeroed
    page and, in a virtual machine, often a fault on the host too. One fault per 2 MiB instead
    cut an engine start on the 1B checkpoint from 15-22 s to 11-13.5 s in float32 and from
    9.8-11.4 s to 8.5-9.0 s in bfloat16 (2-core AMD EPYC VM, runs alternated,
    docs/backends.md); the step speed did not change. PyTorch reads the variable once, at its
    first CPU allocation, so this runs when pagedllm is imported; where tensors were allocated
    before that, it changes nothing. Where the kernel's THP mode is ``never`` the advice is ignored.
    """
    os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")


def env_cpu_isa() -> str | None:
    """``PAGEDLLM_CPU_ISA``: force one ISA level of the CPU kernels (tests, benchmarks)."""
    return os.environ.get("PAGEDLLM_CPU_ISA") or None


def env_fuzz_examples(default: int = 300) -> int:
    """``PAGEDLLM_FUZZ_EXAMPLES``: request bodies the server fuzz test sends (its long mode)."""
    value = os.environ.get("PAGEDLLM_FUZZ_EXAMPLES")
    return int(value) if value else default


def user_cache_dir() -> str:
    """Where pagedllm keeps what it derives once per machine (GGUF tokenizers converted to
    ``tokenizer.json``, the demo model fetched from the package registry):
    ``PAGEDLLM_CACHE_DIR``, else ``$XDG_CACHE_HOME/pagedllm``, else ``~/.cache/pagedllm``."""
    explicit = os.environ.get("PAGEDLLM_CACHE_DIR")
    if explicit:
        return explicit
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "pagedllm")

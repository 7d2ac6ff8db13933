"""The engine's configuration, part by part: each frozen dataclass checks its own fields.

A field and the check of its values change together, and far more often than the rest of
:mod:`pagedllm.config` (the environment's one reader, and where :class:`EngineConfig` joins these
parts); here they sit next to one another and to the shared checks (``require``, whose message
starts with the field's name). Import the classes from :mod:`pagedllm.config`, their public home.
Like it, this module imports only the standard library at import time, so ``core/`` reads the
scheduler's settings without torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pagedllm.core.policy import POLICIES
from pagedllm.names import (
    DTYPES,
    EXECUTOR_BACKENDS,
    KV_CACHE_DTYPES,
    PREEMPTION_MODES,
    QUANTIZATION_METHODS,
    ROUTERS,
)

_GiB = 1 << 30
# The names each field accepts, as its messages list them.
_KV_CACHE_DTYPES = tuple(KV_CACHE_DTYPES)
_PREEMPTION_MODES = (None, *PREEMPTION_MODES)
_POLICIES = tuple(POLICIES)
_QUANTIZATIONS = (None, *QUANTIZATION_METHODS)
_EXECUTOR_BACKENDS = (None, *EXECUTOR_BACKENDS)


def require(cond: bool, name: str, message: str) -> None:
    if not cond:
        raise ValueError(f"{name}: {message}")


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _positive_int(value: Any, name: str, *, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    require(
        isinstance(value, int) and not isinstance(value, bool) and value > 0,
        name,
        f"must be a positive integer, got {value!r}",
    )


MODEL_TASKS = ("auto", "generate", "embed", "score")


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
    # Decode steps through the layer loop: no CUDA graphs, no C++ decode stack (the reference).
    enforce_eager: bool = False
    # Defaults of the sampling fields a request leaves out: "auto" (the model's, with
    # ``sampling_overrides`` on top) or "none" (SamplingParams' own); see
    # engine/sampling_defaults.py.
    generation_config: str = "auto"
    sampling_overrides: tuple[tuple[str, Any], ...] = ()
    # Where a backend keeps a GGUF's packed weights for the next start (None: packed each time).
    packed_cache_dir: str | None = None
    # What the model serves: "auto" (the checkpoint says), "generate", "embed" or "score"; and a
    # pooling override for an embedding model ("mean", "cls:normalize", ...; see --pooling).
    task: str = "auto"
    pooling: str | None = None

    def __post_init__(self) -> None:
        require(
            self.pooling in (None, "mean", "cls", "last"),
            "pooling",
            f"must be mean, cls or last, got {self.pooling!r}",
        )
        require(
            self.task in MODEL_TASKS,
            "task",
            f"must be one of {', '.join(MODEL_TASKS)}, got {self.task!r}",
        )
        require(
            self.generation_config in ("auto", "none"),
            "generation_config",
            f"must be auto or none, got {self.generation_config!r}",
        )
        require(self.dtype in DTYPES, "dtype", f"must be one of {DTYPES}, got {self.dtype!r}")
        require(
            self.quantization in _QUANTIZATIONS,
            "quantization",
            f"must be one of {_QUANTIZATIONS}, got {self.quantization!r}",
        )
        _positive_int(self.max_model_len, "max_model_len", allow_none=True)
        require(isinstance(self.seed, int), "seed", f"must be an integer, got {self.seed!r}")
        require(not self.trust_remote_code, "trust_remote_code", "remote code is never run")
        require(
            isinstance(self.int8_activations, bool),
            "int8_activations",
            f"must be true or false, got {self.int8_activations!r}",
        )
        require(
            isinstance(self.enforce_eager, bool),
            "enforce_eager",
            f"must be true or false, got {self.enforce_eager!r}",
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
        require(
            self.kv_cache_dtype in _KV_CACHE_DTYPES,
            "kv_cache_dtype",
            f"must be one of {_KV_CACHE_DTYPES}, got {self.kv_cache_dtype!r}",
        )
        require(
            self.block_size in (1, 2, 4, 8, 16, 32, 64, 128),
            "block_size",
            f"must be a power of two up to 128, got {self.block_size!r}",
        )
        require(self.kv_cache_space > 0, "kv_cache_space", "must be > 0 GiB")
        require(
            0 < self.gpu_memory_utilization <= 1,
            "gpu_memory_utilization",
            "must be in (0, 1]",
        )
        require(self.swap_space >= 0, "swap_space", "must be >= 0 GiB")
        _positive_int(self.num_kv_blocks, "num_kv_blocks", allow_none=True)
        require(0 <= self.watermark < 1, "watermark", "must be in [0, 1)")
        require(
            self.kv_cache_dir is None or (isinstance(self.kv_cache_dir, str) and self.kv_cache_dir),
            "kv_cache_dir",
            f"must be a folder path, got {self.kv_cache_dir!r}",
        )
        require(
            _is_number(self.kv_disk_space) and self.kv_disk_space > 0,
            "kv_disk_space",
            f"must be > 0 GiB, got {self.kv_disk_space!r}",
        )
        require(
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


# Tokens per step under chunked prefill when max_num_batched_tokens is not given (measured in
# docs/performance.md, "Chunked prefill by default").
DEFAULT_CHUNKED_TOKEN_BUDGET = 256


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None
    max_model_len: int = 2048
    preemption_mode: str | None = None  # None: swap multi-sequence groups, recompute the rest
    # On (as vLLM V1): decodes first in each step's token budget, prompt chunks fill the rest.
    enable_chunked_prefill: bool = True
    delay_factor: float = 0.0
    policy: str = "fcfs"

    def __post_init__(self) -> None:
        _positive_int(self.max_num_seqs, "max_num_seqs")
        _positive_int(self.max_num_batched_tokens, "max_num_batched_tokens", allow_none=True)
        _positive_int(self.max_model_len, "max_model_len")
        require(
            self.preemption_mode in _PREEMPTION_MODES,
            "preemption_mode",
            f"must be 'recompute' or 'swap', got {self.preemption_mode!r}",
        )
        require(self.delay_factor >= 0, "delay_factor", "must be >= 0")
        require(self.policy in _POLICIES, "policy", f"must be one of {_POLICIES}")
        if self.max_num_batched_tokens is not None and not self.enable_chunked_prefill:
            require(
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
            # A step's time grows with its tokens on a compute-bound CPU, and every running
            # decode waits for the whole step: the smallest budget that still holds one decode
            # per sequence (docs/design.md, "The step plan").
            return max(DEFAULT_CHUNKED_TOKEN_BUDGET, self.max_num_seqs)
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
        require(self.router in ROUTERS, "router", f"must be one of {', '.join(ROUTERS)}")
        require(
            isinstance(self.enable_expert_parallel, bool),
            "enable_expert_parallel",
            f"must be true or false, got {self.enable_expert_parallel!r}",
        )
        require(
            self.distributed_executor_backend in _EXECUTOR_BACKENDS,
            "distributed_executor_backend",
            "must be 'uni', 'mp' or 'ray'",
        )
        require(
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
        require(
            self.max_cpu_loras is None or self.max_cpu_loras >= self.max_loras,
            "max_cpu_loras",
            f"({self.max_cpu_loras}) must be >= max_loras ({self.max_loras})",
        )

    @property
    def host_capacity(self) -> int:
        return self.max_cpu_loras or self.max_loras

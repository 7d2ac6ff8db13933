"""Engine configuration: frozen dataclasses validated once, at the edge.

This module imports only the standard library at import time so that ``core/`` can read the
scheduler and cache settings without pulling in torch. It is also the one place that reads
environment variables. The user's keyword arguments (and the CLI's flags) that build these are
``EngineArgs`` (:mod:`pagedllm.engine_args`); the names a field may take are
:mod:`pagedllm.names`' tables.
"""

from __future__ import annotations

import os
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
from pagedllm.spec_decode.config import SpeculativeConfig

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


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig
    cache: CacheConfig
    scheduler: SchedulerConfig
    parallel: ParallelConfig
    device: str  # resolved: "cpu" | "cuda" | "xpu"
    speculative: SpeculativeConfig | None = None
    lora: LoRAConfig | None = None  # None: LoRA adapters are refused


def env_cpu_kv_cache_space() -> float:
    """``PAGEDLLM_CPU_KVCACHE_SPACE``: GiB of KV cache on the CPU, when ``kv_cache_space`` is not
    given (default 4)."""
    return float(os.environ.get("PAGEDLLM_CPU_KVCACHE_SPACE", "4"))


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


def env_packed_cache_dir() -> str | None:
    """The packed-weight cache's folder (``user_cache_dir()/packed``), or None where
    ``PAGEDLLM_PACKED_CACHE`` is ``0`` (every start packs the weights itself)."""
    if os.environ.get("PAGEDLLM_PACKED_CACHE", "1").strip().lower() in ("0", "false", "no", "off"):
        return None
    return os.path.join(user_cache_dir(), "packed")


def env_decode_stack() -> bool:
    """``PAGEDLLM_DECODE_STACK``: ``0`` keeps decode steps on the layer-by-layer path (the
    reference) where a backend would run the whole stack of layers in one call; default on."""
    value = os.environ.get("PAGEDLLM_DECODE_STACK", "1").strip().lower()
    return value not in ("0", "false", "no", "off")


def user_cache_dir() -> str:
    """Where pagedllm keeps what it derives once per machine (GGUF tokenizers converted to
    ``tokenizer.json``, the demo model fetched from the package registry):
    ``PAGEDLLM_CACHE_DIR``, else ``$XDG_CACHE_HOME/pagedllm``, else ``~/.cache/pagedllm``."""
    explicit = os.environ.get("PAGEDLLM_CACHE_DIR")
    if explicit:
        return explicit
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "pagedllm")

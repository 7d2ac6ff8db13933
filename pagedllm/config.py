"""Engine configuration: frozen dataclasses validated once, at the edge, and the environment.

The parts (``ModelConfig``, ``CacheConfig``, ``SchedulerConfig``, ...) are defined with their
checks in :mod:`pagedllm.config_parts` and imported from here, their public home, where
:class:`EngineConfig` joins them. This module is also the one place that reads environment
variables. Both import only the standard library at import time so that ``core/`` can read the
scheduler and cache settings without pulling in torch. The user's keyword arguments (and the
CLI's flags) that build these are ``EngineArgs`` (:mod:`pagedllm.engine_args`); the names a
field may take are :mod:`pagedllm.names`' tables.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from pagedllm.config_parts import (
    DEFAULT_CHUNKED_TOKEN_BUDGET,
    MODEL_TASKS,
    CacheConfig,
    LoRAConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
)
from pagedllm.spec_decode.config import SpeculativeConfig

__all__ = [
    "CORE_GOMP_SPINCOUNT",
    "DEFAULT_CHUNKED_TOKEN_BUDGET",
    "MODEL_TASKS",
    "CacheConfig",
    "EngineConfig",
    "LoRAConfig",
    "ModelConfig",
    "ParallelConfig",
    "SchedulerConfig",
    "SpeculativeConfig",
    "core_openmp_env",
    "env_api_key",
    "env_cpu_isa",
    "env_cpu_kv_cache_space",
    "env_decode_stack",
    "env_fuzz_examples",
    "env_packed_cache_dir",
    "prefer_huge_pages",
    "replica_actor_env",
    "user_cache_dir",
]


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

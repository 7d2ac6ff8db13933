"""Executors: how the engine reaches its workers (in-process, or one process per TP rank)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

from pagedllm.config import EngineConfig
from pagedllm.core.interfaces import ModelRunnerOutput, SchedulerOutput


class Executor(ABC):
    """The engine's only handle on the model; one ``execute_model`` call per step.

    Everything goes through ``collective_rpc``; rank 0 answers for the step.
    """

    def determine_num_blocks(self) -> tuple[int, int]:
        """(device blocks, host blocks): the minimum over workers."""
        counts = self.collective_rpc("determine_num_blocks")
        return min(c[0] for c in counts), min(c[1] for c in counts)

    def initialize_cache(self, num_device_blocks: int, num_host_blocks: int) -> None:
        self.collective_rpc("initialize_cache", num_device_blocks, num_host_blocks)

    def execute_model(self, sched_out: SchedulerOutput) -> ModelRunnerOutput:
        out = self.collective_rpc("execute_model", sched_out)[0]
        assert isinstance(out, ModelRunnerOutput)
        return out

    @abstractmethod
    def collective_rpc(self, method: str, *args: Any) -> list[Any]:
        """Call ``method`` on every worker; results in rank order."""

    def check_health(self) -> None:
        """Raise if a worker has died."""

    def shutdown(self) -> None:
        """Release workers and their resources (idempotent)."""


class UniProcExecutor(Executor):
    """One worker in the engine's own process."""

    def __init__(self, config: EngineConfig, hf_config: Any) -> None:
        from pagedllm.executors.worker import Worker

        self.worker = Worker(config, hf_config)
        # Multi-process executors give each rank its own share instead.
        self.worker.backend.configure_threads(1, config.parallel.cpu_threads)
        self.worker.load_model()

    def execute_model(self, sched_out: SchedulerOutput) -> ModelRunnerOutput:
        return self.worker.execute_model(sched_out)  # no RPC indirection on the hot path

    def collective_rpc(self, method: str, *args: Any) -> list[Any]:
        return [getattr(self.worker, method)(*args)]


def check_worker_choices(config: EngineConfig, hf_config: Any) -> None:
    """Raise here the ``ValueError`` a worker would raise as it starts (``kv_cache_dtype`` or
    ``attention_backend`` its backend refuses): from a rank process it would come only after the
    processes were spawned, and as a ``RuntimeError`` about that rank."""
    from pagedllm.backends.registry import get_backend
    from pagedllm.models.model_loader import resolve_dtype

    backend = get_backend(config.device)
    dtype = resolve_dtype(config.model.dtype, hf_config, backend.default_dtype)
    try:
        attention = backend.attention(config.model.attention_backend)
    except (ImportError, RuntimeError, OSError):
        return  # no usable kernels in this process: each rank reports it in its own words
    attention.resolve_kv_cache_dtype(config.cache.kv_cache_dtype, dtype)


def create_executor(config: EngineConfig, hf_config: Any) -> Executor:
    backend = config.parallel.distributed_executor_backend
    if config.parallel.tensor_parallel_size == 1 and backend in (None, "uni"):
        return UniProcExecutor(config, hf_config)
    check_worker_choices(config, hf_config)
    if backend == "ray":
        from pagedllm.executors.ray_executor import RayExecutor

        return RayExecutor(config, hf_config)
    from pagedllm.executors.multiproc import MultiprocExecutor

    return MultiprocExecutor(config, hf_config)

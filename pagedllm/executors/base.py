"""Executors: how the engine reaches its workers (in-process, or one process per TP rank)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any

from pagedllm.config import EngineConfig
from pagedllm.core.interfaces import ModelRunnerOutput, SchedulerOutput


class StepFuture:
    """A step handed to the workers and not yet answered (pipeline parallelism keeps several in
    flight). ``result`` waits for it; steps are answered in the order they were submitted."""

    def __init__(
        self, wait: Callable[[], ModelRunnerOutput], on_done: Callable[[], None] | None = None
    ) -> None:
        self._wait = wait
        self._on_done = on_done
        self._value: ModelRunnerOutput | None = None

    @classmethod
    def done_with(cls, value: ModelRunnerOutput) -> StepFuture:
        future = cls(lambda: value)
        future._value = value
        return future

    def result(self) -> ModelRunnerOutput:
        if self._value is None:
            value = self._wait()  # raises when a worker failed; then every later call does too
            assert isinstance(value, ModelRunnerOutput)
            self._value = value
            if self._on_done is not None:
                self._on_done()
        return self._value


class Executor(ABC):
    """The engine's only handle on the model; one ``execute_model`` call per step.

    Everything goes through ``collective_rpc``; ``output_rank`` answers for the step (rank 0, or
    TP rank 0 of the last pipeline stage). ``execute_model_async`` submits a step without waiting
    for it; ``peak_in_flight`` is the most steps that were submitted and unanswered at once.
    """

    output_rank: int = 0
    in_flight: int = 0
    peak_in_flight: int = 0

    def determine_num_blocks(self) -> tuple[int, int]:
        """(device blocks, host blocks): the minimum over workers."""
        counts = self.collective_rpc("determine_num_blocks")
        return min(c[0] for c in counts), min(c[1] for c in counts)

    def initialize_cache(
        self, num_device_blocks: int, num_host_blocks: int, num_virtual_engines: int = 1
    ) -> None:
        """Block counts per virtual engine; each worker makes one cache per virtual engine."""
        self.collective_rpc(
            "initialize_cache", num_device_blocks, num_host_blocks, num_virtual_engines
        )

    def execute_model(self, sched_out: SchedulerOutput) -> ModelRunnerOutput:
        out = self.collective_rpc("execute_model", sched_out)[self.output_rank]
        assert isinstance(out, ModelRunnerOutput)
        return out

    def execute_model_async(self, sched_out: SchedulerOutput) -> StepFuture:
        """Submit a step; executors whose ranks run in other processes return before it ran."""
        return StepFuture.done_with(self.execute_model(sched_out))

    def _submitted(self) -> None:
        self.in_flight += 1
        self.peak_in_flight = max(self.peak_in_flight, self.in_flight)

    def _answered(self) -> None:
        self.in_flight -= 1

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

    def shutdown(self) -> None:
        self.worker.release()


def check_worker_choices(config: EngineConfig, hf_config: Any) -> None:
    """Raise here the ``ValueError`` a worker would raise as it starts (``kv_cache_dtype`` or
    ``attention_backend`` its backend refuses, a model family that cannot be split into
    pipeline stages): from a rank process it would come only after the
    processes were spawned, and as a ``RuntimeError`` about that rank."""
    from pagedllm.backends.registry import get_backend
    from pagedllm.models.model_loader import pipeline_model_class, resolve_dtype

    pipeline_model_class(hf_config, config.parallel.pipeline_parallel_size)  # the family splits
    backend = get_backend(config.device)
    dtype = resolve_dtype(config.model.dtype, hf_config, backend.default_dtype)
    try:
        attention = backend.attention(config.model.attention_backend)
    except (ImportError, RuntimeError, OSError):
        return  # no usable kernels in this process: each rank reports it in its own words
    attention.resolve_kv_cache_dtype(config.cache.kv_cache_dtype, dtype)


def create_executor(config: EngineConfig, hf_config: Any) -> Executor:
    """In-process for one rank; otherwise one process (``mp``) or Ray actor per rank, which is
    also what pipeline parallelism gets when no backend is named."""
    backend = config.parallel.distributed_executor_backend
    if config.parallel.world_size == 1 and backend in (None, "uni"):
        return UniProcExecutor(config, hf_config)
    check_worker_choices(config, hf_config)
    if backend == "ray":
        from pagedllm.executors.ray_executor import RayExecutor

        return RayExecutor(config, hf_config)
    from pagedllm.executors.multiproc import MultiprocExecutor

    return MultiprocExecutor(config, hf_config)

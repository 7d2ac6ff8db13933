"""What every tensor- or pipeline-parallel rank does, whichever executor started it.

The multiprocess and Ray executors differ only in how they start a rank's process and carry
calls to it. Inside that process both use :class:`WorkerHost`: join the ``torch.distributed``
group, build a :class:`~pagedllm.executors.worker.Worker` holding this rank's weight slices and KV
heads, and answer calls by name. Keeping this in one place means the two executors cannot drift
apart in how a rank is set up.
"""

from __future__ import annotations

import logging
import os
import socket
import traceback
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from pagedllm.config import EngineConfig
from pagedllm.executors.base import Executor
from pagedllm.executors.pipeline import RankLayout, output_rank, rank_label

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class DistInit:
    """How one rank joins the group: the rendezvous address is rank 0's, chosen by its host."""

    rank: int
    world_size: int
    master_addr: str
    master_port: int
    timeout_s: float = 600.0


def get_open_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago on ``host`` (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def describe_error(exc: BaseException) -> tuple[BaseException | None, str]:
    """The exception itself when it survives pickling (so its type reaches the driver), and its
    formatted traceback (which always does)."""
    import pickle

    text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    try:
        pickle.loads(pickle.dumps(exc))
    except Exception:  # an exception that cannot cross a process boundary
        return None, text
    return exc, text


def rank_error(
    rank: int, what: str, exc: BaseException | None, text: str, *, label: str | None = None
) -> Exception:
    """The exception the driver raises for a rank's failure.

    A ``ValueError`` (a bad setting or checkpoint, the same on every rank) stays a ``ValueError``
    so callers see the usual "field: message" error; anything else becomes a ``RuntimeError``
    carrying the rank's traceback. ``label`` names the rank (with its pipeline stage, if any).
    """
    name = label or f"tensor-parallel rank {rank}"
    if isinstance(exc, ValueError):
        err: Exception = ValueError(f"{exc} ({name}, during {what})")
    else:
        err = RuntimeError(f"{name} failed during {what}:\n{text}")
    if exc is not None:
        err.__cause__ = exc
    return err


class RankedExecutor(Executor):
    """What the executors whose ranks run outside the engine's process (one process or Ray
    actor per rank) share: the rank layout, the step deadline, and the failure that, once
    set, every later call raises. A subclass sets ``_finalizer`` (which stops every rank)
    before it starts the first one."""

    _finalizer: Any

    def __init__(self, config: EngineConfig, *, step_timeout_s: float) -> None:
        parallel = config.parallel
        self.world_size = parallel.world_size
        self.tp_size, self.pp_size = parallel.tensor_parallel_size, parallel.pipeline_parallel_size
        self.output_rank = output_rank(self.tp_size, self.pp_size)
        self.kind = "tensor-parallel" if self.pp_size == 1 else "pipeline-parallel"
        self.step_timeout_s = step_timeout_s
        self._failure: str | None = None

    def _label(self, rank: int) -> str:
        return rank_label(rank, self.tp_size, self.pp_size)

    def check_health(self) -> None:
        if self._failure is not None:
            raise RuntimeError(self._failure)

    def shutdown(self) -> None:
        if self._failure is None:
            self._failure = "the executor was shut down"
        self._finalizer()


class WorkerHost:
    """One rank's end of the executor: owns the process group and the rank's Worker.

    ``device_index`` is the local accelerator index the Worker binds to (the TP rank under the
    multiprocess executor; 0 under Ray, which shows each actor only its own accelerator).
    ``num_threads`` bounds intra-op threads so that ranks sharing a machine do not oversubscribe
    its cores.
    """

    def __init__(
        self,
        config: EngineConfig,
        hf_config: Any,
        *,
        device_index: int,
        num_threads: int | None,
    ) -> None:
        self.config = config
        self.hf_config = hf_config
        self.device_index = device_index
        self.num_threads = num_threads
        self.worker: Any = None
        self.rank = -1
        self.output_rank = 0

    def pid(self) -> int:
        return os.getpid()

    def start(self, init: DistInit) -> int:
        """Join the group, then build and load this rank's Worker; returns the process id."""
        import torch
        import torch.distributed as dist

        from pagedllm.backends.registry import get_backend
        from pagedllm.executors.worker import Worker

        if self.num_threads:
            torch.set_num_threads(self.num_threads)
        backend = get_backend(self.config.device)
        device = backend.device(self.device_index)
        if device.index is not None:  # accelerators: collectives run on this rank's device
            torch.accelerator.set_device_index(device.index)
        dist.init_process_group(
            backend=backend.dist_backend(),
            init_method=f"tcp://{init.master_addr}:{init.master_port}",
            rank=init.rank,
            world_size=init.world_size,
            timeout=timedelta(seconds=init.timeout_s),
        )
        parallel = self.config.parallel
        layout = RankLayout(
            init.rank, parallel.tensor_parallel_size, parallel.pipeline_parallel_size
        )
        self.rank = init.rank
        self.output_rank = output_rank(layout.tp_size, layout.pp_size)
        self.worker = Worker(
            self.config,
            self.hf_config,
            rank=self.device_index,
            tp=self._tp_context(layout),
            pp=layout.pp_context(),
        )
        self.worker.load_model()
        logger.info(
            "%s of %d ready", rank_label(init.rank, layout.tp_size, layout.pp_size), init.world_size
        )
        return os.getpid()

    @staticmethod
    def _tp_context(layout: RankLayout) -> Any:
        """This rank's tensor-parallel group: the whole world without stages, else its stage's
        ranks (every rank creates every stage's group, in order, as torch.distributed asks)."""
        import torch.distributed as dist

        from pagedllm.layers.parallel import TPContext

        if layout.pp_size == 1:
            return TPContext(rank=layout.tp_rank, size=layout.tp_size, group=dist.group.WORLD)
        group = None
        if layout.tp_size > 1:
            for stage in range(layout.pp_size):
                made = dist.new_group(ranks=layout.tp_group_ranks(stage))
                if stage == layout.stage:
                    group = made
        return TPContext(rank=layout.tp_rank, size=layout.tp_size, group=group)

    def call(self, method: str, *args: Any) -> Any:
        """Run ``method`` on the Worker. Only the output rank (TP rank 0 of the last stage)
        returns a step's output: every TP rank samples the same tokens from the same gathered
        logits and seed, and earlier stages have no logits."""
        if self.worker is None:
            raise RuntimeError("the worker was not started")
        result = getattr(self.worker, method)(*args)
        if method == "execute_model" and self.rank != self.output_rank:
            return None
        return result

    def close(self) -> None:
        """Leave the process group; best effort, the process is about to end."""
        import torch.distributed as dist

        self.worker = None
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception as exc:  # a peer is already gone; nothing left to tidy
                logger.debug("destroy_process_group: %s", exc)

"""Tensor and pipeline parallelism on one machine: one spawned process per rank, joined by
torch.distributed.

The engine process is only a coordinator, never a rank: it runs the scheduler once per step and
sends the same (picklable, torch-free) ``SchedulerOutput`` down a pipe to every rank; the ranks run
the forward pass together (all-reduce / all-gather inside the layers) and rank 0 sends back the
``ModelRunnerOutput``. Keeping the driver out of the collectives means it can never block inside
one: every wait is on pipes and process sentinels with a deadline, so a rank that dies is noticed
at once and named, the others are stopped, and the engine gets a ``RuntimeError``.

Under pipeline parallelism several steps may be in flight (``execute_model_async``): each rank
answers its calls in order, so the n-th reply on every pipe belongs to the n-th call, and a
rank reads its pipe on a thread of its own, so the driver never blocks sending while the rank is
busy with an earlier step.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing as mp
import os
import pickle
import queue
import signal
import threading
import time
import weakref
from collections import deque
from multiprocessing.connection import Connection, wait
from typing import Any

from pagedllm.config import EngineConfig
from pagedllm.core.interfaces import ModelRunnerOutput, SchedulerOutput
from pagedllm.executors.base import StepFuture
from pagedllm.executors.distributed import (
    DistInit,
    RankedExecutor,
    WorkerHost,
    describe_error,
    get_open_port,
    rank_error,
)

logger = logging.getLogger(__name__)

_SHUTDOWN = "__shutdown__"
_DEATH_GRACE_S = 1.0  # after a rank reports an error, how long to look for a dead peer behind it


def _worker_main(conn: Connection, host: WorkerHost, init: DistInit) -> None:
    """A rank's process: start, then answer ``(method, args)`` messages until told to stop.

    Ctrl-C is left to the driver (it stops the ranks itself). The loop also ends when the driver's
    end of the pipe closes, so a driver that dies does not leave its ranks behind.
    """
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    startup_error: tuple[BaseException | None, str] | None = None
    try:
        conn.send(("ok", host.start(init)))
    except Exception as exc:
        # Stay alive until told to stop: the driver reads an exit as a crash, not an error.
        startup_error = describe_error(exc)
        conn.send(("error", startup_error))
    inbox: queue.Queue[bytes | None] = queue.Queue()
    threading.Thread(target=_read_calls, args=(conn, inbox), daemon=True).start()
    try:
        while True:
            raw = inbox.get()
            if raw is None:  # the driver's end closed
                break
            method, args = pickle.loads(raw)
            if method == _SHUTDOWN:
                conn.send(("ok", None))
                break
            reply: tuple[str, Any]
            if startup_error is not None:
                reply = ("error", startup_error)
            else:
                try:
                    reply = ("ok", host.call(method, *args))
                except Exception as exc:
                    reply = ("error", describe_error(exc))
            conn.send(reply)
    except (BrokenPipeError, OSError):
        pass  # the driver is gone
    finally:
        host.close()


def _read_calls(conn: Connection, inbox: queue.Queue[bytes | None]) -> None:
    """Move calls off the pipe as they come, so the driver's sends never wait on a busy rank."""
    try:
        while True:
            inbox.put(conn.recv_bytes())
    except (EOFError, OSError):
        inbox.put(None)


def _stop_processes(procs: list[Any], conns: list[Connection], grace_s: float) -> None:
    """Ask politely, then terminate, then kill; always reaps, so nothing is left behind."""
    for proc, conn in zip(procs, conns, strict=True):
        if grace_s > 0 and proc.is_alive():
            with contextlib.suppress(OSError, ValueError):
                conn.send_bytes(pickle.dumps((_SHUTDOWN, ())))
    deadline = time.monotonic() + grace_s
    for proc in procs:
        proc.join(max(0.0, deadline - time.monotonic()))
    for proc in procs:
        if proc.is_alive():
            proc.terminate()
            proc.join(2.0)
        if proc.is_alive():
            proc.kill()
            proc.join()
    for conn in conns:
        conn.close()


class MultiprocExecutor(RankedExecutor):
    """``tensor_parallel_size`` x ``pipeline_parallel_size`` worker processes on this machine
    (``spawn`` start method); rank ``stage * tensor_parallel_size + tp_rank``.

    ``startup_timeout_s`` bounds process start plus model load, ``step_timeout_s`` every later
    call; ``threads_per_worker`` defaults to an even share of this machine's cores.
    """

    def __init__(
        self,
        config: EngineConfig,
        hf_config: Any,
        *,
        startup_timeout_s: float = 600.0,
        step_timeout_s: float = 600.0,
        threads_per_worker: int | None = None,
    ) -> None:
        super().__init__(config, step_timeout_s=step_timeout_s)
        self._pending: deque[list[Any]] = deque()  # steps submitted, not yet answered
        total = config.parallel.cpu_threads or os.cpu_count() or 1
        threads = threads_per_worker or max(1, total // self.world_size)
        ctx = mp.get_context("spawn")
        port = get_open_port()
        self._procs: list[Any] = []
        self._conns: list[Connection] = []
        # Registered before the first start so that a failure part-way still stops what started.
        self._finalizer = weakref.finalize(self, _stop_processes, self._procs, self._conns, 5.0)
        for rank in range(self.world_size):
            host = WorkerHost(
                config,
                hf_config,
                device_index=rank,
                num_threads=threads,
            )
            init = DistInit(
                rank=rank,
                world_size=self.world_size,
                master_addr="127.0.0.1",
                master_port=port,
                timeout_s=startup_timeout_s,
            )
            parent, child = ctx.Pipe()
            proc = ctx.Process(
                target=_worker_main,
                args=(child, host, init),
                name=f"pagedllm-tp{rank}" if self.pp_size == 1 else f"pagedllm-pp{rank}",
                daemon=True,
            )
            proc.start()
            child.close()
            self._procs.append(proc)
            self._conns.append(parent)
        self.worker_pids: list[int] = self._collect("startup", startup_timeout_s)
        logger.info("%d %s workers up: pids %s", self.world_size, self.kind, self.worker_pids)

    # -- the Executor surface ---------------------------------------------------------------
    def collective_rpc(self, method: str, *args: Any) -> list[Any]:
        self.check_health()
        while self._pending:  # earlier steps' replies come first on every pipe
            self._answer_oldest()
        self._send(method, args)
        return self._collect(method, self.step_timeout_s)

    def execute_model_async(self, sched_out: SchedulerOutput) -> StepFuture:
        self.check_health()
        self._send("execute_model", (sched_out,))
        slot: list[Any] = []  # filled with the output rank's reply when it is read
        self._pending.append(slot)
        self._submitted()

        def wait() -> ModelRunnerOutput:
            while not slot:
                self.check_health()
                self._answer_oldest()
            return slot[0]

        return StepFuture(wait, self._answered)

    def _answer_oldest(self) -> None:
        replies = self._collect("execute_model", self.step_timeout_s)
        self._pending.popleft().append(replies[self.output_rank])

    def _send(self, method: str, args: tuple[Any, ...]) -> None:
        payload = pickle.dumps((method, args), protocol=pickle.HIGHEST_PROTOCOL)  # once for all
        for rank, conn in enumerate(self._conns):
            try:
                conn.send_bytes(payload)
            except (BrokenPipeError, ConnectionResetError, EOFError):
                self._fail(self._lost(rank, method))

    def check_health(self) -> None:
        super().check_health()
        message = self._death_message("a health check")
        if message:
            self._fail(message)

    # -- waiting on the ranks ---------------------------------------------------------------
    def _collect(self, what: str, timeout_s: float) -> list[Any]:
        """Every rank's reply to the call just sent, in rank order; raises (after stopping all
        ranks) when one dies, reports an error, or the deadline passes."""
        results: list[Any] = [None] * self.world_size
        pending = dict(enumerate(self._conns))
        deadline = time.monotonic() + timeout_s
        while pending:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                self._fail(
                    f"{self.kind} ranks {sorted(pending)} gave no reply to {what} "
                    f"within {timeout_s:.0f} s; stopped all workers"
                )
            ready = wait([*pending.values(), *(p.sentinel for p in self._procs)], remaining)
            for rank, conn in list(pending.items()):
                if conn not in ready:
                    continue
                try:
                    status, value = conn.recv()
                except (EOFError, OSError):
                    self._fail(self._lost(rank, what))
                del pending[rank]
                if status == "error":
                    label = None if self.pp_size == 1 else self._label(rank)
                    self._fail_with(rank_error(rank, what, *value, label=label), what)
                results[rank] = value
            message = self._death_message(what)
            if message:
                self._fail(message)
        return results

    def _lost(self, rank: int, what: str) -> str:
        """Why the pipe to ``rank`` broke. Its end closes as the process exits, a moment before
        the exit can be collected, so wait for that to name the cause."""
        self._procs[rank].join(_DEATH_GRACE_S)
        return self._death_message(what) or f"lost the pipe to {self.kind} {self._label(rank)}"

    def _death_message(self, what: str) -> str | None:
        dead = [
            f"{self._label(rank)} (pid {proc.pid}, {_exit_text(proc.exitcode)})"
            for rank, proc in enumerate(self._procs)
            if proc.exitcode is not None
        ]
        if not dead:
            return None
        names = ", ".join(dead)
        return (
            f"{self.kind} worker died during {what}: {names}; "
            "its requests cannot finish and all workers were stopped"
        )

    def _fail_with(self, err: Exception, what: str) -> None:
        # A rank's error is often the echo of a peer that died inside a collective: prefer
        # naming the dead rank when one shows up shortly.
        deadline = time.monotonic() + _DEATH_GRACE_S
        while time.monotonic() < deadline:
            message = self._death_message(what)
            if message:
                self._fail(message)
            wait([p.sentinel for p in self._procs], deadline - time.monotonic())
        self._failure = str(err)
        self._finalizer.detach()
        _stop_processes(self._procs, self._conns, 0.0)
        raise err

    def _fail(self, message: str) -> None:
        """Stop every rank at once (the survivors may be stuck in a collective) and raise."""
        self._failure = message
        self._finalizer.detach()
        _stop_processes(self._procs, self._conns, 0.0)
        logger.error("%s", message)
        raise RuntimeError(message)


def _exit_text(code: int | None) -> str:
    if code is not None and code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"

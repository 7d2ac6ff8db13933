"""Tensor and pipeline parallelism across machines: one Ray actor per rank, joined by
torch.distributed.

Same shape as the multiprocess executor: the engine process coordinates (scheduler once per step)
and every rank gets the same ``SchedulerOutput``; only rank 0 returns its ``ModelRunnerOutput``.
The ranks are Ray actors reserved together in a placement group (one bundle per rank: CPUs on the
CPU backend, plus one accelerator elsewhere), and rank 0's actor picks the rendezvous address
(its node's IP and a free port) for ``torch.distributed``. Under pipeline parallelism there are
``tensor_parallel_size * pipeline_parallel_size`` bundles, rank ``stage * tp + tp_rank`` on bundle
of the same index (so PACK keeps a stage's TP group together and stages may land on different
nodes); steps are submitted without waiting (``execute_model_async``) and each actor runs its calls
in the order they were made.

Ray is imported only here, when this executor is chosen; ``import pagedllm`` never needs it.
Uses the running Ray cluster if ``ray.init`` was called or ``ray start`` runs on this machine,
otherwise starts a local one (and stops it again on shutdown).
"""

from __future__ import annotations

import logging
import time
import weakref
from typing import Any

from pagedllm.backends.registry import backend_class
from pagedllm.config import EngineConfig
from pagedllm.core.interfaces import SchedulerOutput
from pagedllm.executors.base import StepFuture
from pagedllm.executors.distributed import (
    DistInit,
    RankedExecutor,
    WorkerHost,
    get_open_port,
    rank_error,
)

logger = logging.getLogger(__name__)

# The Ray resource that reserves one accelerator of each device kind (none on the CPU).
_POLL_S = 0.5
_DEATH_GRACE_S = 1.0  # after a rank reports an error, how long to look for a dead peer


def _bundle_strategy(pg: Any, rank: int) -> Any:
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    return PlacementGroupSchedulingStrategy(placement_group=pg, placement_group_bundle_index=rank)


def _import_ray() -> Any:
    try:
        import ray
    except ImportError as exc:
        raise ImportError(
            "distributed_executor_backend: 'ray' needs Ray; install it with "
            "`pip install -r ci/requirements-ray.txt` (or `pip install ray`)"
        ) from exc
    return ray


class RayWorkerHost(WorkerHost):
    """The actor class: a :class:`WorkerHost` that can also name its node's address."""

    def node_address(self) -> tuple[str, int]:
        """(this node's address in the Ray cluster, a free port on it): the rendezvous for all
        ranks. The cluster's own record is used, not a guess from the routing table, so a
        cluster started on a given interface (even loopback) keeps its traffic there."""
        import ray

        node_id = ray.get_runtime_context().get_node_id()
        addrs = [n["NodeManagerAddress"] for n in ray.nodes() if n["NodeID"] == node_id]
        addr = addrs[0] if addrs else ray.util.get_node_ip_address()
        return addr, get_open_port(addr)

    def node_id(self) -> str:
        import ray

        return str(ray.get_runtime_context().get_node_id())


def _release(ray: Any, actors: list[Any], pg: list[Any], owns_ray: bool) -> None:
    """Kill the actors, free their reservation, and stop Ray if this executor started it."""
    if not ray.is_initialized():
        return
    for actor in actors:
        try:
            ray.kill(actor, no_restart=True)
        except Exception as exc:  # already gone
            logger.debug("ray.kill: %s", exc)
    actors.clear()
    if pg:
        from ray.util.placement_group import remove_placement_group

        try:
            remove_placement_group(pg.pop())
        except Exception as exc:
            logger.debug("remove_placement_group: %s", exc)
    if owns_ray:
        ray.shutdown()


class RayExecutor(RankedExecutor):
    """``tensor_parallel_size`` x ``pipeline_parallel_size`` Ray actors, possibly on several
    machines.

    ``num_cpus_per_worker`` is both the CPUs each rank reserves and its intra-op thread count;
    ``placement_strategy`` is Ray's ("PACK" fills one node first, "SPREAD"/"STRICT_SPREAD" put
    ranks on different nodes).
    """

    def __init__(
        self,
        config: EngineConfig,
        hf_config: Any,
        *,
        num_cpus_per_worker: int = 1,
        placement_strategy: str = "PACK",
        startup_timeout_s: float = 600.0,
        step_timeout_s: float = 600.0,
    ) -> None:
        ray = self._ray = _import_ray()
        super().__init__(config, step_timeout_s=step_timeout_s)
        owns_ray = not ray.is_initialized()
        if owns_ray:
            ray.init()
        accel = backend_class(config.device).ray_resource
        bundle: dict[str, float] = {"CPU": float(num_cpus_per_worker)}
        if accel:
            bundle[accel] = 1.0
        self._actors: list[Any] = []
        self._pg: list[Any] = []
        self._finalizer = weakref.finalize(self, _release, ray, self._actors, self._pg, owns_ray)
        pg = self._reserve(bundle, placement_strategy, startup_timeout_s)
        actor_cls = ray.remote(RayWorkerHost)
        for rank in range(self.world_size):
            self._actors.append(
                actor_cls.options(
                    num_cpus=num_cpus_per_worker,
                    num_gpus=1 if accel == "GPU" else 0,
                    scheduling_strategy=_bundle_strategy(pg, rank),
                ).remote(
                    config,
                    hf_config,
                    device_index=0,  # Ray shows each actor only its own accelerator
                    num_threads=num_cpus_per_worker,
                )
            )
        self.worker_pids: list[int] = self._rendezvous(startup_timeout_s)

    def _reserve(self, bundle: dict[str, float], strategy: str, timeout_s: float) -> Any:
        """A placement group of one bundle per rank, or a ValueError-style failure naming the
        parallel size that asked for more than the cluster has."""
        from ray.util.placement_group import placement_group

        ray = self._ray
        pg = placement_group([dict(bundle)] * self.world_size, strategy=strategy)
        self._pg.append(pg)
        ready, _ = ray.wait([pg.ready()], timeout=timeout_s)
        if not ready:
            field = "tensor_parallel_size" if self.pp_size == 1 else "pipeline_parallel_size"
            self._fail(
                f"{field}: cannot reserve {self.world_size} x {bundle} on the Ray "
                f"cluster within {timeout_s:.0f} s (it has {ray.cluster_resources()})"
            )
        return pg

    def _rendezvous(self, timeout_s: float) -> list[int]:
        """Every rank joins the group at rank 0's node; their pids once all are up."""
        first = self._actors[0].node_address.remote()
        addr, port = self._gather([first], "startup", timeout_s)[0]
        self.master_addr, self.master_port = addr, port
        refs = [
            actor.start.remote(DistInit(rank, self.world_size, addr, port, timeout_s))
            for rank, actor in enumerate(self._actors)
        ]
        pids = self._gather(refs, "startup", timeout_s)
        logger.info(
            "%d Ray %s workers up (rendezvous %s:%d)", self.world_size, self.kind, addr, port
        )
        return pids

    # -- the Executor surface ---------------------------------------------------------------
    def collective_rpc(self, method: str, *args: Any) -> list[Any]:
        self.check_health()
        # One put, so a large SchedulerOutput is serialised once, not once per rank.
        args_ref = [self._ray.put(a) for a in args]
        refs = [actor.call.remote(method, *args_ref) for actor in self._actors]
        return self._gather(refs, method, self.step_timeout_s)

    def execute_model_async(self, sched_out: SchedulerOutput) -> StepFuture:
        self.check_health()
        arg = self._ray.put(sched_out)
        refs = [actor.call.remote("execute_model", arg) for actor in self._actors]
        self._submitted()

        def wait() -> Any:
            self.check_health()
            return self._gather(refs, "execute_model", self.step_timeout_s)[self.output_rank]

        return StepFuture(wait, self._answered)

    def node_ids(self) -> list[str]:
        """The Ray node of each rank, in rank order (where the stages landed)."""
        refs = [actor.node_id.remote() for actor in self._actors]
        return self._gather(refs, "node_ids", self.step_timeout_s)

    # -- waiting on the ranks ---------------------------------------------------------------
    def _gather(self, refs: list[Any], what: str, timeout_s: float) -> list[Any]:
        """Results in rank order. A rank whose actor died is named at once, even while its peers
        still wait for it inside a collective; errors and the deadline stop every rank too."""
        ray = self._ray
        pending = {ref: rank for rank, ref in enumerate(refs)}
        results: list[Any] = [None] * len(refs)
        deadline = time.monotonic() + timeout_s
        error: Exception | None = None
        while pending:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                if error is not None:
                    break
                self._fail(
                    f"{self.kind} ranks {sorted(pending.values())} gave no reply to {what} "
                    f"within {timeout_s:.0f} s; stopped all workers"
                )
            ready, _ = ray.wait(list(pending), num_returns=1, timeout=min(remaining, _POLL_S))
            for ref in ready:
                rank = pending.pop(ref)
                try:
                    results[rank] = ray.get(ref)
                except ray.exceptions.RayActorError as exc:
                    reason = str(exc).strip().splitlines()[0] if str(exc).strip() else "died"
                    self._fail(
                        f"{self.kind} worker died during {what}: {self._label(rank)} "
                        f"({reason}); its requests cannot finish and all workers were stopped"
                    )
                except ray.exceptions.RayTaskError as exc:
                    if error is None:
                        cause = getattr(exc, "cause", None)
                        label = None if self.pp_size == 1 else self._label(rank)
                        error = rank_error(rank, what, cause, str(exc), label=label)
                        # Often the echo of a peer that died inside a collective: give a dead
                        # peer a moment to show up, so the report names it instead.
                        deadline = min(deadline, time.monotonic() + _DEATH_GRACE_S)
        if error is not None:
            self._failure = str(error)
            self._finalizer()
            raise error
        return results

    def _fail(self, message: str) -> None:
        self._failure = message
        logger.error("%s", message)
        self._finalizer()
        raise RuntimeError(message)

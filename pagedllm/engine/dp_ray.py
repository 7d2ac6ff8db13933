"""Data-parallel replicas as Ray actors: one engine core per actor, reached over TCP ZeroMQ.

The replica's core is the same loop as a spawned core process (``core_process.run_core``); only
where it runs and how its sockets are reached differ. The front end binds its two sockets on its
node's address in the Ray cluster (random free ports) and the actor connects to them, so the
per-step messages never pass through Ray's object store. The actors are reserved together in one
placement group, one bundle per replica (its CPUs, plus one accelerator where the device has a
Ray resource), spread over the nodes where they fit.

Ray ends an actor whose owner (this process) is gone, so a killed server leaves no replica
behind. Death is seen by a thread that waits on the actor's ``run`` call and then writes to a
pipe: the pipe's read end is the handle's ``sentinel``, polled by the client next to its socket
exactly as a process's sentinel is. The sockets carry no authentication (Ray's token
authentication covers Ray's traffic only): run the cluster on a private network.

Ray is imported only here (and in ``executors/ray_executor.py``).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
from typing import Any

from pagedllm.engine.core_launch import CoreSpec

logger = logging.getLogger(__name__)

_POLL_S = 0.5


class CoreActor:
    """The actor class (wrapped by ``ray.remote`` on first use)."""

    def pid(self) -> int:
        return os.getpid()

    def run(self, spec: CoreSpec) -> int:
        from pagedllm.engine.core_process import run_core
        from pagedllm.log_setup import setup_logging

        setup_logging(spec.log_level)
        # The replica's threads are Ray's to place: no binding inside an actor.
        return run_core(dataclasses.replace(spec, cpu_binding=None), None)


class RayCoreHandle:
    """A replica actor, shaped like ``multiprocessing.Process`` for ``EngineCoreClient``."""

    def __init__(self, ray: Any, actor: Any, spec: CoreSpec, *, timeout_s: float) -> None:
        self._ray = ray
        self.actor = actor
        self.pid: int = ray.get(actor.pid.remote(), timeout=timeout_s)  # placed and alive
        self._ref = actor.run.remote(spec)
        self.exitcode: int | None = None
        self._done = threading.Event()
        self.sentinel, self._wake = os.pipe()
        threading.Thread(target=self._watch, name="pagedllm-replica-watch", daemon=True).start()

    def _watch(self) -> None:
        ray = self._ray
        try:
            while not ray.wait([self._ref], timeout=_POLL_S)[0]:
                pass
            self.exitcode = int(ray.get(self._ref))
        except Exception as exc:  # the actor died (killed, its node gone, or Ray shut down)
            logger.debug("replica actor ended: %s", exc)
            self.exitcode = -9
        self._done.set()
        os.write(self._wake, b"x")
        os.close(self._wake)

    def is_alive(self) -> bool:
        return not self._done.is_set()

    def join(self, timeout: float | None = None) -> None:
        self._done.wait(timeout)

    def terminate(self) -> None:
        try:
            self._ray.kill(self.actor, no_restart=True)
        except Exception as exc:  # already gone
            logger.debug("ray.kill: %s", exc)

    kill = terminate


class RayCoreLauncher:
    """Starts replica ``index`` in its bundle of the placement group."""

    def __init__(self, placement: RayPlacement, index: int) -> None:
        self.placement = placement
        self.index = index

    def bind(self, in_sock: Any, out_sock: Any, folder: str) -> tuple[str, str]:
        host = self.placement.address
        in_port = in_sock.bind_to_random_port(f"tcp://{host}")
        out_port = out_sock.bind_to_random_port(f"tcp://{host}")
        return f"tcp://{host}:{in_port}", f"tcp://{host}:{out_port}"

    def start(self, spec: CoreSpec) -> RayCoreHandle:
        return self.placement.start_actor(self.index, spec)


class RayPlacement:
    """The Ray side of a data-parallel client: the cluster, the placement group, the actors.

    Uses the running cluster (``ray.init`` called, ``ray start`` on this machine or
    ``RAY_ADDRESS``), else starts a local one and stops it in ``release``.
    """

    def __init__(
        self,
        num_replicas: int,
        *,
        num_cpus: int,
        accelerator: str | None,
        num_accelerators: int = 1,
        env_vars: dict[str, str],
        timeout_s: float = 600.0,
        strategy: str = "SPREAD",
    ) -> None:
        from pagedllm.executors.ray_executor import _import_ray

        ray = self._ray = _import_ray()
        from ray.util.placement_group import placement_group

        self.owns_ray = not ray.is_initialized()
        if self.owns_ray:
            ray.init()
        self.timeout_s = timeout_s
        self.num_cpus = num_cpus
        self.accelerator = accelerator
        self.num_accelerators = num_accelerators
        self.env_vars = env_vars
        self.address = _node_address(ray)
        bundle: dict[str, float] = {"CPU": float(num_cpus)}
        if accelerator:
            bundle[accelerator] = float(num_accelerators)  # one per tensor-parallel rank
        self.pg = placement_group([dict(bundle)] * num_replicas, strategy=strategy)
        logger.info("reserving %d x %s on the Ray cluster", num_replicas, bundle)
        ready, _ = ray.wait([self.pg.ready()], timeout=timeout_s)
        if not ready:
            self.release()
            raise RuntimeError(
                f"data_parallel_size: cannot reserve {num_replicas} x {bundle} on the Ray "
                f"cluster within {timeout_s:.0f} s (it has {ray.cluster_resources()})"
            )

    def launcher(self, index: int) -> RayCoreLauncher:
        return RayCoreLauncher(self, index)

    def start_actor(self, index: int, spec: CoreSpec) -> RayCoreHandle:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        ray = self._ray
        actor = (
            ray.remote(CoreActor)
            .options(
                name=None,
                num_cpus=self.num_cpus,
                num_gpus=self.num_accelerators if self.accelerator == "GPU" else 0,
                max_restarts=0,  # the client restarts replicas itself, with its own bounds
                runtime_env={"env_vars": dict(self.env_vars)},
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    placement_group=self.pg, placement_group_bundle_index=index
                ),
            )
            .remote()
        )
        return RayCoreHandle(ray, actor, spec, timeout_s=self.timeout_s)

    def release(self) -> None:
        ray = self._ray
        if not ray.is_initialized():
            return
        from ray.util.placement_group import remove_placement_group

        try:
            remove_placement_group(self.pg)
        except Exception as exc:
            logger.debug("remove_placement_group: %s", exc)
        if self.owns_ray:
            ray.shutdown()


def _node_address(ray: Any) -> str:
    """This process's node address as the cluster records it (a cluster started on loopback
    keeps its traffic there)."""
    node_id = ray.get_runtime_context().get_node_id()
    addrs = [n["NodeManagerAddress"] for n in ray.nodes() if n["NodeID"] == node_id]
    return addrs[0] if addrs else ray.util.get_node_ip_address()

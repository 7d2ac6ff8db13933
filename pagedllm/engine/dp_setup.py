"""How data-parallel replicas are placed: which launcher (Ray or local processes), each
replica's engine arguments and share of the CPU threads, and under Ray the placement group.

``DataParallelClient`` (``dp_client.py``) starts the replicas from what this decides.
"""

from __future__ import annotations

import os
from typing import Any


def choose_backend(backend: str | None) -> str:
    """Ray where it is installed and not declined (``mp``/``uni``: local processes)."""
    if backend in ("mp", "uni"):
        return "mp"
    if backend == "ray":
        return "ray"
    try:
        import ray  # noqa: F401
    except ImportError:
        return "mp"
    return "ray"


def replica_threads(cpu_threads: int | None, num_replicas: int, tp: int) -> int:
    """Each co-located replica's share of the CPU threads (the ranks of a tensor- or
    pipeline-parallel replica, ``tp`` of them, split it again), so replicas never oversubscribe
    the cores."""
    if cpu_threads is None:
        from pagedllm.backends.cpu.backend import physical_cores

        cpu_threads = physical_cores()
    return max(tp, cpu_threads // num_replicas)


def replica_setup(
    engine_args: dict[str, Any],
    *,
    backend: str,
    num_replicas: int,
    device: str,
    startup_timeout: float,
) -> tuple[dict[str, Any], Any]:
    """Every replica's engine arguments (this client's own removed) and, under Ray, the
    placement group that reserves each replica's CPUs and accelerators (None with local
    processes)."""
    args = dict(engine_args)
    args.pop("data_parallel_size", None)
    args.pop("router", None)
    # Every rank of a replica (TP x PP) is a process next to its core, on its node.
    tp = int(args.get("tensor_parallel_size") or 1) * int(args.get("pipeline_parallel_size") or 1)
    args["distributed_executor_backend"] = "mp" if tp > 1 else None
    if backend == "mp":
        args["cpu_threads"] = replica_threads(args.get("cpu_threads"), num_replicas, tp)
        return args, None
    from pagedllm.backends.registry import backend_class, resolve_device
    from pagedllm.config import replica_actor_env
    from pagedllm.engine.dp_ray import RayPlacement

    num_cpus = int(args.get("cpu_threads") or tp)
    args["cpu_threads"] = num_cpus
    accel = backend_class(resolve_device(device)).ray_resource
    package_root = os.path.dirname(os.path.dirname(os.path.dirname(__file__)))
    placement = RayPlacement(
        num_replicas,
        num_cpus=num_cpus,
        accelerator=accel or None,
        num_accelerators=tp,
        env_vars=replica_actor_env(package_root),
        timeout_s=startup_timeout,
    )
    return args, placement

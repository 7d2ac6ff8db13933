"""DataParallelClient: N engine-core replicas behind one ``EngineClient``, with a router.

Each replica is a whole engine (its own scheduler and KV cache; tensor-parallel inside where
asked) run as an engine core (``core_process.py``) and reached by its own ``EngineCoreClient``:
a Ray actor over TCP ZeroMQ (``dp_ray.py``), or a spawned process over ``ipc://`` with
``distributed_executor_backend="mp"`` or where Ray is not installed. The server holds this
client exactly as it holds one ``EngineCoreClient``; each request goes to the replica the
router chooses (``router.py``) and its stream is that replica's.

Faults: a replica's client sees its core die at once and ends that replica's streams with an
``EngineDeadError`` naming the replica; the other replicas never notice. A monitor thread here
then takes the replica out of the rotation, restarts it (``max_restarts`` tries per failure,
logged) and puts it back. While one restarts, ``health()`` says ``degraded``; only when every
replica is gone for good is the client unhealthy (and the server stops).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
from collections.abc import Callable
from typing import Any

from pagedllm.core.pooling_params import RequestParams
from pagedllm.core.sampling_params import SamplingParams
from pagedllm.engine.admission import default_max_tokens
from pagedllm.engine.client import (
    EngineClient,
    EngineClientBase,
    EngineDeadError,
    ReplicaSet,
    RequestStream,
)
from pagedllm.engine.core_client import EngineCoreClient
from pagedllm.engine.core_launch import ProcessLauncher
from pagedllm.engine.dp_setup import choose_backend, replica_setup
from pagedllm.engine.early_tokenizer import load_tokenizer_early
from pagedllm.engine.router import Router
from pagedllm.outputs import RequestOutput

logger = logging.getLogger(__name__)

UP, RESTARTING, FAILED = "up", "restarting", "failed"
_MONITOR_S = 0.1
_SUMMED_AS_FRACTION = {  # usage gauges recomputed from the summed block counts
    "kv_cache_usage_perc": ("num_free_device_blocks", "num_device_blocks"),
    "cpu_cache_usage_perc": ("num_free_host_blocks", "num_host_blocks"),
}


class DataParallelClient(EngineClientBase):
    """``data_parallel_size`` replicas of ``model``; see the module docstring.

    ``engine_args`` are every replica's (``data_parallel_size`` and ``router`` are this
    client's). ``cpu_threads`` is the total on one machine with local processes, and what each
    replica reserves and uses under Ray.
    """

    def __init__(
        self,
        model: str,
        device: str = "auto",
        *,
        data_parallel_size: int = 2,
        router: str = "prefix",
        log_stats_interval: float | None = 5.0,
        max_restarts: int = 3,
        startup_timeout: float = 900.0,
        **engine_args: Any,
    ) -> None:
        engine_args.pop("cpu_binding", None)  # one core per process: binding is for one core
        self.num_replicas = data_parallel_size
        self.router = Router(
            data_parallel_size, router, block_size=int(engine_args.get("block_size") or 16)
        )
        self.on_request_finished: list[Callable[[RequestOutput], None]] = []
        self.on_timing: list[Callable[[str, float], None]] = []
        self.max_restarts = max_restarts
        self.restarts = [0] * data_parallel_size
        self.failed_requests = [0] * data_parallel_size
        self.states = [UP] * data_parallel_size
        self._lock = threading.Lock()
        self._closing = threading.Event()
        self._accepting = True
        self._model, self._device = model, device
        self._startup_timeout = startup_timeout
        self._log_stats_interval = log_stats_interval
        self.backend = choose_backend(engine_args.get("distributed_executor_backend"))
        if router == "prefix" and not engine_args.get("enable_prefix_caching"):
            logger.warning("router 'prefix' without enable_prefix_caching: no replica caches")
        self._engine_args, self._placement = replica_setup(
            engine_args,
            backend=self.backend,
            num_replicas=data_parallel_size,
            device=device,
            startup_timeout=startup_timeout,
        )
        # One load of the tokenizer for every replica (and restart), beside their starts.
        self._tokenizer_load = load_tokenizer_early(model, self._engine_args)
        self.replicas: list[EngineCoreClient] = self._start_all()
        self.tokenizer = self.replicas[0].tokenizer
        self.info = self.replicas[0].info
        self._monitor = threading.Thread(
            target=self._watch, name="pagedllm-dp-monitor", daemon=True
        )
        self._monitor.start()
        logger.info("%d %s replicas up, router %s", data_parallel_size, self.backend, router)

    @classmethod
    def from_engine_args(cls, model: str, device: str = "auto", **kwargs: Any) -> EngineClient:
        return cls(model, device, **kwargs)

    # -- replicas ------------------------------------------------------------------------------
    def _start_all(self) -> list[EngineCoreClient]:
        """Every replica at once (each loads its model); on a failure, none is left running."""
        n = self.num_replicas
        with concurrent.futures.ThreadPoolExecutor(n) as pool:
            futures = [pool.submit(self._start_replica, i) for i in range(n)]
            concurrent.futures.wait(futures)
        errors = [f.exception() for f in futures if f.exception() is not None]
        if errors:
            for f in futures:
                if f.exception() is None:
                    f.result().stop()
            self._release()
            raise errors[0]
        return [f.result() for f in futures]

    def _start_replica(self, index: int) -> EngineCoreClient:
        placement = self._placement
        if placement is None and self.backend == "ray":
            raise RuntimeError(f"replica {index}: the replicas' placement group was released")
        launcher = ProcessLauncher() if placement is None else placement.launcher(index)
        client = EngineCoreClient(
            self._model,
            self._device,
            log_stats_interval=self._log_stats_interval,  # each replica's own throughput line
            startup_timeout=self._startup_timeout,
            launcher=launcher,
            name=f"replica {index}",
            tokenizer_load=self._tokenizer_load,
            **self._engine_args,
        )
        client.on_request_finished = self.on_request_finished  # shared lists: hooks added later
        client.on_timing = self.on_timing
        client.on_request_done = self._request_done
        blocks = int(client.get_stats().get("num_device_blocks", 0))
        with self._lock:
            if blocks:
                self.router.set_capacity(index, blocks)
        return client

    def _request_done(self, request_id: str) -> None:
        with self._lock:
            replica = self.router.finished(request_id)
        if replica is not None and self.replicas and not self.replicas[replica].is_healthy:
            self.failed_requests[replica] += 1  # ended by the replica's death

    def _watch(self) -> None:
        while not self._closing.wait(_MONITOR_S):
            for index, replica in enumerate(self.replicas):
                if self.states[index] == UP and not replica.is_healthy and self._accepting:
                    self._on_replica_dead(index, replica)

    def _on_replica_dead(self, index: int, replica: EngineCoreClient) -> None:
        with self._lock:
            self.states[index] = RESTARTING
            self.failed_requests[index] += len(self.router.mark_down(index))
        logger.error(
            "replica %d is down (%s); %d requests in all ended with an error; restarting it",
            index,
            replica.dead_error,
            self.failed_requests[index],
        )
        threading.Thread(
            target=self._restart, args=(index, replica), name=f"pagedllm-restart-{index}"
        ).start()

    def _restart(self, index: int, old: EngineCoreClient) -> None:
        try:
            old.stop(join_timeout=5.0)
        except Exception:
            logger.exception("replica %d: cleaning up after its death failed", index)
        for attempt in range(1, self.max_restarts + 1):
            if self._closing.is_set():
                return
            logger.warning("replica %d: restart %d of %d", index, attempt, self.max_restarts)
            try:
                fresh = self._start_replica(index)
            except Exception as exc:
                if self._closing.is_set():
                    return  # the client stopped (and released the placement) meanwhile
                logger.error("replica %d: restart %d failed: %s", index, attempt, exc)
                if self._closing.wait(min(2.0**attempt, 30.0)):
                    return
                continue
            if self._closing.is_set():
                fresh.stop()
                return
            self.replicas[index] = fresh
            with self._lock:
                self.restarts[index] += 1
                self.router.mark_up(index)
                self.states[index] = UP
            logger.info("replica %d is back after %d attempt(s)", index, attempt)
            return
        with self._lock:
            self.states[index] = FAILED
        logger.error("replica %d: gave up after %d restarts", index, self.max_restarts)

    # -- what the server reads -----------------------------------------------------------------
    @property
    def is_healthy(self) -> bool:
        """False once stopped or every replica is gone for good (not while one restarts, and
        not merely while draining at shutdown: the server's watcher would read that as a
        failure)."""
        return not self._closing.is_set() and any(s != FAILED for s in self.states)

    @property
    def dead_error(self) -> BaseException | None:
        if self.is_healthy:
            return None
        errors = [r.dead_error for r in self.replicas if r.dead_error is not None]
        return errors[0] if errors else EngineDeadError("every replica is gone")

    def replica_set(self) -> ReplicaSet:
        return self

    def health(self) -> dict[str, Any]:
        """``ok``, or ``degraded`` while a replica is down (restarting or given up). A replica
        the monitor has not looked at since it died (it looks every ``_MONITOR_S``) is down
        already: its streams have failed, so "ok" would be a lie."""
        states = [
            "down" if s == UP and not r.is_healthy else s
            for s, r in zip(self.states, self.replicas, strict=True)
        ]
        status = "ok" if all(s == UP for s in states) else "degraded"
        return {"status": status, "replicas": states}

    @property
    def num_in_flight(self) -> int:
        return sum(r.num_in_flight for r in self.replicas)

    @property
    def num_cut(self) -> int:
        return sum(r.num_cut for r in self.replicas)

    def describe(self) -> dict[str, Any]:
        return self.replicas[0].describe()

    def get_stats(self) -> dict[str, float]:
        """The replicas that are up, summed (usage gauges recomputed from the sums)."""
        live = [r.get_stats() for i, r in enumerate(self.replicas) if self.states[i] == UP]
        total: dict[str, float] = {}
        for stats in live:
            for key, value in stats.items():
                total[key] = total.get(key, 0.0) + float(value)
        for key, (free, size) in _SUMMED_AS_FRACTION.items():
            if key in total:
                n = total.get(size, 0.0)
                total[key] = 1.0 - total.get(free, 0.0) / n if n else 0.0
        for key in ("spec_decode_draft_acceptance_rate", "spec_decode_mean_accepted_length"):
            if key in total and live:
                total[key] /= len(live)
        return total

    def replica_stats(self) -> list[dict[str, Any]]:
        """Per replica, for /metrics and the dashboard: state, routed load, engine stats."""
        with self._lock:
            rows = [
                {
                    "replica": i,
                    "state": self.states[i],
                    "up": float(self.states[i] == UP),
                    "load_tokens": float(self.router.load[i]),
                    "routed_in_flight": float(self.router.in_flight[i]),
                    "restarts": float(self.restarts[i]),
                    "failed_requests": float(self.failed_requests[i]),
                }
                for i in range(self.num_replicas)
            ]
        for row, replica in zip(rows, self.replicas, strict=True):
            row["stats"] = replica.get_stats() if row["state"] == UP else {}
        return rows

    def router_stats(self) -> dict[str, Any]:
        with self._lock:
            s = self.router.stats
            return {
                "policy": self.router.policy,
                "decisions": dict(s.decisions),
                "matched_blocks": s.matched_blocks,
                "query_blocks": s.query_blocks,
            }

    # -- requests ------------------------------------------------------------------------------
    async def add_request(
        self,
        request_id: str,
        prompt: Any,
        params: RequestParams,
        *,
        priority: int = 0,
        arrival_time: float | None = None,
        lora_request: Any = None,
    ) -> RequestStream:
        """Route and hand over. A replica found dead at the hand-over is routed around (the
        request was never taken, so it is not lost); one that dies later fails the stream."""
        if not self._accepting:
            raise EngineDeadError("the engine is shutting down")
        token_ids = self._token_ids(prompt)
        root = _lora_root(lora_request)
        max_len = self.info["max_model_len"]
        out_len = 0  # a pooling request is its prompt alone
        if isinstance(params, SamplingParams):
            out_len = params.max_tokens or default_max_tokens(len(token_ids), max_len)
        tokens = len(token_ids) + out_len
        for _ in range(self.num_replicas):
            with self._lock:
                try:
                    decision = self.router.choose(token_ids, root=root)
                except ValueError as exc:
                    raise EngineDeadError(str(exc)) from None
                self.router.sent(request_id, decision, tokens=tokens)
            replica = self.replicas[decision.replica]
            try:
                return await replica.add_request(
                    request_id,
                    prompt,
                    params,
                    priority=priority,
                    arrival_time=arrival_time,
                    lora_request=lora_request,
                )
            except EngineDeadError:
                self._request_done(request_id)
                if replica.is_healthy:  # shutting down, not dead
                    raise
                with self._lock:
                    self.router.up[decision.replica] = False  # until the monitor restarts it
            except BaseException:
                self._request_done(request_id)
                raise
        raise EngineDeadError("data_parallel_size: no replica is up to take the request")

    def _token_ids(self, prompt: Any) -> list[int]:
        if isinstance(prompt, dict):
            ids = prompt.get("prompt_token_ids")
            if ids is not None:
                return list(ids)
            prompt = prompt.get("prompt", "")
        if isinstance(prompt, list):
            return list(prompt)
        if self.tokenizer is None:
            return []
        return list(self.tokenizer.encode(prompt))

    def request_abort(self, request_id: str | list[str]) -> None:
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        with self._lock:
            owners = {rid: self.router.replica_of(rid) for rid in ids}
        for rid, owner in owners.items():
            if owner is not None:
                self.replicas[owner].request_abort(rid)

    async def call(self, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(engine, *args)`` on every replica that is up (adapters must reach them all);
        replica 0's result (the first one up)."""
        live = [r for i, r in enumerate(self.replicas) if self.states[i] == UP]
        results = await asyncio.gather(*(r.call(fn, *args) for r in live))
        return results[0]

    # -- shutdown ------------------------------------------------------------------------------
    async def shutdown(self, timeout: float = 30.0) -> None:
        self.stop_accepting()
        await asyncio.gather(*(r.shutdown(timeout) for r in self.replicas))
        await asyncio.to_thread(self.stop)

    def stop_accepting(self) -> None:
        self._accepting = False
        for replica in self.replicas:
            replica.stop_accepting()

    def cut_in_flight(self, reason: str) -> None:
        self._accepting = False
        for replica in self.replicas:
            replica.cut_in_flight(reason)

    def stop(self, join_timeout: float = 30.0) -> None:
        self._accepting = False
        self._closing.set()
        for replica in self.replicas:
            try:
                replica.stop(join_timeout)
            except Exception:
                logger.exception("stopping a replica failed")
        self._release()

    def _release(self) -> None:
        if self._placement is not None:
            self._placement.release()
            self._placement = None


def _lora_root(lora_request: Any) -> int | None:
    if lora_request is None:
        return None
    from pagedllm.engine.lora_registry import lora_cache_root

    return lora_cache_root(lora_request)

"""The three engine clients implement ``EngineClient``, the protocol the server is typed to, so
the server calls what every client has instead of probing with ``hasattr``."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import pytest

import pagedllm
from pagedllm.engine.async_engine import AsyncEngine
from pagedllm.engine.client import EngineClient, EngineClientBase
from pagedllm.engine.core_client import EngineCoreClient
from pagedllm.engine.dp_client import DataParallelClient

CLIENTS = [AsyncEngine, EngineCoreClient, DataParallelClient]


def _members(proto: type) -> set[str]:
    names = {n for n in vars(proto) if not n.startswith("_")}
    return names | set(getattr(proto, "__annotations__", {}))


def _has(cls: type, name: str) -> bool:
    """A method or property on the class, or an attribute its base declares for instances
    (``on_request_finished``) or its constructor sets (``num_cut``)."""
    if any(name in vars(k) for k in cls.__mro__[:-1]):
        return True
    declared = {n for k in cls.__mro__ for n in getattr(k, "__annotations__", {})}
    assigned = re.search(rf"self\.{name}\b\s*(:[^=\n]*)?=", inspect.getsource(cls.__init__))
    return name in declared or assigned is not None


@pytest.mark.parametrize("client", CLIENTS, ids=lambda c: c.__name__)
def test_client_implements_every_protocol_member(client: type) -> None:
    assert issubclass(client, EngineClientBase)
    members = _members(EngineClient)
    assert {"add_request", "health", "replica_set", "call", "on_timing"} <= members, members
    missing = sorted(n for n in members if not _has(client, n))
    assert not missing, f"{client.__name__} lacks {missing}"


def test_only_the_replica_client_answers_replica_set() -> None:
    assert EngineClientBase.replica_set is AsyncEngine.replica_set
    assert EngineClientBase.replica_set is EngineCoreClient.replica_set
    assert DataParallelClient.replica_set is not EngineClientBase.replica_set


def test_server_and_engine_do_not_probe_the_client() -> None:
    root = Path(pagedllm.__file__).parent
    probes = [
        f"{p.relative_to(root)}:{i}"
        for folder in ("engine", "entrypoints/openai", "entrypoints/web")
        for p in sorted((root / folder).glob("*.py"))
        for i, line in enumerate(p.read_text().splitlines(), 1)
        if "hasattr(engine" in line or "getattr(engine" in line
    ]
    assert not probes, probes

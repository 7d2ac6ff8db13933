"""Tensor-parallel engines refuse a ``kv_cache_dtype`` their workers cannot run in the engine's
own process, with a ``ValueError`` naming the field, before any rank process is spawned.

The CPU kernels read every cache dtype, so the test narrows one backend's list (in this process
only, which is the point: the check must run here, not in a rank).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from pagedllm import Engine
from pagedllm.backends import kernels


def test_refused_kv_cache_dtype_is_raised_before_spawning(llama_path: Path, monkeypatch) -> None:
    from pagedllm.executors import multiproc

    torch_attention = kernels.load(kernels.entry("attention", "torch"))
    monkeypatch.setattr(torch_attention, "supported_kv_cache_dtypes", ("float32",))

    def no_spawn(*args, **kwargs):
        raise AssertionError("a rank process was started before the choice was checked")

    monkeypatch.setattr(multiproc.MultiprocExecutor, "__init__", no_spawn)
    with pytest.raises(ValueError, match=r"^kv_cache_dtype: 'fp8_e4m3' .*supports \['auto'"):
        Engine(
            str(llama_path),
            device="cpu",
            attention_backend="torch",
            kv_cache_dtype="fp8_e4m3",
            tensor_parallel_size=2,
            distributed_executor_backend="mp",
        )


def test_accepted_choices_reach_the_executor(llama_path: Path, monkeypatch) -> None:
    """The check passes what the workers run (it must not refuse a valid engine)."""
    from pagedllm.executors import multiproc

    class Reached(Exception):
        pass

    def reached(*args, **kwargs):
        raise Reached

    monkeypatch.setattr(multiproc.MultiprocExecutor, "__init__", reached)
    with pytest.raises(Reached):
        Engine(
            str(llama_path),
            device="cpu",
            kv_cache_dtype="fp8_e4m3",
            tensor_parallel_size=2,
            distributed_executor_backend="mp",
        )

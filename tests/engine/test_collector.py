"""The cyclic collector held off while an engine is built (``engine/collector.py``), and given
back as the caller had it."""

from __future__ import annotations

import gc
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from pagedllm.engine.collector import collector_paused


@pytest.fixture
def collector_on() -> Iterator[None]:
    was_on = gc.isenabled()
    gc.enable()
    yield
    if not was_on:
        gc.disable()


def test_paused_inside_and_restored_after(collector_on: None) -> None:
    with collector_paused():
        assert not gc.isenabled()
        with collector_paused():  # nested: the inner one leaves it off
            assert not gc.isenabled()
        assert not gc.isenabled()
    assert gc.isenabled()


def test_restored_after_an_error(collector_on: None) -> None:
    with pytest.raises(RuntimeError), collector_paused():
        raise RuntimeError("a build that failed")
    assert gc.isenabled()


def test_a_caller_that_turned_it_off_keeps_it_off(collector_on: None) -> None:
    gc.disable()
    with collector_paused():
        pass
    assert not gc.isenabled()
    gc.enable()


def test_an_engine_build_runs_with_the_collector_paused_and_gives_it_back(
    llama_path: Path, collector_on: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Half-way through an engine's build (a tiny Llama on the CPU: its output processor about
    to be built, the model loaded and its KV cache allocated) the collector is off, with more
    objects allocated than its youngest generation's threshold (a collection would have run);
    it is on again afterwards, and the engine generates."""
    from pagedllm import Engine, SamplingParams
    from pagedllm.engine import llm_engine

    seen: list[tuple[bool, int]] = []
    output_processor = llm_engine.OutputProcessor

    def observed(*args: Any, **kwargs: Any) -> Any:
        seen.append((gc.isenabled(), gc.get_count()[0]))
        return output_processor(*args, **kwargs)

    monkeypatch.setattr(llm_engine, "OutputProcessor", observed)
    gc.collect()  # counts from zero: what the build allocates decides
    engine = Engine(str(llama_path), device="cpu", dtype="float32", num_kv_blocks=16)
    [(enabled, allocated)] = seen
    assert not enabled
    assert allocated > gc.get_threshold()[0]
    assert gc.isenabled()
    out = engine.generate(["The quick brown fox"], SamplingParams(max_tokens=4, temperature=0))
    assert len(out[0].outputs[0].token_ids) == 4

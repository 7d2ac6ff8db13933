"""The GGUF fuzz taken through an engine (issue 58): a file with flipped or cut bytes either is
refused in one line, or loads; and a file that loads while describing the same model as the
original (the same hyper-parameters, the same tensors with the same bytes) gives the same
first greedy tokens. One that loads describing another model is a model GGUF cannot tell from
the original, having no checksum of its data (a flip inside a weight, or a float hyper-parameter
nudged): it must still run, computing finite log-probabilities, and is counted, not compared
(``inspect --verify-sha256`` is the answer to that, see docs/models.md).

Besides byte flips, each numeric hyper-parameter is set to values at and around the edges
(zero, one, off by one, huge, NaN, infinities), in place, the file's size unchanged: the
values that the checks exist for, which random flips reach rarely.

Engine starts cost about a second each, so CI runs a few examples (6 and 10);
``PAGEDLLM_FUZZ_EXAMPLES`` (the header fuzz's count) raises these too, at 1/25 and 1/20 of it.
At 2,000 the edge test found a NaN norm epsilon loading (NaN log-probabilities) with
``_check_floats`` removed; at 10 it may not.
"""

from __future__ import annotations

import hashlib
import math
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from pagedllm import Engine, SamplingParams
from pagedllm.config import env_fuzz_examples
from pagedllm.models.gguf.reader import GGUFFile, GGUFFileError
from tests.models.test_hostile_gguf import (  # noqa: F401  (good, good_bytes: fixtures)
    _field_value_offset,
    _metadata,
    _put,
    good,
    good_bytes,
)

_U32_VALUES = [0, 1, 2, 3, 4, 7, 8, 15, 16, 17, 31, 32, 33, 63, 64, 65, 128, 255, 256, 1 << 31]
_F32_VALUES = [math.nan, math.inf, -math.inf, 0.0, -1.0, 1e-38, 1e-6, 0.5, 1.0, 1e4, 3e38]
_NUMERIC = sorted(k for k, (v, _) in _metadata().items() if isinstance(v, int | float))
PROMPTS = [[2, 3, 4, 5, 6], [30, 7, 7, 12], [9]]
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, logprobs=0)
ENGINE: dict[str, Any] = dict(
    device="cpu",
    dtype="float32",
    block_size=8,
    num_kv_blocks=16,
    max_model_len=64,
    skip_tokenizer_init=True,
)


def describe_model(path: Path) -> tuple[Any, ...]:
    """What the engine builds from a file: its config and every tensor's name, type, shape
    and bytes."""
    from pagedllm.models.gguf.loading import gguf_config

    config = dict(vars(gguf_config(path)))
    config.pop("_name_or_path", None)
    gguf = GGUFFile(path)
    tensors = tuple(
        (n, t.type_name, t.shape, hashlib.sha256(t.raw.tobytes()).hexdigest())
        for n, t in sorted(gguf.tensors.items())
    )
    return repr(sorted(config.items())), tensors


def first_tokens(path: Path) -> list[list[int]]:
    """The greedy tokens, each of a finite log-probability: a model that loads computes
    numbers, not NaN (what a NaN rope base or norm epsilon used to give)."""
    engine = Engine(str(path), **ENGINE)
    try:
        outs = engine.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
    finally:
        engine.shutdown()
    for o in outs:
        steps, tokens = o.outputs[0].logprobs or [], o.outputs[0].token_ids
        chosen = [step[t] for step, t in zip(steps, tokens, strict=True)]
        assert len(chosen) == GREEDY.max_tokens and all(map(math.isfinite, chosen)), chosen
    return [list(o.outputs[0].token_ids) for o in outs]


@pytest.fixture(scope="module")
def original(good: Path) -> tuple[tuple[Any, ...], list[list[int]]]:  # noqa: F811
    return describe_model(good), first_tokens(good)


@settings(
    max_examples=max(6, env_fuzz_examples(200) // 25),
    deadline=None,  # an engine start; the header fuzz bounds the checks' own time
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(data=st.data())
def test_a_fuzzed_file_is_refused_or_runs_as_the_model_it_describes(
    good_bytes: tuple[bytes, int],  # noqa: F811
    original: tuple[tuple[Any, ...], list[list[int]]],
    tmp_path_factory: pytest.TempPathFactory,
    data: st.DataObject,
) -> None:
    blob, header = bytearray(good_bytes[0]), good_bytes[1]
    where = st.one_of(st.integers(0, header - 1), st.integers(0, len(blob) - 1))
    flips = data.draw(st.lists(st.tuples(where, st.integers(1, 255)), min_size=1, max_size=3))
    for at, mask in flips:
        blob[at] ^= mask
    if data.draw(st.booleans()):
        del blob[data.draw(st.integers(0, len(blob))) :]
    path = tmp_path_factory.mktemp("fuzz-engine") / "fuzzed.gguf"
    path.write_bytes(bytes(blob))
    try:
        tokens = first_tokens(path)
    except GGUFFileError as exc:
        assert "\n" not in str(exc) and str(path) in str(exc)
        event("refused")
        return
    described, expected = original
    if describe_model(path) == described:
        event("loaded: the same model")
        assert tokens == expected, f"flips {flips}: the same model gave other tokens"
    else:  # another model, as far as any check can tell: it runs, in its vocabulary
        event("loaded: another model (weights or a float hyper-parameter changed)")
        assert all(len(t) == GREEDY.max_tokens for t in tokens)


@settings(
    max_examples=max(10, env_fuzz_examples(200) // 20),
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(data=st.data())
def test_an_edged_hyper_parameter_is_refused_or_runs(
    good: Path,  # noqa: F811
    original: tuple[tuple[Any, ...], list[list[int]]],
    tmp_path_factory: pytest.TempPathFactory,
    data: st.DataObject,
) -> None:
    from gguf import GGUFReader, GGUFValueType

    key = data.draw(st.sampled_from(_NUMERIC))
    blob = bytearray(good.read_bytes())
    at = _field_value_offset(GGUFReader(str(good)), key)
    if _metadata()[key][1] == GGUFValueType.FLOAT32:
        value: Any = data.draw(st.sampled_from(_F32_VALUES))
        _put(blob, at, "<f", value)
    else:
        value = data.draw(st.sampled_from(_U32_VALUES))
        _put(blob, at, "<I", value)
    path = tmp_path_factory.mktemp("edge-engine") / "edged.gguf"
    path.write_bytes(bytes(blob))
    try:
        tokens = first_tokens(path)
    except GGUFFileError as exc:
        assert "\n" not in str(exc) and str(path) in str(exc), str(exc)  # it or what it sizes
        event("refused")
        return
    except ValueError as exc:  # a context shorter than the engine was asked for: its own check
        assert str(exc).startswith("max_model_len: ") and key.endswith("context_length"), exc
        event("refused: context shorter than max_model_len")
        return
    described, expected = original
    if describe_model(path) == described:
        event("loaded: the same model")
        assert tokens == expected, f"{key} = {value}: the same model gave other tokens"
    else:
        event("loaded: another model")
        assert all(len(t) == GREEDY.max_tokens for t in tokens), (key, value)

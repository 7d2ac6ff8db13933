"""benchmarks/activation_rounding.py's scoring: which positions count, how a flip and a tie are
read, and what the log-probability change measures."""

from __future__ import annotations

import importlib.util
import math
import sys
from pathlib import Path
from types import ModuleType

import numpy as np
import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "activation_rounding.py"


@pytest.fixture(scope="module")
def bench() -> ModuleType:
    spec = importlib.util.spec_from_file_location("activation_rounding_bench", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def _rows(bench: ModuleType, logits: list[list[float]]) -> np.ndarray:
    return bench.log_softmax(np.array(logits, dtype=np.float64))


def test_only_answer_positions_count_and_a_flip_carries_the_reference_margin(
    bench: ModuleType,
) -> None:
    # 5 tokens, the answer starts at 3: the logits at positions 2 and 3 predict tokens 3 and 4.
    ref = _rows(bench, [[9, 0, 0], [9, 0, 0], [2.0, 1.5, 0], [0, 3.0, 0], [0, 0, 0]])
    got = ref.copy()
    got[0] = _rows(bench, [[0, 9, 0]])[0]  # a prompt position: not scored
    got[2] = _rows(bench, [[1.5, 2.0, 0]])[0]  # flips the 0.5-nat choice
    report = bench.compare([ref], [3], [[0, 0, 0, 0, 1]], full=[got])
    assert report["positions"] == 2
    assert report["same_top"] == 0.5
    assert report["flips"] == [{"seq": 0, "pos": 3, "reference_margin_nats": 0.5}]
    assert report["dlogp_max"] == pytest.approx(0.5, abs=1e-4)
    assert report["kl_mean"] > 0


def test_a_tie_goes_to_the_lowest_token_id_as_greedy_breaks_it(bench: ModuleType) -> None:
    ref = _rows(bench, [[0, 0, 0], [1.0, 3.0, 2.9], [0, 0, 0]])
    tied = {2: -0.7, 1: -0.7, 0: -2.0}  # prompt_logprobs of token 2: tokens 1 and 2 tie
    report = bench.compare([ref], [2], [[0, 0, 1]], top=[[None, None, tied]])
    assert report["same_top"] == 1.0 and report["flips"] == []
    lower_first = {2: -0.7, 0: -0.7, 1: -2.0}  # now the tie is between 0 and 2: 0 wins
    report = bench.compare([ref], [2], [[0, 0, 1]], top=[[None, None, lower_first]])
    assert report["same_top"] == 0.0
    assert report["flips"][0]["reference_margin_nats"] == pytest.approx(0.1, abs=1e-4)


def test_a_reference_token_outside_the_top_list_is_left_out_of_the_change(
    bench: ModuleType,
) -> None:
    ref = _rows(bench, [[0, 0, 0, 0], [0, 5.0, 0, 0], [0, 0, 5.0, 0], [0, 0, 0, 0]])
    top = [None, None, {1: -0.1, 0: -3.0}, {3: -0.1}]  # token 2 absent at the last position
    report = bench.compare([ref], [2], [[0, 0, 1, 2]], top=[top])
    assert report["positions"] == 2 and report["same_top"] == 0.5
    assert math.isfinite(report["dlogp_max"])

"""Mixture-of-experts GGUF files whose expert counts or stacks disagree with their
hyper-parameters are refused in one line naming the key or tensor (issue 58).

The tiny llama of ``test_hostile_gguf`` with its MLPs replaced by a router and three expert
stacks (a Mixtral file, as llama.cpp's converter writes one: arch "llama" with experts), then
altered through the writer; each is refused by the checks an engine start runs, within the same
CPU and memory bounds.
"""

from __future__ import annotations

import time
import tracemalloc
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from pagedllm.models.gguf.reader import GGUFFileError
from pagedllm.models.gguf.summary import describe
from tests.models.test_hostile_gguf import (
    _MAX_CPU_S,
    _MAX_TRACED,
    BLOCKS,
    FFN,
    HIDDEN,
    U32,
    write_tiny,
)

EXPERTS, USED = 4, 2


def _w(*shape: int) -> np.ndarray:
    return (np.random.default_rng(1).standard_normal(shape) * 0.05).astype(np.float32)


def _moe_tensors(changes: dict[str, np.ndarray | None]) -> dict[str, np.ndarray | None]:
    out: dict[str, np.ndarray | None] = {}
    for i in range(BLOCKS):
        b = f"blk.{i}"
        out |= {f"{b}.ffn_gate.weight": None, f"{b}.ffn_up.weight": None}
        out |= {f"{b}.ffn_down.weight": None, f"{b}.ffn_gate_inp.weight": _w(EXPERTS, HIDDEN)}
        out[f"{b}.ffn_gate_exps.weight"] = _w(EXPERTS, FFN, HIDDEN)
        out[f"{b}.ffn_up_exps.weight"] = _w(EXPERTS, FFN, HIDDEN)
        out[f"{b}.ffn_down_exps.weight"] = _w(EXPERTS, HIDDEN, FFN)
    for name, value in changes.items():
        if value is None and out.get(name) is not None:
            del out[name]  # a stack this file adds: not written at all
        else:
            out[name] = value
    return out


def write_moe(
    path: Path, meta: dict[str, Any] | None = None, tensors: dict[str, Any] | None = None
) -> Path:
    counts = {"llama.expert_count": (EXPERTS, U32), "llama.expert_used_count": (USED, U32)}
    return write_tiny(path, meta=counts | (meta or {}), tensors=_moe_tensors(tensors or {}))


# (case, metadata changes, tensor changes by name, what the message names)
CASES: list[tuple[str, dict[str, Any], dict[str, np.ndarray | None], str]] = [
    ("used-over-count", {"llama.expert_used_count": (5, U32)}, {},
     "llama.expert_used_count is 5, more than llama.expert_count 4"),
    ("used-zero", {"llama.expert_used_count": (0, U32)}, {},
     "llama.expert_used_count is 0 (must be a positive whole number)"),
    ("count-zero", {"llama.expert_count": (0, U32)}, {},
     "llama.expert_count is 0 (must be a positive whole number)"),
    ("count-huge", {"llama.expert_count": (1 << 31, U32)}, {},
     "blk.0.ffn_gate_exps.weight stacks 4 experts where llama.expert_count says 2147483648"),
    ("stack-missing", {}, {"blk.1.ffn_up_exps.weight": None},
     "blk.1.ffn_up_exps.weight is missing"),
    ("stack-short", {}, {"blk.0.ffn_down_exps.weight": _w(EXPERTS - 1, HIDDEN, FFN)},
     "blk.0.ffn_down_exps.weight stacks 3 experts where llama.expert_count says 4"),
    ("stack-flat", {}, {"blk.0.ffn_gate_exps.weight": _w(EXPERTS * FFN, HIDDEN)},
     "blk.0.ffn_gate_exps.weight has shape [512, 64] (a stack is [experts, rows, columns])"),
    ("stack-narrow", {}, {"blk.1.ffn_up_exps.weight": _w(EXPERTS, FFN // 2, HIDDEN)},
     "blk.1.ffn_up_exps.weight has shape [4, 64, 64] where llama.expert_count 4, "
     "llama.feed_forward_length 128 and llama.embedding_length 64 make [4, 128, 64]"),
    ("down-transposed", {}, {"blk.0.ffn_down_exps.weight": _w(EXPERTS, FFN, HIDDEN)},
     "blk.0.ffn_down_exps.weight has shape [4, 128, 64]"),
    ("router-narrow", {}, {"blk.1.ffn_gate_inp.weight": _w(EXPERTS, HIDDEN // 2)},
     "blk.1.ffn_gate_inp.weight has shape [4, 32] where llama.expert_count 4"),
    ("router-extra-expert", {}, {"blk.0.ffn_gate_inp.weight": _w(EXPERTS + 1, HIDDEN)},
     "blk.0.ffn_gate_inp.weight has shape [5, 64]"),
]  # fmt: skip


def test_the_tiny_moe_file_passes(tmp_path: Path) -> None:
    lines = describe(write_moe(tmp_path / "moe.gguf"))
    assert "MixtralForCausalLM" in " ".join(lines), lines


@pytest.mark.parametrize(("name", "meta", "tensors", "names"), CASES, ids=[c[0] for c in CASES])
def test_altered_moe_file_is_refused_in_one_line_cheaply(
    tmp_path: Path, name: str, meta: dict[str, Any], tensors: dict[str, Any], names: str
) -> None:
    path = write_moe(tmp_path / f"{name}.gguf", meta, tensors)
    tracemalloc.start()
    cpu = time.process_time()
    try:
        with pytest.raises(GGUFFileError) as info:
            describe(path)
        cpu = time.process_time() - cpu
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    message = str(info.value)
    assert "\n" not in message and message.startswith(f"{path}: "), message
    assert names in message, message
    assert cpu < _MAX_CPU_S and peak < _MAX_TRACED, (cpu, peak)

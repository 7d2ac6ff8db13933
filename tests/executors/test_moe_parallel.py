"""Mixture-of-experts models on two ranks: tensor parallelism (every expert's intermediate
dimension split) and expert parallelism (whole experts per rank), greedy tokens equal to
transformers' with preemption and prefix caching on.

Each rank also holds half the attention heads, half of the shared expert's MLP (Qwen2-MoE) and
half of OLMoE's whole-projection q/k norms, whose mean of squares is completed across ranks.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from pagedllm import Engine
from tests.models.test_moe import check_against, generate, moe_paths, moe_refs  # noqa: F401

CASES = [
    ("mixtral", False),
    ("qwen2_moe", False),
    ("olmoe", False),
    ("qwen3_moe", True),
    ("mixtral", True),
]


@pytest.mark.parametrize(("name", "expert_parallel"), CASES)
def test_two_ranks_match_transformers(
    moe_paths: dict[str, Path],  # noqa: F811
    moe_refs: Any,  # noqa: F811
    name: str,
    expert_parallel: bool,
) -> None:
    ids, refs = moe_refs(name)
    engine = Engine(
        str(moe_paths[name]),
        device="cpu",
        dtype="float32",
        tensor_parallel_size=2,
        enable_expert_parallel=expert_parallel,
        block_size=8,
        num_kv_blocks=14,
        enable_prefix_caching=True,
        skip_tokenizer_init=True,
    )
    label = f"{name}/{'ep' if expert_parallel else 'tp'}2"
    try:
        for attempt in ("cold", "cached"):
            check_against(generate(engine, ids), refs, f"{label}/{attempt}")
        stats = engine.get_stats()
    finally:
        engine.shutdown()
    assert stats["num_preemptions_recompute"] + stats["num_preemptions_swap"] > 0, stats
    assert stats["prefix_cache_hits"] > 0, stats

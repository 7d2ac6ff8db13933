"""The engine on CPU with IPEX's paged attention (``attention_backend="ipex"``) vs transformers.

Greedy float32 output must equal transformers' token for token (up to genuine near-ties, see
``tests/hf_reference.py``). Every run also checks that IPEX's kernels really served the forward
passes (a spy on ``IpexPagedAttention.forward``), and the chunked-prefill, prefix-caching and
swap runs check that the path they are meant to exercise (prompt chunks over cached context,
block swaps) was taken. Needs intel_extension_for_pytorch: run with ``bash ci/xpu.sh``.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import torch

from pagedllm.backends.base import AttentionMetadata
from tests.backends.test_ipex_kernels import requires_ipex
from tests.conftest import PROMPTS
from tests.hf_reference import HFGreedy, assert_first_logprobs_close, assert_greedy_match, hf_greedy

if TYPE_CHECKING:
    from pagedllm import Engine
    from pagedllm.backends.xpu.attention import IpexPagedAttention

pytestmark = [pytest.mark.xpu, requires_ipex]

MAX_NEW = 16


@dataclass
class Spy:
    """What IPEX's forward saw over a run."""

    calls: int = 0
    prefills_with_context: int = 0
    decodes: int = 0
    windows: set[int | None] = field(default_factory=set)


@pytest.fixture
def spy(monkeypatch: pytest.MonkeyPatch) -> Iterator[Spy]:
    from pagedllm.backends.xpu.attention import IpexPagedAttention

    seen = Spy()
    real = IpexPagedAttention.forward

    def forward(
        self: IpexPagedAttention,
        query: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        *,
        sliding_window: int | None = None,
    ) -> torch.Tensor:
        seen.calls += 1
        seen.decodes += meta.num_decode_tokens
        ctx = meta.context_lens[: meta.num_prefills]
        seen.prefills_with_context += int((ctx > 0).sum())
        seen.windows.add(sliding_window)
        return real(self, query, kv_cache, meta, scale, sliding_window=sliding_window)

    monkeypatch.setattr(IpexPagedAttention, "forward", forward)
    yield seen


@pytest.fixture(scope="module")
def references(tiny_models: dict[str, Path]) -> dict[str, tuple[list[list[int]], list[HFGreedy]]]:
    from transformers import AutoTokenizer

    refs = {}
    for name, path in tiny_models.items():
        tok = AutoTokenizer.from_pretrained(str(path))
        ids = [tok.encode(p) for p in PROMPTS]
        refs[name] = (ids, hf_greedy(path, ids, MAX_NEW))
    return refs


def run_ipex(path: Path, ids: list[list[int]], **kwargs: object) -> tuple[Engine, list]:
    from pagedllm import Engine, SamplingParams

    engine = Engine(str(path), device="cpu", dtype="float32", attention_backend="ipex", **kwargs)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, logprobs=5)
    outs = engine.generate([{"prompt_token_ids": i} for i in ids], params, use_tqdm=False)
    return engine, outs


def check(outs: list, refs: list[HFGreedy], label: str) -> None:
    assert len(outs) == len(refs)
    for i, (out, ref) in enumerate(zip(outs, refs, strict=True)):
        comp = out.outputs[0]
        assert_greedy_match(comp.token_ids, ref, f"{label} prompt {i}")
        assert_first_logprobs_close(comp.logprobs[0], ref, f"{label} prompt {i}")


@pytest.mark.parametrize("model", ["llama", "qwen2", "mistral"])
@pytest.mark.parametrize("block_size", [8, 16])
def test_greedy_matches_transformers(
    tiny_models: dict[str, Path], references: dict, spy: Spy, model: str, block_size: int
) -> None:
    ids, refs = references[model]
    _, outs = run_ipex(tiny_models[model], ids, block_size=block_size)
    check(outs, refs, f"ipex {model}/bs{block_size}")
    assert spy.calls > 0 and spy.decodes > 0, f"IPEX attention was not used: {spy}"


def test_chunked_prefill_reads_cached_context(
    tiny_models: dict[str, Path], references: dict, spy: Spy
) -> None:
    ids, refs = references["llama"]
    _, outs = run_ipex(
        tiny_models["llama"],
        ids,
        block_size=8,
        enable_chunked_prefill=True,
        max_num_batched_tokens=16,
    )
    check(outs, refs, "ipex chunked prefill")
    assert spy.prefills_with_context > 0, f"no prompt chunk had cached context: {spy}"


def test_prefix_cache_hits_give_same_tokens(
    tiny_models: dict[str, Path], references: dict, spy: Spy
) -> None:
    """The second generate finds the prompts' full blocks cached and prefills only the rest."""
    from pagedllm import SamplingParams

    ids, refs = references["llama"]
    engine, outs = run_ipex(tiny_models["llama"], ids, block_size=8, enable_prefix_caching=True)
    check(outs, refs, "ipex prefix cache (cold)")
    before = spy.prefills_with_context
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, logprobs=5)
    again = engine.generate([{"prompt_token_ids": i} for i in ids], params, use_tqdm=False)
    check(again, refs, "ipex prefix cache (warm)")
    assert spy.prefills_with_context > before, f"no prefix-cache hit reached attention: {spy}"


def test_swap_preemption_gives_same_tokens(
    tiny_models: dict[str, Path], references: dict, spy: Spy
) -> None:
    ids, refs = references["llama"]
    # 9 prompts of up to ~30 tokens plus 16 new ones cannot all fit in 14 blocks of 8 tokens.
    engine, outs = run_ipex(
        tiny_models["llama"], ids, block_size=8, num_kv_blocks=14, preemption_mode="swap"
    )
    check(outs, refs, "ipex swap preemption")
    stats = engine.get_stats()
    assert stats["num_preemptions_swap"] > 0, f"no swap preemption happened: {stats}"

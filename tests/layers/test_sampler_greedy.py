"""The sampler's greedy short path (``Sampler.greedy``): a batch whose every row is plain
greedy (temperature 0, no logprobs asked, no beams, logits unmodified) skips the per-row
parameters and output lists and gives exactly the full path's tokens and log-probabilities;
any other batch (a sampled row, logprobs asked, penalties, bias, min_tokens, a grammar) takes
the full path. ``plain_greedy_params`` (what the model runner's decode step asks before calling
``Sampler.greedy`` itself) answers as the sampler decides."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from pagedllm.core.sampling_params import SamplingParams
from pagedllm.layers.sampler import (
    SampleKernel,
    Sampler,
    SamplerOutput,
    SamplingRow,
    plain_greedy_params,
)

VOCAB = 1000


def _kernels() -> list[SampleKernel | None]:
    from pagedllm.backends.registry import get_backend

    built = get_backend("cpu").kernel("sample").value
    return [None] if built is None else [None, built]


@pytest.fixture(params=_kernels(), ids=lambda k: "reference" if k is None else "kernel")
def kernel(request: pytest.FixtureRequest) -> SampleKernel | None:
    return request.param


def _full_path(sampler: Sampler, logits: torch.Tensor, rows: list[SamplingRow]) -> SamplerOutput:
    """What ``Sampler.__call__`` computed for unmodified rows before the short path."""
    from pagedllm.layers.sampler import sample_reference

    work = logits if sampler.kernel is not None else logits.float()
    sample = sampler.kernel or sample_reference
    tokens, chosen = sample(work, None, *sampler._row_params(rows, logits.shape[1]))
    return sampler._outputs(tokens, chosen, logits, rows)


def _logits(n: int, dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(n)
    logits = 3 * torch.randn(n, VOCAB, generator=g)
    logits[0, 7] = logits[0, 9] = logits[0].max() + 1  # a tie: the first maximum wins
    return logits.to(dtype)


def _spy(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """How many batches took the short path."""
    calls: list[int] = []
    real: Callable[..., SamplerOutput] = Sampler.greedy

    def greedy(self: Sampler, logits: torch.Tensor) -> SamplerOutput:
        calls.append(logits.shape[0])
        return real(self, logits)

    monkeypatch.setattr(Sampler, "greedy", greedy)
    return calls


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n", [1, 5])
def test_a_plain_greedy_batch_takes_the_short_path_with_the_full_paths_answer(
    kernel: SampleKernel | None, dtype: torch.dtype, n: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls = _spy(monkeypatch)
    sampler = Sampler(seed=3, kernel=kernel)
    logits = _logits(n, dtype)
    # top_p / top_k set with temperature 0 change nothing: still greedy.
    params = [SamplingParams(temperature=0.0, top_p=0.5 if i % 2 else 1.0) for i in range(n)]
    rows = [SamplingRow(i, p, output_len=i) for i, p in enumerate(params)]
    for _ in range(2):  # the second call reuses the cached row parameters
        out = sampler(logits, rows)
        full = _full_path(sampler, logits, rows)
        assert out == full
    assert out.token_ids[0] == 7
    assert calls == [n, n]
    assert all(plain_greedy_params(r.params, r.output_len, r.history) for r in rows)
    other = sampler(_logits(n + 1, dtype), [*rows, SamplingRow(n, params[0], 0)])
    assert other == _full_path(
        sampler, _logits(n + 1, dtype), [*rows, SamplingRow(n, params[0], 0)]
    )


@pytest.mark.parametrize(
    "odd",
    [
        SamplingParams(temperature=0.8, seed=1),  # a sampled row: the batch is mixed
        SamplingParams(temperature=0.0, logprobs=0),
        SamplingParams(temperature=0.0, logprobs=3),
        SamplingParams(temperature=0.0, logit_bias={5: 10.0}),
        SamplingParams(temperature=0.0, min_tokens=4, stop_token_ids=[1]),
        SamplingParams(temperature=0.0, repetition_penalty=1.3),
    ],
    ids=["mixed", "logprobs0", "logprobs3", "bias", "min_tokens", "penalty"],
)
def test_any_other_row_sends_the_batch_down_the_full_path(
    kernel: SampleKernel | None, odd: SamplingParams, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls = _spy(monkeypatch)
    history = ([1, 2, 3], [4]) if odd.needs_token_history else None
    rows = [
        SamplingRow(0, SamplingParams(temperature=0.0), 1),
        SamplingRow(1, odd, 1, history=history),
    ]
    out = Sampler(seed=3, kernel=kernel)(_logits(2, torch.float32), rows)
    assert calls == []
    assert not plain_greedy_params(odd, 1, history)
    if odd.logprobs is not None:
        assert out.top_logprobs[1] is not None and len(out.top_logprobs[1]) >= 1


def test_a_grammar_sends_the_batch_down_the_full_path(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = _spy(monkeypatch)
    rows = [SamplingRow(0, SamplingParams(temperature=0.0), 1)]
    mask = torch.zeros(1, (VOCAB + 31) // 32, dtype=torch.int32)
    mask[0, 0] = 1 << 3  # only token 3 allowed
    out = Sampler()(_logits(1, torch.float32), rows, token_bitmask=mask, bitmask_rows={0: 0})
    assert calls == [] and out.token_ids == [3]

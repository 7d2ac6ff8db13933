"""The C++ sampler (``csrc/sampling.cpp``) at every ISA level this processor runs, against
``draw_reference`` / ``filter_logits`` (the PyTorch definition in ``layers/sampler.py``).

The kernel works on unnormalised probabilities and sums in another order than softmax + cumsum,
so a draw may differ from the reference only where the uniform lands within rounding of a
boundary of the reference's CDF; every draw is checked to lie in the reference's CDF interval of
the token it chose (to 1e-5) and to be a token the reference keeps. Greedy picks and top-k sets
are exact.
"""

from __future__ import annotations

import pytest
import torch

from pagedllm.core.sampling_params import SamplingParams
from pagedllm.layers.sampler import Sampler, SamplingRow, draw_reference, filter_logits

CDF_SLACK = 1e-5


def params(n: int, vocab: int, g: torch.Generator, *, kind: str) -> tuple[torch.Tensor, ...]:
    """Per-row (temperature, top_k, top_p, min_p, u) for one of the filter mixes."""
    temp = 0.3 + 1.5 * torch.rand(n, generator=g)
    top_k = torch.full((n,), vocab, dtype=torch.long)
    top_p = torch.ones(n)
    min_p = torch.zeros(n)
    if kind in ("top_k", "all"):
        top_k = torch.randint(1, max(2, vocab // 2), (n,), generator=g)
    if kind in ("top_p", "all"):
        top_p = 0.05 + 0.9 * torch.rand(n, generator=g)
    if kind in ("min_p", "all"):
        min_p = 0.2 * torch.rand(n, generator=g)
    if kind == "greedy":
        temp = torch.zeros(n)
    if kind == "mixed":  # every other row greedy
        temp[::2] = 0.0
    u = torch.rand(n, generator=g)
    return temp, top_k, top_p, min_p, u


def check_draws(tokens: torch.Tensor, logits: torch.Tensor, p: tuple[torch.Tensor, ...]) -> None:
    """Each kernel token is the reference's draw up to rounding at a CDF boundary."""
    temp, top_k, top_p, min_p, u = p
    ref = draw_reference(logits, *p)
    x = logits.float()
    for i in range(logits.shape[0]):
        t = int(tokens[i])
        if temp[i] == 0:
            assert t == int(ref[i]), f"row {i}: greedy {t} != {int(ref[i])}"
            continue
        if t == int(ref[i]):
            continue
        row = filter_logits(
            (x[i : i + 1] / temp[i]), top_k[i : i + 1], top_p[i : i + 1], min_p[i : i + 1]
        )
        cdf = row.softmax(-1).cumsum(-1)[0].double()
        cdf = cdf / cdf[-1]
        lo = float(cdf[t - 1]) if t > 0 else 0.0
        assert torch.isfinite(row[0, t]), f"row {i}: token {t} is outside the reference's set"
        assert lo - CDF_SLACK <= float(u[i]) <= float(cdf[t]) + CDF_SLACK, (
            f"row {i}: u={float(u[i])} outside token {t}'s interval [{lo}, {float(cdf[t])}]"
        )


KINDS = ["greedy", "mixed", "temperature", "top_k", "top_p", "min_p", "all"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("vocab", [1, 7, 1000, 1025, 5003])
def test_draws_match_reference(ops, dtype: torch.dtype, kind: str, vocab: int) -> None:
    g = torch.Generator().manual_seed(vocab * 31 + len(kind))
    n = 24
    logits = (3 * torch.randn(n, vocab, generator=g)).to(dtype)
    p = params(n, vocab, g, kind=kind)
    tokens, logprobs = ops.sample_rows(logits, None, *p)
    assert tokens.dtype == torch.long and tokens.shape == (n,)
    check_draws(tokens, logits, p)
    want = torch.log_softmax(logits.float(), -1).gather(1, tokens[:, None])[:, 0]
    torch.testing.assert_close(logprobs, want, rtol=0, atol=2e-5)


def test_greedy_takes_the_first_maximum_and_skips_masked(ops) -> None:
    logits = torch.full((4, 40), -1.0)
    logits[0, [3, 9, 30]] = 5.0  # ties: the first
    logits[1] = float("-inf")
    logits[1, 17] = 0.0
    logits[2] = float("-inf")  # nothing finite: index 0, as torch.argmax
    logits[3, 39] = 2.0  # the last column
    p = params(4, 40, torch.Generator().manual_seed(0), kind="greedy")
    tokens, logprobs = ops.sample_rows(logits, None, *p)
    assert tokens.tolist() == [3, 17, 0, 39]
    assert logprobs[1].item() == 0.0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("vocab", [1, 7, 1000, 1025, 5003, 49152])
def test_plain_greedy_rows_equal_the_general_path_bit_for_bit(ops, dtype, vocab: int) -> None:
    """Greedy rows without separate raw logits take a fused pass (load and maximum together,
    the maximum not recomputed); given the same tensor as ``raw`` they take the general path
    (first_max, then logprob_of on the reloaded row). Tokens and log-probabilities must be
    equal exactly, with ties, masked rows, NaN and the last column among them."""
    g = torch.Generator().manual_seed(vocab)
    n = 12
    logits = (4 * torch.randn(n, vocab, generator=g)).to(dtype)
    logits[0, : min(vocab, 3)] = 50.0  # a tie at the front
    logits[1] = float("-inf")  # nothing finite
    logits[2, vocab // 2] = float("nan")
    logits[3, vocab - 1] = 60.0  # the last column
    logits[4] = float("-inf")
    logits[4, vocab - 1] = 0.0
    logits[5, :: max(1, vocab // 5)] = 40.0  # ties spread over the blocks
    p = params(n, vocab, g, kind="greedy")
    fused = ops.sample_rows(logits, None, *p)
    general = ops.sample_rows(logits, logits, *p)
    assert fused[0].tolist() == general[0].tolist()
    assert torch.equal(fused[1].isnan(), general[1].isnan())
    finite = ~general[1].isnan()
    assert torch.equal(fused[1][finite], general[1][finite])


def test_top_k_keeps_ties_at_the_kth_value(ops) -> None:
    """bfloat16 logits tie often; every token equal to the k-th largest stays (transformers)."""
    vocab, n = 64, 4000
    row = torch.zeros(vocab)
    row[[5, 6, 7, 8]] = 2.0  # the 2nd..5th largest are equal
    row[0] = 3.0
    logits = row.expand(n, vocab).contiguous()
    temp = torch.ones(n)
    top_k = torch.full((n,), 2, dtype=torch.long)
    u = torch.linspace(0, 1 - 1e-6, n)
    tokens, _ = ops.sample_rows(logits, None, temp, top_k, torch.ones(n), torch.zeros(n), u)
    assert set(tokens.tolist()) == {0, 5, 6, 7, 8}
    kept = torch.isfinite(filter_logits(logits[:1], top_k[:1], torch.ones(1), torch.zeros(1)))
    assert kept[0].nonzero().flatten().tolist() == [0, 5, 6, 7, 8]


@pytest.mark.parametrize("kind", ["top_p", "min_p", "all"])
def test_kept_set_equals_reference(ops, kind: str) -> None:
    """A fine sweep of u over one row reaches every token the reference keeps, and no other."""
    vocab, n = 48, 6000
    g = torch.Generator().manual_seed(7)
    row = 1.5 * torch.randn(vocab, generator=g)
    logits = row.expand(n, vocab).contiguous()
    top_k = torch.full((n,), 30 if kind == "all" else vocab, dtype=torch.long)
    top_p = torch.full((n,), 0.8 if kind != "min_p" else 1.0)
    min_p = torch.full((n,), 0.05 if kind != "top_p" else 0.0)
    temp = torch.full((n,), 0.9)
    u = (torch.arange(n) + 0.5) / n
    tokens, _ = ops.sample_rows(logits, None, temp, top_k, top_p, min_p, u)
    ref = filter_logits(logits[:1] / 0.9, top_k[:1], top_p[:1], min_p[:1])
    probs = ref.softmax(-1)[0]
    kept = set(torch.isfinite(ref[0]).nonzero().flatten().tolist())
    drawn = set(tokens.tolist())
    assert drawn <= kept
    assert {t for t in kept if probs[t] > 2.0 / n} <= drawn
    check_draws(tokens, logits, (temp, top_k, top_p, min_p, u))


def test_draws_follow_the_filtered_distribution(ops) -> None:
    """Frequencies over many uniforms match the reference's filtered probabilities."""
    vocab, n = 20, 40000
    g = torch.Generator().manual_seed(3)
    row = torch.randn(vocab, generator=g)
    logits = row.expand(n, vocab).contiguous()
    temp, top_p = torch.full((n,), 0.7), torch.full((n,), 0.9)
    top_k, min_p = torch.full((n,), vocab, dtype=torch.long), torch.zeros(n)
    u = torch.rand(n, generator=g)
    tokens, _ = ops.sample_rows(logits, None, temp, top_k, top_p, min_p, u)
    probs = filter_logits(logits[:1] / 0.7, top_k[:1], top_p[:1], min_p[:1]).softmax(-1)[0]
    freq = torch.bincount(tokens, minlength=vocab).double() / n
    sigma = (probs.double() * (1 - probs.double()) / n).sqrt()
    assert ((freq - probs.double()).abs() <= 5 * sigma + 1e-9).all()


def test_logprobs_come_from_the_raw_row(ops) -> None:
    """With penalties or a bias applied, the draw reads the changed logits and the reported
    log-probability the model's own distribution."""
    g = torch.Generator().manual_seed(11)
    raw = torch.randn(6, 300, generator=g).to(torch.bfloat16)
    changed = raw.float()
    changed[:, 17] += 50.0  # a bias no greedy row can ignore
    p = params(6, 300, g, kind="mixed")
    tokens, logprobs = ops.sample_rows(changed, raw, *p)
    assert all(tokens[i] == 17 for i in range(0, 6, 2))
    want = torch.log_softmax(raw.float(), -1).gather(1, tokens[:, None])[:, 0]
    torch.testing.assert_close(logprobs, want, rtol=0, atol=2e-5)


def test_sampler_with_kernel_matches_reference_sampler(ops) -> None:
    """The Sampler gives the same tokens through the kernel as through draw_reference, rows
    with penalties, bias, seeds and logprobs included."""
    vocab = 500
    g = torch.Generator().manual_seed(5)
    logits = 2 * torch.randn(8, vocab, generator=g)
    plist = [
        SamplingParams(temperature=0),
        SamplingParams(temperature=0.8, top_p=0.9, seed=4),
        SamplingParams(temperature=1.0, top_k=20, logprobs=3),
        SamplingParams(temperature=0.5, min_p=0.1, logit_bias={3: 2.0}),
        SamplingParams(temperature=0, repetition_penalty=1.3, logprobs=0),
        SamplingParams(temperature=1.2, presence_penalty=0.5, seed=9),
        SamplingParams(temperature=0.7),
        SamplingParams(temperature=0, min_tokens=4, stop_token_ids=[int(logits[7].argmax())]),
    ]
    history = ([1, 2, 3], [4, 5])
    rows = [
        SamplingRow(i, p, output_len=2, history=history if p.needs_token_history else None)
        for i, p in enumerate(plist)
    ]

    def kernel(*args):
        return ops.sample_rows(*args)

    with_kernel = Sampler(seed=1, kernel=kernel)(logits.clone(), rows)
    reference = Sampler(seed=1)(logits.clone(), rows)
    assert with_kernel.token_ids == reference.token_ids
    torch.testing.assert_close(
        torch.tensor(with_kernel.logprobs), torch.tensor(reference.logprobs), rtol=0, atol=2e-5
    )
    assert with_kernel.top_logprobs[2] is not None and len(with_kernel.top_logprobs[2]) >= 3
    assert with_kernel.top_logprobs[4] == {with_kernel.token_ids[4]: with_kernel.logprobs[4]}
    assert with_kernel.token_ids[7] != int(logits[7].argmax())  # banned under min_tokens


def test_bad_arguments_are_refused(ops) -> None:
    logits = torch.randn(3, 10)
    p = params(3, 10, torch.Generator().manual_seed(0), kind="temperature")
    with pytest.raises(RuntimeError, match="top_k"):
        ops.sample_rows(logits, None, p[0], p[1].int(), *p[2:])
    with pytest.raises(RuntimeError, match="raw must have the shape"):
        ops.sample_rows(logits, torch.randn(3, 11), *p)
    with pytest.raises(RuntimeError, match="unit inner stride"):
        ops.sample_rows(logits.t().contiguous().t(), None, *p)

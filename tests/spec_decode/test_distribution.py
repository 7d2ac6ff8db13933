"""Sampled requests under speculation keep the target's distribution.

A target over 8 tokens: the exact distribution of the 2nd and 3rd generated tokens (where the
proposals are verified) is computed with transformers on the same weights; thousands of seeded
requests must land within sampling noise of it in total variation. The same test with the
acceptance rule replaced by always-accept must fail, so it can.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch

import pagedllm.spec_decode.verify as verify
from pagedllm import Engine, SamplingParams

PROMPT = [3, 4, 5, 6, 3, 4, 5, 6, 3, 4]  # repeats itself: n-gram lookups hit
VOCAB = 8
NUM_SAMPLES = 2000


def exact_joint(target: Path) -> torch.Tensor:  # [VOCAB, VOCAB] p(t2, t3)
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(target), dtype=torch.float32).eval()
    with torch.no_grad():

        def next_probs(prefixes: list[list[int]]) -> torch.Tensor:  # [len(prefixes), VOCAB]
            return model(torch.tensor(prefixes)).logits[:, -1].float().softmax(-1)

        p1 = next_probs([PROMPT])[0]
        p2 = next_probs([[*PROMPT, a] for a in range(VOCAB)])  # [t1, t2]
        p3 = next_probs([[*PROMPT, a, b] for a in range(VOCAB) for b in range(VOCAB)])
    joint = p1[:, None, None] * p2[:, :, None] * p3.view(VOCAB, VOCAB, VOCAB)
    return joint.sum(0).double()


def sample_joint(target: Path, spec: dict[str, Any]) -> tuple[torch.Tensor, dict[str, float]]:
    engine = Engine(
        str(target),
        device="cpu",
        skip_tokenizer_init=True,
        num_kv_blocks=2048,
        block_size=4,
        speculative_config=spec,
    )
    params = [
        SamplingParams(temperature=1.0, max_tokens=4, ignore_eos=True, seed=i)
        for i in range(NUM_SAMPLES)
    ]
    outs = engine.generate([list(PROMPT)] * NUM_SAMPLES, params, use_tqdm=False)
    counts = torch.zeros(VOCAB, VOCAB, dtype=torch.float64)
    for o in outs:
        t = o.outputs[0].token_ids
        counts[t[1], t[2]] += 1
    return counts / NUM_SAMPLES, engine.get_stats()


def total_variation(p: torch.Tensor, q: torch.Tensor) -> float:
    return 0.5 * float((p - q).abs().sum())


def noise_level(p: torch.Tensor) -> float:
    """Expected TV of an empirical distribution of NUM_SAMPLES draws from ``p`` (normal approx.)."""
    return 0.5 * float(torch.sqrt(2 * p * (1 - p) / (math.pi * NUM_SAMPLES)).sum())


@pytest.fixture(scope="module")
def exact(small_vocab_paths: tuple[Path, Path]) -> torch.Tensor:
    return exact_joint(small_vocab_paths[0])


def specs(draft: Path) -> dict[str, dict[str, Any]]:
    return {
        "ngram": {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4},
        "draft_model": {"method": "draft_model", "model": str(draft), "num_speculative_tokens": 3},
    }


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_speculative_samples_follow_the_target(
    small_vocab_paths: tuple[Path, Path], exact: torch.Tensor, method: str
) -> None:
    target, draft = small_vocab_paths
    empirical, stats = sample_joint(target, specs(draft)[method])
    assert stats["spec_decode_num_draft_tokens"] > NUM_SAMPLES // 2  # most requests speculated
    assert 0.05 < stats["spec_decode_draft_acceptance_rate"] < 0.95  # both outcomes happen
    tv, noise = total_variation(empirical, exact), noise_level(exact)
    assert tv < 1.6 * noise, f"TV {tv:.4f} vs expected sampling noise {noise:.4f}"


def test_always_accept_is_caught(
    small_vocab_paths: tuple[Path, Path], exact: torch.Tensor, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(verify, "accepted_prefix", lambda drawn, proposals: len(proposals))
    target, draft = small_vocab_paths
    empirical, _ = sample_joint(target, specs(draft)["draft_model"])
    tv, noise = total_variation(empirical, exact), noise_level(exact)
    assert tv > 4 * noise, f"always-accept went unnoticed: TV {tv:.4f}, noise {noise:.4f}"

"""Speculation changes speed, never tokens: greedy (and seeded) outputs equal plain decoding's.

Plain decoding is itself checked against transformers (tests/models); here the greedy runs are
also compared with transformers' own generate on the same weights.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from pagedllm import Engine, SamplingParams
from tests.conftest import PROMPTS
from tests.hf_reference import assert_greedy_match, hf_greedy

# Code-editing style prompts whose continuation repeats their own spans (n-gram hits).
REPETITIVE = [
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(",
    "import os\nimport sys\n\nprint(os.getcwd(), sys.argv)\nimport os\nimport sys\n\nprint(",
]
ALL_PROMPTS = PROMPTS + REPETITIVE
GREEDY = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)

SCENARIOS: dict[str, dict[str, Any]] = {
    "roomy": {"num_kv_blocks": 256},
    # Tight cache: preemption by recompute happens mid-run,
    # with prefix caching: only full blocks of accepted tokens may become cache hits.
    "preempt": {"num_kv_blocks": 40, "max_num_seqs": 8, "enable_prefix_caching": True},
    "chunked": {"enable_chunked_prefill": True, "max_num_batched_tokens": 24, "num_kv_blocks": 48},
}


def run(path: Path, prompts: list[str], params: Any, **kwargs: Any) -> tuple[Engine, list[Any]]:
    engine = Engine(str(path), device="cpu", block_size=4, **kwargs)
    return engine, engine.generate(prompts, params, use_tqdm=False)


def assert_pool_whole(engine: Engine) -> None:
    bm = engine.block_manager
    assert bm.get_num_free_device_blocks() == bm.num_device_blocks, "device blocks leaked"
    assert bm.get_num_free_host_blocks() == bm.num_host_blocks, "host blocks leaked"


def spec_config(method: str, k: int, draft: Path) -> dict[str, Any]:
    if method == "ngram":
        return {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": 3}
    return {"method": "draft_model", "model": str(draft), "num_speculative_tokens": k}


@pytest.fixture(scope="module")
def baseline(llama_path: Path) -> dict[str, list[list[int]]]:
    out = {}
    for name, kwargs in SCENARIOS.items():
        engine, outs = run(llama_path, ALL_PROMPTS, GREEDY, **kwargs)
        out[name] = [o.outputs[0].token_ids for o in outs]
        assert_pool_whole(engine)
    return out


@pytest.fixture(scope="module")
def hf_reference(llama_path: Path) -> list[Any]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(llama_path))
    return hf_greedy(llama_path, [tok.encode(p) for p in ALL_PROMPTS], GREEDY.max_tokens or 0)


@pytest.mark.parametrize("scenario", list(SCENARIOS))
@pytest.mark.parametrize("k", [1, 3, 5])
@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_greedy_equals_plain_decoding(
    llama_path: Path,
    draft_path: Path,
    baseline: dict[str, list[list[int]]],
    hf_reference: list[Any],
    method: str,
    k: int,
    scenario: str,
) -> None:
    kwargs = SCENARIOS[scenario]
    engine, outs = run(
        llama_path,
        ALL_PROMPTS,
        GREEDY,
        speculative_config=spec_config(method, k, draft_path),
        **kwargs,
    )
    got = [o.outputs[0].token_ids for o in outs]
    assert got == baseline[scenario]
    for i, (ours, ref) in enumerate(zip(got, hf_reference, strict=True)):
        assert_greedy_match(ours, ref, f"{method} k={k} {scenario} prompt {i}")
    assert_pool_whole(engine)
    stats = engine.get_stats()
    assert stats["spec_decode_num_draft_tokens"] > 0
    assert stats["spec_decode_num_accepted_tokens"] > 0
    if scenario == "preempt":
        assert stats["num_preemptions_total"] > 0
    if scenario == "chunked":
        assert stats["chunked_prefill_steps"] > 0


def test_same_weights_draft_is_always_accepted(llama_path: Path) -> None:
    spec = {"method": "draft_model", "model": str(llama_path), "num_speculative_tokens": 4}
    engine, _ = run(llama_path, ALL_PROMPTS, GREEDY, num_kv_blocks=256, speculative_config=spec)
    stats = engine.get_stats()
    assert stats["spec_decode_draft_acceptance_rate"] == 1.0
    assert stats["spec_decode_mean_accepted_length"] > 4.0


# Features that act per output position, each landing inside accepted runs.
FEATURES: dict[str, SamplingParams] = {
    "penalties": SamplingParams(
        temperature=0.0,
        max_tokens=16,
        ignore_eos=True,
        repetition_penalty=1.2,
        presence_penalty=0.3,
    ),
    "logprobs": SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=3),
    "seeded-n3": SamplingParams(
        temperature=0.8, top_k=20, n=3, seed=1234, max_tokens=12, ignore_eos=True
    ),
    "max-tokens-7": SamplingParams(temperature=0.0, max_tokens=7, ignore_eos=True),
}


@pytest.mark.parametrize("feature", list(FEATURES))
@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_per_position_features_match(
    llama_path: Path, draft_path: Path, method: str, feature: str
) -> None:
    params = FEATURES[feature]
    common = {"num_kv_blocks": 64, "max_num_seqs": 16}
    _, plain = run(llama_path, ALL_PROMPTS, params, **common)
    engine, spec = run(
        llama_path,
        ALL_PROMPTS,
        params,
        speculative_config=spec_config(method, 4, draft_path),
        **common,
    )
    for a, b in zip(plain, spec, strict=True):
        assert [o.token_ids for o in a.outputs] == [o.token_ids for o in b.outputs]
        assert [o.text for o in a.outputs] == [o.text for o in b.outputs]
        for x, y in zip(a.outputs, b.outputs, strict=True):
            assert x.cumulative_logprob == pytest.approx(y.cumulative_logprob, abs=1e-4)
            if params.logprobs is not None:
                assert x.logprobs is not None and y.logprobs is not None
                assert len(x.logprobs) == len(y.logprobs) == len(x.token_ids)
                for lx, ly in zip(x.logprobs, y.logprobs, strict=True):
                    assert lx.keys() == ly.keys()
                    assert list(lx.values()) == pytest.approx(list(ly.values()), abs=1e-4)
    assert engine.get_stats()["spec_decode_num_accepted_tokens"] > 0
    assert_pool_whole(engine)


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_parallel_samples_under_swap_preemption(
    llama_path: Path, draft_path: Path, method: str
) -> None:
    """n = 3 seeded samples per prompt in a cache so tight that groups are swapped out."""
    params = FEATURES["seeded-n3"]
    common = {"num_kv_blocks": 48, "preemption_mode": "swap", "swap_space": 0.01}
    _, plain = run(llama_path, ALL_PROMPTS, params, **common)
    engine, spec = run(
        llama_path,
        ALL_PROMPTS,
        params,
        speculative_config=spec_config(method, 3, draft_path),
        **common,
    )
    for a, b in zip(plain, spec, strict=True):
        assert [o.token_ids for o in a.outputs] == [o.token_ids for o in b.outputs]
    assert engine.get_stats()["num_preemptions_swap"] > 0
    assert engine.get_stats()["spec_decode_num_accepted_tokens"] > 0
    assert_pool_whole(engine)


def test_stops_inside_an_accepted_run(llama_path: Path) -> None:
    """A stop token id or stop string in the middle of a run ends the output exactly there."""
    spec = {"method": "draft_model", "model": str(llama_path), "num_speculative_tokens": 5}
    _, plain = run(llama_path, ALL_PROMPTS, GREEDY, num_kv_blocks=256)
    for i, out in enumerate(plain):
        ids, text = out.outputs[0].token_ids, out.outputs[0].text
        stop_id = ids[7]
        stop_str = text[len(text) // 2 : len(text) // 2 + 3]
        variants = [
            GREEDY.clone(stop_token_ids=[stop_id]),
            GREEDY.clone(stop_token_ids=[stop_id], min_tokens=9),
            GREEDY.clone(stop=[stop_str]) if stop_str.strip() else GREEDY,
        ]
        for params in variants:
            _, [a] = run(llama_path, [ALL_PROMPTS[i]], params, num_kv_blocks=64)
            engine, [b] = run(
                llama_path, [ALL_PROMPTS[i]], params, num_kv_blocks=64, speculative_config=spec
            )
            assert a.outputs[0].token_ids == b.outputs[0].token_ids, params
            assert a.outputs[0].text == b.outputs[0].text
            assert a.outputs[0].finish_reason == b.outputs[0].finish_reason
            assert a.outputs[0].stop_reason == b.outputs[0].stop_reason
            # What a stop dropped from an accepted run was never generated, as far as the
            # counters (and /metrics) are concerned.
            assert engine.counters.generation_tokens == len(b.outputs[0].token_ids)
            assert_pool_whole(engine)
        if i >= 2:
            break


def test_mixed_batch_with_per_request_opt_out(llama_path: Path, draft_path: Path) -> None:
    """Speculating and plain sequences share steps; a request may opt out."""
    spec = spec_config("draft_model", 3, draft_path)
    params = [GREEDY.clone(allow_speculation=i % 2 == 0) for i in range(len(ALL_PROMPTS))]
    _, plain = run(llama_path, ALL_PROMPTS, GREEDY, num_kv_blocks=128)
    engine, outs = run(llama_path, ALL_PROMPTS, params, num_kv_blocks=128, speculative_config=spec)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in plain]
    assert_pool_whole(engine)


def test_beam_search_falls_back_to_plain_decoding(llama_path: Path) -> None:
    params = SamplingParams(use_beam_search=True, best_of=3, n=2, temperature=0.0, max_tokens=8)
    spec = {"method": "ngram", "num_speculative_tokens": 3}
    _, plain = run(llama_path, PROMPTS[:3], params, num_kv_blocks=128)
    engine, outs = run(llama_path, PROMPTS[:3], params, num_kv_blocks=128, speculative_config=spec)
    assert [[c.token_ids for c in o.outputs] for o in outs] == [
        [c.token_ids for c in o.outputs] for o in plain
    ]
    assert engine.get_stats()["spec_decode_num_draft_tokens"] == 0
    assert_pool_whole(engine)

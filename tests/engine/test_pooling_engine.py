"""Pooling requests on the engine: a causal LM served as a decoder embedder (last-token pooling).

Embeddings equal transformers' last hidden state of each prompt's last token (normalised),
requests finish after their prefill with every block freed, shared prefixes hit the prefix
cache, and bad input is a ValueError naming the field with nothing queued.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pagedllm import Engine, SamplingParams
from pagedllm.core.pooling_params import PoolingParams
from tests.conftest import PROMPTS

TEXTS = [p for p in PROMPTS if p.strip()]


@pytest.fixture(scope="module")
def embedder(llama_path: Path) -> Engine:
    return Engine(
        str(llama_path),
        device="cpu",
        task="embed",
        block_size=8,
        num_kv_blocks=64,
        max_model_len=128,
        enable_prefix_caching=True,
    )


def all_free(engine: Engine) -> bool:
    bm = engine.block_manager
    return bm.get_num_free_device_blocks() == bm.num_device_blocks


def reference(path: Path, texts: list[str]) -> torch.Tensor:
    """transformers' final hidden state (after the final norm) of each text's last token."""
    from transformers import AutoModel, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(path))
    model = AutoModel.from_pretrained(str(path), dtype=torch.float32).eval()
    rows = []
    with torch.no_grad():
        for text in texts:
            ids = torch.tensor([tok.encode(text)])
            rows.append(model(input_ids=ids).last_hidden_state[0, -1])
    return torch.nn.functional.normalize(torch.stack(rows), dim=-1)


def test_decoder_embeddings_match_transformers(embedder: Engine, llama_path: Path) -> None:
    outs = embedder.embed(TEXTS)
    got = torch.tensor([o.embedding for o in outs])
    torch.testing.assert_close(got, reference(llama_path, TEXTS), atol=2e-5, rtol=1e-4)
    assert torch.allclose(got.norm(dim=-1), torch.ones(len(TEXTS)), atol=1e-5)
    assert all_free(embedder)


def test_dimensions_truncate_then_normalise(embedder: Engine) -> None:
    raw = torch.tensor(embedder.embed("The quick brown fox", normalize=False)[0].embedding)
    short = torch.tensor(embedder.embed("The quick brown fox", dimensions=16)[0].embedding)
    assert short.shape == (16,)
    torch.testing.assert_close(short, torch.nn.functional.normalize(raw[:16], dim=0))
    assert raw.norm() > 1.5  # not normalised when asked not to be


def test_shared_prefix_hits_the_cache_and_matches(embedder: Engine) -> None:
    prefix = "The lazy dog sleeps while the quick brown fox jumps over it again and again, "
    first = embedder.embed(prefix + "one")[0].embedding
    hits0 = embedder.get_stats()["prefix_cache_hits"]
    second = embedder.embed([prefix + "two", prefix + "one"])
    assert embedder.get_stats()["prefix_cache_hits"] > hits0
    torch.testing.assert_close(torch.tensor(second[1].embedding), torch.tensor(first))
    assert all_free(embedder)


def test_token_ids_and_truncation(embedder: Engine) -> None:
    ids = embedder.get_tokenizer().encode("Paged attention")
    by_ids = embedder.embed([ids])[0].embedding
    by_text = embedder.embed("Paged attention")[0].embedding
    torch.testing.assert_close(torch.tensor(by_ids), torch.tensor(by_text))
    long_ids = [5] * 300
    with pytest.raises(ValueError, match="^input: 300 tokens"):
        embedder.embed([long_ids])
    out = embedder.embed([long_ids], truncate_prompt_tokens=100)[0]
    assert len(out.prompt_token_ids) == 100
    assert all_free(embedder)


@pytest.mark.parametrize(
    ("inputs", "field"),
    [
        ([], "input"),
        ([""], "input"),
        (["ok"] * 2049, "input"),
        ([[10**6]], "prompt_token_ids"),
    ],
)
def test_bad_input_names_the_field(embedder: Engine, inputs: list, field: str) -> None:
    with pytest.raises(ValueError, match=f"^{field}:"):
        embedder.embed(inputs)
    assert not embedder.has_unfinished_requests()
    assert all_free(embedder)


def test_params_checked() -> None:
    with pytest.raises(ValueError, match="^dimensions:"):
        PoolingParams(dimensions=0)
    with pytest.raises(ValueError, match="^task:"):
        PoolingParams(task="generate")
    with pytest.raises(ValueError, match="^truncate_prompt_tokens:"):
        PoolingParams(truncate_prompt_tokens=-1)


def test_generation_refused_on_an_embedding_engine(embedder: Engine) -> None:
    with pytest.raises(ValueError, match="^task: this model serves embed"):
        embedder.generate(["A"], SamplingParams(max_tokens=2), use_tqdm=False)


def test_bi_encoder_score_is_the_cosine(embedder: Engine) -> None:
    docs = ["The quick brown fox", "Paged attention"]
    scores = embedder.score("fox", docs)
    vecs = torch.tensor([o.embedding for o in embedder.embed(["fox", *docs])])
    assert [s.score for s in scores] == pytest.approx((vecs[1:] @ vecs[0]).tolist(), abs=1e-5)


def test_generative_engine_refuses_pooling(llama_path: Path) -> None:
    engine = Engine(str(llama_path), device="cpu", block_size=8, num_kv_blocks=32)
    with pytest.raises(ValueError, match="^task: this model generates text"):
        engine.embed("A")
    with pytest.raises(ValueError, match="^task:"):
        Engine(str(llama_path), device="cpu", task="score", num_kv_blocks=32)


def test_dimensions_past_the_width_refused(embedder: Engine) -> None:
    with pytest.raises(ValueError, match="^dimensions: at most 64"):
        embedder.embed("A", dimensions=65)
    assert all_free(embedder)


def test_mean_pooling_override_runs_whole_prompts(llama_path: Path) -> None:
    engine = Engine(
        str(llama_path),
        device="cpu",
        task="embed",
        pooling="mean",
        num_kv_blocks=64,
        block_size=8,
        max_num_batched_tokens=64,
        enable_chunked_prefill=True,
    )
    from transformers import AutoModel, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(llama_path))
    model = AutoModel.from_pretrained(str(llama_path), dtype=torch.float32).eval()
    text = TEXTS[-1]
    with torch.no_grad():
        want = model(input_ids=torch.tensor([tok.encode(text)])).last_hidden_state[0].mean(0)
    got = torch.tensor(engine.embed(text)[0].embedding)
    torch.testing.assert_close(
        got, torch.nn.functional.normalize(want, dim=0), atol=2e-5, rtol=1e-4
    )
    with pytest.raises(ValueError, match="^input: 100 tokens, more than one step"):
        engine.embed([[5] * 100])
    assert all_free(engine)


def test_speculation_refused_on_a_pooling_model(llama_path: Path) -> None:
    spec = '{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 2}'
    with pytest.raises(ValueError, match="^speculative_config: a pooling model"):
        Engine(
            str(llama_path), device="cpu", task="embed", num_kv_blocks=32, speculative_config=spec
        )


def test_data_parallel_replicas_embed_and_score(llama_path: Path, embedder: Engine) -> None:
    engine = Engine(
        str(llama_path),
        "cpu",
        task="embed",
        data_parallel_size=2,
        distributed_executor_backend="mp",
        block_size=8,
        num_kv_blocks=64,
        max_model_len=128,
    )
    try:
        got = torch.tensor([o.embedding for o in engine.embed(TEXTS)])
        want = torch.tensor([o.embedding for o in embedder.embed(TEXTS)])
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        scores = [s.score for s in engine.score(TEXTS[0], TEXTS[1:3])]
        assert scores == pytest.approx((want[1:3] @ want[0]).tolist(), abs=1e-5)
        with pytest.raises(ValueError, match="^input:"):
            engine.embed([])
    finally:
        engine.shutdown()

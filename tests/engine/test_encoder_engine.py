"""Bidirectional encoders through the engine: a BERT embedder against sentence-transformers'
``encode`` (float32 and bfloat16, short and long texts batched together, no KV block reserved), and
a BERT cross-encoder's scores against transformers' logits, offline and through /v1/rerank."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from pagedllm import Engine
from tests.engine.pooling_models import WORDS, build_cross_encoder, build_st_bert

pytest.importorskip("sentence_transformers")


def texts(n: int) -> list[str]:
    rng = np.random.default_rng(0)
    lens = [3, 90, 1, 40, 7, 110, 15, 2][:n]
    return [" ".join(rng.choice(WORDS, size=k)) for k in lens]


@pytest.fixture(scope="module")
def st_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_st_bert(tmp_path_factory.mktemp("st-bert"))


@pytest.fixture(scope="module")
def cross_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_cross_encoder(tmp_path_factory.mktemp("cross"))


def st_encode(folder: Path, batch: list[str], dtype: torch.dtype) -> np.ndarray:
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(str(folder), device="cpu", model_kwargs={"torch_dtype": dtype})
    return model.encode(batch, normalize_embeddings=True, convert_to_numpy=True).astype("f8")


@pytest.mark.parametrize(("dtype", "bound"), [("float32", 0.9999), ("bfloat16", 0.999)])
def test_bert_embeddings_match_sentence_transformers(
    st_folder: Path, dtype: str, bound: float
) -> None:
    engine = Engine(str(st_folder), device="cpu", dtype=dtype, max_num_batched_tokens=1024)
    assert engine.pooling.task == "embed" and not engine.pooling.uses_kv_cache
    batch = texts(8)
    got = np.asarray([o.embedding for o in engine.embed(batch)], dtype="f8")
    want = st_encode(st_folder, batch, getattr(torch, dtype))
    cos = (got * want).sum(1) / np.linalg.norm(got, axis=1) / np.linalg.norm(want, axis=1)
    assert cos.min() >= bound, cos
    bm = engine.block_manager
    assert bm.num_device_blocks == 0  # an encoder keeps no KV cache: none is reserved
    with pytest.raises(ValueError, match="^input: 2000 tokens"):
        engine.embed([[5] * 2000])


def reference_scores(folder: Path, query: str, docs: list[str]) -> list[float]:
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(folder))
    model = AutoModelForSequenceClassification.from_pretrained(str(folder)).eval()
    with torch.no_grad():
        enc = tok([query] * len(docs), docs, padding=True, return_tensors="pt")
        return torch.sigmoid(model(**enc).logits[:, 0]).tolist()


def test_cross_encoder_scores_match_transformers(cross_folder: Path) -> None:
    engine = Engine(str(cross_folder), device="cpu")
    assert engine.pooling.task == "score"
    docs = texts(6)
    got = [s.score for s in engine.score("quick fox cache", docs)]
    want = reference_scores(cross_folder, "quick fox cache", docs)
    np.testing.assert_allclose(got, want, atol=1e-5)
    with pytest.raises(ValueError, match="^task:"):
        engine.embed("a fox")


def test_whole_prompts_longer_than_the_chunk_budget_run(tmp_path: Path) -> None:
    """Chunked prefill's default step budget (256 tokens) is below a 512-position encoder's
    longest input, which must run in one step: the engine raises the budget to the model's
    context instead of refusing inputs the model takes."""
    folder = build_cross_encoder(tmp_path / "long", max_position_embeddings=512)
    engine = Engine(str(folder), device="cpu")
    assert engine.config.scheduler.token_budget >= 512
    words = " ".join(WORDS[i % len(WORDS)] for i in range(400))
    got = engine.score("quick fox cache", [words])[0].score
    want = reference_scores(folder, "quick fox cache", [words])[0]
    assert got == pytest.approx(want, abs=1e-5)
    explicit = Engine(str(folder), device="cpu", max_num_batched_tokens=300)
    with pytest.raises(ValueError, match="max_num_batched_tokens=300"):
        explicit.score("quick fox cache", [words])


def test_rerank_route_orders_like_transformers(cross_folder: Path) -> None:
    from fastapi.testclient import TestClient

    from pagedllm.engine.async_engine import AsyncEngine
    from pagedllm.entrypoints.openai.api_server import build_app, model_info

    engine = AsyncEngine.from_engine_args(str(cross_folder), "cpu", log_stats_interval=None)
    app = build_app(engine, model_info(engine, ["rerank"]))
    docs = texts(6)
    want = reference_scores(cross_folder, "lazy dog", docs)
    with TestClient(app) as client:
        body = {"query": "lazy dog", "documents": docs, "top_n": 4}
        r = client.post("/v1/rerank", json=body)
        assert r.status_code == 200, r.text
        results = r.json()["results"]
        assert [x["index"] for x in results] == list(np.argsort(want)[::-1][:4])
        for x in results:
            assert x["relevance_score"] == pytest.approx(want[x["index"]], abs=1e-5)
        score = client.post("/v1/score", json={"model": "rerank", "text_1": "lazy dog",
                                               "text_2": docs[:2]})  # fmt: skip
        assert [d["score"] for d in score.json()["data"]] == pytest.approx(want[:2], abs=1e-5)
        r = client.post("/v1/embeddings", json={"model": "rerank", "input": "a"})
        assert r.status_code == 400 and "score" in r.json()["error"]["message"]


def test_truncation_keeps_cls_and_sep_like_sentence_transformers(st_folder: Path) -> None:
    """An encoder's truncated text keeps [CLS] ... [SEP] and the head of the text (what
    sentence-transformers reads at max_seq_length N), not the last N tokens."""
    from sentence_transformers import SentenceTransformer

    engine = Engine(str(st_folder), device="cpu", dtype="float32")
    tokenizer = engine.get_tokenizer()
    text = " ".join(WORDS[i % len(WORDS)] for i in range(60))
    out = engine.embed(text, truncate_prompt_tokens=20)[0]
    full = tokenizer.encode(text)
    assert out.prompt_token_ids == [*full[:19], full[-1]]
    assert (out.prompt_token_ids[0], out.prompt_token_ids[-1]) == (
        tokenizer.cls_token_id,
        tokenizer.sep_token_id,
    )
    st = SentenceTransformer(str(st_folder), device="cpu")
    st.max_seq_length = 20
    want = st.encode([text], normalize_embeddings=True, convert_to_numpy=True)[0]
    np.testing.assert_allclose(np.asarray(out.embedding), want, rtol=0, atol=1e-5)
    ids = engine.embed([full[1:-1]], truncate_prompt_tokens=20)[0]  # no frame: the head
    assert ids.prompt_token_ids == full[1:21]


def test_truncate_prompt_sides() -> None:
    from pagedllm.engine.pooling import truncate_prompt

    ids, types = [101, 1, 2, 3, 4, 5, 102], (0, 0, 0, 1, 1, 1, 1)
    frame = ((101,), (102,))
    assert truncate_prompt(ids, types, 4, keep_head=True, frame=frame) == (
        [101, 1, 2, 102],
        (0, 0, 0, 1),
    )
    assert truncate_prompt(ids, None, 4, keep_head=False, frame=frame) == ([3, 4, 5, 102], None)
    assert truncate_prompt(ids, None, 2, keep_head=True, frame=frame) == ([101, 1], None)
    assert truncate_prompt(ids, None, 9, keep_head=True, frame=frame) == (ids, None)
    assert truncate_prompt([1, 2, 3], None, 2, keep_head=True, frame=frame) == ([1, 2], None)

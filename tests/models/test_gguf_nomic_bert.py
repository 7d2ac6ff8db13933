"""llama.cpp ``nomic-bert`` GGUF files (nomic-embed-text: rotary positions, fused q/k/v, SwiGLU)
through the GGUF loader into ``models/bert.py``'s rotary encoder, against a plain-torch reference
of the architecture written here (its Hugging Face class is remote code) on the same weights."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from pagedllm.models.gguf.reader import GGUFFileError
from pagedllm.models.pooling import PoolingConfig, PoolingType
from tests.models.gguf_bert_files import write_encoder_gguf
from tests.models.test_gguf_bert import TEXTS, embed, tiny_vocab

pytest.importorskip("gguf")
transformers = pytest.importorskip("transformers")

HIDDEN, HEADS, FFN, LAYERS, BASE = 64, 4, 96, 2, 1000.0
CONFIG = {
    "max_position_embeddings": 128,
    "hidden_size": HIDDEN,
    "num_hidden_layers": LAYERS,
    "intermediate_size": FFN,
    "num_attention_heads": HEADS,
    "layer_norm_eps": 1e-12,
    "rope_theta": BASE,
    "type_vocab_size": 2,
}


def weights(vocab: int, *, biases: bool, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)

    def mat(rows: int, cols: int) -> np.ndarray:
        return rng.normal(0.0, 0.1, (rows, cols)).astype(np.float32)

    def norm(prefix: str) -> dict[str, np.ndarray]:
        return {
            f"{prefix}.weight": rng.normal(1.0, 0.1, HIDDEN).astype(np.float32),
            f"{prefix}.bias": rng.normal(0.0, 0.1, HIDDEN).astype(np.float32),
        }

    out = {"token_embd.weight": mat(vocab, HIDDEN), "token_types.weight": mat(2, HIDDEN)}
    out.update(norm("token_embd_norm"))
    shapes = {
        "attn_qkv": (3 * HIDDEN, HIDDEN),
        "attn_output": (HIDDEN, HIDDEN),
        "ffn_gate": (FFN, HIDDEN),
        "ffn_up": (FFN, HIDDEN),
        "ffn_down": (HIDDEN, FFN),
    }
    for i in range(LAYERS):
        for kind, (rows, cols) in shapes.items():
            out[f"blk.{i}.{kind}.weight"] = mat(rows, cols)
            if biases:
                out[f"blk.{i}.{kind}.bias"] = rng.normal(0.0, 0.1, rows).astype(np.float32)
        out.update(norm(f"blk.{i}.attn_output_norm"))
        out.update(norm(f"blk.{i}.layer_output_norm"))
    return out


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def reference(w: dict[str, np.ndarray], ids: list[int]) -> torch.Tensor:
    """nomic-bert's forward in float64 for one sequence, mean-pooled and normalised."""
    t = {k: torch.from_numpy(v).double() for k, v in w.items()}
    F = torch.nn.functional

    def ln(x: torch.Tensor, name: str) -> torch.Tensor:
        return F.layer_norm(x, (HIDDEN,), t[f"{name}.weight"], t[f"{name}.bias"], 1e-12)

    def lin(x: torch.Tensor, name: str) -> torch.Tensor:
        return F.linear(x, t[f"{name}.weight"], t.get(f"{name}.bias"))

    n, head = len(ids), HIDDEN // HEADS
    x = ln(t["token_embd.weight"][ids] + t["token_types.weight"][0], "token_embd_norm")
    inv = 1.0 / BASE ** (torch.arange(0, head, 2, dtype=torch.float64) / head)
    angles = torch.arange(n, dtype=torch.float64)[:, None] * inv[None]
    cos, sin = (
        torch.cat((angles, angles), -1).cos()[:, None],
        torch.cat((angles, angles), -1).sin()[:, None],
    )
    for i in range(LAYERS):
        b = f"blk.{i}"
        q, k, v = (p.reshape(n, HEADS, head) for p in lin(x, f"{b}.attn_qkv").split(HIDDEN, -1))
        q, k = q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin
        scores = torch.einsum("qhd,khd->hqk", q, k) / head**0.5
        attn = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(n, HIDDEN)
        x = ln(lin(attn, f"{b}.attn_output") + x, f"{b}.attn_output_norm")
        mlp = lin(F.silu(lin(x, f"{b}.ffn_gate")) * lin(x, f"{b}.ffn_up"), f"{b}.ffn_down")
        x = ln(mlp + x, f"{b}.layer_output_norm")
    return F.normalize(x.mean(0), dim=-1)


@pytest.mark.parametrize(
    ("kind", "biases", "bound"),
    [("F32", False, 0.9999), ("F32", True, 0.9999), ("F16", False, 0.9999), ("Q8_0", True, 0.999)],
)
def test_embeddings_match_the_reference(tmp_path: Path, kind: str, biases: bool, bound: float):
    from pagedllm.models.gguf.loading import gguf_tokenizer
    from tests.models.encoder_models import load_packed

    tokens = tiny_vocab(cased=False)
    w = weights(len(tokens), biases=biases)
    path = write_encoder_gguf(tmp_path / "nomic.gguf", "nomic-bert", CONFIG, tokens, w, kind=kind)
    model = load_packed(path, torch.float32)
    assert model.pooling_config == PoolingConfig(PoolingType.MEAN, normalize=True)
    tokenizer = gguf_tokenizer(path)
    ours = embed(model, tokenizer, TEXTS)
    want = torch.stack([reference(w, tokenizer(text)["input_ids"]) for text in TEXTS]).float()
    cosine = torch.nn.functional.cosine_similarity(ours, want, dim=-1)
    assert cosine.min().item() >= bound, cosine.tolist()
    if kind == "F32":
        torch.testing.assert_close(ours, want, rtol=0, atol=1e-5)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"drop": ("blk.1.ffn_gate.weight",)}, r"blk\.1\.ffn_gate\.weight is missing"),
        ({"drop": ("blk.1.ffn_up.bias",)}, r"blk\.1\.ffn_up\.bias is missing"),
        (
            {"reshape": {"blk.0.attn_qkv.weight": (64, 64)}},
            r"blk\.0\.attn_qkv\.weight has shape \[64, 64\] where .* make \[192, 64\]",
        ),
        ({"extra": {"position_embd.weight": (128, 64)}}, r"'position_embd\.weight' has no place"),
    ],
)
def test_damaged_files_are_refused_in_one_line(tmp_path: Path, change: dict, message: str):
    from pagedllm.models.model_loader import load_hf_config

    tokens = tiny_vocab(cased=False)
    w = weights(len(tokens), biases=True)
    for name, shape in change.pop("extra", {}).items():
        w[name] = np.zeros(shape, dtype=np.float32)
    path = write_encoder_gguf(tmp_path / "bad.gguf", "nomic-bert", CONFIG, tokens, w, **change)
    with pytest.raises(GGUFFileError, match=message) as info:
        load_hf_config(str(path))
    assert "\n" not in str(info.value)

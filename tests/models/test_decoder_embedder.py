"""Decoder embedders (Qwen3-Embedding / gte-Qwen style) through the real loader, the CPU backend's
kernels and the paged KV cache, against transformers' last hidden state and sentence-transformers'
last-token pooling; and the task a checkpoint is given."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from pagedllm.backends.cpu.backend import CpuBackend
from pagedllm.backends.kv_layout import AttentionMetadata, build_attention_metadata
from pagedllm.models.decoder_embedder import LlamaEmbeddingModel, Qwen3EmbeddingModel
from pagedllm.models.model_loader import load_hf_config, load_model
from pagedllm.models.pooling import PoolingConfig, PoolingType, finish_embedding
from pagedllm.models.registry import model_task, resolve_model_class
from tests.conftest import build_tokenizer

transformers = pytest.importorskip("transformers")

LENS = [6, 1, 19, 11]
BLOCK = 4
_SIZES = dict(
    hidden_size=64,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=96,
    num_hidden_layers=2,
    max_position_embeddings=128,
)


def _save(folder: Path, arch: str, *, bare: bool, tied: bool = True) -> Path:
    """A random decoder saved from the bare model (no ``model.`` prefix, no head) or the LM."""
    tokenizer = build_tokenizer(folder)
    family = {"qwen3": "Qwen3", "llama": "Llama"}[arch]
    extra: dict[str, Any] = {"head_dim": 16} if arch == "qwen3" else {}
    config = getattr(transformers, f"{family}Config")(
        vocab_size=len(tokenizer), tie_word_embeddings=tied, **_SIZES, **extra
    )
    torch.manual_seed(0)
    model = getattr(transformers, f"{family}Model" if bare else f"{family}ForCausalLM")(config)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.08)
    model.save_pretrained(str(folder))
    return folder


def _sentence_transformers(folder: Path) -> None:
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {
            "idx": 1,
            "name": "1",
            "path": "1_Pooling",
            "type": "sentence_transformers.models.Pooling",
        },
        {
            "idx": 2,
            "name": "2",
            "path": "2_Normalize",
            "type": "sentence_transformers.models.Normalize",
        },
    ]
    (folder / "1_Pooling").mkdir(exist_ok=True)
    (folder / "1_Pooling" / "config.json").write_text(
        json.dumps({"word_embedding_dimension": 64, "pooling_mode_lasttoken": True})
    )
    (folder / "modules.json").write_text(json.dumps(modules))


def _load(folder: Path, dtype: torch.dtype, task: str | None = None) -> tuple[Any, Any]:
    backend = CpuBackend()
    attention = backend.attention("auto")
    model = load_model(
        str(folder),
        load_hf_config(str(folder)),
        attn_backend=attention,
        device=torch.device("cpu"),
        dtype=dtype,
        task=task,
    )
    backend.prepare_model(model)
    return model, attention


class PagedRun:
    """Sequences on a paged cache, computed in steps of any chunk sizes (as the scheduler would
    run them: chunked prefill, or a cached prefix and then the rest)."""

    def __init__(self, model: Any, attention: Any, dtype: torch.dtype) -> None:
        self.model = model
        attn = model.layers[0].self_attn.attn
        shape = attention.kv_cache_shape(64, BLOCK, attn.num_kv_heads, attn.head_size)
        self.caches = [torch.zeros(shape, dtype=dtype) for _ in model.layers]
        self.next_block = 0

    def blocks(self, length: int) -> list[int]:
        count = -(-length // BLOCK)
        self.next_block += count
        return list(range(self.next_block - count, self.next_block))

    def step(self, ids: list[list[int]], done: list[int], tables: list[list[int]]) -> torch.Tensor:
        """Tokens ``ids[i]`` of sequence i after its ``done[i]`` computed ones; pooled rows."""
        lens = [len(t) for t in ids]
        slots = [
            tables[i][p // BLOCK] * BLOCK + p % BLOCK
            for i, n in enumerate(lens)
            for p in range(done[i], done[i] + n)
        ]
        meta: AttentionMetadata = build_attention_metadata(
            num_prefills=len(ids),
            seq_lens=[d + n for d, n in zip(done, lens, strict=True)],
            query_lens=lens,
            slot_mapping=slots,
            block_tables=tables,
            block_size=BLOCK,
            device=torch.device("cpu"),
        )
        flat = torch.tensor([t for seq in ids for t in seq])
        positions = torch.cat([torch.arange(d, d + n) for d, n in zip(done, lens, strict=True)])
        with torch.inference_mode():
            hidden = self.model(flat, positions, self.caches, meta)
            return self.model.pool(hidden, lens)


def _ids() -> list[list[int]]:
    gen = torch.Generator().manual_seed(3)
    return [torch.randint(3, 300, (n,), generator=gen).tolist() for n in LENS]


def _hf_last(folder: Path, dtype: torch.dtype, ids: list[list[int]]) -> torch.Tensor:
    hf = transformers.AutoModel.from_pretrained(str(folder), dtype=dtype).eval()
    with torch.inference_mode():
        return torch.stack([hf(torch.tensor([seq])).last_hidden_state[0, -1] for seq in ids])


TOL = {torch.float32: 2e-4, torch.bfloat16: 5e-2}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_last_token_matches_transformers(tmp_path: Path, arch: str, dtype: torch.dtype) -> None:
    folder = _save(tmp_path, arch, bare=True)
    model, attention = _load(folder, dtype)
    want_cls = Qwen3EmbeddingModel if arch == "qwen3" else LlamaEmbeddingModel
    assert type(model) is want_cls and model.uses_kv_cache and model.lm_head is None
    ids = _ids()
    want = _hf_last(folder, dtype, ids)
    run = PagedRun(model, attention, dtype)
    tables = [run.blocks(n) for n in LENS]
    whole = run.step(ids, [0] * len(ids), tables)
    assert whole.dtype == torch.float32
    diff = (whole - want.float()).abs().max().item()
    assert diff <= TOL[dtype], f"{arch} {dtype}: largest difference {diff:.3g}"
    # The same sequences again, their first 4 tokens already cached (a prefix-cache hit): the
    # last token's state is the same.
    tables = [run.blocks(n) for n in LENS]
    cut = [min(4, n - 1) for n in LENS]
    first = [seq[:c] for seq, c in zip(ids, cut, strict=True) if c]
    run.step(first, [0] * len(first), [t for t, c in zip(tables, cut, strict=True) if c])
    rest = run.step([seq[c:] for seq, c in zip(ids, cut, strict=True)], cut, tables)
    diff = (rest - whole).abs().max().item()
    assert diff <= TOL[dtype], f"after a cached prefix: largest difference {diff:.3g}"


def test_sentence_transformers_folder_over_a_causal_lm_embeds(tmp_path: Path) -> None:
    """Qwen3-Embedding's shape: config says Qwen3ForCausalLM, modules.json says last token and
    Normalize; the LM head in the checkpoint is not read."""
    from sentence_transformers import SentenceTransformer

    folder = _save(tmp_path, "qwen3", bare=False, tied=False)
    assert model_task(["Qwen3ForCausalLM"], folder) == "generate"
    _sentence_transformers(folder)
    assert model_task(["Qwen3ForCausalLM"], folder) == "embed"
    model, attention = _load(folder, torch.float32)
    assert isinstance(model, Qwen3EmbeddingModel)
    assert model.pooling_config == PoolingConfig(PoolingType.LAST, normalize=True)
    ids = _ids()
    run = PagedRun(model, attention, torch.float32)
    ours = finish_embedding(run.step(ids, [0] * len(ids), [run.blocks(n) for n in LENS]), True)
    st = SentenceTransformer(str(folder), device="cpu")
    with torch.inference_mode():
        want = torch.stack(
            [
                st({"input_ids": torch.tensor([s]), "attention_mask": torch.ones(1, len(s))})[
                    "sentence_embedding"
                ][0]
                for s in ids
            ]
        )
    torch.testing.assert_close(ours, want, rtol=0, atol=1e-5)


def test_task_choice(tmp_path: Path) -> None:
    assert model_task(["BertModel"]) == "embed"
    assert model_task(["XLMRobertaForSequenceClassification"]) == "classify"
    assert model_task(["LlamaForCausalLM"]) == "generate"
    assert resolve_model_class(["LlamaForCausalLM"], "embed") is LlamaEmbeddingModel
    with pytest.raises(ValueError, match="task: BertModel serves 'embed', not 'generate'"):
        resolve_model_class(["BertModel"], "generate")
    with pytest.raises(ValueError, match="task"):
        resolve_model_class(["LlamaForCausalLM"], "classify")
    with pytest.raises(ValueError, match="task: 'rerank'"):
        resolve_model_class(["BertModel"], "rerank")

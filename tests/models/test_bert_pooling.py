"""BERT-family encoders through the real loader and the CPU backend's prepare_model (packed GEMMs)
against transformers' hidden states and logits and sentence-transformers' pooled embeddings."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from pagedllm.models.pooling import PoolingConfig, PoolingType, finish_embedding
from tests.engine.pooling_models import widen
from tests.models.encoder_models import encoder_meta, load_packed

transformers = pytest.importorskip("transformers")

LENS = [5, 1, 23, 9, 2]
_SIZES = dict(
    vocab_size=120,
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    intermediate_size=96,
    max_position_embeddings=64,
)
FAMILIES: dict[str, dict[str, Any]] = {
    "bert": dict(config="BertConfig", type_vocab_size=2, pad_token_id=0),
    "roberta": dict(config="RobertaConfig", type_vocab_size=1, pad_token_id=1),
    "xlm-roberta": dict(config="XLMRobertaConfig", type_vocab_size=1, pad_token_id=1),
}
_HEADS = {"bert": "Bert", "roberta": "Roberta", "xlm-roberta": "XLMRoberta"}


def _hf_config(family: str, num_labels: int = 3) -> Any:
    spec = dict(FAMILIES[family])
    cls = getattr(transformers, spec.pop("config"))
    return cls(**_SIZES, **spec, num_labels=num_labels, hidden_act="gelu")


def save_encoder(folder: Path, family: str, *, classifier: bool, dtype: torch.dtype) -> Path:
    config = _hf_config(family)
    torch.manual_seed(0)
    head = "ForSequenceClassification" if classifier else "Model"
    cls = getattr(transformers, _HEADS[family] + head)
    model = cls(config) if classifier else cls(config, add_pooling_layer=family == "bert")
    widen(model)
    model.to(dtype).save_pretrained(str(folder))
    return folder


def write_sentence_transformers(folder: Path, mode: str, normalize: bool) -> None:
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {
            "idx": 1,
            "name": "1",
            "path": "1_Pooling",
            "type": "sentence_transformers.models.Pooling",
        },
    ]
    if normalize:
        modules.append(
            {
                "idx": 2,
                "name": "2",
                "path": "2_Normalize",
                "type": "sentence_transformers.models.Normalize",
            }
        )
    (folder / "1_Pooling").mkdir(exist_ok=True)
    (folder / "1_Pooling" / "config.json").write_text(
        json.dumps(
            {"word_embedding_dimension": _SIZES["hidden_size"], f"pooling_mode_{mode}": True}
        )
    )
    (folder / "modules.json").write_text(json.dumps(modules))


def flat_batch(lens: list[int], *, types: bool) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(7)
    ids = torch.randint(3, _SIZES["vocab_size"], (sum(lens),), generator=gen)  # no pad ids
    positions = torch.cat([torch.arange(n) for n in lens])
    type_ids = torch.cat([(torch.arange(n) >= n // 2).long() for n in lens]) if types else None
    return ids, positions, type_ids


def run_ours(model: torch.nn.Module, lens: list[int], *, types: bool) -> torch.Tensor:
    ids, positions, type_ids = flat_batch(lens, types=types)
    with torch.inference_mode():
        return model(ids, positions, [], encoder_meta(lens), token_type_ids=type_ids)


def run_hf(hf: torch.nn.Module, lens: list[int], *, types: bool) -> list[torch.Tensor]:
    """transformers one sequence at a time (no padding to argue about): its output per sequence."""
    ids, _, type_ids = flat_batch(lens, types=types)
    outs, start = [], 0
    with torch.inference_mode():
        for n in lens:
            kw = {} if type_ids is None else {"token_type_ids": type_ids[start : start + n][None]}
            out = hf(input_ids=ids[start : start + n][None], **kw)
            outs.append(out.logits[0] if hasattr(out, "logits") else out.last_hidden_state[0])
            start += n
    return outs


TOL = {torch.float32: 2e-4, torch.bfloat16: 6e-2}


def _close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype, what: str) -> None:
    diff = (got.float() - want.float()).abs().max().item()
    assert diff <= TOL[dtype], f"{what} {dtype}: largest difference {diff:.3g}"


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, bool, str], Path]:
    root = tmp_path_factory.mktemp("encoders")
    out = {}
    for family in FAMILIES:
        for classifier in (False, True):
            for dtype in (torch.float32, torch.bfloat16):
                name = f"{family}-{'cls' if classifier else 'emb'}-{str(dtype)[6:]}"
                out[(family, classifier, str(dtype))] = save_encoder(
                    root / name, family, classifier=classifier, dtype=dtype
                )
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_hidden_states_match_transformers(folders: dict, family: str, dtype: torch.dtype) -> None:
    folder = folders[(family, False, str(dtype))]
    model = load_packed(folder, dtype)
    assert model.uses_kv_cache is False and model.task == "embed"
    layer = model.encoder.layer[0]
    packed = (layer.attention.self_attn.qkv_proj, layer.intermediate.dense, layer.output.dense)
    assert all(m.fast_linear is not None for m in packed), model.linear_path
    assert "encoder_attention x2" in model.layer_kernels, model.layer_kernels
    hf = getattr(transformers, _HEADS[family] + "Model").from_pretrained(str(folder), dtype=dtype)
    for types in (False, True) if family == "bert" else (False,):
        got = torch.split(run_ours(model, LENS, types=types), LENS)
        for i, want in enumerate(run_hf(hf.eval(), LENS, types=types)):
            _close(got[i], want, dtype, f"{family} sequence {i} (token types: {types})")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_classifier_logits_match_transformers(folders: dict, family: str, dtype: torch.dtype):
    folder = folders[(family, True, str(dtype))]
    model = load_packed(folder, dtype)
    assert model.task == "classify"
    cls = getattr(transformers, _HEADS[family] + "ForSequenceClassification")
    hf = cls.from_pretrained(str(folder), dtype=dtype).eval()
    with torch.inference_mode():
        logits = model.pool(run_ours(model, LENS, types=False), LENS)
    assert logits.shape == (len(LENS), 3) and logits.dtype == torch.float32
    _close(logits, torch.stack(run_hf(hf, LENS, types=False)), dtype, f"{family} logits")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("mode", "kind"), [("mean_tokens", "mean"), ("cls_token", "cls")])
@pytest.mark.parametrize("family", ["bert", "xlm-roberta"])
def test_pooled_matches_sentence_transformers(
    folders: dict, tmp_path: Path, family: str, mode: str, kind: str, dtype: torch.dtype
) -> None:
    from sentence_transformers import SentenceTransformer

    folder = folders[(family, False, str(dtype))]
    write_sentence_transformers(folder, mode, normalize=True)
    try:
        model = load_packed(folder, dtype)
        assert model.pooling_config == PoolingConfig(PoolingType(kind), normalize=True)
        with torch.inference_mode():
            ours = finish_embedding(model.pool(run_ours(model, LENS, types=False), LENS), True)
        st = SentenceTransformer(str(folder), device="cpu", model_kwargs={"dtype": dtype})
        ids, _, _ = flat_batch(LENS, types=False)
        wants = []
        with torch.inference_mode():
            for seq in torch.split(ids, LENS):
                features = {"input_ids": seq[None], "attention_mask": torch.ones(1, len(seq))}
                wants.append(st(features)["sentence_embedding"][0])
    finally:
        (folder / "modules.json").unlink()
    want = torch.stack(wants).float()
    cosine = torch.nn.functional.cosine_similarity(ours, want, dim=-1).min().item()
    assert cosine >= (0.99999 if dtype == torch.float32 else 0.999), cosine
    _close(ours, want, dtype, f"{family} {kind}")


def test_checkpoint_without_prefix_and_with_prefix_load_alike(tmp_path: Path) -> None:
    """A classifier's encoder tensors say ``bert.``; an embedder saved from BertModel does not."""
    folder = save_encoder(tmp_path / "c", "bert", classifier=True, dtype=torch.float32)
    hf = transformers.BertForSequenceClassification.from_pretrained(str(folder))
    hf.bert.save_pretrained(str(tmp_path / "e"))
    a = load_packed(folder, torch.float32)
    b = load_packed(tmp_path / "e", torch.float32)
    torch.testing.assert_close(run_ours(a, LENS, types=True), run_ours(b, LENS, types=True))


def test_unsupported_position_embedding_is_refused(tmp_path: Path) -> None:
    config = _hf_config("bert")
    config.position_embedding_type = "relative_key"
    transformers.BertModel(config).save_pretrained(str(tmp_path))
    with pytest.raises(ValueError, match="position_embedding_type"):
        load_packed(tmp_path, torch.float32)

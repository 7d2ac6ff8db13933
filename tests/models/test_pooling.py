"""Pooling over a flat batch against sentence-transformers' Pooling module on the padded batch."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from pagedllm.models.pooling import (
    PoolingConfig,
    PoolingType,
    finish_embedding,
    parse_pooling_override,
    pool_hidden,
    sentence_max_seq_length,
)

st_modules = pytest.importorskip("sentence_transformers.sentence_transformer.modules")

LENS = [3, 1, 17, 8]
_ST_MODE = {PoolingType.MEAN: "mean", PoolingType.CLS: "cls", PoolingType.LAST: "lasttoken"}


def _padded(hidden: torch.Tensor, lens: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    rows = torch.split(hidden, lens)
    padded = torch.nn.utils.rnn.pad_sequence(list(rows), batch_first=True)
    mask = torch.zeros(padded.shape[:2], dtype=torch.int64)
    for i, n in enumerate(lens):
        mask[i, :n] = 1
    return padded, mask


@pytest.mark.parametrize("kind", list(PoolingType))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_pool_hidden_matches_sentence_transformers(kind: PoolingType, dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    hidden = (torch.randn(sum(LENS), 16) * 3 + 1).to(dtype)
    padded, mask = _padded(hidden, LENS)
    module = st_modules.Pooling(16, _ST_MODE[kind])
    want = module({"token_embeddings": padded, "attention_mask": mask})["sentence_embedding"]
    got = pool_hidden(hidden, LENS, kind)
    assert got.dtype == torch.float32 and got.shape == (len(LENS), 16)
    torch.testing.assert_close(
        got, want.float(), rtol=1e-5, atol=1e-5 if dtype == torch.float32 else 1e-2
    )


@pytest.mark.parametrize("dimensions", [None, 5])
def test_finish_embedding_truncates_then_normalises(dimensions: int | None) -> None:
    torch.manual_seed(1)
    vec = torch.randn(4, 16)
    got = finish_embedding(vec, True, dimensions)
    want = st_modules.Normalize()({"sentence_embedding": vec[:, : dimensions or 16]})
    torch.testing.assert_close(got, want["sentence_embedding"])
    assert torch.allclose(got.norm(dim=-1), torch.ones(4))
    torch.testing.assert_close(finish_embedding(vec, False, dimensions), vec[:, : dimensions or 16])
    with pytest.raises(ValueError, match="dimensions"):
        finish_embedding(vec, True, 17)


def test_pool_hidden_refuses_lengths_that_do_not_cover() -> None:
    with pytest.raises(ValueError, match="query_lens"):
        pool_hidden(torch.zeros(5, 2), [2, 2], "mean")


def _write_folder(tmp: Path, pooling: dict[str, object], normalize: bool, extra: str = "") -> Path:
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
    if extra:
        modules.append({"idx": 3, "name": "3", "path": "3_Dense", "type": extra})
    (tmp / "1_Pooling").mkdir(parents=True, exist_ok=True)
    (tmp / "1_Pooling" / "config.json").write_text(json.dumps(pooling))
    (tmp / "modules.json").write_text(json.dumps(modules))
    return tmp


@pytest.mark.parametrize(
    ("pooling", "want"),
    [
        ({"word_embedding_dimension": 8, "pooling_mode_mean_tokens": True}, PoolingType.MEAN),
        ({"pooling_mode_cls_token": True, "pooling_mode_mean_tokens": False}, PoolingType.CLS),
        ({"pooling_mode_lasttoken": True}, PoolingType.LAST),
        ({"embedding_dimension": 8, "pooling_mode": "lasttoken"}, PoolingType.LAST),
        ({"pooling_mode": "cls"}, PoolingType.CLS),
    ],
)
@pytest.mark.parametrize("normalize", [False, True])
def test_from_folder_reads_modules(
    tmp_path: Path, pooling: dict[str, object], want: PoolingType, normalize: bool
) -> None:
    config = PoolingConfig.from_folder(_write_folder(tmp_path, pooling, normalize))
    assert config == PoolingConfig(want, normalize)


def test_from_folder_reads_what_sentence_transformers_writes(tmp_path: Path) -> None:
    (tmp_path / "1_Pooling").mkdir()
    for kind, mode in _ST_MODE.items():
        st_modules.Pooling(8, mode).save(str(tmp_path / "1_Pooling"))
        _write_folder(tmp_path, json.loads((tmp_path / "1_Pooling/config.json").read_text()), True)
        assert PoolingConfig.from_folder(tmp_path) == PoolingConfig(kind, True)


def test_from_folder_without_modules_is_none(tmp_path: Path) -> None:
    assert PoolingConfig.from_folder(tmp_path) is None


@pytest.mark.parametrize(
    ("pooling", "extra", "match"),
    [
        ({"pooling_mode_max_tokens": True}, "", "pooling_mode_max_tokens"),
        ({"pooling_mode": "weightedmean"}, "", "weightedmean"),
        ({"pooling_mode_mean_tokens": True}, "sentence_transformers.models.Dense", "Dense"),
    ],
)
def test_from_folder_refuses_what_it_cannot_run(
    tmp_path: Path, pooling: dict[str, object], extra: str, match: str
) -> None:
    with pytest.raises(ValueError, match=match):
        PoolingConfig.from_folder(_write_folder(tmp_path, pooling, False, extra))


def test_parse_pooling_override() -> None:
    assert parse_pooling_override("CLS") is PoolingType.CLS
    assert parse_pooling_override("last") is PoolingType.LAST
    with pytest.raises(ValueError, match="--pooling"):
        parse_pooling_override("max")


def test_sentence_max_seq_length(tmp_path: Path) -> None:
    assert sentence_max_seq_length(tmp_path) is None
    (tmp_path / "sentence_bert_config.json").write_text('{"max_seq_length": 256}')
    assert sentence_max_seq_length(tmp_path) == 256
    (tmp_path / "sentence_bert_config.json").write_text('{"max_seq_length": -1}')
    with pytest.raises(ValueError, match="max_seq_length"):
        sentence_max_seq_length(tmp_path)

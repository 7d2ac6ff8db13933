"""Checkpoint loading: a tensor-parallel rank reads only the slices it keeps."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

import pagedllm.models.loading as loading
from pagedllm.layers.linear import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding
from pagedllm.layers.parallel import TPContext
from pagedllm.models.loading import WeightMapper, iterate_weights, load_mapped_weights


class Tiny(torch.nn.Module):
    def __init__(self, tp: TPContext) -> None:
        super().__init__()
        self.up = ColumnParallelLinear(4, [6], bias=True, tp=tp)
        self.down = RowParallelLinear(6, 4, tp=tp)
        self.emb = VocabParallelEmbedding(10, 4, tp=tp)


def test_rank_reads_only_its_slices(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    torch.manual_seed(0)
    full = {
        "up.weight": torch.randn(6, 4),
        "up.bias": torch.randn(6),
        "down.weight": torch.randn(4, 6),
        "emb.weight": torch.randn(10, 4),
    }
    save_file(full, str(tmp_path / "model.safetensors"))
    materialized: list[tuple[int, ...]] = []
    real = loading.LazyTensor.materialize

    def spy(self: loading.LazyTensor) -> torch.Tensor:
        materialized.append(tuple(self.shape))
        return real(self)

    monkeypatch.setattr(loading.LazyTensor, "materialize", spy)
    model = Tiny(TPContext(rank=1, size=2))
    load_mapped_weights(model, iterate_weights(tmp_path, lazy=True), WeightMapper())
    assert materialized == []  # every tensor was read as a slice
    torch.testing.assert_close(model.up.weight.data, full["up.weight"][3:])
    torch.testing.assert_close(model.up.bias.data, full["up.bias"][3:])
    torch.testing.assert_close(model.down.weight.data, full["down.weight"][:, 3:])
    torch.testing.assert_close(model.emb.weight.data, full["emb.weight"][5:])

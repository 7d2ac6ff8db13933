"""Quantising at load keeps one layer's float weight alive, not the model's.

The checkpoint reader holds every parameter object in its name table until loading ends, and it
adopts a freshly read tensor as a parameter's storage when it can; either would keep the float
weights of all layers next to their int8 copies (the 1B model peaked at 3.4 GiB instead of about
2.8). Checked structurally: every linear layer is quantised by its loader as soon as its last shard
is in, and at that moment the float storage of every layer finished before it is already gone.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pagedllm.layers.linear import ColumnParallelLinear, RowParallelLinear
from pagedllm.layers.quantization import _FinishingLoader


@pytest.mark.parametrize("quantization", ["int8", "w8a8"])
def test_float_weights_are_released_layer_by_layer(
    llama_path: Path, monkeypatch, quantization: str
) -> None:
    from pagedllm.backends.reference import ReferenceAttention
    from pagedllm.models.model_loader import load_hf_config, load_model

    finished: list[tuple[torch.nn.Module, torch.nn.Parameter]] = []
    live_at_finish: list[int] = []
    inner_call = _FinishingLoader.__call__

    def call(self, param, loaded, shard_id=None):
        before = len(self.seen)
        inner_call(self, param, loaded, shard_id)
        if len(self.seen) == self.shards and before < self.shards:
            finished.append((self.layer, param))
            live_at_finish.append(sum(p.numel() for _, p in finished))

    monkeypatch.setattr(_FinishingLoader, "__call__", call)
    model = load_model(
        str(llama_path),
        load_hf_config(str(llama_path)),
        attn_backend=ReferenceAttention(),
        device=torch.device("cpu"),
        dtype=torch.bfloat16,
        quantization=quantization,
    )
    layers = [
        m for m in model.modules() if isinstance(m, (ColumnParallelLinear, RowParallelLinear))
    ]
    assert {id(layer) for layer, _ in finished} == {id(layer) for layer in layers}
    assert live_at_finish == [0] * len(layers)  # no float weight outlived its quantisation
    assert all(layer.weight.dtype == torch.int8 for layer in layers)

"""The KV cache's geometry comes from the model's attention layers, not from a config formula."""

from __future__ import annotations

import pytest
from torch import nn

from pagedllm.backends.reference import ReferenceAttention
from pagedllm.executors.worker import kv_geometry
from pagedllm.layers.attention import Attention


def layers(*shapes: tuple[int, int]) -> nn.Module:
    return nn.ModuleList(
        Attention(ReferenceAttention(), num_heads=8, num_kv_heads=kv, head_size=d, scale=1.0)
        for kv, d in shapes
    )


def test_geometry_is_read_off_the_layers() -> None:
    assert kv_geometry(layers((2, 64), (2, 64), (2, 64))) == (3, 2, 64)


@pytest.mark.parametrize("shapes", [((2, 64), (4, 64)), ((2, 64), (2, 128)), ()])
def test_layers_that_differ_are_refused(shapes: tuple[tuple[int, int], ...]) -> None:
    with pytest.raises(ValueError, match=r"^model: attention layers differ"):
        kv_geometry(layers(*shapes))


def test_engine_sizes_the_cache_from_the_model(llama_path) -> None:
    from transformers import AutoConfig

    from pagedllm import Engine

    engine = Engine(str(llama_path), device="cpu", dtype="float32", num_kv_blocks=8)
    cfg = AutoConfig.from_pretrained(str(llama_path))
    spec = engine.executor.worker.cache_spec()
    assert spec.num_layers == cfg.num_hidden_layers
    assert spec.num_kv_heads == cfg.num_key_value_heads
    assert spec.head_size == cfg.hidden_size // cfg.num_attention_heads

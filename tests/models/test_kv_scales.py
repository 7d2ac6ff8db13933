"""fp8 KV-cache scales read from checkpoints (every naming the quantisation tools use), and
passed by the attention layer to the backend, which stores ``k / k_scale`` in an fp8 cache."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from pagedllm.backends.kv_layout import to_cache_dtype
from pagedllm.backends.reference import ReferenceAttention
from pagedllm.layers.attention import Attention
from pagedllm.models.checkpoint import CheckpointError
from pagedllm.models.checkpoint_kv_scales import kv_scale_target
from tests.conftest import load_on_reference

NAMINGS = {
    "compressed-tensors": ("self_attn.k_scale", "self_attn.v_scale"),
    "vllm-attn": ("self_attn.attn.k_scale", "self_attn.attn.v_scale"),
    "modelopt": ("self_attn.k_proj.k_scale", "self_attn.v_proj.v_scale"),
    "output-scale": ("self_attn.k_proj.output_scale", "self_attn.v_proj.output_scale"),
}


def _with_scales(src: Path, dst: Path, names: dict[str, torch.Tensor]) -> Path:
    shutil.copytree(src, dst)
    tensors = load_file(str(src / "model.safetensors"))
    tensors.update(names)
    (dst / "model.safetensors").unlink()
    save_file(tensors, str(dst / "model.safetensors"))
    return dst


def _load(path: Path) -> torch.nn.Module:
    return load_on_reference(path, torch.float32)


def _attention_layers(model: torch.nn.Module) -> list[Attention]:
    return [m for m in model.modules() if isinstance(m, Attention)]


@pytest.mark.parametrize("naming", sorted(NAMINGS))
def test_scales_reach_each_attention_layer(llama_path: Path, tmp_path: Path, naming: str) -> None:
    k_name, v_name = NAMINGS[naming]
    layers = len(_attention_layers(_load(llama_path)))
    scales = {}
    for i in range(layers):
        scales[f"model.layers.{i}.{k_name}"] = torch.tensor(0.5 + i)
        scales[f"model.layers.{i}.{v_name}"] = torch.tensor([0.25 * (i + 1)])  # a [1] tensor
    model = _load(_with_scales(llama_path, tmp_path / naming, scales))
    got = [(a.k_scale, a.v_scale) for a in _attention_layers(model)]
    assert got == [(0.5 + i, 0.25 * (i + 1)) for i in range(layers)]


def test_kv_scale_sets_both_and_per_head_takes_the_max(llama_path: Path, tmp_path: Path) -> None:
    scales = {
        "model.layers.0.self_attn.kv_scale": torch.tensor(3.0),
        "model.layers.1.self_attn.k_scale": torch.tensor([0.5, 2.0, 1.0]),
    }
    model = _load(_with_scales(llama_path, tmp_path / "kv", scales))
    first, second = _attention_layers(model)[:2]
    assert (first.k_scale, first.v_scale) == (3.0, 3.0)
    assert (second.k_scale, second.v_scale) == (2.0, 1.0)


@pytest.mark.parametrize(
    ("name", "error"),
    [
        ("model.layers.0.self_attn.k_scale", "> 0"),
        ("model.layers.99.self_attn.k_scale", "no attention layer"),
    ],
)
def test_bad_scales_are_refused(llama_path: Path, tmp_path: Path, name: str, error: str) -> None:
    folder = _with_scales(llama_path, tmp_path / "bad", {name: torch.tensor(0.0)})
    with pytest.raises(CheckpointError, match=error):
        _load(folder)


def test_weight_scales_are_not_kv_scales() -> None:
    assert kv_scale_target("model.layers.0.self_attn.k_proj.weight_scale") is None
    assert kv_scale_target("model.layers.0.self_attn.q_proj.output_scale") is None
    assert kv_scale_target("model.layers.0.self_attn.k_proj.k_scale") == (
        "model.layers.0.self_attn",
        ("k_scale",),
    )


@pytest.mark.parametrize("cache_dtype", [torch.float8_e4m3fn, torch.float8_e5m2], ids=str)
def test_attention_layer_writes_scaled_fp8(cache_dtype: torch.dtype) -> None:
    """The cache holds k / k_scale and v / v_scale: the scales reach the backend."""
    backend = ReferenceAttention()
    layer = Attention(backend, num_heads=2, num_kv_heads=1, head_size=8, scale=0.3)
    layer.k_scale, layer.v_scale = 4.0, 0.5
    torch.manual_seed(0)
    n = 3
    q, k, v = torch.randn(n, 16), torch.randn(n, 8) * 20, torch.randn(n, 8)
    cache = torch.zeros(backend.kv_cache_shape(2, 4, 1, 8), dtype=cache_dtype)
    meta = backend.build_metadata(
        num_prefills=1,
        seq_lens=[n],
        query_lens=[n],
        slot_mapping=[4, 5, 6],
        block_tables=[[1]],
        block_size=4,
        device=torch.device("cpu"),
    )
    layer(q, k, v, cache, meta)
    stored_k = cache[0, 1, 0, :n].float()
    stored_v = cache[1, 1, 0, :n].float()
    assert torch.equal(stored_k, to_cache_dtype(k, cache_dtype, 4.0).float())
    assert torch.equal(stored_v, to_cache_dtype(v, cache_dtype, 0.5).float())


@pytest.mark.parametrize("attention_backend", ["cpp", "torch"])
def test_engine_runs_fp8_cache_with_checkpoint_scales(
    llama_path: Path, tmp_path: Path, attention_backend: str
) -> None:
    """The CPU backends take the scales: scales of 1 give the tokens of no scales, and scales so
    large that k / scale underflows fp8 (every cached key and value 0) change them."""
    from pagedllm import Engine, SamplingParams

    def run(path: Path) -> list[list[int]]:
        engine = Engine(
            str(path),
            device="cpu",
            kv_cache_dtype="fp8_e4m3",
            attention_backend=attention_backend,
            num_kv_blocks=64,
            block_size=8,
        )
        params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
        outs = engine.generate(["The quick brown fox", "Paged attention"], params, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]

    ones = {f"model.layers.{i}.self_attn.kv_scale": torch.tensor(1.0) for i in range(2)}
    plain = run(llama_path)
    assert run(_with_scales(llama_path, tmp_path / "ones", ones)) == plain
    huge = {name: torch.tensor(1e6) for name in ones}
    assert run(_with_scales(llama_path, tmp_path / "huge", huge)) != plain

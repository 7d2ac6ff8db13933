"""4-bit weights from a float checkpoint (``quantization="int4"``) and from a compressed-tensors
W4A16 checkpoint: greedy tokens equal transformers running the same 4-bit weights (the model
with every linear weight replaced by its dequantised 4-bit version)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from pagedllm import Engine, SamplingParams
from pagedllm.layers.quantization.groupwise import dequantize_int4, quantize_int4
from tests.hf_reference import assert_greedy_match, hf_greedy

MAX_NEW = 10
PROMPTS = [[5, 17, 99, 3, 44, 12, 7], [7, 8, 9], list(range(20, 60))]
GREEDY = SamplingParams(max_tokens=MAX_NEW, temperature=0.0)


def _linear(name: str, t: torch.Tensor) -> bool:
    return t.dim() == 2 and ".layers." in name and name.endswith("proj.weight")


def _copy_with(src: Path, dst: Path, tensors: dict[str, torch.Tensor], config: dict) -> Path:
    from safetensors.torch import save_file

    dst.mkdir()
    for item in src.iterdir():
        if item.suffix != ".safetensors" and item.name != "config.json":
            (dst / item.name).symlink_to(item)
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    (dst / "config.json").write_text(json.dumps(config))
    return dst


def _fake_quantized(src: Path, dst: Path, quant) -> Path:
    """``src`` with every linear weight replaced by ``quant(weight)`` (the reference model)."""
    from safetensors.torch import load_file

    tensors = load_file(str(src / "model.safetensors"))
    tensors = {n: quant(t).to(t.dtype) if _linear(n, t) else t for n, t in tensors.items()}
    return _copy_with(src, dst, tensors, json.loads((src / "config.json").read_text()))


def _engine_tokens(path: Path, **kw: object) -> list[list[int]]:
    engine = Engine(str(path), device="cpu", block_size=8, num_kv_blocks=64, **kw)
    outs = engine.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def test_int4_at_load_matches_transformers_on_the_same_weights(
    llama_path: Path, tmp_path: Path
) -> None:
    ref = hf_greedy(
        _fake_quantized(llama_path, tmp_path / "ref", lambda t: dequantize_int4(*quantize_int4(t))),
        PROMPTS,
        MAX_NEW,
    )
    for i, (ours, r) in enumerate(
        zip(_engine_tokens(llama_path, quantization="int4"), ref, strict=True)
    ):
        assert_greedy_match(ours, r, f"int4 prompt {i}")


def _symmetric_int4(w: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """llm-compressor's symmetric int4: q in -8..7, one scale per ``group`` columns."""
    n, k = w.shape
    g = w.float().reshape(n, k // group, group)
    scale = (g.abs().amax(dim=-1) / 7.5).clamp_min(1e-8)  # [N, K/group]
    q = torch.round(g / scale[..., None]).clamp(-8, 7).to(torch.int8).reshape(n, k)
    return q, scale


def _pack_int4(q: torch.Tensor) -> torch.Tensor:
    """Eight values to an int32, offset by 8, the first in the lowest nibble."""
    u = (q.to(torch.int32) + 8).reshape(q.shape[0], -1, 8)
    shifts = torch.arange(8, dtype=torch.int32) * 4
    return (u << shifts).sum(dim=-1, dtype=torch.int64).to(torch.uint32).view(torch.int32)


@pytest.mark.parametrize("group", [32, 64, None], ids=["g32", "g64", "channel"])
def test_compressed_tensors_w4a16_matches_transformers(
    llama_path: Path, tmp_path: Path, group: int | None
) -> None:
    from safetensors.torch import load_file

    tensors = load_file(str(llama_path / "model.safetensors"))
    out: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        if not _linear(name, t):
            out[name] = t
            continue
        prefix = name.removesuffix(".weight")
        q, scale = _symmetric_int4(t, group or t.shape[1])
        out[f"{prefix}.weight_packed"] = _pack_int4(q)
        out[f"{prefix}.weight_shape"] = torch.tensor(list(t.shape), dtype=torch.int64)
        out[f"{prefix}.weight_scale"] = scale.to(torch.bfloat16).float()
    config = json.loads((llama_path / "config.json").read_text())
    weights = {"num_bits": 4, "type": "int", "symmetric": True, "dynamic": False}
    if group:
        weights.update(strategy="group", group_size=group)
    else:
        weights.update(strategy="channel", group_size=None)
    config["quantization_config"] = {
        "quant_method": "compressed-tensors",
        "format": "pack-quantized",
        "ignore": ["lm_head"],
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights}},
    }
    w4 = _copy_with(llama_path, tmp_path / "w4a16", out, config)

    def dequant_bf16_scale(t: torch.Tensor) -> torch.Tensor:
        q, scale = _symmetric_int4(t, group or t.shape[1])
        scale = scale.to(torch.bfloat16).float()
        return (q.float().reshape(*scale.shape, -1) * scale[..., None]).reshape(t.shape)

    ref = hf_greedy(
        _fake_quantized(llama_path, tmp_path / "ref", dequant_bf16_scale), PROMPTS, MAX_NEW
    )
    engine = Engine(str(w4), device="cpu", block_size=8, num_kv_blocks=64)
    layer = engine.executor.worker.runner.model.layers[0].mlp.down_proj  # type: ignore[attr-defined]
    assert layer.quant_method.name == "int4"
    outs = engine.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
    for i, (o, r) in enumerate(zip(outs, ref, strict=True)):
        assert_greedy_match(list(o.outputs[0].token_ids), r, f"w4a16 {group} prompt {i}")
    with pytest.raises(ValueError, match="^quantization: 'int8' cannot run a 4-bit"):
        Engine(str(w4), device="cpu", num_kv_blocks=16, quantization="int8")

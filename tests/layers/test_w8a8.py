"""W8A8 (int8 weights per channel, dynamic int8 activations per token) end to end.

Reference: transformers on the same tiny checkpoint with every decoder ``nn.Linear`` replaced by
the scheme written out here in plain PyTorch (weights rounded per output row, each input row
rounded per token, float64 sums of the int8 products). Our engine must give the same greedy
tokens except at near-ties, and teacher-forced prompt log-probabilities within a small bound.
Rounding the activations is discontinuous: where the two implementations differ by float32
summation order (~1e-6), an activation sitting on a rounding boundary may round the other way,
so the bounds leave room for that (on this model none happened: 5e-7 measured, against 2e-2
for weight-only int8).
The scheme must also be visibly *not* weight-only int8: that engine, against the same reference,
is several times further off.
"""

from __future__ import annotations

import functools
import json
import shutil
from pathlib import Path

import pytest
import torch
from torch import nn

from pagedllm import Engine, SamplingParams
from pagedllm.layers.quantization import get_quant_config
from tests.conftest import PROMPTS
from tests.hf_reference import HFGreedy, assert_greedy_match

TIE_MARGIN = 1e-3
MAX_LOGPROB_DIFF = 1e-3  # measured 5e-7
MAX_NEW_TOKENS = 8


def _w8a8_forward(
    x: torch.Tensor, q: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    sx = x.abs().amax(dim=-1, keepdim=True) / 127
    sx = torch.where(sx > 0, sx, torch.ones_like(sx))
    xq = torch.round(x / sx).clamp(-127, 127)
    y = (xq.double() @ q.double().T) * sx.double() * w_scale.double()
    y = y.to(x.dtype)
    return y if bias is None else y + bias


def _fake_quantized_hf(path: Path) -> nn.Module:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear) and ".layers." in name:  # not the LM head
            w = module.weight.detach()
            scale = w.abs().amax(dim=1) / 127
            scale = torch.where(scale > 0, scale, torch.ones_like(scale))
            q = torch.round(w / scale[:, None]).clamp(-127, 127)
            module.forward = functools.partial(_w8a8_forward, q=q, w_scale=scale, bias=module.bias)
    return model


@pytest.fixture(scope="module")
def reference(llama_path: Path):
    """(greedy outputs, teacher-forced prompt log-probabilities) of the fake-quantised model."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(llama_path))
    model = _fake_quantized_hf(llama_path)
    greedy, prompt_lps = [], []
    with torch.no_grad():
        for prompt in PROMPTS:
            ids = torch.tensor([tokenizer(prompt)["input_ids"]])
            out = model.generate(
                ids,
                max_new_tokens=MAX_NEW_TOKENS,
                do_sample=False,
                output_scores=True,
                return_dict_in_generate=True,
                pad_token_id=model.config.pad_token_id,
            )
            gen = out.sequences[0, ids.shape[1] :].tolist()
            greedy.append(HFGreedy(gen, [torch.log_softmax(s[0], dim=-1) for s in out.scores]))
            lps = torch.log_softmax(model(ids).logits[0].double(), dim=-1)  # [T, V]
            prompt_lps.append(lps[:-1].gather(1, ids[0, 1:, None]).squeeze(1))
    return greedy, prompt_lps


def _run(path: Path, **kwargs) -> tuple[list[list[int]], list[torch.Tensor], str]:
    engine = Engine(str(path), device="cpu", block_size=8, num_kv_blocks=128, **kwargs)
    params = SamplingParams(max_tokens=MAX_NEW_TOKENS, temperature=0.0, prompt_logprobs=0)
    outs = engine.generate(PROMPTS, params, use_tqdm=False)
    lps = [
        torch.tensor(
            [e[t] for t, e in zip(o.prompt_token_ids[1:], o.prompt_logprobs[1:], strict=True)],
            dtype=torch.float64,
        )
        for o in outs
    ]
    return (
        [list(o.outputs[0].token_ids) for o in outs],
        lps,
        engine.executor.worker.backend.linear_path,
    )


def _max_diff(lps: list[torch.Tensor], ref: list[torch.Tensor]) -> float:
    assert [len(a) for a in lps] == [len(b) for b in ref]
    return float((torch.cat(lps) - torch.cat(ref)).abs().max())


@pytest.fixture(scope="module")
def w8a8_run(llama_path: Path):
    return _run(llama_path, quantization="w8a8")


def test_w8a8_engine_matches_fake_quantized_transformers(reference, w8a8_run) -> None:
    greedy, ref_lps = reference
    tokens, lps, paths = w8a8_run
    assert "cpp-w8a8" in paths, paths
    for i, (ours, ref) in enumerate(zip(tokens, greedy, strict=True)):
        assert_greedy_match(ours, ref, f"prompt {i}", tie_margin=TIE_MARGIN)
    assert _max_diff(lps, ref_lps) < MAX_LOGPROB_DIFF


def test_w8a8_is_not_weight_only(llama_path: Path, reference, w8a8_run) -> None:
    """Weight-only int8 against the W8A8 reference is far further off than W8A8 itself."""
    _, ref_lps = reference
    _, int8_lps, _ = _run(llama_path, quantization="int8")
    assert _max_diff(int8_lps, ref_lps) > 5 * _max_diff(w8a8_run[1], ref_lps)


def test_torch_apply_path_matches_cpp(llama_path: Path, w8a8_run, monkeypatch) -> None:
    """The PyTorch fallback (other backends) computes the same scheme as the C++ kernel."""
    import pagedllm.backends.cpu.packed_linear as packed_linear

    monkeypatch.setattr(packed_linear, "pack_linear_layers", lambda model, **_: {})
    tokens, lps, _ = _run(llama_path, quantization="w8a8")
    assert tokens == w8a8_run[0]
    assert _max_diff(lps, w8a8_run[1]) < 1e-3


def _write_w8a8(src: Path, dst: Path, inputs: dict | None) -> Path:
    """The tiny checkpoint as llm-compressor writes W8A8 (int-quantized, dynamic tokens)."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    out = {}
    for name, t in load_file(str(src / "model.safetensors")).items():
        if not (name.endswith("proj.weight") and ".layers." in name):
            out[name] = t
            continue
        scale = t.float().abs().amax(dim=1) / 127
        out[name] = torch.round(t.float() / scale[:, None]).clamp(-127, 127).to(torch.int8)
        out[name.removesuffix(".weight") + ".weight_scale"] = scale[:, None].contiguous()
    (dst / "model.safetensors").unlink()
    save_file(out, str(dst / "model.safetensors"))
    weights = {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel"}
    config = json.loads((dst / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "compressed-tensors",
        "format": "int-quantized",
        "ignore": ["lm_head"],
        "config_groups": {
            "group_0": {"targets": ["Linear"], "weights": weights, "input_activations": inputs}
        },
    }
    (dst / "config.json").write_text(json.dumps(config))
    return dst


W8A8_INPUTS = {
    "num_bits": 8,
    "type": "int",
    "symmetric": True,
    "dynamic": True,
    "strategy": "token",
}


def test_compressed_tensors_w8a8_checkpoint(llama_path: Path, tmp_path: Path, w8a8_run) -> None:
    folder = _write_w8a8(llama_path, tmp_path / "w8a8", W8A8_INPUTS)
    tokens, lps, paths = _run(folder)  # no argument: the checkpoint says w8a8
    assert "cpp-w8a8" in paths
    assert tokens == w8a8_run[0]
    assert _max_diff(lps, w8a8_run[1]) < 1e-4


@pytest.mark.parametrize(
    "inputs",
    [
        {**W8A8_INPUTS, "dynamic": False},  # static activation scales
        {**W8A8_INPUTS, "symmetric": False},
        {**W8A8_INPUTS, "strategy": "tensor", "dynamic": False},
        {**W8A8_INPUTS, "num_bits": 4},
    ],
    ids=["static", "asymmetric", "per-tensor", "int4"],
)
def test_unsupported_activation_schemes_refused(inputs: dict) -> None:
    hf_config = type("C", (), {})()
    hf_config.quantization_config = {
        "quant_method": "compressed-tensors",
        "config_groups": {
            "g": {
                "weights": {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel"},
                "input_activations": inputs,
            }
        },
    }
    with pytest.raises(ValueError, match="^quantization: .*input_activations"):
        get_quant_config(None, hf_config)


def test_requested_scheme_chooses_how_int8_checkpoints_run() -> None:
    hf_config = type("C", (), {})()
    group = {"weights": {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel"}}
    hf_config.quantization_config = {
        "quant_method": "compressed-tensors",
        "config_groups": {"g": {**group, "input_activations": W8A8_INPUTS}},
    }
    assert get_quant_config(None, hf_config).method.name == "w8a8"
    assert get_quant_config("int8", hf_config).method.name == "int8"
    hf_config.quantization_config["config_groups"]["g"]["input_activations"] = None
    assert get_quant_config("w8a8", hf_config).method.name == "w8a8"
    assert get_quant_config(None, hf_config).method.name == "int8"


def test_cli_accepts_w8a8() -> None:
    from pagedllm.entrypoints.cli import build_parser, engine_kwargs

    args = build_parser().parse_args(["generate", "m", "--prompt", "x", "--quantization", "w8a8"])
    assert engine_kwargs(args)["quantization"] == "w8a8"

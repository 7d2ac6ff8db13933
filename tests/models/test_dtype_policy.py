"""``dtype``: "auto" keeps a 16-bit checkpoint's dtype where the processor runs it well and says
why in the log; an explicit dtype is always honoured; an unknown one is a ValueError naming it."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from pagedllm import Engine
from pagedllm.backends.cpu import backend as cpu_backend
from pagedllm.backends.cpu._ops import cpu_flags
from pagedllm.backends.cpu.backend import CpuBackend, auto_dtype
from pagedllm.models.model_loader import load_hf_config, resolve_dtype

AVX2 = frozenset({"avx", "avx2", "fma", "f16c"})


@pytest.mark.parametrize(
    ("stored", "flags", "expected", "reason"),
    [
        (torch.bfloat16, AVX2 | {"avx512f", "avx512_bf16"}, torch.bfloat16, "has avx512_bf16"),
        (torch.bfloat16, AVX2 | {"amx_bf16", "avx512_bf16"}, torch.bfloat16, "has amx_bf16"),
        (torch.float16, AVX2 | {"avx512_fp16"}, torch.float16, "has avx512_fp16"),
        (torch.bfloat16, AVX2, torch.bfloat16, "avx2/f16c"),
        (torch.float16, AVX2, torch.float16, "avx2/f16c"),
        (torch.bfloat16, frozenset({"sse4_2"}), torch.float32, "neither avx2+f16c"),
        (torch.float16, frozenset(), torch.float32, "neither avx2+f16c"),
        (torch.float32, AVX2 | {"avx512_bf16", "amx_bf16"}, torch.float32, "is float32"),
    ],
)
def test_auto_rule(
    stored: torch.dtype, flags: frozenset[str], expected: torch.dtype, reason: str
) -> None:
    dtype, why = auto_dtype(stored, flags)
    assert dtype == expected and reason in why, (dtype, why)


def test_auto_says_what_it_chose_and_why(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    import pagedllm.backends.cpu._ops as ops

    monkeypatch.setattr(ops, "cpu_flags", lambda: AVX2 | {"avx512_bf16"})
    with caplog.at_level(logging.INFO, logger=cpu_backend.__name__):
        assert CpuBackend().default_dtype(torch.bfloat16) == torch.bfloat16
    assert "dtype auto -> bfloat16 (checkpoint dtype; processor has avx512_bf16)" in caplog.text


def test_resolve_honours_explicit_and_rejects_unknown(llama_path: Path) -> None:
    config = load_hf_config(str(llama_path))  # a float32 checkpoint

    def never(_: torch.dtype) -> torch.dtype:
        raise AssertionError("the backend rule is for 'auto' only")

    assert resolve_dtype("float16", config, never) == torch.float16
    assert resolve_dtype("bfloat16", config, never) == torch.bfloat16
    assert resolve_dtype("auto", config, lambda d: d) == torch.float32
    with pytest.raises(ValueError, match="^dtype: 'float64'"):
        resolve_dtype("float64", config, never)
    with pytest.raises(ValueError, match="dtype"):
        Engine(str(llama_path), device="cpu", dtype="half")


@pytest.fixture(scope="module")
def bf16_llama(llama_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny llama saved in bfloat16, as real checkpoints ship."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = tmp_path_factory.mktemp("bf16_llama")
    model = AutoModelForCausalLM.from_pretrained(str(llama_path), dtype=torch.bfloat16)
    model.save_pretrained(str(folder))
    AutoTokenizer.from_pretrained(str(llama_path)).save_pretrained(str(folder))
    return folder


def param_dtypes(engine: Engine) -> set[torch.dtype]:
    model = engine.executor.worker.runner.model  # type: ignore[attr-defined]
    return {p.dtype for p in model.parameters()}


@pytest.mark.parametrize("requested", ["auto", "float16", "float32"])
def test_engine_weights_follow_the_resolved_dtype(bf16_llama: Path, requested: str) -> None:
    engine = Engine(str(bf16_llama), device="cpu", dtype=requested, num_kv_blocks=16)
    expected = (
        auto_dtype(torch.bfloat16, cpu_flags())[0]
        if requested == "auto"
        else getattr(torch, requested)
    )
    assert param_dtypes(engine) == {expected}
    model = engine.executor.worker.runner.model  # type: ignore[attr-defined]
    assert {b.dtype for n, b in model.named_buffers() if n.endswith(("cos", "sin"))} == {
        torch.float32
    }

"""Checkpoint loading: a tensor-parallel rank reads only the slices it keeps; the plain-read
safetensors reader is exact and names a damaged file; a 16-bit checkpoint loads without ever
holding a float32 copy (peak RSS measured in a clean subprocess)."""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

import pagedllm.models.checkpoint as loading
from pagedllm.layers.linear import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding
from pagedllm.layers.parallel import TPContext
from pagedllm.models.checkpoint import (
    CheckpointError,
    WeightMapper,
    iterate_weights,
    load_mapped_weights,
)
from pagedllm.models.safetensors_reader import read_safetensors


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


# -- the plain-read safetensors reader ---------------------------------------------------------
def test_reader_returns_every_dtype_bit_exactly(tmp_path: Path) -> None:
    torch.manual_seed(0)
    tensors = {
        "bf16": torch.randn(3, 5).to(torch.bfloat16),
        "f16": torch.randn(7).to(torch.float16),
        "f32": torch.randn(2, 2, 2),
        "i64": torch.arange(6).reshape(2, 3),
        "i8": torch.tensor([-128, 0, 127], dtype=torch.int8),
        "u8": torch.tensor([0, 255], dtype=torch.uint8),
        "flag": torch.tensor([True, False]),
        "scalar": torch.tensor(2.5),
        "empty": torch.empty(0, 4),
    }
    save_file(tensors, str(tmp_path / "model.safetensors"))
    got = dict(read_safetensors(tmp_path / "model.safetensors"))
    assert set(got) == set(tensors)
    for name, want in tensors.items():
        assert got[name].dtype == want.dtype and got[name].shape == want.shape, name
        assert torch.equal(got[name], want), name


@pytest.mark.parametrize("damage", ["garbage", "truncated", "bad_json", "bad_offsets"])
def test_reader_names_the_damaged_file(tmp_path: Path, damage: str) -> None:
    path = tmp_path / "model.safetensors"
    save_file({"w": torch.randn(16, 16)}, str(path))
    data = path.read_bytes()
    (length,) = struct.unpack("<Q", data[:8])
    if damage == "garbage":
        data = b"not a safetensors file"
    elif damage == "truncated":
        data = data[:-100]
    elif damage == "bad_json":
        data = data[:8] + b"{" * length + data[8 + length :]
    else:
        header = data[8 : 8 + length].replace(
            b'"data_offsets":[0,1024]', b'"data_offsets":[0,1000]'
        )
        assert header != data[8 : 8 + length]
        data = data[:8] + header + data[8 + length :]
    path.write_bytes(data)
    with pytest.raises(CheckpointError, match=r"model\.safetensors"):
        list(read_safetensors(path))


# -- 16-bit checkpoints load without a float32 copy ----------------------------------------------
_MEASURE = r"""
import json, os, sys, torch
from pagedllm.backends.cpu.backend import CpuBackend
from pagedllm.models.model_loader import load_hf_config, load_model
from pagedllm.models.registry import resolve_model_class

def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

def peak():
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) * 1024 for l in f if l.startswith("VmHWM:"))

path, dtype = sys.argv[1], getattr(torch, sys.argv[2])
config = load_hf_config(path)
attention = CpuBackend().attention("torch")
resolve_model_class(config.architectures)  # import the model's modules before measuring
try:  # start the peak afresh (Linux >= 4.0); else the peak since start only overstates growth
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
except OSError:
    pass
before = rss()
model = load_model(path, config, attn_backend=attention, device=torch.device("cpu"), dtype=dtype)
dtypes = sorted({str(p.dtype) for p in model.parameters()})
print(json.dumps({"before": before, "peak": peak(), "dtypes": dtypes}))
"""
# Loading holds the model plus at most one checkpoint tensor; a float32 detour would double it.
RSS_GROWTH_LIMIT = 1.3


@pytest.fixture(scope="module")
def bf16_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from benchmarks.model_builder import build_random_llama

    # ~90 MB in bfloat16: large enough that the interpreter's own noise does not matter.
    spec = dict(
        hidden_size=512,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
        intermediate_size=1408,
        vocab_size=32000,
        tie_word_embeddings=False,
    )
    return build_random_llama(tmp_path_factory.mktemp("bf16ckpt"), spec, dtype=torch.bfloat16)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_16bit_load_grows_rss_by_about_the_checkpoint(bf16_checkpoint: Path, dtype: str) -> None:
    size = sum(p.stat().st_size for p in bf16_checkpoint.glob("*.safetensors"))
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    proc = subprocess.run(
        [sys.executable, "-c", _MEASURE, str(bf16_checkpoint), dtype],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["dtypes"] == [f"torch.{dtype}"], result
    growth = result["peak"] - result["before"]
    assert growth <= RSS_GROWTH_LIMIT * size, (
        f"loading a {size / 2**20:.0f} MiB {dtype} checkpoint grew peak RSS by "
        f"{growth / 2**20:.0f} MiB (> {RSS_GROWTH_LIMIT}x)"
    )


_HUGE_PAGE_PROBE = r"""
import os, re, sys
import pagedllm  # noqa: F401  (sets the default before torch's first allocation)
import torch

t = torch.empty(64 << 20, dtype=torch.uint8)
t.fill_(1)
start, huge_kb = t.data_ptr(), 0
for entry in re.split(r"\n(?=[0-9a-f]+-[0-9a-f]+ )", open("/proc/self/smaps").read()):
    lo, hi = (int(x, 16) for x in entry.split()[0].split("-"))
    if lo <= start < hi:
        huge_kb = int(re.search(r"AnonHugePages:\s+(\d+)", entry).group(1))
print(os.environ.get("THP_MEM_ALLOC_ENABLE"), huge_kb)
"""


def _thp_mode() -> str | None:
    try:
        text = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    except OSError:
        return None
    return text.split("[", 1)[1].split("]", 1)[0] if "[" in text else None


@pytest.mark.parametrize("user_value", [None, "0"])
def test_large_tensors_are_advised_onto_huge_pages(user_value: str | None) -> None:
    """Importing pagedllm asks PyTorch for transparent huge pages under its large tensors
    (fewer page faults while a checkpoint is read and packed), unless the user chose."""
    env = {k: v for k, v in os.environ.items() if k != "THP_MEM_ALLOC_ENABLE"}
    if user_value is not None:
        env["THP_MEM_ALLOC_ENABLE"] = user_value
    out = subprocess.run(
        [sys.executable, "-c", _HUGE_PAGE_PROBE], env=env, capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr[-2000:]
    value, huge_kb = out.stdout.split()
    assert value == (user_value or "1")
    mode = _thp_mode()
    if user_value is None and mode in ("madvise", "always"):
        assert int(huge_kb) > 0, "a 64 MiB tensor got no huge page"
    if user_value == "0" and mode == "madvise":
        assert int(huge_kb) == 0, "huge pages although the user turned them off"

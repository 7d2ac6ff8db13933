"""Conformance of the CPU backend's linear and MoE kernels: every path this machine runs, for
every weight format the backend claims, against the format's PyTorch definition.

The formats come from the backend's own table (``packed_linear.linear_makers()``, whose
group-wise names are ``groupwise.FORMATS``'), not from a list here, so a format added there is
tested here or fails :func:`test_every_claimed_format_has_a_sample_layer`. Each layer is made by
the format's quantization method (its ``weight_format`` is checked to be the format), and the
reference is that method's ``apply`` on a float64 copy of the layer, x in float64: the PyTorch
definition the kernels replace. The kernel paths: each ISA level this processor runs (the C++
builds) x ``int8_activations`` off and on x float32 / bf16 / fp16 activations x 1, 5 and 33
rows, plus the int8 GEMMs the chooser does not pick on this processor (the split planes and the
converting GEMM).

Bounds, relative to the largest reference output (those of test_cpu_groupwise.py,
test_cpu_w8a8.py and tests/layers): float32 outputs 2e-5 (summation order), bf16 8e-3 and fp16
2e-3 (one rounding of the output); the int8 split planes 2e-4 in float32 (x kept to
max|x| / 64516 per row); the group-wise dot path (x rounded to int8 per group of 32, the user's
``int8_activations``) 3e-2 against the float definition, and its own definition
(``dot_linear_reference``) to the output's rounding.
"""

from __future__ import annotations

import copy
import shutil
from collections.abc import Callable

import pytest
import torch
from torch import nn

from pagedllm.backends.cpu import dense_gemm, groupwise_linear, groupwise_reference, packed_linear
from pagedllm.backends.cpu._ops import load_kernels, supported_isas
from pagedllm.layers.linear import ColumnParallelLinear
from pagedllm.layers.quantization.base import FLOAT, UNQUANTIZED, LinearMethod
from pagedllm.layers.quantization.groupwise import FORMATS, GroupwiseMethod
from pagedllm.layers.quantization.groupwise_parts import MIXED, GroupwisePartsMethod
from pagedllm.layers.quantization.int8 import Int8WeightOnly
from pagedllm.layers.quantization.w8a8 import Int8W8A8

pytestmark = pytest.mark.skipif(shutil.which("c++") is None, reason="no C++ compiler")

N, K = 40, 256  # N off the 16-column panels; K one q6_k super-block (8 groups of 32)
ROWS = (1, 5, 33)
ACT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
TOL = {torch.float32: 2e-5, torch.bfloat16: 8e-3, torch.float16: 2e-3}
SPLIT_TOL_F32 = 2e-4
DOT_TOL = 3e-2
CLAIMED = sorted(packed_linear.linear_makers())


# -- sample layers, one maker per format --------------------------------------------------------
# q of each group-wise format (what its checkpoints hold); a format missing here fails the
# coverage test below rather than going untested.
Q_RANGE = {"int4": (0, 256), "q8_0": (-127, 128), "q6_k": (-32, 32), "q5_k": (0, 32)}


def _fp16(t: torch.Tensor) -> torch.Tensor:
    return t.half().float()


def groupwise_tensors(fmt: str, n: int, k: int) -> dict[str, torch.Tensor]:
    """The stored tensors of a ``fmt`` layer, by name, with values its format can hold exactly:
    q in its range (int4: any byte of two nibbles), fp16 scales and offsets, and for a format
    with super-block factors (q6_k) scales that are ``d * sc`` for a signed byte sc."""
    stored = GroupwiseMethod.for_format(fmt).stored_tensors(n, k)
    low, high = Q_RANGE[fmt]
    out = {
        "weight": torch.randint(low, high, stored["weight"][0].shape).to(stored["weight"][0].dtype)
    }
    scale_shape = stored["weight_scale"][0].shape
    if "weight_super" in stored:
        d = _fp16((torch.rand(stored["weight_super"][0].shape) + 0.5) * 1e-3)
        sc = torch.randint(-128, 128, scale_shape).float()
        out["weight_super"] = d
        out["weight_scale"] = d.repeat_interleave(scale_shape[1] // d.shape[1], dim=1) * sc
    else:
        out["weight_scale"] = _fp16(torch.rand(scale_shape) * 0.01 + 1e-3)
    if "weight_offset" in stored:
        out["weight_offset"] = _fp16(-torch.rand(stored["weight_offset"][0].shape) * 0.05)
    return out


def _linear(method: LinearMethod | None, dtype: torch.dtype = torch.float32) -> nn.Module:
    layer = ColumnParallelLinear(K, [N], bias=True)
    layer.weight.data = (torch.randn(N, K) * 0.05).to(dtype)
    layer.bias.data = torch.randn(N).to(dtype)
    layer.quant_method = method
    return layer


def groupwise_layer(fmt: str) -> nn.Module:
    method = GroupwiseMethod.for_format(fmt)
    layer = _linear(method)
    method.create_weights(layer)
    for name, tensor in groupwise_tensors(fmt, N, K).items():
        getattr(layer, name).data.copy_(tensor)
    method.finish_loading(layer)
    return layer


def int8_layer(method: Int8WeightOnly) -> nn.Module:
    layer = _linear(method)
    method.create_weights(layer)
    method.finish_loading(layer)  # quantised from the float weight
    return layer


def mixed_layer() -> nn.Module:
    """q/k in one group-wise format and v in another (llama.cpp's Q4_K_M attention), loaded
    through the fused layer's loaders part by part."""
    formats, sizes = ("int4", "int4", "q6_k"), [16, 8, 16]
    method = GroupwisePartsMethod(formats)
    layer = ColumnParallelLinear(K, sizes, bias=True)
    layer.bias.data.normal_()
    layer.quant_method = method
    method.create_weights(layer)
    for shard, (fmt, n) in enumerate(zip(formats, sizes, strict=True)):
        for name, tensor in groupwise_tensors(fmt, n, K).items():
            param = getattr(layer, name)
            param.weight_loader(param, tensor, shard)
    method.finish_loading(layer)
    return layer


# format -> [(sample name, layer maker)]: float weights in each dtype, int8 made at load.
SAMPLES: dict[str, list[tuple[str, Callable[[], nn.Module]]]] = {
    FLOAT: [(str(dt).removeprefix("torch."), lambda dt=dt: _linear(None, dt)) for dt in ACT_DTYPES],
    Int8WeightOnly.weight_format: [("int8", lambda: int8_layer(Int8WeightOnly()))],
    Int8W8A8.weight_format: [("w8a8", lambda: int8_layer(Int8W8A8()))],
    MIXED: [("int4,int4,q6_k", mixed_layer)],
    **{fmt: [(fmt, lambda fmt=fmt: groupwise_layer(fmt))] for fmt in FORMATS if fmt in Q_RANGE},
}
CASES = [(fmt, name, make) for fmt in CLAIMED for name, make in SAMPLES.get(fmt, [])]


def test_every_claimed_format_has_a_sample_layer() -> None:
    """A format the backend claims (or a new group-wise format) must be tested here."""
    assert set(FORMATS) <= set(CLAIMED)
    missing = sorted(set(CLAIMED) - set(SAMPLES)) + sorted(set(FORMATS) - set(Q_RANGE))
    assert not missing, f"no sample layer for the claimed formats {missing}: add one"


@pytest.fixture(scope="module", params=supported_isas())
def isa_ops(request: pytest.FixtureRequest):
    """The GEMM library at each ISA level this processor runs (others are skipped: they would
    fault here)."""
    try:
        module = load_kernels(isa=request.param)
    except (ImportError, RuntimeError, OSError) as exc:
        pytest.skip(f"the {request.param} GEMM library could not be built: {exc}")
    assert module.built_isa() == request.param
    return module


@pytest.fixture
def at_isa(isa_ops, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(dense_gemm, "gemm_ops", lambda: isa_ops)
    return isa_ops


# -- the references -----------------------------------------------------------------------------
def reference(layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The method's ``apply`` (the PyTorch definition) on a float64 copy, x in float64."""
    ref = copy.deepcopy(layer).double()
    method = ref.quant_method or UNQUANTIZED
    return method.apply(ref, x.double(), ref.bias)


def rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    return ((y.double() - ref).abs().max() / ref.abs().max().clamp_min(1e-30)).item()


def _dot_reference(layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The group-wise dot path's own definition (x rounded to int8 per group)."""
    scale, offset = groupwise_linear.weight_groups(layer)
    q = groupwise_reference.weight_integers(layer)
    return groupwise_reference.dot_linear_reference(x, q, scale, offset, layer.bias.double())


def check_kernel(fn, layer: nn.Module, path: str, *, dot_rows=None, split: bool = False) -> None:
    """``fn`` against the definition at every activation dtype (a float weight's own dtype)
    and row count; ``dot_rows``: up to how many rows of each dtype take the dot path."""
    fmt = (layer.quant_method or UNQUANTIZED).layer_format(layer)
    dtypes = (layer.weight.dtype,) if fmt == FLOAT else ACT_DTYPES
    torch.manual_seed(11)
    for dtype in dtypes:
        for m in ROWS:
            x = torch.randn(m, K).to(dtype)
            y = fn(x)
            assert y.shape == (m, N) and y.dtype == dtype, (path, y.shape, y.dtype)
            ref = reference(layer, x)
            dot = m <= (dot_rows or {}).get(dtype, 0)
            tol = DOT_TOL if dot else TOL[dtype]
            if split and dtype == torch.float32:
                tol = SPLIT_TOL_F32
            err = rel_err(y, ref)
            assert err < tol, f"{fmt} {path} {dtype} m={m}: {err:.2e} >= {tol:g}"
            if dot and fmt in FORMATS:  # and to its own definition, to the output's rounding
                err = rel_err(y, _dot_reference(layer, x))
                assert err < TOL[dtype], f"{fmt} {path} dot {dtype} m={m}: {err:.2e}"


# -- the linear kernels -------------------------------------------------------------------------
@pytest.mark.parametrize("int8_activations", (False, True), ids=("x", "int8x"))
@pytest.mark.parametrize(("fmt", "sample", "make"), CASES, ids=[f"{f}-{s}" for f, s, _ in CASES])
def test_chosen_linear_kernel_matches_the_method(
    at_isa, fmt: str, sample: str, make, int8_activations: bool
) -> None:
    """The kernel the backend installs for a layer of each format, at each ISA level."""
    torch.manual_seed(5)
    layer = make()
    method = layer.quant_method or UNQUANTIZED
    assert method.layer_format(layer) == fmt
    kernel = packed_linear.make_linear_kernel(layer, int8_activations=int8_activations)
    if kernel.fn is None and kernel.path.startswith("torch-float16"):
        pytest.skip("no fp16 GEMM on this processor: fp16 layers keep PyTorch")  # never here
    assert kernel.fn is not None, f"{fmt}: no packed kernel ({kernel.path})"
    if fmt in FORMATS:
        assert kernel.groupwise is not None and kernel.packed_rows is not None
        assert kernel.path.startswith(f"cpp-{kernel.groupwise.name}-{at_isa.built_isa()}")
        rows = torch.tensor([0, 17, N - 1])
        want = groupwise_reference.dequantize_rows(layer, rows)
        assert torch.equal(kernel.packed_rows(rows), want)
    check_kernel(kernel.fn, layer, kernel.path, dot_rows=kernel.dot_rows)


INT8_GEMMS = {
    "split": dense_gemm.make_int8_split_linear,
    "converting": dense_gemm.make_cpp_linear,
}


@pytest.mark.parametrize("gemm", sorted(INT8_GEMMS))
def test_every_int8_gemm_matches_the_method(at_isa, gemm: str) -> None:
    """The int8 weight-only GEMMs the chooser may not pick on this processor."""
    from pagedllm.layers.quantization import weight_scale

    torch.manual_seed(5)
    layer = int8_layer(Int8WeightOnly())
    fn = INT8_GEMMS[gemm](layer.weight, weight_scale(layer), layer.bias)
    assert fn is not None, gemm
    check_kernel(fn, layer, f"int8-{gemm}", split=gemm == "split")


# -- the MoE expert path ------------------------------------------------------------------------
E, H, INTER, TOP_K, TOKENS = 4, 256, 256, 2, 9  # K of both GEMMs: whole q6_k super-blocks


def _moe_layer(fmt: str, dtype: torch.dtype):
    """A FusedMoE with both stacks in ``fmt`` (float in ``dtype``; int8 made at load)."""
    from pagedllm.layers.fused_moe import FusedMoE

    layer = FusedMoE(num_experts=E, hidden_size=H, intermediate_size=INTER)
    layer.w13_weight.data = (torch.randn(layer.w13_weight.shape) * 0.2).to(dtype)
    layer.w2_weight.data = (torch.randn(layer.w2_weight.shape) * 0.2).to(dtype)
    if fmt == Int8WeightOnly.weight_format:
        layer.quantize_int8()
    elif fmt in FORMATS:
        for name in ("w13_weight", "w2_weight"):
            e, n, k = getattr(layer, name).shape
            layer.use_groupwise(name, fmt)
            for e_ in range(e):
                for suffix, tensor in groupwise_tensors(fmt, n, k).items():
                    getattr(layer, name + suffix.removeprefix("weight")).data[e_].copy_(tensor)
        layer.finish_groupwise()
    return layer


def _moe_formats() -> list[str]:
    from pagedllm.backends.cpu.fused_moe import expert_formats

    return sorted(expert_formats())


MOE_CASES = [
    (fmt, dt)
    for fmt in _moe_formats()
    for dt in ((torch.float32, torch.bfloat16) if fmt == FLOAT else (torch.float32,))
]


def test_every_expert_format_has_a_sample() -> None:
    assert set(_moe_formats()) <= {FLOAT, Int8WeightOnly.weight_format} | set(Q_RANGE)


@pytest.mark.parametrize("int8_activations", (False, True), ids=("x", "int8x"))
@pytest.mark.parametrize(("fmt", "dtype"), MOE_CASES, ids=[f"{f}-{d}" for f, d in MOE_CASES])
def test_packed_experts_match_fused_experts(at_isa, fmt: str, dtype, int8_activations) -> None:
    """The CPU's packed expert GEMMs (per expert, and grouped for group-wise stacks) against
    the layer's own ``fused_experts_torch`` (its PyTorch definition), in float64."""
    from pagedllm.backends.cpu.fused_moe import pack_moe_layer
    from pagedllm.layers.fused_moe import fused_experts_torch

    torch.manual_seed(5)
    layer = _moe_layer(fmt, dtype)
    g = torch.Generator().manual_seed(2)
    weights = torch.rand(TOKENS, TOP_K, generator=g) + 0.1
    ids = torch.stack([torch.randperm(E, generator=g)[:TOP_K] for _ in range(TOKENS)])
    ref_layer = copy.deepcopy(layer).double()
    path = pack_moe_layer(layer, int8_activations=int8_activations)
    assert path != "torch" and layer.fast_moe is not None, path
    if fmt in FORMATS:
        assert f"cpp-{fmt}-{at_isa.built_isa()}" in path and "grouped" in path, path
    # A float stack runs x of its own dtype; quantised stacks float32 and bf16 x.
    for act in (dtype,) if fmt == FLOAT else (torch.float32, torch.bfloat16):
        x = torch.randn(TOKENS, H).to(act)
        ref = fused_experts_torch(ref_layer, x.double(), weights.double(), ids)
        got = layer(x, weights.to(act), ids)
        assert got.dtype == act
        # Two GEMMs and the activation between them: twice the one-GEMM bound; the dot path's
        # rounding of x at both.
        dot = "+dot" in path and act != torch.float32
        split = "int8-split" in path and act == torch.float32
        tol = 2 * (DOT_TOL if dot else SPLIT_TOL_F32 if split else TOL[act])
        err = rel_err(got, ref)
        assert err < tol, f"{fmt} {path} {act}: {err:.2e} >= {tol:g}"

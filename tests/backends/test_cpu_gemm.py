"""The C++ weight GEMM (bf16/fp16/int8 weights) against a float64 PyTorch reference.

Reference: ``x.double() @ W_dequant.double().T + bias``. Tolerances, relative to the largest
reference output: float32 outputs 2e-5 (only the float32 summation order differs); bf16 outputs
8e-3 and fp16 outputs 2e-3 (one rounding of the output to the 16-bit type, 2^-8 / 2^-11, plus
the float32 sums).
"""

from __future__ import annotations

import shutil

import pytest
import torch

from pagedllm.backends.cpu._ops import load_kernels, supported_isas
from pagedllm.backends.cpu.dense_gemm import pack_panels

pytestmark = pytest.mark.skipif(shutil.which("c++") is None, reason="no C++ compiler")

ISAS = supported_isas()  # every level this processor runs, AVX-512 ones included
WEIGHT_DTYPES = (torch.bfloat16, torch.float16, torch.int8)
ACT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
TOLERANCE = {torch.float32: 2e-5, torch.bfloat16: 8e-3, torch.float16: 2e-3}


@pytest.fixture(scope="module", params=ISAS)
def ops(request: pytest.FixtureRequest):
    module = load_kernels(isa=request.param)
    assert module.built_isa() == request.param
    return module


def _weight(n: int, k: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor | None]:
    if dtype == torch.int8:
        return torch.randint(-127, 128, (n, k), dtype=torch.int8), torch.rand(n) * 0.02 + 1e-3
    return (torch.randn(n, k) * 0.1).to(dtype), None


def _reference(x, w, scale, bias) -> torch.Tensor:
    wd = w.double() if scale is None else w.double() * scale.double()[:, None]
    y = x.double() @ wd.T
    return y if bias is None else y + bias.double()


@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("m", [1, 3, 8, 12, 17, 64, 300])
@pytest.mark.parametrize("xdtype", ACT_DTYPES, ids=str)
@pytest.mark.parametrize("wdtype", WEIGHT_DTYPES, ids=str)
def test_matches_float64_reference(ops, wdtype, xdtype, m: int, bias: bool) -> None:
    torch.manual_seed(m)
    n, k = 37, 1100  # N not a multiple of 16, K more than one 1024-chunk and not a multiple
    w, scale = _weight(n, k, wdtype)
    x = torch.randn(m, k).to(xdtype)
    b = torch.randn(n).to(xdtype) if bias else None
    y = ops.weight_gemm(x, pack_panels(w), n, scale, b)
    assert y.dtype == xdtype and y.shape == (m, n)
    ref = _reference(x, w, scale, b)
    err = (y.double() - ref).abs().max().item() / ref.abs().max().item()
    assert err < TOLERANCE[xdtype], f"relative error {err:.2e}"


@pytest.mark.parametrize("n", [1, 16, 17, 100])
def test_output_widths(ops, n: int) -> None:
    w, _ = _weight(n, 64, torch.bfloat16)
    x = torch.randn(5, 64)
    ref = _reference(x, w, None, None)
    y = ops.weight_gemm(x, pack_panels(w), n)
    torch.testing.assert_close(y.double(), ref, rtol=1e-5, atol=1e-5)


def test_empty_batch(ops) -> None:
    w, _ = _weight(20, 8, torch.float16)
    assert ops.weight_gemm(torch.empty(0, 8), pack_panels(w), 20).shape == (0, 20)


def test_bad_inputs_raise(ops) -> None:
    w, scale = _weight(20, 8, torch.int8)
    packed = pack_panels(w)
    with pytest.raises(RuntimeError, match="need a scale"):
        ops.weight_gemm(torch.randn(2, 8), packed, 20)
    with pytest.raises(RuntimeError, match="K="):
        ops.weight_gemm(torch.randn(2, 9), packed, 20, scale)
    with pytest.raises(RuntimeError, match="panels"):
        ops.weight_gemm(torch.randn(2, 8), packed, 40, scale)
    with pytest.raises(RuntimeError, match="float32, bfloat16 or float16"):
        ops.weight_gemm(torch.randn(2, 8).double(), packed, 20, scale)
    with pytest.raises(RuntimeError, match=r"\[N/16, K, 16\]"):
        ops.weight_gemm(torch.randn(2, 8), packed.transpose(1, 2), 20, scale)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.int8])
@pytest.mark.parametrize(("n", "k"), [(16, 128), (37, 300), (5, 1), (64, 257)])
def test_pack_panels_matches_the_pytorch_layout(ops, dtype: torch.dtype, n: int, k: int) -> None:
    """The C++ copy gives exactly the PyTorch layout: whole and partial panels, K past a block."""
    from pagedllm.backends.cpu.dense_gemm import pack_panels_reference

    w = (torch.randn(n, k) * 50).to(dtype)
    got = ops.pack_panels(w)
    assert got.dtype == dtype
    assert torch.equal(got, pack_panels_reference(w))
    assert torch.equal(ops.pack_panels(w.t().contiguous().t()), got)  # a strided weight


def test_amx_only_where_built_and_reported(ops) -> None:
    from pagedllm.backends.cpu._ops import cpu_flags

    if ops.built_isa() != "avx512bf16" or "amx_bf16" not in cpu_flags():
        assert not ops.has_amx()


@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("m", [6, 13, 16, 17, 64, 100, 300])
@pytest.mark.parametrize("wdtype", [torch.bfloat16, torch.int8], ids=str)
def test_amx_tiles_match_float64_reference(ops, wdtype, m: int, bias: bool) -> None:
    """AMX tiles (bf16 activations, K % 32 == 0, 6+ rows): whole and partial row tiles, more
    than one group of row tiles, K past two 512-wide blocks with a partial third, a tail panel;
    and the same outputs as the vdpbf16ps path up to float32 summation order."""
    if not ops.has_amx():
        pytest.skip("AMX tiles need an avx512bf16 build on a processor with amx_bf16")
    torch.manual_seed(m)
    n, k = 37, 1088
    w, scale = _weight(n, k, wdtype)
    x = torch.randn(m, k).bfloat16()
    b = torch.randn(n).bfloat16() if bias else None
    packed = pack_panels(w)
    y = ops.weight_gemm(x, packed, n, scale, b)
    assert y.dtype == torch.bfloat16 and y.shape == (m, n)
    ref = _reference(x, w, scale, b)
    err = (y.double() - ref).abs().max().item() / ref.abs().max().item()
    assert err < TOLERANCE[torch.bfloat16], f"relative error {err:.2e}"
    dp = ops.weight_gemm(x, packed, n, scale, b, allow_amx=False)
    diff = (y.double() - dp.double()).abs().max().item() / ref.abs().max().item()
    assert diff < 2 * 2**-8, f"AMX vs vdpbf16ps: relative difference {diff:.2e}"

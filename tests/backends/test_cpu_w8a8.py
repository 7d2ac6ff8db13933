"""The C++ W8A8 GEMM (int8 activations per token x int8 weights per channel) against PyTorch.

References, all plain PyTorch: the activation rounding is ``quantize_per_token`` (equal bit for
bit); the integer sums are an int64 matmul (equal exactly: nothing may saturate, even at +-127
everywhere); the whole GEMM is ``w8a8_linear_reference`` in float64, within the rounding of the
float32 epilogue (2e-6 relative to the largest output) or of the 16-bit output (bf16 8e-3, fp16
2e-3).
"""

from __future__ import annotations

import shutil

import pytest
import torch
import torch.nn.functional as F

from pagedllm.backends.cpu._ops import load_kernels, supported_isas
from pagedllm.layers.quantization.int8 import quantize_per_channel, row_absmax
from pagedllm.layers.quantization.w8a8 import quantize_per_token

pytestmark = pytest.mark.skipif(shutil.which("c++") is None, reason="no C++ compiler")

ISAS = supported_isas()  # every level this processor runs, AVX-512 ones included
# The integer dot product each build level uses: VNNI's vpdpbusd comes with the avx512bf16 level;
# plain AVX-512 keeps the AVX2 vpmaddubsw path (there is no 512-bit one without VNNI).
DOT_PRODUCT = {"avx512bf16": "avx512vnni", "avx512": "avx2", "avx2": "avx2", "scalar": "scalar"}
TOLERANCE = {torch.float32: 2e-6, torch.bfloat16: 8e-3, torch.float16: 2e-3}
# (M, N, K): one row; N off the 16-column panels; K off the 4-byte groups and past one
# 1024-wide block; M past the 4-row tile with a remainder. The last three have K in whole
# 64-byte AMX tiles: 3 rows (the fewest that take the tiles), 17 (a partial row tile), 50 (more
# than one group of three row tiles).
SHAPES = [
    (1, 37, 1103),
    (5, 16, 8),
    (17, 100, 2050),
    (3, 1, 3),
    (64, 48, 256),
    (3, 16, 64),
    (17, 100, 1024),
    (50, 33, 192),
]


@pytest.fixture(scope="module", params=ISAS)
def ops(request: pytest.FixtureRequest):
    module = load_kernels(isa=request.param)
    assert module.built_isa() == request.param
    assert module.int8_dot_isa() == DOT_PRODUCT[request.param]
    return module


def _int8(*shape: int) -> torch.Tensor:
    return torch.randint(-127, 128, shape, dtype=torch.int8)


def _packed_reference(w: torch.Tensor) -> torch.Tensor:
    """``[N, K]`` -> ``[ceil(N/16), ceil(K/4), 64]``: per 4-k group, 16 columns x 4 k."""
    n, k = w.shape
    padded = F.pad(w, (0, (-k) % 4, 0, (-n) % 16))
    panels, groups = padded.shape[0] // 16, padded.shape[1] // 4
    return padded.reshape(panels, 16, groups, 4).permute(0, 2, 1, 3).reshape(panels, groups, 64)


@pytest.mark.parametrize(("n", "k"), [(16, 8), (37, 1103), (1, 3)])
def test_pack_layout(ops, n: int, k: int) -> None:
    w = _int8(n, k)
    assert torch.equal(ops.pack_w8a8(w), _packed_reference(w))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_activation_rounding_matches_pytorch(ops, dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    x = (torch.randn(9, 301) * torch.rand(9, 1) * 5).to(dtype)
    x[3] = 0  # an all-zero row: scale 1, zeros
    x[4, 7] = -x[4].abs().max() * 2  # the negative extreme must round to -127
    q, scale = ops.quantize_rows(x)
    q_ref, scale_ref = quantize_per_token(x)
    assert torch.equal(scale, scale_ref)
    assert torch.equal(q, q_ref)
    assert int(q[4, 7]) == -127 and not q[3].any()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("k", [2048, 301, 36, 7])  # whole vectors (no copy), tails, short rows
def test_weight_quantizer_matches_pytorch(ops, dtype: torch.dtype, k: int) -> None:
    """The load-time int8 weights: quantize_rows == quantize_per_channel bit for bit, with the
    rows' own maxima and with given ones (a row-parallel shard scaled as its whole row)."""
    torch.manual_seed(k)
    w = (torch.randn(37, k) * torch.rand(37, 1) * 3).to(dtype)
    w[5] = 0
    # Exact halves after the division (scale 1): round half to even, as torch.round does.
    w[6] = torch.tensor([127.0, 2.5, -3.5, 0.5, -0.5, 1.5, -126.5][: min(k, 7)] * (k // 7 + 1))[
        :k
    ].to(dtype)
    q, scale = ops.quantize_rows(w)
    q_ref, scale_ref = quantize_per_channel(w)
    assert q.shape == (37, k) and q.is_contiguous()
    assert torch.equal(scale, scale_ref)
    assert torch.equal(q, q_ref)
    if k >= 7:
        assert q[6, :7].tolist() == [127, 2, -4, 0, 0, 2, -126]
    whole = row_absmax(w) * (1 + torch.rand(37))  # a whole row's maxima: >= this shard's
    q, scale = ops.quantize_rows(w, whole)
    q_ref, scale_ref = quantize_per_channel(w, whole)
    assert torch.equal(scale, scale_ref)
    assert torch.equal(q, q_ref)


def test_weight_quantizer_bad_absmax(ops) -> None:
    w = torch.randn(4, 8)
    with pytest.raises(RuntimeError, match="absmax must be a CPU float32"):
        ops.quantize_rows(w, torch.ones(3))


def test_backend_quantizes_at_load_with_the_kernel() -> None:
    """What the loader is given: the C++ quantiser, which falls back to the definition for
    weights it does not take (here a float64 one)."""
    from pagedllm.backends.cpu.backend import CpuBackend

    quantize = CpuBackend().kernel("int8_quantize").value
    assert quantize is not None
    w = torch.randn(20, 64).bfloat16()
    for weight in (w, w.double()):
        q, scale = quantize(weight, None)
        q_ref, scale_ref = quantize_per_channel(weight)
        assert torch.equal(q, q_ref) and torch.equal(scale, scale_ref)


@pytest.mark.parametrize(("m", "n", "k"), SHAPES)
def test_int32_sums_are_exact(ops, m: int, n: int, k: int) -> None:
    torch.manual_seed(m * n + k)
    qx, w = _int8(m, k), _int8(n, k)
    packed = ops.pack_w8a8(w)
    got = ops.w8a8_gemm_s32(qx, packed, n)
    assert torch.equal(got, (qx.long() @ w.long().T).int())


@pytest.mark.parametrize(("xv", "wv"), [(127, 127), (-127, 127), (-127, -127), (127, -127)])
def test_extremes_do_not_saturate(ops, xv: int, wv: int) -> None:
    """Every pair of products at its largest magnitude: 16-bit pair sums would overflow if
    the sign trick were wrong (32258 fits, 2 * 127 * 255 would not)."""
    m, n, k = 6, 20, 2052
    qx = torch.full((m, k), xv, dtype=torch.int8)
    w = torch.full((n, k), wv, dtype=torch.int8)
    w[1, ::2] = -wv  # mixed signs within a pair
    packed = ops.pack_w8a8(w)
    got = ops.w8a8_gemm_s32(qx, packed, n)
    assert torch.equal(got, (qx.long() @ w.long().T).int())


def _reference64(x, w, w_scale, bias) -> torch.Tensor:
    q, sx = quantize_per_token(x)
    y = (q.double() @ w.double().T) * sx.double()[:, None] * w_scale.double()
    return y if bias is None else y + bias.double()


@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize(("m", "n", "k"), SHAPES)
@pytest.mark.parametrize("xdtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_gemm_matches_reference(ops, xdtype, m: int, n: int, k: int, bias: bool) -> None:
    torch.manual_seed(m + n + k)
    x = torch.randn(m, k).to(xdtype)
    w, w_scale = _int8(n, k), torch.rand(n) * 0.02 + 1e-3
    b = torch.randn(n).to(xdtype) if bias else None
    packed = ops.pack_w8a8(w)
    y = ops.w8a8_gemm(x, packed, n, w_scale, b)
    assert y.dtype == xdtype and y.shape == (m, n)
    ref = _reference64(x, w, w_scale, b)
    err = (y.double() - ref).abs().max().item() / ref.abs().max().item()
    assert err < TOLERANCE[xdtype], f"relative error {err:.2e}"


def test_empty_batch(ops) -> None:
    packed = ops.pack_w8a8(_int8(20, 8))
    y = ops.w8a8_gemm(torch.empty(0, 8), packed, 20, torch.ones(20))
    assert y.shape == (0, 20)


def test_bad_inputs_raise(ops) -> None:
    packed = ops.pack_w8a8(_int8(20, 8))
    scale = torch.ones(20)
    with pytest.raises(RuntimeError, match="K="):
        ops.w8a8_gemm(torch.randn(2, 9), packed, 20, scale)
    with pytest.raises(RuntimeError, match="panels"):
        ops.w8a8_gemm(torch.randn(2, 8), packed, 40, scale)
    with pytest.raises(RuntimeError, match="w_scale"):
        ops.w8a8_gemm(torch.randn(2, 8), packed, 20, torch.ones(20).double())
    with pytest.raises(RuntimeError, match="float32, bfloat16 or float16"):
        ops.w8a8_gemm(torch.randn(2, 8).double(), packed, 20, scale)
    with pytest.raises(RuntimeError, match="int8"):
        ops.pack_w8a8(torch.randn(4, 4))


@pytest.mark.parametrize(("m", "n", "k"), [(3, 16, 64), (17, 100, 1024), (64, 48, 256)])
def test_amx_tiles_equal_the_vector_path(ops, m: int, n: int, k: int) -> None:
    """AMX-INT8 (signed x signed, no offset) gives bit for bit the vector path's outputs."""
    if not ops.has_amx_int8():
        pytest.skip("AMX-INT8 tiles need an avx512bf16 build on a processor with amx_int8")
    torch.manual_seed(k)
    qx, w = _int8(m, k), _int8(n, k)
    packed = ops.pack_w8a8(w)
    tiles = ops.w8a8_gemm_s32(qx, packed, n)
    assert torch.equal(tiles, ops.w8a8_gemm_s32(qx, packed, n, allow_amx=False))
    assert torch.equal(tiles, (qx.long() @ w.long().T).int())
    x, w_scale = torch.randn(m, k).bfloat16(), torch.rand(n) * 0.02 + 1e-3
    y = ops.w8a8_gemm(x, packed, n, w_scale)
    assert torch.equal(y, ops.w8a8_gemm(x, packed, n, w_scale, allow_amx=False))


def test_amx_int8_only_where_built_and_reported(ops) -> None:
    from pagedllm.backends.cpu._ops import cpu_flags

    if ops.built_isa() != "avx512bf16" or "amx_int8" not in cpu_flags():
        assert not ops.has_amx_int8()


# The split planes of int8 weight-only layers (``int8_split_gemm``). Against float64 sums of x
# and the dequantised weights, i.e. weight-only int8 with exact activations: the planes keep x
# to max|x| / 64516 per row, so float32 outputs agree to 2e-4 of the largest (K up to 2050:
# K * E|w| * max|x| / 64516 against an output of sqrt(K) * |x| * |w|); 16-bit outputs to their
# own rounding.
SPLIT_TOLERANCE = {torch.float32: 2e-4, torch.bfloat16: 8e-3, torch.float16: 2e-3}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_split_planes_match_the_python_definition(ops, dtype: torch.dtype) -> None:
    from pagedllm.layers.quantization.int8 import split_per_token

    torch.manual_seed(1)
    m, k = 19, 1103  # a partial chunk of 8 tokens, a tail past the 16-wide vectors
    x = (torch.randn(m, k) * torch.rand(m, 1) * 5).to(dtype)
    x[3] = 0  # an all-zero row: scales 1, zeros
    x[4, 7] = -x[4].abs().max() * 2  # the extreme must take -127, its remainder the low plane
    q, s = ops.split_rows(x)
    hi, lo, s_hi, s_lo = split_per_token(x)
    assert torch.equal(q[:m], hi) and torch.equal(q[m:], lo)
    assert torch.equal(s[:m], s_hi) and torch.equal(s[m:], s_lo)
    assert int(hi[4, 7]) == -127 and not hi[3].any() and not lo[3].any()
    rebuilt = hi.double() * s_hi.double()[:, None] + lo.double() * s_lo.double()[:, None]
    # Half a low step, plus the float32 rounding of the remainder x - hi * s_hi (< 1% of it).
    bound = x.double().abs().amax(dim=1) / 64516 * 1.01
    assert ((rebuilt - x.double()).abs().amax(dim=1) <= bound).all()


@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize(("m", "n", "k"), SHAPES)
@pytest.mark.parametrize("xdtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_split_gemm_matches_weight_only_int8(ops, xdtype, m: int, n: int, k: int, bias: bool):
    torch.manual_seed(m + n + k)
    x = torch.randn(m, k).to(xdtype)
    w, w_scale = _int8(n, k), torch.rand(n) * 0.02 + 1e-3
    b = torch.randn(n).to(xdtype) if bias else None
    y = ops.int8_split_gemm(x, ops.pack_w8a8(w), n, w_scale, b)
    assert y.dtype == xdtype and y.shape == (m, n)
    ref = x.double() @ (w.double() * w_scale.double()[:, None]).T
    ref = ref if b is None else ref + b.double()
    err = (y.double() - ref).abs().max().item() / ref.abs().max().item()
    assert err < SPLIT_TOLERANCE[xdtype], f"relative error {err:.2e}"


def test_split_is_much_finer_than_w8a8(ops) -> None:
    """Two planes, not one: the error is a small fraction of per-token int8 rounding's."""
    torch.manual_seed(2)
    m, n, k = 17, 100, 1024
    x, w, w_scale = torch.randn(m, k), _int8(n, k), torch.rand(n) * 0.02 + 1e-3
    packed = ops.pack_w8a8(w)
    ref = x.double() @ (w.double() * w_scale.double()[:, None]).T
    split = (ops.int8_split_gemm(x, packed, n, w_scale).double() - ref).abs().max()
    w8a8 = (ops.w8a8_gemm(x, packed, n, w_scale).double() - ref).abs().max()
    assert split < w8a8 / 50, (split.item(), w8a8.item())


@pytest.mark.parametrize("allow_amx", [True, False], ids=["amx", "vector"])
def test_passes_over_rows_cover_every_row(ops, allow_amx: bool) -> None:
    """Rows past one L2-sized pass (96 rows at K = 8192), a partial pass and a partial chunk."""
    torch.manual_seed(3)
    m, n, k = 211, 20, 8192
    qx, w = _int8(m, k), _int8(n, k)
    packed = ops.pack_w8a8(w)
    got = ops.w8a8_gemm_s32(qx, packed, n, allow_amx=allow_amx)
    assert torch.equal(got, (qx.long() @ w.long().T).int())
    x, w_scale = torch.randn(m, k), torch.rand(n) * 0.02 + 1e-3
    y = ops.int8_split_gemm(x, packed, n, w_scale, allow_amx=allow_amx)
    ref = x.double() @ (w.double() * w_scale.double()[:, None]).T
    assert ((y.double() - ref).abs().max() / ref.abs().max()).item() < SPLIT_TOLERANCE[x.dtype]


@pytest.mark.parametrize(("m", "n", "k"), [(2, 16, 64), (9, 100, 1024), (64, 48, 256)])
def test_split_tiles_equal_the_vector_path(ops, m: int, n: int, k: int) -> None:
    if not ops.has_amx_int8():
        pytest.skip("AMX-INT8 tiles need an avx512bf16 build on a processor with amx_int8")
    torch.manual_seed(k)
    x, w, w_scale = torch.randn(m, k).bfloat16(), _int8(n, k), torch.rand(n) * 0.02 + 1e-3
    packed = ops.pack_w8a8(w)
    tiles = ops.int8_split_gemm(x, packed, n, w_scale)
    vector = ops.int8_split_gemm(x, packed, n, w_scale, allow_amx=False, dp_min_rows=0)
    assert torch.equal(tiles, vector)


def test_split_bad_inputs_raise(ops) -> None:
    packed = ops.pack_w8a8(_int8(20, 8))
    with pytest.raises(RuntimeError, match="int8_split_gemm: .*K="):
        ops.int8_split_gemm(torch.randn(2, 9), packed, 20, torch.ones(20))
    with pytest.raises(RuntimeError, match="float32, bfloat16 or float16"):
        ops.int8_split_gemm(torch.randn(2, 8).double(), packed, 20, torch.ones(20))
    assert ops.int8_split_gemm(torch.empty(0, 8), packed, 20, torch.ones(20)).shape == (0, 20)


# Many bf16 rows: int8_split_gemm converts each K-block of the weights to bf16 once and runs
# vdpbf16ps (gemm_dp.h) in builds that have it. Same reference and tolerance as the planes.
# (M, N, K): K off the 4-byte groups by 2 (a group whose second pair lies past K), past one
# 256-k block; an odd panel count (a last panel alone); M off the 8- and 12-row tiles.
DP_SHAPES = [(33, 37, 1102), (40, 48, 256), (17, 16, 6), (70, 100, 530), (1, 20, 64)]


@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize(("m", "n", "k"), DP_SHAPES)
def test_bf16_batches_convert_the_weights(ops, m: int, n: int, k: int, bias: bool) -> None:
    torch.manual_seed(m * n + k)
    x = torch.randn(m, k).bfloat16()
    w, w_scale = _int8(n, k), torch.rand(n) * 0.02 + 1e-3
    b = torch.randn(n).bfloat16() if bias else None
    packed = ops.pack_w8a8(w)
    converted = ops.int8_split_gemm(x, packed, n, w_scale, b, allow_amx=False, dp_min_rows=1)
    planes = ops.int8_split_gemm(x, packed, n, w_scale, b, allow_amx=False, dp_min_rows=0)
    assert converted.dtype == torch.bfloat16 and converted.shape == (m, n)
    ref = x.double() @ (w.double() * w_scale.double()[:, None]).T
    ref = ref if b is None else ref + b.double()
    scale = ref.abs().max().item()
    for y in (converted, planes):
        err = (y.double() - ref).abs().max().item() / scale
        assert err < SPLIT_TOLERANCE[torch.bfloat16], f"relative error {err:.2e}"
    if ops.int8_dp_min_rows() == 0:  # no vdpbf16ps in this build: the planes either way
        assert torch.equal(converted, planes)


def test_the_row_count_chooses_the_path(ops) -> None:
    """From int8_dp_min_rows() bf16 rows on, the default call is the converting path, below it
    the planes (where AMX-INT8 tiles run the planes they keep every batch)."""
    threshold = ops.int8_dp_min_rows()
    if threshold == 0:
        assert ops.built_isa() != "avx512bf16"
        return
    assert ops.built_isa() == "avx512bf16"
    torch.manual_seed(4)
    n, k = 40, 64
    w, w_scale = _int8(n, k), torch.rand(n) * 0.02 + 1e-3
    packed = ops.pack_w8a8(w)
    for m, dp in ((threshold, True), (threshold - 1, False)):
        x = torch.randn(m, k).bfloat16()
        default = ops.int8_split_gemm(x, packed, n, w_scale, allow_amx=False)
        forced = ops.int8_split_gemm(x, packed, n, w_scale, allow_amx=False, dp_min_rows=int(dp))
        assert torch.equal(default, forced), m
    # float32 rows never convert (their precision is not bf16's)
    x = torch.randn(threshold, k)
    assert torch.equal(
        ops.int8_split_gemm(x, packed, n, w_scale, allow_amx=False),
        ops.int8_split_gemm(x, packed, n, w_scale, allow_amx=False, dp_min_rows=0),
    )

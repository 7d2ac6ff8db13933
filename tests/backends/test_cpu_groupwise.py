"""The C++ group-wise GEMM (4-bit and 8-bit weights, groups of 32) against PyTorch references.

The float path against ``dequantize_layer``'s weights: ``x.double() @ W.double().T + bias``,
relative to the largest reference output: float32 outputs 2e-5 (only float32 summation order
differs), bf16 8e-3 and fp16 2e-3 (one rounding of the output). The dot path against its own
definition (``dot_linear_reference``: x rounded to int8 per group, exact integer sums, float32
scales) within float32 rounding (2e-6) or the 16-bit output's; its rounding of x bit for bit
against ``quantize_activation_groups``; and its error against the float reference, bounded.
Every ISA level this processor runs is tested.
"""

from __future__ import annotations

import dataclasses
import shutil

import pytest
import torch
import torch.nn.functional as F

from pagedllm.backends.cpu import dense_gemm, groupwise_linear, groupwise_pack, packed_linear
from pagedllm.backends.cpu._ops import load_kernels, supported_isas
from pagedllm.backends.cpu.groupwise_pack import factor_q6_k, factor_super_blocks, pack_groupwise
from pagedllm.backends.cpu.groupwise_reference import (
    dot_linear_reference,
    quantize_activation_groups,
    split_activation_groups,
)
from pagedllm.layers.linear import ColumnParallelLinear, RowParallelLinear
from pagedllm.layers.quantization.groupwise import (
    GroupwiseMethod,
    dequantize_groups,
    dequantize_int4,
    dequantize_int8_groups,
    dequantize_layer,
    pack_nibbles,
    quantize_int4,
)

pytestmark = pytest.mark.skipif(shutil.which("c++") is None, reason="no C++ compiler")

ISAS = supported_isas()
DOT_ISA = {"avx512bf16": "avx512vnni", "avx512": "avx2", "avx2": "avx2", "scalar": "scalar"}
ACT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
FLOAT_TOL = {torch.float32: 2e-5, torch.bfloat16: 8e-3, torch.float16: 2e-3}
DOT_TOL = {torch.float32: 2e-6, torch.bfloat16: 8e-3, torch.float16: 2e-3}
ROWS = (1, 2, 3, 7, 8, 9, 16, 33, 70)
# (N, K): N off the 16-column panels; K one group, three (an odd count), 128.
SHAPES = ((37, 32), (17, 96), (50, 4096))  # factored Q4_K needs whole 256s: the last
# Weight sources: GGUF Q4_0 / Q4_1 / Q4_K / Q8_0 / Q6_K, quantize_int4, and float32 scales (no
# exact compact form: the 6-bit and 9-bit formats).
KINDS = ("q4_0", "q4_1", "q4_k", "int4", "q4_f32", "q8_0", "q8_f32", "q6_k", "q5_k")
# q6_k needs K in whole super-blocks of 256: one, three (an odd count) and 16.
Q6_K_SHAPES = ((17, 256), (37, 768), (50, 4096))
CASES = [(kind, shape) for kind in KINDS if kind != "q6_k" for shape in SHAPES] + [
    ("q6_k", shape) for shape in Q6_K_SHAPES
]
# The float path reads Q6_K's q at 6 bits too ("q6_k6": AVX2 and AVX-512 builds; no dot
# path), and 8-bit layers of IQ4 levels at 4 bits (IQ4_NL's fp16 d, IQ4_XS's float32
# d * (ls - 32)); so do AVX2's int16 kernels of bf16 rows (six blocks and levels alike).
SIX_CASES = [("q6_k6", shape) for shape in Q6_K_SHAPES]
IQ4_CASES = [(kind, shape) for kind in ("iq4", "iq4_f32") for shape in SHAPES]
INT16_CASES = CASES + SIX_CASES + IQ4_CASES
FLOAT_CASES = INT16_CASES
INT16_KINDS = (
    *("q4_0", "q4_1", "q4_k", "int4", "q4_f32", "q8_0", "q8_f32", "q5_k", "q6_k", "q6_k6"),
    *("iq4", "iq4_f32"),
)


@pytest.fixture(scope="module", params=ISAS)
def ops(request: pytest.FixtureRequest):
    module = load_kernels(isa=request.param)
    assert module.built_isa() == request.param
    assert module.int8_dot_isa() == DOT_ISA[request.param]
    return module


def _fp16(t: torch.Tensor) -> torch.Tensor:
    return t.half().float()


def _q4_k_factor(n: int, g: int) -> torch.Tensor:
    """float32 ``[N, G]``: fp16 per 8 groups times 0..63, Q4_K's largest group of 8 at 63."""
    units = torch.randint(0, 64, (n, g)).float()
    units[:, ::8] = 63
    d = _fp16(torch.rand(n, (g + 7) // 8) + 0.5).repeat_interleave(8, dim=1)[:, :g]
    return d * units


def _q6_k_data(n: int, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q int8 in -32..31 [N, K], scale = d * sc [N, K/16], d [N, K/256]) as Q6_K stores them:
    fp16 d of either sign, any signed byte sc (-128 included)."""
    q = torch.randint(-32, 32, (n, k), dtype=torch.int8)
    d = _fp16((torch.rand(n, k // 256) + 0.5) * 1e-4 * torch.randn(n, k // 256).sign())
    sc = torch.randint(-128, 128, (n, k // 16)).float()
    sc[:, ::16] = -128
    return q, d.repeat_interleave(16, dim=1) * sc, d


def _pack(ops, weight: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor | None):
    """pack_groupwise, given a q6_k layer's d (carried by _layer_data's scale as ``q6_k_d``,
    and ``q6_k_six`` for q at 6 bits)."""
    six = getattr(scale, "q6_k_six", False)
    if six and not ops.groupwise_six_bits():
        pytest.skip(f"the {ops.built_isa()} build reads no six-bit weights")
    if getattr(scale, "iq4", False):
        return pack_groupwise(ops, weight, scale, offset, levels=True)
    return pack_groupwise(ops, weight, scale, offset, getattr(scale, "q6_k_d", None), six=six)


def _layer_data(
    kind: str, n: int, k: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """(stored weight, scale, offset, integers q [N, K]) shaped as each source makes them
    (q6_k: :func:`_q6_k_data`'s d as the scale's ``q6_k_d``, read by :func:`_pack`)."""
    if kind in ("q6_k", "q6_k6"):
        q, scale, d = _q6_k_data(n, k)
        scale.q6_k_d = d
        scale.q6_k_six = kind == "q6_k6"
        return q, scale, None, q
    g = k // 32
    if kind in ("iq4", "iq4_f32"):  # int8 IQ4 levels, every one of them; fp16 d or float32
        q = torch.tensor(groupwise_pack.IQ4_LEVELS, dtype=torch.int8)[torch.randint(0, 16, (n, k))]
        d = (torch.rand(n, g) * 0.01 + 1e-3) * torch.randn(n, g).sign()
        scale = _fp16(d) if kind == "iq4" else d
        scale.iq4 = True
        return q, scale, None, q
    if kind == "q5_k":  # q in 0..31 as int8, d * sc and -dmin * m (Q4_K's factors)
        q = torch.randint(0, 32, (n, k), dtype=torch.int8)
        scale, offset = _q4_k_factor(n, g) * 2**-10, _q4_k_factor(n, g) * -(2**-10)
        return q, scale, offset, q
    if kind in ("q8_0", "q8_f32"):  # fp16 d (or any float32), q in -127..127
        q = torch.randint(-127, 128, (n, k), dtype=torch.int8)
        d = torch.rand(n, g) * 0.01 + 1e-3
        return q, _fp16(d) if kind == "q8_0" else d, None, q
    if kind == "int4":  # quantize_int4 of a float weight: fp16 scale and offset
        packed, scale, offset = quantize_int4(torch.randn(n, k) * 0.05)
        q = torch.stack((packed & 15, packed >> 4), dim=-1).reshape(n, k)
        return packed, scale, offset, q
    q = torch.randint(0, 16, (n, k), dtype=torch.uint8)
    d = _fp16(torch.rand(n, g) * 0.01 + 1e-3)
    if kind == "q4_0":
        scale, offset = d, -8 * d
    elif kind == "q4_1":
        scale, offset = d, _fp16(torch.randn(n, g) * 0.05)
    elif kind == "q4_k":  # fp16 d and dmin per 8 groups, 6-bit sc and m
        scale, offset = _q4_k_factor(n, g) * 2**-10, _q4_k_factor(n, g) * -(2**-10)
    else:  # any float32
        scale, offset = torch.rand(n, g) * 0.01 + 1e-3, torch.randn(n, g) * 0.05
    return pack_nibbles(q), scale, offset, q


def _dequantized(weight: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor | None):
    return dequantize_groups(weight, scale, offset)


def _rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    return ((y.double() - ref).abs().max() / ref.abs().max().clamp_min(1e-30)).item()


def _case_id(case) -> str:
    kind, (n, k) = case
    return f"{kind}-n{n}k{k}"


@pytest.mark.parametrize("xdtype", ACT_DTYPES, ids=str)
@pytest.mark.parametrize("case", FLOAT_CASES, ids=_case_id)
def test_float_path_matches_float64_reference(ops, case, xdtype) -> None:
    kind, shape = case
    n, k = shape
    torch.manual_seed(n + k)
    weight, scale, offset, _ = _layer_data(kind, n, k)
    pw = _pack(ops, weight, scale, offset)
    w = _dequantized(weight, scale, offset).double()
    for m in ROWS:
        for bias in (None, torch.randn(n).to(xdtype)):
            x = torch.randn(m, k).to(xdtype)
            y = pw.gemm(ops, x, bias, False)
            assert y.dtype == xdtype and y.shape == (m, n)
            ref = x.double() @ w.T + (0 if bias is None else bias.double())
            err = _rel_err(y, ref)
            assert err < FLOAT_TOL[xdtype], f"m={m} bias={bias is not None}: rel err {err:.2e}"


@pytest.mark.parametrize("case", FLOAT_CASES, ids=_case_id)
def test_amx_tiles_agree_with_the_vdpbf16ps_path(ops, case) -> None:
    """Where the processor has AMX-BF16, bf16 batches from ``groupwise_amx_rows()`` rows on
    take a tile product per group (two half products for two-scale groups), scaled as the
    vdpbf16ps path scales them: both against the float64 reference, and against each other
    (the same products summed in another order), at row counts across whole and partial
    tiles and the three-tile blocks."""
    tiles_from = ops.groupwise_amx_rows()
    if not tiles_from:
        pytest.skip(f"no AMX tiles for the {ops.built_isa()} build on this processor")
    kind, (n, k) = case
    torch.manual_seed(7 * n + k)
    weight, scale, offset, _ = _layer_data(kind, n, k)
    pw = _pack(ops, weight, scale, offset)
    w = _dequantized(weight, scale, offset).double()
    fmt = (pw.bits, pw.half_scales, pw.with_offset, pw.factored)
    for m in (tiles_from, 16, 17, 48, 49, 70):
        x = torch.randn(m, k).bfloat16()
        bias = torch.randn(n).bfloat16()
        # vdpbf16ps for few rows: the split kernel keeps 4-bit layers off tiles up to 4 rows
        tiles = ops.groupwise_gemm(x, pw.packed, n, *fmt, bias, False, pw.levels, True, "dp")
        vector = ops.groupwise_gemm(x, pw.packed, n, *fmt, bias, False, pw.levels, False, "dp")
        ref = x.double() @ w.T + bias.double()
        assert _rel_err(tiles, ref) < FLOAT_TOL[torch.bfloat16], f"m={m}"
        assert _rel_err(vector, ref) < FLOAT_TOL[torch.bfloat16], f"m={m}"
        assert _rel_err(tiles, vector.double()) < FLOAT_TOL[torch.bfloat16], f"m={m}"
        # Rows are their own: a row's output does not depend on the rows batched with it.
        alone = ops.groupwise_gemm(
            x[:tiles_from], pw.packed, n, *fmt, bias, False, pw.levels, True, "dp"
        )
        assert torch.equal(alone, tiles[:tiles_from])


@pytest.mark.parametrize("case", FLOAT_CASES, ids=_case_id)
def test_weight_rows_from_the_panels_are_the_definition_bit_for_bit(ops, case) -> None:
    """``groupwise_weight_rows`` unpacks rows of W from the panels (what a tied embedding reads
    instead of a second copy of its table): every format, rows in every panel position and
    the last, partial panel, equal to the definition's dequantisation bit for bit."""
    kind, (n, k) = case
    torch.manual_seed(n + k + 1)
    weight, scale, offset, _ = _layer_data(kind, n, k)
    pw = _pack(ops, weight, scale, offset)
    rows = torch.tensor([0, n - 1, 15 % n, 16 % n, 5 % n, n - 1, 0])
    got = pw.rows(ops, rows)
    want = _dequantized(weight, scale, offset)[rows]
    assert got.dtype == torch.float32 and got.shape == (len(rows), k)
    assert torch.equal(got, want), f"max diff {(got - want).abs().max()}"
    assert pw.rows(ops, torch.tensor([], dtype=torch.long)).shape == (0, k)
    with pytest.raises(RuntimeError, match=f"row {n} of {n}"):
        pw.rows(ops, torch.tensor([n]))


@pytest.mark.parametrize("xdtype", ACT_DTYPES, ids=str)
@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_dot_path_matches_its_definition(ops, case, xdtype) -> None:
    kind, shape = case
    n, k = shape
    torch.manual_seed(n * k)
    weight, scale, offset, q = _layer_data(kind, n, k)
    pw = _pack(ops, weight, scale, offset)
    for m in ROWS:
        for bias in (None, torch.randn(n).to(xdtype)):
            x = torch.randn(m, k).to(xdtype)
            y = pw.gemm(ops, x, bias, True)
            assert y.dtype == xdtype and y.shape == (m, n)
            ref = dot_linear_reference(x, q, scale, offset, None if bias is None else bias.float())
            err = _rel_err(y, ref)
            assert err < DOT_TOL[xdtype], f"m={m} bias={bias is not None}: rel err {err:.2e}"


# Prefill-sized batches: odd row counts across the dot path's blocks of rows (128 rows of
# K = 2048, 64 of K = 4096) and its row tiles, N off the panels.
MANY_ROWS = ((257, 2048), (131, 4096))


@pytest.mark.parametrize("xdtype", (torch.float32, torch.bfloat16), ids=str)
@pytest.mark.parametrize("kind", ("q4_0", "q4_1", "q4_k", "q8_0", "q6_k", "q5_k"))
def test_dot_path_matches_its_definition_at_many_rows(ops, kind: str, xdtype) -> None:
    n = 20
    for m, k in MANY_ROWS:
        torch.manual_seed(m + k)
        weight, scale, offset, q = _layer_data(kind, n, k)
        pw = _pack(ops, weight, scale, offset)
        x = torch.randn(m, k).to(xdtype)
        bias = torch.randn(n).to(xdtype)
        y = pw.gemm(ops, x, bias, True)
        assert y.dtype == xdtype and y.shape == (m, n)
        ref = dot_linear_reference(x, q, scale, offset, bias.float())
        err = _rel_err(y, ref)
        assert err < DOT_TOL[xdtype], f"m={m} k={k}: rel err {err:.2e}"
        # Each row is its own: the rows of a prefill equal those rows computed alone.
        rows = torch.tensor([0, m // 2, m - 1])
        assert torch.equal(pw.gemm(ops, x[rows], bias, True), y[rows]), f"m={m} k={k}"


@pytest.mark.parametrize("kind", ("q4_0", "q4_1", "q4_k", "int4"))
def test_a_row_on_the_dot_tiles_is_the_row_alone(ops, kind: str) -> None:
    """Past four rows the dot path runs 4-bit layers on register tiles (AVX2 builds:
    gemm_q4_dot_tiles.h) whose integer sums and float32 operations per group are the few-row
    kernel's, in its order: every row of a batch is bit for bit that row alone, uneven tiles,
    K-blocks and passes included."""
    n, k = 37, 768  # 24 groups: three K-blocks of 8
    torch.manual_seed(43)
    pw = _pack(ops, *_layer_data(kind, n, k)[:3])
    bias = torch.randn(n).bfloat16()
    for m in (5, 6, 7, 13, 64):
        x = _spiky_rows(m, k)
        y = pw.gemm(ops, x, bias, True)
        for r in range(m):
            assert torch.equal(y[r], pw.gemm(ops, x[r : r + 1], bias, True)[0]), (m, r)


@pytest.mark.parametrize("xdtype", ACT_DTYPES, ids=str)
def test_activation_rounding_is_the_definition_bit_for_bit(ops, xdtype) -> None:
    torch.manual_seed(1)
    x = torch.randn(9, 256) * 3
    x[0, :32] = 0  # an all-zero group: scale 1, zeros
    x[1, :32] = torch.arange(32) - 15.5  # max 16.5: x / dx lands on halves (ties to even)
    x[2, 32:64] = 1e-30  # tiny
    x = x.to(xdtype)
    q, dx = ops.quantize_groups(x)
    q_ref, dx_ref = quantize_activation_groups(x)
    assert torch.equal(dx, dx_ref), (dx - dx_ref).abs().max()
    assert torch.equal(q, q_ref), (q.int() - q_ref.int()).abs().max()
    assert int(q.abs().max()) == 127


@pytest.mark.parametrize("kind", ("q4_1", "q8_0", "q6_k", "q5_k"))
def test_dot_path_error_against_the_float_reference_is_bounded(ops, kind: str) -> None:
    """What rounding x to int8 per group costs: measured rms ~0.55% of the output (Gaussian x;
    ~1.1% with 1% of x 20x larger), against ~0.17% for rounding the output to bf16."""
    torch.manual_seed(3)
    n, k = 64, 2048
    weight, scale, offset, _ = _layer_data(kind, n, k)
    pw = _pack(ops, weight, scale, offset)
    x = torch.randn(8, k)
    y = pw.gemm(ops, x, None, True)
    ref = x.double() @ _dequantized(weight, scale, offset).double().T
    rms = ((y.double() - ref).norm() / ref.norm()).item()
    assert 1e-4 < rms < 1e-2, f"rms relative error {rms:.2e}"


def test_formats_and_bits_per_weight(ops) -> None:
    n, k = 20, 512
    expected = {  # (half_scales, with_offset, factored), bits a weight
        "q4_0": ((True, False, False), 4.5),
        "q4_k": ((True, True, True), 4.625),
        "q4_1": ((True, True, False), 5.0),
        "int4": ((True, True, False), 5.0),
        "q4_f32": ((False, True, False), 6.0),
        "q8_0": ((True, False, False), 8.5),
        "q8_f32": ((False, False, False), 9.0),
        # Factored: a header per 8 groups of d (and dm) padded to 64 bytes, then the groups'
        # index bytes (sc, m: 2 * 16 each), before 8 blocks of q alone.
        "q6_k": ((True, False, True), 8.625),  # 512 a block, 64 + 256 a header
        "q5_k": ((False, True, False), 10.0),  # 8-bit q, float32 scale and offset per 32
        "iq4": ((True, False, False), 4.5),  # Q4_0's layout, read through the levels
        "iq4_f32": ((False, False, False), 5.0),
    }
    if ops.groupwise_six_bits():
        expected["q6_k6"] = ((True, False, True), 6.625)  # 384 a block, 64 + 256 a header
    for kind, (fmt, bits) in expected.items():
        torch.manual_seed(0)
        weight, scale, offset, _ = _layer_data(kind, n, k)
        pw = _pack(ops, weight, scale, offset)
        assert (pw.half_scales, pw.with_offset, pw.factored) == fmt, kind
        assert pw.packed.shape == (2, int(bits * k * 16 / 8)), kind
        assert pw.bits_per_weight == bits
        # Super-blocks of a header and 2 blocks (8 factored): every block on a cache line.
        assert pw.packed.shape[1] % 64 == 0 and pw.packed.data_ptr() % 64 == 0, kind
        names = {"q6_k": "q6_k", "q6_k6": "q6_k", "q8_0": "q8_0", "q8_f32": "q8_0"}
        names.update(iq4="iq4", iq4_f32="iq4", q5_k="q5_k")
        assert pw.name == names.get(kind, "int4")


def test_six_bit_weights_are_refused_where_they_cannot_run(ops) -> None:
    """Six-bit q6_k never runs the dot path, and packs only in builds that read it (AVX2,
    AVX-512)."""
    torch.manual_seed(5)
    q, scale, d = _q6_k_data(20, 256)
    x = torch.randn(2, 256).bfloat16()
    if not ops.groupwise_six_bits():
        with pytest.raises(RuntimeError, match="six-bit weights need an AVX2 or AVX-512 build"):
            pack_groupwise(ops, q, scale, None, d, six=True)
        return
    pw = pack_groupwise(ops, q, scale, None, d, six=True)
    assert pw.bits == 6
    with pytest.raises(RuntimeError, match="six-bit weights never take the dot path"):
        pw.gemm(ops, x, None, True)
    # The six and int8 layouts of one layer give the same float path sums, up to order.
    eight = pack_groupwise(ops, q, scale, None, d)
    ref = eight.gemm(ops, x.float(), None, False)
    torch.testing.assert_close(pw.gemm(ops, x.float(), None, False), ref, rtol=1e-5, atol=1e-7)
    with pytest.raises(RuntimeError, match="factored"):
        ops.groupwise_gemm(x, pw.packed, 20, 6, True, False, False, None, False)


def test_iq4_levels_never_take_the_dot_path_and_must_all_be_levels(ops) -> None:
    """A layer of IQ4 levels at 4 bits: the dot path refused; a q outside the levels refused
    at pack time (make_groupwise_linear then keeps the 8-bit layout); the 4- and 8-bit layouts
    of one layer give the same float path sums, up to order."""
    torch.manual_seed(7)
    q, scale, _, _ = _layer_data("iq4_f32", 20, 256)
    pw = pack_groupwise(ops, q, scale, None, levels=True)
    assert (pw.bits, pw.levels, pw.name) == (4, True, "iq4")
    x = torch.randn(3, 256)
    with pytest.raises(RuntimeError, match="IQ4 levels never take the dot path"):
        pw.gemm(ops, x.bfloat16(), None, True)
    eight = pack_groupwise(ops, q, scale, None)
    want = eight.gemm(ops, x, None, False)
    torch.testing.assert_close(pw.gemm(ops, x, None, False), want, rtol=1e-5, atol=1e-6)
    off = q.clone()
    off[3, 7] = 2  # not a level
    with pytest.raises(ValueError, match="not IQ4 levels"):
        pack_groupwise(ops, off, scale, None, levels=True)


def test_a_q8_0_layer_of_iq4_levels_packs_four_bits_unless_it_takes_the_dot_path() -> None:
    """make_groupwise_linear: an IQ4 layer (held as q8_0) at 4 bits by default, the 8-bit
    layout where ``int8_activations`` sends it to the dot path (not where the int16 tiles run:
    ``takes_dot``, there it keeps 4 bits) and for a true Q8_0 layer; a layer whose first row is
    levels but not the rest falls back to 8 bits, still correct."""
    from types import SimpleNamespace

    ops = dense_gemm.gemm_ops()
    if ops is None:
        pytest.skip("the C++ GEMM could not be built")
    torch.manual_seed(8)
    q, scale, _, _ = _layer_data("iq4", 48, 512)
    q8, scale8, _, _ = _layer_data("q8_0", 48, 512)
    mixed = q.clone()
    mixed[5, 9] = 3
    dot_name = "q8_0" if groupwise_linear.takes_dot(ops, "q8_0", dot=True) else "iq4"
    cases = ((q, scale, False, "iq4"), (q, scale, True, dot_name), (q8, scale8, False, "q8_0"))
    for weight, s, dot, name in (*cases, (mixed, scale, False, "q8_0")):
        layer = SimpleNamespace(
            weight=weight,
            weight_scale_bits=s.float().contiguous().view(torch.int32),
            quant_method=GroupwiseMethod.for_format("q8_0"),
        )
        kernel = groupwise_linear.make_groupwise_linear(layer, None, dot=dot)
        fn, path = kernel.fn, kernel.path
        assert fn is not None and path.startswith(f"cpp-{name}-"), (name, dot, path)
        x = torch.randn(2, 512)
        ref = x.double() @ dequantize_int8_groups(weight, s.float()).double().T
        assert _rel_err(fn(x), ref) < FLOAT_TOL[torch.float32]


def test_a_q6_k_layer_packs_six_bits_unless_it_takes_the_dot_path() -> None:
    """make_groupwise_linear: six bits where the layer only runs the float path (the default,
    and every LM head); the int8 layout where int8_activations sends it to the dot path."""
    ops = dense_gemm.gemm_ops()
    if ops is None or not ops.groupwise_six_bits():
        pytest.skip("this machine's build reads no six-bit weights")
    torch.manual_seed(6)
    q, scale, d = _q6_k_data(48, 512)
    for dot, bits in ((False, 6), (True, 8)):
        assert groupwise_pack.six_bits(ops, "q6_k", dot=dot) == (bits == 6)
        assert pack_groupwise(ops, q, scale, None, d, six=bits == 6).bits == bits
    assert not groupwise_pack.six_bits(ops, "q8_0", dot=False)


def test_q6_k_factoring_is_exact_or_refused(ops) -> None:
    """sc = scale / d, checked bit for bit; a layer whose scales are not d * sc (sc a signed
    byte) is refused rather than packed approximately."""
    torch.manual_seed(4)
    q, scale, d = _q6_k_data(4, 512)
    sc = factor_q6_k(scale, d)
    assert sc is not None and torch.equal(d.repeat_interleave(16, dim=1) * sc.float(), scale)
    assert int(sc.min()) == -128
    zero = d.clone()
    zero[1, 0] = 0  # d = 0: sc = 0 is exact only where the products are zero
    assert factor_q6_k(scale, zero) is None
    scale0 = scale.clone()
    scale0[1, :16] = 0
    assert factor_q6_k(scale0, zero) is not None
    off = scale.clone()
    off[2, 5] *= 1 + 2**-20  # off the grid
    assert factor_q6_k(off, d) is None
    assert factor_q6_k(scale * 2, d) is None  # sc = -256: not a byte
    with pytest.raises(ValueError, match="weight_scale"):
        pack_groupwise(ops, q, off, None, d)
    # d that no fp16 holds: stored as float32 (products of d and sc rounded as the layer's)
    d32 = d * (1 + 2**-12)
    scale32 = d32.repeat_interleave(16, dim=1) * sc.float()
    pw = pack_groupwise(ops, q, scale32, None, d32)
    assert pw.factored and not pw.half_scales
    x = torch.randn(3, 512)
    ref = x.double() @ dequantize_int8_groups(q, scale32).double().T
    assert _rel_err(pw.gemm(ops, x, None, False), ref) < FLOAT_TOL[torch.float32]


def test_factoring_is_exact_or_refused() -> None:
    torch.manual_seed(2)
    scale, offset = _q4_k_factor(4, 16), _q4_k_factor(4, 16) * -1
    factors, index = factor_super_blocks(scale, offset)
    units = index.float()  # [N, G, 2]
    d = factors.repeat_interleave(8, dim=1)  # [N, G, 2]
    assert torch.equal(d[..., 0] * units[..., 0], scale)
    assert torch.equal(d[..., 1] * units[..., 1], offset)
    scale[2, 9] = scale[2, 9] * (1 + 2**-20)  # one group off the grid: the whole layer refuses
    assert factor_super_blocks(scale, offset) is None
    assert factor_super_blocks(scale[:, :12], offset[:, :12]) is None  # not whole super-blocks


def test_one_inexact_fp16_scale_keeps_the_layer_float32(ops) -> None:
    torch.manual_seed(5)
    weight, scale, offset, _ = _layer_data("q4_1", 16, 64)
    scale[3, 1] = 1.0 + 2**-20  # not an fp16: rounding it would change the weights
    pw = _pack(ops, weight, scale, offset)
    assert not pw.half_scales and not pw.factored
    x = torch.randn(2, 64)
    ref = x.double() @ dequantize_int4(weight, scale, offset).double().T
    assert _rel_err(pw.gemm(ops, x, None, False), ref) < FLOAT_TOL[torch.float32]


def test_bad_inputs_raise(ops) -> None:
    weight, scale, offset, _ = _layer_data("q4_1", 20, 64)
    pw = _pack(ops, weight, scale, offset)
    x = torch.randn(1, 64)
    with pytest.raises(RuntimeError, match="packed must be"):  # the format disagrees
        ops.groupwise_gemm(x, pw.packed, 20, 4, True, False, False, None, False)
    with pytest.raises(RuntimeError, match="packed must be"):  # K=128 for a K=64 layer
        ops.groupwise_gemm(torch.randn(1, 128), pw.packed, 20, 4, True, True, False, None, False)
    # K=32 fills the same panels as K=64 (super-blocks of 2 groups): the layer checks K.
    with pytest.raises(ValueError, match="^x: 32 features for a layer of 64$"):
        pw.gemm(ops, torch.randn(1, 32), None, False)
    with pytest.raises(ValueError, match="^x: 32 features for a layer of 64$"):
        groupwise_linear.make_groupwise_gemm(ops, pw, None)(torch.randn(1, 32))
    with pytest.raises(RuntimeError, match="does not fit"):
        ops.groupwise_gemm(x, pw.packed, 40, 4, True, True, False, None, False)
    with pytest.raises(RuntimeError, match="bits must be"):
        ops.groupwise_gemm(x, pw.packed, 20, 3, True, True, False, None, False)
    with pytest.raises(RuntimeError, match="multiple of 256"):
        ops.groupwise_gemm(x, pw.packed, 20, 4, True, True, True, None, False)
    with pytest.raises(RuntimeError, match="multiple of 32"):
        ops.pack_groupwise(
            torch.zeros(4, 24, dtype=torch.uint8), scale[:4], offset[:4], 4, True, True
        )
    assert pw.gemm(ops, torch.empty(0, 64), None, True).shape == (0, 20)


# -- the three kernels of few bf16 rows on 4-bit layers -------------------------------
FOUR_BIT_CASES = [c for c in FLOAT_CASES if c[0] in ("q4_0", "q4_1", "q4_k", "int4", "q4_f32")]
FOUR_BIT_CASES += [c for c in FLOAT_CASES if c[0] in ("iq4", "iq4_f32")]


def _bf16_row_kernels(ops) -> tuple[str, ...]:
    """The three kernels where the build has vdpbf16ps (a build without it has none)."""
    built = ops.groupwise_bf16_rows_kernels()
    assert sorted(built) in ([], ["dp", "fma", "split"]), built
    return ("dp", "fma", "split") if built else ()


def _within_a_bf16_step(y: torch.Tensor, ref: torch.Tensor) -> bool:
    """Every element of ``y`` within one bf16 step (2^-7 of its power of two) of the float64
    ``ref``, plus 1e-4 of the largest (what float32 sums and the split rounding may add to
    an output near zero): tighter than the float path's relative bound, loose enough for the
    kernels' own roundings."""
    step = torch.exp2(torch.floor(torch.log2(ref.abs().clamp_min(1e-30))) - 7)
    return bool(((y.double() - ref).abs() <= step + 1e-4 * ref.abs().max()).all())


def _within_a_step(y: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> bool:
    """:func:`_within_a_bf16_step` for bf16 or fp16 ``y`` (one step: 2^-7 or 2^-10 of its
    power of two)."""
    bits = 7 if dtype == torch.bfloat16 else 10
    step = torch.exp2(torch.floor(torch.log2(ref.abs().clamp_min(1e-30))) - bits)
    return bool(((y.double() - ref).abs() <= step + 1e-5 * ref.abs().max()).all())


@pytest.mark.parametrize("xdtype", (torch.bfloat16, torch.float16), ids=str)
@pytest.mark.parametrize("case", FLOAT_CASES, ids=_case_id)
def test_few_16bit_rows_are_the_reference_rounded_once(ops, case, xdtype) -> None:
    """One to four rows of bf16 / fp16 x (decode) on every format: each output element within
    one step of its dtype of the float64 reference (float32 sums add ~1e-7 of the largest):
    AVX2 builds run them on q with the scales applied per group (gemm_q4_avx2.h), where a
    wrong nibble, byte, scale or offset moves an element by far more than a step."""
    kind, (n, k) = case
    torch.manual_seed(5 * n + k)
    weight, scale, offset, _ = _layer_data(kind, n, k)
    pw = _pack(ops, weight, scale, offset)
    w = _dequantized(weight, scale, offset).double()
    for m in (1, 2, 3, 4):
        x = torch.randn(m, k).to(xdtype)
        bias = torch.randn(n).to(xdtype) if m % 2 else None
        ref = x.double() @ w.T + (0 if bias is None else bias.double())
        y = pw.gemm(ops, x, bias, False)
        assert y.dtype == xdtype
        assert _within_a_step(y, ref, xdtype), f"m={m}: max err {(y.double() - ref).abs().max()}"


@pytest.mark.parametrize("case", FOUR_BIT_CASES, ids=_case_id)
def test_the_bf16_row_kernels_match_the_reference_and_each_other(ops, case) -> None:
    """Few bf16 rows on a 4-bit layer take the split kernel (x as two int8 rows, the default),
    vdpbf16ps on q or float32 FMAs on q (``rows_kernel``): each within one bf16 step
    of the float64 reference element by element, so within the float path's bound of each
    other, at every row count the register kernels take (past them, where none runs, equal)."""
    kernels = _bf16_row_kernels(ops)
    if not kernels:
        pytest.skip(f"the {ops.built_isa()} build has no vdpbf16ps kernels")
    kind, (n, k) = case
    torch.manual_seed(3 * n + k)
    weight, scale, offset, _ = _layer_data(kind, n, k)
    pw = _pack(ops, weight, scale, offset)
    w = _dequantized(weight, scale, offset).double()
    differs = False
    for m in (1, 2, 3, 4, 5, 8, 9):
        x = torch.randn(m, k).bfloat16()
        bias = torch.randn(n).bfloat16()
        ref = x.double() @ w.T + bias.double()
        got = {}
        for kernel in kernels:
            got[kernel] = pw.gemm(ops, x, bias, False, rows_kernel=kernel)
            assert _within_a_bf16_step(got[kernel], ref), f"{kernel} m={m}"
        for kernel in kernels[1:]:
            err = _rel_err(got[kernel], got["dp"].double())
            assert err < FLOAT_TOL[torch.bfloat16], f"{kernel} m={m}"
        if m > 8:  # no register kernel at this many rows: one path for every setting
            assert all(torch.equal(got[kernel], got["dp"]) for kernel in kernels)
        elif m <= 3:
            differs |= not torch.equal(got["split"], got["dp"])
    if k == 4096 and not kind.startswith("iq4"):  # split ran (not on levels): its rounding
        assert differs, "split gave vdpbf16ps's outputs bit for bit"  # shows in 50 x 6 rows


@pytest.mark.parametrize("xdtype", (torch.float32, torch.bfloat16), ids=str)
def test_the_split_rounding_is_its_definition_bit_for_bit(ops, xdtype) -> None:
    """``quantize_groups(x, split=True)`` (the split kernel's rows) equals
    ``split_activation_groups``, and the two rows give x back to max|x| / 64,516 per group,
    where one int8 row is off by up to max|x| / 254."""
    torch.manual_seed(4)
    x = (torch.randn(5, 256) * torch.logspace(-3, 2, 256)).to(xdtype)
    x[1, 32:64] = 0  # an all-zero group
    q, dx = ops.quantize_groups(x, split=True)
    want_q, want_dx = split_activation_groups(x)
    assert torch.equal(q, want_q) and torch.equal(dx, want_dx)
    groups = (q.double().view(10, 8, 32) * dx.double()[..., None]).view(5, 2, 8, 32).sum(1)
    amax = x.double().view(5, 8, 32).abs().amax(-1, keepdim=True)
    err = (groups - x.double().view(5, 8, 32)).abs()
    assert (err <= amax / 64516 + 1e-30).all() and err.amax() > 0
    one_row, one_dx = ops.quantize_groups(x)
    assert torch.equal(one_row, q[0::2]) and torch.equal(one_dx, dx[0::2])


def test_the_split_kernel_is_named_in_the_path_and_the_kernel_checked() -> None:
    """``+split`` in a 4-bit layer's path where its few bf16 rows take the split kernel (the
    default), never in an 8-bit or IQ4 layer's; an unknown ``rows_kernel`` is refused by name,
    by the single and the grouped GEMM."""
    from types import SimpleNamespace

    ops = dense_gemm.gemm_ops()
    if ops is None or not ops.groupwise_bf16_rows_kernels():
        pytest.skip("no vdpbf16ps build on this processor")
    torch.manual_seed(9)
    paths = {}
    for kind in ("q4_0", "q8_0", "iq4"):
        weight, scale, offset, _ = _layer_data(kind, 32, 64)
        layer = SimpleNamespace(
            weight=weight,
            weight_scale_bits=scale.float().contiguous().view(torch.int32),
            # A Q4_0 layer is an int4 one; IQ4 levels are held as q8_0.
            quant_method=GroupwiseMethod.for_format(
                {"q4_0": "int4", "iq4": "q8_0"}.get(kind, kind)
            ),
        )
        if offset is not None:
            layer.weight_offset_bits = offset.float().contiguous().view(torch.int32)
        kernel = groupwise_linear.make_groupwise_linear(layer, None)
        fn, paths[kind] = kernel.fn, kernel.path
        assert fn is not None, paths[kind]
    assert paths["q4_0"].startswith("cpp-int4-") and "+split" in paths["q4_0"], paths
    assert "+split" not in paths["q8_0"] and "+split" not in paths["iq4"], paths
    assert paths["iq4"].startswith("cpp-iq4-"), paths
    # Where AMX tiles run, the names say from which rows: later for the split 4-bit layer.
    tiles_from, split_tiles_from = ops.groupwise_amx_rows(), ops.groupwise_amx_rows(True)
    assert bool(tiles_from) == bool(split_tiles_from) and split_tiles_from >= tiles_from
    if tiles_from:
        assert f"+amx{split_tiles_from}+split" in paths["q4_0"], paths
        assert f"+amx{tiles_from}" in paths["q8_0"] and f"+amx{tiles_from}" in paths["iq4"]
        # The split kernel's one dot tile of rows beats the tiles where they would start ...
        assert split_tiles_from > tiles_from, (tiles_from, split_tiles_from)
        # ... and the calls do what the names say: below split_tiles_from rows a 4-bit layer's
        # rows take the split kernel whether tiles are allowed or not, from there the tiles
        # (the same bits under any kernel of few rows).
        big = _pack(ops, *_layer_data("q4_0", 48, 256)[:3])
        big_fmt = (48, big.bits, big.half_scales, big.with_offset, big.factored)
        for m, tiles in ((split_tiles_from - 1, False), (split_tiles_from, True)):
            x = torch.randn(m, 256).bfloat16()
            split = ops.groupwise_gemm(x, big.packed, *big_fmt, None, False, False, True, "split")
            alone = ops.groupwise_gemm(x, big.packed, *big_fmt, None, False, False, False, "split")
            on_tiles = ops.groupwise_gemm(x, big.packed, *big_fmt, None, False, False, True, "dp")
            assert torch.equal(split, on_tiles if tiles else alone), f"{m} rows"
    pw = _pack(ops, *_layer_data("q4_0", 32, 64)[:3])
    x = torch.randn(2, 64).bfloat16()
    with pytest.raises(RuntimeError, match="groupwise_gemm: rows_kernel must be 'split', 'dp'"):
        pw.gemm(ops, x, None, False, rows_kernel="vnni")
    fmt = (32, pw.bits, pw.half_scales, pw.with_offset, pw.factored)
    with pytest.raises(RuntimeError, match="groupwise_gemm_grouped: rows_kernel must be"):
        ops.groupwise_gemm_grouped(x, [pw.packed], [0, 2], *fmt, rows_kernel="auto")


# -- the int16 kernel of few bf16 rows (AVX2 without AVX-512) --------------------------------
def _int16_rounded(x: torch.Tensor) -> torch.Tensor:
    """float64 ``x`` as the int16 kernel reads it: per group of 32, s = 2^(floor(log2(max|x|))
    - 14), x / s rounded half to even (an all-zero group stays zero)."""
    m, k = x.shape
    groups = x.double().view(m, k // 32, 32)
    amax = groups.abs().amax(-1, keepdim=True)
    e = torch.where(amax > 0, torch.floor(torch.log2(amax.clamp_min(1e-300))), 0.0)
    s = torch.exp2(e - 14)
    q = torch.round(groups / s)  # torch.round: half to even
    assert q.abs().max() <= 2**15 - 1
    return (q * s).view(m, k)


def _int16_kernel_rows(ops) -> int:
    rows = ops.groupwise_int16_rows()
    if not rows:
        pytest.skip(f"the {ops.built_isa()} build has no int16 kernel")
    return rows


def test_int16_rounding_keeps_bf16_within_2_to_the_7_of_the_max_exactly() -> None:
    """The rounding the int16 kernel defines (``_int16_rounded``): every bf16 element within 2^7
    of its group's largest is kept exactly (8 significant bits times a power of two at or above
    s), smaller ones within s / 2 = 2^-15 of the largest of their own values."""
    torch.manual_seed(21)
    top = torch.logspace(-30, 30, 6)[:, None]  # each group's largest, 1 to 2^7 above the rest
    x = torch.exp2(-7 * torch.rand(6, 256)) * torch.randn(6, 256).sign() * top
    x[:, ::32] = top
    x = x.bfloat16()
    assert torch.equal(_int16_rounded(x), x.double())
    wide = (torch.randn(6, 256) * torch.logspace(-8, 8, 256)).bfloat16()  # 2^53 across a row
    err = (_int16_rounded(wide) - wide.double()).abs().view(6, 8, 32)
    amax = wide.double().abs().view(6, 8, 32).amax(-1, keepdim=True)
    assert (err <= amax * 2**-15).all() and (err > 0).any()


@pytest.mark.parametrize("kind", INT16_KINDS)
def test_the_int16_kernel_is_its_rounding_then_the_definition(ops, kind: str) -> None:
    """One to sixteen bf16 rows under the default kernel on AVX2 builds (the few-row kernel, in
    chunks of four rows per panel past four), and batches past them (the int16 tiles:
    ``groupwise_int16_tiles_from()``): the float64 product of the
    dequantised layer with ``_int16_rounded(x)``, rounded once to bf16 (within half a step plus
    float32 sums). Each column's weights are one value across K, so an output is that value
    times the sum of the row's rounded x. Groups of +H and -H with small values (2^-2 to 2^-10
    of 1, H = 2^10: s = 2^-4) exercise the rounding; groups of +H, -H, 2s and values just
    below s / 2 (which round to zero) make it ~20% of every output, which exact x (the float
    kernel, ``rows_kernel="fma"``) shows by many steps."""
    rows = _int16_kernel_rows(ops)
    n, k = 37, 96 if kind not in ("q4_k", "q6_k", "q6_k6") else 256
    torch.manual_seed(23)
    weight, scale, offset, q = _layer_data(kind, n, k)
    # Every column one q across K (its first), so one weight value per group and column.
    q = q[:, :1].expand(n, k).contiguous()
    if kind in ("q8_0", "q8_f32", "q5_k", "q6_k", "q6_k6", "iq4", "iq4_f32"):
        weight = q.to(torch.int8)
    else:
        weight = pack_nibbles(q.to(torch.uint8))
    if kind == "q4_k":  # one scale and offset across K too, so that w is one value per column
        scale, offset = scale[:, :1].expand(n, k // 32), offset[:, :1].expand(n, k // 32)
    elif kind in ("q6_k", "q6_k6"):  # one d and sc across K: a group's scales the same
        d = scale.q6_k_d[:, :1]
        scale = scale[:, :1].expand(n, k // 16).contiguous()
        scale.q6_k_d = d.expand(n, k // 256).contiguous()
        scale.q6_k_six = kind == "q6_k6"
    else:
        scale = scale[:, :1].expand(n, k // 32).contiguous()
        offset = None if offset is None else offset[:, :1].expand(n, k // 32).contiguous()
    if not scale.is_contiguous():
        scale = scale.contiguous()
    pw = _pack(ops, weight, scale, offset if offset is None else offset.contiguous())
    w = _dequantized(weight, scale, offset).double()
    big = 2.0**10
    many = (20, 64) if ops.groupwise_int16_tiles_from() else ()  # on the int16 tiles
    counts = (*range(1, rows + 1), *many)
    for m, designed in [(m, False) for m in counts] + [(m, True) for m in (4, rows, *many)]:
        x = torch.rand(m, k) * 0.5 - 0.25
        x *= torch.exp2(-torch.randint(0, 9, (m, k)).float())  # 2^-2 .. 2^-10: many below s
        if designed:  # half 2s, half in [0.02, 0.03): rounded to 0, the exact sums 20% more
            x[:, 0::2], x[:, 1::2] = 0.125, 0.02 + 0.01 * torch.rand(m, k // 2)
        x[:, 0::32], x[:, 1::32] = big, -big
        x[m - 1, 32:64] = 0  # an all-zero group
        x = x.bfloat16()
        y = pw.gemm(ops, x, None, False)
        want = _int16_rounded(x) @ w.T
        exact = x.double() @ w.T
        step = torch.exp2(torch.floor(torch.log2(want.abs().clamp_min(1e-30))) - 7)
        slack = 1e-6 * big * w.abs().max()  # float32 sums of the +-H terms
        assert ((y.double() - want).abs() <= step / 2 + slack).all(), (m, designed)
        flt = pw.gemm(ops, x, None, False, rows_kernel="fma")
        assert ((flt.double() - exact).abs() <= step + slack).all(), (m, designed)
        if designed:  # the rounding shows: exact x moves every nonzero output many steps
            cols = w[:, 0] != 0  # (a Q4_0 column of q = 8 is zero)
            assert cols.sum() > n // 2
            assert ((exact - want).abs() > 8 * step)[:, cols].all(), m
            assert ((y.double() - flt.double()).abs() > 4 * step)[:, cols].all(), m


@pytest.mark.parametrize("kind", ("q4_0", "q8_0", "q6_k6"))
def test_the_int16_rounding_takes_every_exponent(ops, kind: str) -> None:
    """The rows' rounding to int16 on bf16's whole range of groups (the largest 2^-133 to 2^127,
    signed zeros, an all-zero group; below ~2^-112 the group's scale is no normal float32 and
    it is rounded element by element): one to five rows (the few-row kernel) and 20 (the
    tiles), each output the float64 product of ``_int16_rounded(x)`` and the dequantised layer
    within half a bf16 step, and every row bit for bit what it gives alone."""
    rows = _int16_kernel_rows(ops)
    n, k = 37, 256
    torch.manual_seed(29)
    weight, scale, offset, _ = _layer_data(kind, n, k)
    pw = _pack(ops, weight, scale, offset)
    w = _dequantized(weight, scale, offset).double()
    top = float(scale.abs().max())
    exponents = torch.tensor([-133.0, -120.0, -60.0, -1.0, 0.0, 20.0, 60.0, 100.0])
    for m in (*range(1, min(rows, 5) + 1), 20):
        x = torch.randn(m, k) * torch.exp2(-torch.randint(0, 9, (m, k)).float())
        x = x.view(m, k // 32, 32) * torch.exp2(exponents[torch.arange(k // 32) % 8])[:, None]
        x = x.view(m, k)
        x[:, 32:36] = -0.0
        x[m - 1, 64:96] = 0.0  # an all-zero group
        x = x.bfloat16()
        # One group's exponent at a time, so that no output mixes 2^-133 with 2^100.
        for g in range(k // 32):
            xg = torch.zeros_like(x)
            xg[:, g * 32 : (g + 1) * 32] = x[:, g * 32 : (g + 1) * 32]
            y = pw.gemm(ops, xg, None, False).double()
            want = _int16_rounded(xg) @ w.T
            step = torch.exp2(torch.floor(torch.log2(want.abs().clamp_min(1e-300))) - 7)
            tiny = 2.0**-126 * 2 * w.abs().max()  # float32 outputs below its normal range
            # float32 sums of terms as large as |x| * (|w| + Q4_0's 8 * scale), which cancel
            terms = xg.double().abs().sum(-1, keepdim=True) * (w.abs().max() + 8 * top)
            assert ((y - want).abs() <= step / 2 + tiny + 1e-6 * terms).all(), (m, g)
            if m > 1:
                alone = pw.gemm(ops, xg[m - 1 :], None, False)
                assert torch.equal(pw.gemm(ops, xg, None, False)[m - 1 :], alone), (m, g)


@pytest.mark.parametrize("case", INT16_CASES, ids=_case_id)
def test_fp16_and_nonfinite_rows_keep_the_float_kernel(ops, case) -> None:
    """fp16 x (11 significant bits, for which the int16 grid would round what its outputs
    resolve) and bf16 rows holding an inf or a NaN take the float kernel whatever
    ``rows_kernel`` says: bit for bit ``rows_kernel="fma"``'s outputs, infs and NaNs where the
    definition has them; past four rows too (6 and 13 rows: bf16 on the few-row kernels in
    chunks of four, fp16 on ``run_f32``; 20: the int16 tiles' batches, the whole batch on the
    float path)."""
    kind, (n, k) = case
    _int16_kernel_rows(ops)
    torch.manual_seed(n + 2 * k)
    pw = _pack(ops, *_layer_data(kind, n, k)[:3])
    for m in (1, 3, 6, 13, 20):
        x = torch.randn(m, k).half()
        fma = pw.gemm(ops, x, None, False, rows_kernel="fma")
        assert torch.equal(pw.gemm(ops, x, None, False), fma)
        x = torch.randn(m, k).bfloat16()
        x[m - 1, k // 2] = float("inf") if m == 1 else float("nan")
        y, want = pw.gemm(ops, x, None, False), pw.gemm(ops, x, None, False, rows_kernel="fma")
        assert torch.equal(y.isnan(), want.isnan()) and torch.equal(y.isinf(), want.isinf())
        finite = want.isfinite()
        assert torch.equal(y[finite], want[finite])
        assert not y[m - 1].isfinite().all()


def test_the_int16_kernel_is_named_in_the_path() -> None:
    """``+i16r<rows>`` in the path of the layers whose few bf16 rows take the int16 kernel (AVX2
    builds: 4-bit, Q8_0, Q6_K and IQ4 layers), not under ``int8_activations`` where every
    batch takes the dot path."""
    ops = dense_gemm.gemm_ops()
    if ops is None or not ops.groupwise_int16_rows():
        pytest.skip("no int16 kernel in this build")
    tag = f"+i16r{ops.groupwise_int16_rows()}"
    assert tag in groupwise_linear.path_name(ops, "int4", four_bit=True)
    assert tag in groupwise_linear.path_name(ops, "q8_0")
    assert tag in groupwise_linear.path_name(ops, "iq4", four_bit=True, levels=True)
    assert tag in groupwise_linear.path_name(ops, "q6_k")
    assert tag not in groupwise_linear.path_name(ops, "int4", four_bit=True, dot=True)


def test_the_int16_tiles_are_named_in_the_path() -> None:
    """``+i16t<rows>`` in the path of every layer whose bf16 batches of that many rows or more
    run on the int16 tiles (AVX2 builds: 4-bit, Q8_0, Q6_K and IQ4 layers), with ``+i16r``
    covering the rows below, not under ``int8_activations``."""
    ops = dense_gemm.gemm_ops()
    if ops is None or not ops.groupwise_int16_tiles_from():
        pytest.skip("no int16 tiles in this build")
    start = ops.groupwise_int16_tiles_from()
    assert start == ops.groupwise_int16_rows() + 1  # together: every batch size
    tag = f"+i16t{start}"
    assert tag in groupwise_linear.path_name(ops, "int4", four_bit=True)
    assert tag in groupwise_linear.path_name(ops, "q8_0")
    assert tag in groupwise_linear.path_name(ops, "q6_k")
    assert tag in groupwise_linear.path_name(ops, "iq4", four_bit=True, levels=True)
    assert "+i16" not in groupwise_linear.path_name(ops, "int4", four_bit=True, dot=True)


# -- the int16 tiles of many bf16 rows (AVX2 without AVX-512) -----------------------------------
TILE_ROWS = (17, 18, 64, 300)  # three uneven tiles, three even ones, decode, prefill


def _int16_tiles_from(ops) -> int:
    start = ops.groupwise_int16_tiles_from()
    if not start:
        pytest.skip(f"the {ops.built_isa()} build has no int16 tiles")
    return start


def _spiky_rows(m: int, k: int) -> torch.Tensor:
    """bf16 rows whose groups span many binades: a few spikes 2^6 above the rest, values down to
    2^-20 of them (below the int16 grid: rounded to zero or to a few steps), one all-zero
    group, and one group of a single tiny value."""
    x = torch.randn(m, k) * torch.exp2(-20 * torch.rand(m, k))
    x[:, ::29] *= 64.0
    x[m // 2, :32] = 0
    x[m - 1, -32:] = 0
    x[m - 1, -20] = 1e-30
    return x.bfloat16()


@pytest.mark.parametrize("case", INT16_CASES, ids=_case_id)
def test_the_int16_tiles_are_the_rounding_then_the_definition(ops, case) -> None:
    """Past the few rows (``groupwise_int16_tiles_from()``), bf16 rows under the default kernel
    on AVX2 builds run on int16 register tiles: the float64 product of the dequantised layer
    with ``_int16_rounded(x)`` plus the bias, within float32 sums over the groups and the
    output's bf16 rounding, for every format the tiles read (Q6_K's two scales too), N off the
    panels, one to many row tiles and a prefill-sized batch."""
    start = _int16_tiles_from(ops)
    kind, (n, k) = case
    torch.manual_seed(3 * n + k)
    weight, scale, offset, _ = _layer_data(kind, n, k)
    pw = _pack(ops, weight, scale, offset)
    w = _dequantized(weight, scale, offset).double()
    bias = torch.randn(n).bfloat16()
    for m in TILE_ROWS:
        assert m >= start
        x = _spiky_rows(m, k)
        y = pw.gemm(ops, x, bias, False)
        xr = _int16_rounded(x)
        want = xr @ w.T + bias.double()
        size = torch.maximum(want.abs(), y.double().abs())
        step = torch.exp2(torch.floor(torch.log2(size.clamp_min(1e-30))) - 7)
        sums = 4 * (k // 32 + 8) * 2.0**-24 * (xr.abs() @ w.abs().T + bias.double().abs())
        assert ((y.double() - want).abs() <= step / 2 + sums).all(), m


@pytest.mark.parametrize("kind", INT16_KINDS)
def test_a_row_on_the_int16_tiles_is_the_row_alone(ops, kind: str) -> None:
    """The tiles repeat the few-row int16 kernel's arithmetic (the same rounding of x, exact
    integer sums per group, the same float32 operations per group in the same order), so each
    row of a batch is bit for bit what that row gives alone: a sequence's logits do not depend
    on how many others decode beside it. So do the few-row kernel's chunks of four (6 and 16
    rows)."""
    start = _int16_tiles_from(ops)
    rows = _int16_kernel_rows(ops)
    n, k = 37, 256
    torch.manual_seed(41)
    pw = _pack(ops, *_layer_data(kind, n, k)[:3])
    bias = torch.randn(n).bfloat16()
    m = start + 3
    x = _spiky_rows(m, k)
    y = pw.gemm(ops, x, bias, False)
    for r in range(m):
        assert torch.equal(y[r], pw.gemm(ops, x[r : r + 1], bias, False)[0]), r
    assert torch.equal(y[:6], pw.gemm(ops, x[:6], bias, False))
    assert torch.equal(y[:rows], pw.gemm(ops, x[:rows], bias, False))


# -- grouped: an MoE layer's experts in one call ---------------------------------------------
# Rows per group: an expert without rows, the register kernels (1, 2; 4 on 4-bit layers under
# the split kernel, and everywhere without AMX; 5 without AMX) and past them (4 on other layers
# where AMX runs, 9: AMX tiles or the scratch, each such group its own GEMM).
GROUPED_ROWS = (1, 0, 2, 4, 5, 9, 1)


def _stacked(ops, kind: str, n: int, k: int, count: int):
    """``count`` layers of one kind packed into one buffer (as an MoE stack), and their pws."""
    pws = [_pack(ops, *_layer_data(kind, n, k)[:3]) for _ in range(count)]
    buffer = ops.huge_page_empty(count * pws[0].packed.numel()).view(count, *pws[0].packed.shape)
    for pw, slot in zip(pws, buffer, strict=True):
        slot.copy_(pw.packed)
    return [dataclasses.replace(pw, packed=slot) for pw, slot in zip(pws, buffer, strict=True)]


@pytest.mark.parametrize("dot", (False, True), ids=("float", "dot"))
@pytest.mark.parametrize("xdtype", ACT_DTYPES, ids=str)
@pytest.mark.parametrize("kind", ("q4_0", "q4_k", "q8_0", "q6_k", "q6_k6", "iq4", "q4_f32"))
def test_grouped_gemm_equals_each_groups_own_gemm_bit_for_bit(ops, kind: str, xdtype, dot):
    if dot and kind in ("q6_k6", "iq4"):
        pytest.skip("read by the float path only")
    torch.manual_seed(11)
    n, k = 37, 256  # a tail panel; one super-block
    pws = _stacked(ops, kind, n, k, len(GROUPED_ROWS))
    starts = [0]
    for rows in GROUPED_ROWS:
        starts.append(starts[-1] + rows)
    x = torch.randn(starts[-1], k).to(xdtype)
    pw = pws[0]
    fmt = (n, pw.bits, pw.half_scales, pw.with_offset, pw.factored)
    kernels = _bf16_row_kernels(ops) if xdtype == torch.bfloat16 and not dot else ()
    for kernel in kernels or ("split",):  # every kernel of few bf16 rows
        packed = [p.packed for p in pws]
        got = ops.groupwise_gemm_grouped(x, packed, starts, *fmt, dot, pw.levels, kernel)
        assert got.shape == (starts[-1], n) and got.dtype == xdtype
        for i, p in enumerate(pws):
            lo, hi = starts[i], starts[i + 1]
            want = ops.groupwise_gemm(
                x[lo:hi], p.packed, *fmt, None, dot, pw.levels, rows_kernel=kernel
            )
            assert torch.equal(got[lo:hi], want), f"{kernel}: group {i} ({hi - lo} rows)"


def test_grouped_gemm_bad_inputs_raise(ops) -> None:
    pws = _stacked(ops, "q4_0", 20, 64, 2)
    packed = [p.packed for p in pws]
    fmt = (20, 4, True, False, False)
    x = torch.randn(3, 64)
    assert ops.groupwise_gemm_grouped(x, packed, [0, 1, 3], *fmt).shape == (3, 20)
    with pytest.raises(RuntimeError, match="starts must be 3 row offsets from 0 to the 3 rows"):
        ops.groupwise_gemm_grouped(x, packed, [0, 3], *fmt)
    with pytest.raises(RuntimeError, match="starts must be 3 row offsets"):
        ops.groupwise_gemm_grouped(x, packed, [0, 1, 2], *fmt)  # a row left out
    with pytest.raises(RuntimeError, match="starts must not decrease"):
        ops.groupwise_gemm_grouped(x, packed, [0, 4, 3], *fmt)
    with pytest.raises(RuntimeError, match="groupwise_gemm_grouped: packed must be"):
        ops.groupwise_gemm_grouped(x, [packed[0], packed[1][:, :-1]], [0, 1, 3], *fmt)
    with pytest.raises(RuntimeError, match="groupwise_gemm_grouped: N=40 does not fit"):
        ops.groupwise_gemm_grouped(x, packed, [0, 1, 3], 40, *fmt[1:])
    with pytest.raises(RuntimeError, match="x must be float32, bfloat16 or float16"):
        ops.groupwise_gemm_grouped(x.double(), packed, [0, 1, 3], *fmt)
    empty = ops.groupwise_gemm_grouped(torch.empty(0, 64), packed, [0, 0, 0], *fmt)
    assert empty.shape == (0, 20)


def test_packing_into_a_given_buffer_and_huge_page_buffers(ops) -> None:
    weight, scale, offset, _ = _layer_data("q4_k", 40, 512)
    own = _pack(ops, weight, scale, offset)
    buffer = ops.huge_page_empty(3 * own.packed.numel() + 5)
    assert buffer.data_ptr() % (2 << 20) == 0 and buffer.numel() == 3 * own.packed.numel() + 5
    slot = buffer[own.packed.numel() : 2 * own.packed.numel()].view(own.packed.shape)
    into = pack_groupwise(ops, weight, scale, offset, storage=lambda shape: slot)
    assert into.packed.data_ptr() == slot.data_ptr() and torch.equal(into.packed, own.packed)
    assert ops.groupwise_panel_bytes(512, 4, True, True, True) == own.packed.shape[1]
    with pytest.raises(RuntimeError, match=r"into must be a contiguous uint8 \[3, "):
        pack_groupwise(ops, weight, scale, offset, storage=lambda shape: slot[:2])
    assert ops.huge_page_empty(0).numel() == 0


# -- the layer: make_linear_kernel's choice --------------------------------------------------
def _groupwise_layer(kind: str, n: int, k: int, *, row: bool = False, bias: bool = False):
    torch.manual_seed(7)
    layer = RowParallelLinear(k, n, bias=bias) if row else ColumnParallelLinear(k, [n], bias=bias)
    # IQ4 layers are q8_0 ones of the levels (the GGUF loader's form).
    fmt = "q8_0" if kind.startswith("iq4") else kind
    method = GroupwiseMethod.for_format(fmt if fmt in ("q8_0", "q6_k") else "int4")
    layer.quant_method = method
    method.create_weights(layer)
    weight, scale, offset, _ = _layer_data(kind, n, k)
    layer.weight.data.copy_(weight)
    layer.weight_scale.data.copy_(scale)
    if offset is not None:
        layer.weight_offset.data.copy_(offset)
    if kind == "q6_k":
        layer.weight_super.data.copy_(scale.q6_k_d)
    if bias:
        layer.bias.data.normal_()
    method.finish_loading(layer)
    return layer


def test_make_linear_kernel_installs_the_groupwise_gemm() -> None:
    ops = dense_gemm.gemm_ops()
    if ops is None:
        pytest.skip("the C++ GEMM could not be built")
    for kind, row, k in (
        ("q4_1", False, 128),
        ("q8_0", True, 128),
        ("q4_k", False, 256),
        ("q6_k", True, 256),
        ("q6_k", False, 512),
    ):
        layer = _groupwise_layer(kind, 40, k, row=row, bias=True)
        name = kind if kind in ("q8_0", "q6_k") else "int4"
        kernel = packed_linear.make_linear_kernel(layer)
        fn, path = kernel.fn, kernel.path
        # x unrounded unless asked (+amx<rows> where bf16 batches run on AMX tiles)
        four_bit = name == "int4"  # + the kernel of its few bf16 rows (+split by default)
        assert path == groupwise_linear.path_name(ops, name, four_bit=four_bit), path
        assert path.startswith(f"cpp-{name}-{ops.built_isa()}") and "+dot" not in path, path
        dot_path = packed_linear.make_linear_kernel(layer, int8_activations=True).path
        # Every bf16 batch on the dot path; the scalar build has none, and a Q6_K layer keeps
        # the int16 kernels where they run (takes_dot). (No AMX tiles then: no bf16 batch takes
        # the float path.)
        off = ops.int8_dot_isa() == "scalar" or not groupwise_linear.takes_dot(ops, name, dot=True)
        assert dot_path == (path if off else f"cpp-{name}-{ops.built_isa()}+dot"), dot_path
        ref_w = dequantize_layer(layer).double()
        # A row-parallel layer adds its bias after the all-reduce, not in the GEMM.
        bias = layer.bias.double() if layer.fast_linear_has_bias else None
        for m, dtype, tol in ((3, torch.float32, 2e-5), (70, torch.bfloat16, 8e-3)):
            x = torch.randn(2, m, k).to(dtype)  # [batch, tokens, K]
            y = fn(x)
            assert y.shape == (2, m, 40) and y.dtype == dtype
            ref = F.linear(x.double(), ref_w, bias)
            assert _rel_err(y, ref) < tol, f"{kind} m={m} {dtype}"


def test_an_lm_head_never_rounds_x() -> None:
    """With ``int8_activations`` the dot path runs in the layers of bf16 decode batches, never in
    the LM head: the head's bf16 rows equal the float path's, bit for bit, where a layer's take
    the dot path."""
    ops = dense_gemm.gemm_ops()
    if ops is None or not groupwise_linear.dot_rows(ops, torch.bfloat16):
        pytest.skip("no default dot path on this build")
    layer = _groupwise_layer("q4_0", 48, 128)  # 4-bit: a layer on the dot path everywhere
    x = torch.randn(3, 128).bfloat16()
    kernel = packed_linear.make_linear_kernel(layer, is_head=True, int8_activations=True)
    head_fn, head_path = kernel.fn, kernel.path
    kernel = packed_linear.make_linear_kernel(layer, int8_activations=True)
    layer_fn, layer_path = kernel.fn, kernel.path
    isa = ops.built_isa()
    assert head_path == groupwise_linear.path_name(
        ops, "int4", four_bit=True
    ) and head_path.startswith(f"cpp-int4-{isa}")
    assert layer_path == f"cpp-int4-{isa}+dot", layer_path
    pw = groupwise_pack.pack_groupwise(ops, layer.weight, *groupwise_linear.weight_groups(layer))
    gemm = groupwise_linear.make_groupwise_gemm(ops, pw, None)
    assert torch.equal(head_fn(x), gemm(x, dot=False))
    assert torch.equal(layer_fn(x), gemm(x, dot=True))
    assert not torch.equal(head_fn(x), layer_fn(x))


@pytest.mark.parametrize("kind", ("q6_k", "q8_0", "iq4"))
def test_an_8_bit_layer_keeps_the_int16_kernels_where_they_run(kind: str) -> None:
    """Under ``int8_activations`` an 8-bit layer (Q6_K, Q8_0, a q8_0 layer of IQ4 levels) takes
    the dot path unless the build has the int16 register tiles (AVX2 without AVX-512), where
    it keeps the default's int16 arithmetic, exact for bf16 x and faster there: its rows equal
    the plain layer's bit for bit at one row, a decode batch and a prefill's, and it keeps its
    smaller packing (Q6_K's six bits, IQ4's four). 4-bit layers take the dot path."""
    ops = dense_gemm.gemm_ops()
    if ops is None or not groupwise_linear.dot_rows(ops, torch.bfloat16):
        pytest.skip("no default dot path on this build")
    name = "q8_0" if kind == "iq4" else kind
    assert groupwise_linear.takes_dot(ops, "int4", dot=True)
    assert not groupwise_linear.takes_dot(ops, name, dot=False)
    layer = _groupwise_layer(kind, 40, 256)
    kernel = packed_linear.make_linear_kernel(layer, int8_activations=True)
    plain = packed_linear.make_linear_kernel(layer)
    if not ops.groupwise_int16_tiles_from():  # no int16 tiles: the dot path, at 8 bits
        assert groupwise_linear.takes_dot(ops, name, dot=True)
        assert kernel.path.endswith("+dot"), kernel.path
        assert kernel.groupwise.bits == 8
        return
    assert not groupwise_linear.takes_dot(ops, name, dot=True)
    assert kernel.path == plain.path and "+dot" not in kernel.path, kernel.path
    assert dict(kernel.dot_rows) == dict(plain.dot_rows) == {dt: 0 for dt in kernel.dot_rows}
    assert kernel.groupwise.levels == plain.groupwise.levels == (kind == "iq4")
    if kind == "iq4":
        assert kernel.groupwise.bits == 4 and kernel.path.startswith("cpp-iq4-"), kernel.path
    if kind == "q6_k" and ops.groupwise_six_bits():
        assert kernel.groupwise.bits == plain.groupwise.bits == 6
    for m in (1, 20, 300):
        x = torch.randn(m, 256).bfloat16()
        assert torch.equal(kernel.fn(x), plain.fn(x)), m


def test_int8_activations_round_prefill_batches_too() -> None:
    """Under ``int8_activations`` bf16 batches of every size take the dot path (prefill
    included, as llama.cpp rounds them): the layer's rows equal the dot path's bit for bit, at
    one row and at a prefill's 300; float32 x never rounds; without the flag nothing does."""
    ops = dense_gemm.gemm_ops()
    if ops is None or not groupwise_linear.dot_rows(ops, torch.bfloat16):
        pytest.skip("no default dot path on this build")
    layer = _groupwise_layer("q4_0", 40, 256)
    fn = packed_linear.make_linear_kernel(layer, int8_activations=True).fn
    plain = packed_linear.make_linear_kernel(layer).fn
    pw = groupwise_pack.pack_groupwise(ops, layer.weight, *groupwise_linear.weight_groups(layer))
    gemm = groupwise_linear.make_groupwise_gemm(ops, pw, None)
    for m in (1, 65, 300):
        x = torch.randn(m, 256).bfloat16()
        assert torch.equal(fn(x), gemm(x, dot=True)), m
        assert torch.equal(plain(x), gemm(x, dot=False)), m
        assert not torch.equal(fn(x), plain(x)), m
        x32 = x.float()
        assert torch.equal(fn(x32), gemm(x32, dot=False)), m


def test_make_linear_kernel_keeps_pytorch_when_the_check_fails(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    ops = dense_gemm.gemm_ops()
    if ops is None:
        pytest.skip("the C++ GEMM could not be built")

    class Wrong:
        def __getattr__(self, name: str):
            return getattr(ops, name)

        def groupwise_gemm(self, *args):
            return ops.groupwise_gemm(*args) * 1.01

    monkeypatch.setattr(dense_gemm, "gemm_ops", lambda: Wrong())
    kernel = packed_linear.make_linear_kernel(_groupwise_layer("q4_0", 32, 64))
    fn, path = kernel.fn, kernel.path
    assert fn is None and path == "torch-int4"


class _Counting:
    """The GEMM library with its checking GEMMs counted (and, from ``wrong_after`` calls on, its
    results off by 1%)."""

    def __init__(self, ops: object, wrong_after: int | None = None) -> None:
        self.ops, self.calls, self.wrong_after = ops, 0, wrong_after

    def __getattr__(self, name: str):
        return getattr(self.ops, name)

    def groupwise_gemm(self, *args):
        self.calls += 1
        y = self.ops.groupwise_gemm(*args)
        return y * 1.01 if self.wrong_after is not None and self.calls > self.wrong_after else y


def test_a_repeated_shape_is_checked_with_one_probe(monkeypatch: pytest.MonkeyPatch) -> None:
    """In one load the first layer of a (format, shape) gets every probe; the next ones one
    float32 row, which still compares their own packed values with their dequantised rows."""
    ops = dense_gemm.gemm_ops()
    if ops is None:
        pytest.skip("the C++ GEMM could not be built")
    counting = _Counting(ops)
    monkeypatch.setattr(dense_gemm, "gemm_ops", lambda: counting)
    checked: set[tuple] = set()
    first = packed_linear.make_linear_kernel(_groupwise_layer("q4_0", 32, 64), checked=checked).fn
    full = counting.calls
    assert first is not None and full >= 4
    second = packed_linear.make_linear_kernel(_groupwise_layer("q4_1", 32, 64), checked=checked).fn
    assert second is not None and counting.calls == 2 * full  # another format: all probes
    third = packed_linear.make_linear_kernel(_groupwise_layer("q4_0", 32, 64), checked=checked).fn
    assert third is not None and counting.calls == 2 * full + 1
    # The one probe of a repeated shape still refuses a kernel that is wrong on its layer.
    wrong = _Counting(ops, wrong_after=counting.calls)
    monkeypatch.setattr(dense_gemm, "gemm_ops", lambda: wrong)
    wrong.calls = counting.calls
    kernel = packed_linear.make_linear_kernel(_groupwise_layer("q4_0", 32, 64), checked=checked)
    fn, path = kernel.fn, kernel.path
    assert fn is None and path == "torch-int4"


def test_pack_linear_layers_drops_the_unpacked_tensors() -> None:
    if dense_gemm.gemm_ops() is None:
        pytest.skip("the C++ GEMM could not be built")
    model = torch.nn.Module()
    model.proj = _groupwise_layer("q4_1", 48, 64)
    ref_w = dequantize_layer(model.proj)
    x = torch.randn(5, 64)
    paths = packed_linear.pack_linear_layers(model)
    assert paths["ColumnParallelLinear"].startswith("cpp-int4-")
    assert model.proj.weight.numel() == 0
    assert model.proj.weight_scale_bits.numel() == model.proj.weight_offset_bits.numel() == 0
    torch.testing.assert_close(model.proj(x), x @ ref_w.T, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kind", ("q4_0", "q4_k", "q8_0", "q6_k"))
@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16), ids=str)
def test_a_tied_table_is_held_once_and_looked_up_from_the_head(kind: str, dtype) -> None:
    """A group-wise embedding that is also the LM head: after packing, its table lives only in
    the head's panels (weight and scales dropped), and look-ups read rows back from them equal
    to ``GroupwiseMethod.embed``'s bit for bit, in the compute dtype; the logits are
    unchanged."""
    from pagedllm.layers.linear import VocabParallelEmbedding

    if dense_gemm.gemm_ops() is None:
        pytest.skip("the C++ GEMM could not be built")
    n, k = 45, 256  # rows off the 16-row panels; whole Q4_K / Q6_K super-blocks
    torch.manual_seed(3)
    table = VocabParallelEmbedding(n, k)
    table.quant_method = GroupwiseMethod.for_format(kind if kind in ("q8_0", "q6_k") else "int4")
    table.quant_method.create_weights(table)
    weight, scale, offset, _ = _layer_data(kind, n, k)
    table.weight.data = weight.clone()
    table.weight_scale.data.copy_(scale)
    if offset is not None:
        table.weight_offset.data.copy_(offset)
    if kind == "q6_k":
        table.weight_super.data.copy_(scale.q6_k_d)
    table.quant_method.finish_loading(table)
    table.compute_dtype = dtype
    model = torch.nn.Module()
    model.embed_tokens = model.lm_head = table
    ids = torch.tensor([[3, 0, 44], [16, 15, 3]])
    want_rows = table(ids)
    x = torch.randn(4, k)
    ref_w = dequantize_layer(table)
    paths = packed_linear.pack_linear_layers(model)
    assert paths["lm_head"].startswith("cpp-"), paths
    assert table.weight.numel() == 0 and table.weight_scale_bits.numel() == 0
    got_rows = table(ids)
    assert got_rows.dtype == dtype and got_rows.shape == (2, 3, k)
    assert torch.equal(got_rows, want_rows)
    torch.testing.assert_close(table.logits(x), x @ ref_w.T, rtol=1e-5, atol=1e-5)


def test_a_fused_layer_of_several_formats_runs_each_run_of_parts_packed(
    ops, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Q4_K q/k with a Q6_K v (parts of 40, 24, 24 rows: off the 16-column panels), loaded
    through the fused layer's loaders: two packed GEMMs (q/k, v), the bias in its columns, equal
    to ``F.linear`` on the parts' dequantised weights side by side (and so is the PyTorch path)."""
    from pagedllm.layers.quantization.groupwise_parts import GroupwisePartsMethod

    monkeypatch.setattr(dense_gemm, "gemm_ops", lambda: ops)  # this ISA level's build
    k, sizes, kinds = 256, [40, 24, 24], ("q4_k", "q4_k", "q6_k")
    layer = ColumnParallelLinear(k, sizes, bias=True)
    method = GroupwisePartsMethod(("int4", "int4", "q6_k"))
    layer.quant_method = method
    method.create_weights(layer)
    dense = []
    torch.manual_seed(3)
    for shard, (kind, n) in enumerate(zip(kinds, sizes, strict=True)):
        weight, scale, offset, _ = _layer_data(kind, n, k)
        stored = {"weight": weight, "weight_scale": scale}
        if offset is not None:
            stored["weight_offset"] = offset
        if kind == "q6_k":
            stored["weight_super"] = scale.q6_k_d
            dense.append(dequantize_int8_groups(weight, scale))
        else:
            dense.append(dequantize_int4(weight, scale, offset))
        for name, tensor in stored.items():
            param = getattr(layer, name)
            param.weight_loader(param, tensor, shard)
    layer.bias.data.normal_()
    method.finish_loading(layer)
    assert len(layer.parts) == 2 and method.is_quantized(layer)
    ref_w, bias = torch.cat(dense).double(), layer.bias.double()
    x = torch.randn(5, k)
    torch.testing.assert_close(
        layer(x).double(), F.linear(x.double(), ref_w, bias), rtol=1e-5, atol=1e-5
    )
    kernel = packed_linear.make_linear_kernel(layer)
    fn, path = kernel.fn, kernel.path
    assert path == groupwise_linear.path_name(ops, "mixed(int4,int4,q6_k)", four_bit=True), path
    assert path.startswith(f"cpp-mixed(int4,int4,q6_k)-{ops.built_isa()}"), path
    for m, dtype in (
        (1, torch.float32),
        (3, torch.float32),
        (1, torch.bfloat16),
        (70, torch.bfloat16),
    ):
        x = torch.randn(m, k).to(dtype)
        y = fn(x)
        assert y.shape == (m, sum(sizes)) and y.dtype == dtype
        ref = F.linear(x.double(), ref_w, bias)
        assert _rel_err(y, ref) < FLOAT_TOL[dtype], f"m={m} {dtype}"


# -- GGUF 4-bit blocks decoded at load ---------------------------------------------------------
def test_the_gguf_block_decoder_equals_the_numpy_definitions() -> None:
    """``decode_gguf_blocks`` (the CPU's ``gguf_decode`` kernel) gives ``int4_groups``'
    nibbles, scales and offsets bit for bit (offsets' signed zeros included) for Q4_0, Q4_1
    and Q4_K blocks, ``q6_k_groups``' q, scales and d for Q6_K and Q3_K, ``int8_groups``' q
    and scales for Q8_0, Q5_0, IQ4_NL and IQ4_XS, and ``q5_k_groups``' q, scales and offsets
    for Q5_K: random bytes with finite fp16 factors."""
    import numpy as np
    from gguf import GGMLQuantizationType

    from pagedllm.backends.cpu.backend import CpuBackend
    from pagedllm.models.gguf.reader import GGUFTensor
    from pagedllm.models.gguf.weights import (
        KEPT_AS,
        int4_groups,
        int8_groups,
        q5_k_groups,
        q6_k_groups,
    )

    decode = CpuBackend().kernel("gguf_decode").value
    if decode is None:
        pytest.skip("the C++ GEMM could not be built")
    rng = np.random.default_rng(3)
    rows, cols = 7, 512
    for kind, size, per, halves in (
        ("Q4_0", 18, 32, (0,)),
        ("Q4_1", 20, 32, (0, 2)),
        ("Q4_K", 144, 256, (0, 2)),
        ("Q6_K", 210, 256, (208,)),
        ("Q3_K", 110, 256, (108,)),
        ("Q8_0", 34, 32, (0,)),
        ("Q5_0", 22, 32, (0,)),
        ("IQ4_NL", 18, 32, (0,)),
        ("IQ4_XS", 136, 256, (0,)),
        ("Q5_K", 176, 256, (0, 2)),
    ):
        raw = rng.integers(0, 256, size=(rows, cols // per, size), dtype=np.uint8)
        for at in halves:  # finite fp16 factors, some of them zero
            h = rng.normal(size=(rows, cols // per)).astype(np.float16)
            h[0, :2] = 0
            raw[..., at : at + 2] = h.view(np.uint8).reshape(rows, cols // per, 2)
        raw = raw.reshape(rows, -1)
        tensor = GGUFTensor("t", kind, (rows, cols), raw, GGMLQuantizationType[kind])
        definition = {
            "int4": int4_groups,
            "q8_0": int8_groups,
            "q6_k": q6_k_groups,
            "q5_k": q5_k_groups,
        }[KEPT_AS[kind]]
        want = [torch.from_numpy(a) for a in definition(tensor)]
        got = decode(torch.from_numpy(raw), kind)
        assert [t.dtype for t in got] == [t.dtype for t in want], kind
        for i, (g, w) in enumerate(zip(got, want, strict=True)):
            g, w = g.contiguous(), w.contiguous()
            bits = (g.view(torch.int32), w.view(torch.int32)) if g.is_floating_point() else (g, w)
            assert torch.equal(*bits), f"{kind} output {i}"
    with pytest.raises(RuntimeError, match="kind must be"):
        decode(torch.zeros(2, 18, dtype=torch.uint8), "Q5_1")
    with pytest.raises(RuntimeError, match="not whole Q4_0 blocks"):
        decode(torch.zeros(2, 19, dtype=torch.uint8), "Q4_0")


def test_the_load_time_check_bounds_like_assert_close() -> None:
    """``_check`` keeps assert_close's bound (NaN and shape mismatches fail) without importing
    what assert_close imports on first use (torch.distributed.tensor: up to 1.8 s of start-up)."""
    import subprocess
    import sys

    ref = torch.tensor([[1.0, -2.0], [0.0, 3.0]])
    ident = dense_gemm._check
    ident(lambda x: x + 1e-6, ref, ref, 1e-5)  # within rtol x (max|ref| + 1 + |ref|)
    for got in (ref * 1.01, ref.masked_fill(ref == 0, float("nan")), ref[:1]):
        with pytest.raises(AssertionError):
            ident(lambda x, got=got: got, ref, ref, 1e-5)
    code = (
        "import sys, torch\n"
        "from pagedllm.backends.cpu import dense_gemm as p\n"
        "p._check(lambda x: x, torch.ones(2, 2), torch.ones(2, 2), 1e-5)\n"
        "print('torch.distributed.tensor' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False", out.stderr

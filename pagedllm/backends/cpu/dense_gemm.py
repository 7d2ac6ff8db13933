"""The CPU's GEMMs for dense weights (float, 16-bit, per-row int8, W8A8), each checked when packed.

PyTorch's default CPU GEMM streams a row-major weight poorly when few rows of activations meet a
large weight (decode steps; above all the LM head), and its bf16 GEMM is slower than float32 on
processors without bf16 arithmetic. So each weight gets, by dtype and processor:

- float32: oneDNN's blocked layout (2-4x faster than ``F.linear`` at small batches);
- bf16 / fp16 where the processor computes them (avx512_bf16, AMX, avx_ne_convert): oneDNN's
  packed 16-bit weights, except bf16 with avx512_bf16 and no AMX, where our GEMM is as fast
  from 16 rows and faster below (``cpp_gemm_first``);
- bf16 / fp16 elsewhere, and int8 (weight-only quantised): our C++ GEMM (``csrc/gemm.cpp``),
  which reads the 2- or 1-byte weights and converts them in registers;
- int8 (weight-only) on processors with AMX-INT8, or VNNI without AMX: the activations split
  into two int8 planes (``split_per_token``: near-16-bit precision) and the integer GEMM of
  W8A8, which needs no conversion of the weights (1.5-3x the converting path there, measured on
  1B shapes; ``int8_split_planes``);
- W8A8 (int8 weights, int8 activations per token): our integer GEMM (``csrc/gemm_i8.cpp``).

Every factory checks its GEMM against a PyTorch reference on sampled output rows when it packs
the weight (``_checked``; the group-wise GEMMs reuse it); a result that differs, or a missing op
/ extension, gives no function, and the layer keeps its own forward. Which factory a layer gets
is ``packed_linear``'s choice, by the weight format its method declares.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from types import ModuleType

import torch
import torch.nn.functional as F

from pagedllm.backends.cpu.linear_kernel import LinearFn, LinearKernel

logger = logging.getLogger(__name__)

_BATCH_HINT = 64  # the batch oneDNN blocks for; any batch size works
_PANEL = 16  # output columns per panel of the C++ GEMM's layout
# Processor flags with which oneDNN computes 16-bit GEMMs natively.
_NATIVE_16BIT = {
    torch.bfloat16: ("avx512_bf16", "amx_bf16", "avx_ne_convert"),
    torch.float16: ("avx512_fp16", "amx_fp16", "avx_ne_convert"),
}


def _ops_available() -> bool:
    mkldnn = getattr(torch.ops, "mkldnn", None)
    return bool(
        torch.backends.mkldnn.is_available()
        and mkldnn is not None
        and hasattr(mkldnn, "_reorder_linear_weight")
        and hasattr(mkldnn, "_linear_pointwise")
    )


@functools.cache
def gemm_ops() -> ModuleType | None:
    """Our C++ weight GEMM for this processor's ISA level, or None if it cannot be built."""
    from pagedllm.backends.cpu._ops import load_kernels

    try:
        return load_kernels()
    except (ImportError, RuntimeError, OSError) as exc:
        logger.warning("C++ weight GEMM unavailable (%s); 16-bit/int8 layers use PyTorch", exc)
        return None


_QUANTIZABLE = (torch.float32, torch.bfloat16, torch.float16)


def cpp_weight_quantizer() -> Callable[..., tuple[torch.Tensor, torch.Tensor]] | None:
    """``quantize_per_channel`` by the C++ per-row quantiser (W8A8's activation quantiser, which
    computes it bit for bit: a true division, round half to even), or None without the build.

    Weights it cannot take (another device or dtype) go to the PyTorch definition.
    """
    ops = gemm_ops()
    if ops is None:
        return None
    from pagedllm.layers.quantization import quantize_per_channel

    def quantize(
        weight: torch.Tensor, absmax: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if weight.device.type != "cpu" or weight.dim() != 2 or weight.dtype not in _QUANTIZABLE:
            return quantize_per_channel(weight, absmax)
        return ops.quantize_rows(weight, None if absmax is None else absmax.float())

    return quantize


def pack_panels(weight: torch.Tensor) -> torch.Tensor:
    """``[N, K]`` -> ``[ceil(N/16), K, 16]``: each panel's 16 columns contiguous per k.

    The C++ copy (blocked, threaded) when the GEMM library is built; PyTorch's strided copy
    otherwise, which gives the same tensor several times slower.
    """
    ops = gemm_ops()
    if ops is not None:
        return ops.pack_panels(weight)
    return pack_panels_reference(weight)


def pack_panels_reference(weight: torch.Tensor) -> torch.Tensor:
    """The layout in plain PyTorch (the fallback, and the oracle of the C++ copy's test)."""
    n, k = weight.shape
    panels = -(-n // _PANEL)
    padded = weight
    if n % _PANEL:  # one copy less in the usual case of whole panels
        padded = weight.new_zeros(panels * _PANEL, k)
        padded[:n] = weight
    return padded.reshape(panels, _PANEL, k).transpose(1, 2).contiguous()


def _check(fn: LinearFn, reference: torch.Tensor, probe: torch.Tensor, rtol: float) -> None:
    """Raise AssertionError unless ``fn(probe)`` matches up to summation order (and rounding).

    ``torch.testing.assert_close``'s bound (``|got - ref| <= atol + rtol |ref|``, NaN fails)
    without calling it: its first call imports ``torch.distributed.tensor``, 0.5-1.8 s of every
    start-up that packs a layer.
    """
    scale = float(reference.abs().max()) + 1.0
    got = fn(probe).float()
    if got.shape != reference.shape:
        raise AssertionError(f"output shape {tuple(got.shape)}, expected {tuple(reference.shape)}")
    diff = (got - reference).abs()
    bad = ~(diff <= rtol * scale + rtol * reference.abs())  # NaN compares False: bad
    if bool(bad.any()):
        worst = float(diff.nan_to_num(float("inf")).max())
        raise AssertionError(
            f"{int(bad.sum())} of {bad.numel()} outputs differ (largest by {worst:.3g}, "
            f"allowed {rtol:g} x ({scale:.3g} + |ref|))"
        )


def make_packed_linear(weight: torch.Tensor, bias: torch.Tensor | None) -> LinearFn | None:
    """oneDNN: ``x -> x @ weight^T + bias`` on a packed copy; None if it cannot be used.

    float32 always; bf16/fp16 only where the processor computes them natively (elsewhere oneDNN
    refuses to pack them, or would convert the whole weight per call).
    """
    if weight.device.type != "cpu" or weight.dim() != 2:
        return None
    if weight.dtype != torch.float32:
        from pagedllm.backends.cpu._ops import cpu_flags

        if not set(_NATIVE_16BIT.get(weight.dtype, ())) & cpu_flags():
            return None
    try:
        packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), _BATCH_HINT)
    except RuntimeError as exc:
        logger.debug("no oneDNN packing for a %s %s weight: %s", weight.dtype, weight.shape, exc)
        return None

    def linear(x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")

    # Checked on sampled output rows: a float copy of the whole weight for the reference took
    # a third of a 1B bf16 model's load.
    rows = _sample_rows(weight.shape[0])
    reference = _dequantized_reference(
        weight, None, None if bias is None else bias.detach().float(), rows
    )
    probe = torch.randn(3, weight.shape[1]).to(weight.dtype)
    rtol = 1e-5 if weight.dtype == torch.float32 else 2e-2
    return _checked(linear, weight, reference, rows, ((probe, rtol),), "oneDNN packed GEMM")


def _reshaped(gemm: LinearFn, k: int, n: int) -> LinearFn:
    """``gemm`` on ``[T, K]`` rows as a layer's ``x [..., K] -> [..., N]`` (2-D ``x``, what the
    decoder passes, goes straight through: two reshapes per call were a tenth of the Python a
    small model's decode step spends per layer)."""

    def linear(x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 2:
            return gemm(x)
        return gemm(x.reshape(-1, k)).reshape(*x.shape[:-1], n)

    return linear


def _dequantized_reference(
    weight: torch.Tensor, scale: torch.Tensor | None, bias: torch.Tensor | None, rows: torch.Tensor
) -> LinearFn:
    """``F.linear`` in float32 on the sampled output rows of the (dequantised) weight."""
    dequant = weight[rows].float()
    if scale is not None:
        dequant = dequant * scale[rows, None]
    bias_rows = None if bias is None else bias[rows]
    return lambda probe: F.linear(probe.float(), dequant, bias_rows)


def _checked(
    linear: LinearFn,
    weight: torch.Tensor,
    reference: LinearFn,
    rows: torch.Tensor,
    probes: tuple[tuple[torch.Tensor, float], ...],
    what: str,
) -> LinearFn | None:
    """``linear`` if it matches ``reference`` on every probe (sampled rows), else None.

    A sample of output rows (the first, last and a spread between, so every panel position and
    the tail panel are covered) keeps a float copy of the weight out of loading.
    """
    try:
        for probe, rtol in probes:
            _check(lambda x: linear(x)[:, rows], reference(probe), probe, rtol)
    except (RuntimeError, AssertionError) as exc:
        logger.warning("%s disagrees on a %s weight; not used: %s", what, weight.shape, exc)
        return None
    return linear


def _prepared(
    weight: torch.Tensor, scale: torch.Tensor | None, bias: torch.Tensor | None
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor]:
    """(float32 scale, float32 bias, sampled rows) as the C++ GEMMs take them."""
    scale32 = None if scale is None else scale.detach().float().contiguous()
    bias32 = None if bias is None else bias.detach().float().contiguous()
    return scale32, bias32, _sample_rows(weight.shape[0])


def _usable(weight: torch.Tensor) -> ModuleType | None:
    ops = gemm_ops()
    return ops if ops is not None and weight.device.type == "cpu" and weight.dim() == 2 else None


def make_cpp_linear(
    weight: torch.Tensor, scale: torch.Tensor | None, bias: torch.Tensor | None
) -> LinearFn | None:
    """Our GEMM on bf16/fp16/int8 ``weight [N, K]`` (int8 with float32 ``scale [N]``)."""
    ops = _usable(weight)
    if ops is None:
        return None
    n, k = weight.shape
    packed = pack_panels(weight.detach())
    scale32, bias32, rows = _prepared(weight, scale, bias)
    linear = _reshaped(lambda x: ops.weight_gemm(x, packed, n, scale32, bias32), k, n)
    # float32 activations, and bf16 ones in a batch of 16 rows: where the build has them, bf16
    # rows take other code (vdpbf16ps, AMX tiles for 6+ rows), which must be checked as well.
    probes = ((torch.randn(3, k), 1e-4), (torch.randn(16, k).bfloat16(), 2e-2))
    reference = _dequantized_reference(weight, scale32, bias32, rows)
    return _checked(linear, weight, reference, rows, probes, "C++ GEMM")


def make_w8a8_linear(
    weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None
) -> LinearFn | None:
    """Our integer GEMM on int8 ``weight [N, K]`` with int8 activations made per token."""
    from pagedllm.layers.quantization.w8a8 import w8a8_linear_reference

    ops = _usable(weight)
    if ops is None:
        return None
    n, k = weight.shape
    packed = ops.pack_w8a8(weight.detach())
    scale32, bias32, rows = _prepared(weight, scale, bias)
    linear = _reshaped(lambda x: ops.w8a8_gemm(x, packed, n, scale32, bias32), k, n)
    bias_rows = None if bias32 is None else bias32[rows]

    def reference(probe: torch.Tensor) -> torch.Tensor:
        return w8a8_linear_reference(probe, weight[rows], scale32[rows], bias_rows)

    return _checked(linear, weight, reference, rows, ((torch.randn(3, k), 1e-5),), "W8A8 GEMM")


def make_int8_split_linear(
    weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None
) -> LinearFn | None:
    """Int8 weight-only ``weight [N, K]`` on the integer GEMM, x split into two int8 planes."""
    ops = _usable(weight)
    if ops is None:
        return None
    n, k = weight.shape
    packed = ops.pack_w8a8(weight.detach())
    scale32, bias32, rows = _prepared(weight, scale, bias)
    linear = _reshaped(lambda x: ops.int8_split_gemm(x, packed, n, scale32, bias32), k, n)
    # The planes keep x to max|x| / 64516 per row: float32 results agree to ~1e-4 of the
    # largest output; a batch of bf16 rows takes the tiles, checked to bf16's rounding.
    probes = ((torch.randn(3, k), 1e-3), (torch.randn(16, k).bfloat16(), 2e-2))
    reference = _dequantized_reference(weight, scale32, bias32, rows)
    return _checked(linear, weight, reference, rows, probes, "int8 split GEMM")


def int8_split_planes(k: int) -> bool:
    """Whether an int8 weight-only layer with ``K = k`` runs on the split planes here.

    The planes double the integer rows, so they pay where integer dot products are cheap
    against converting the weights: AMX-INT8 tiles (K in whole 64-byte tiles), or VNNI's
    ``vpdpbusd`` where there is no AMX-BF16 for the converting GEMM. Measured with
    ``benchmarks/linear_cpu.py`` on 1B shapes: an AMD EPYC with avx512_vnni and no AMX, 1.05-3.1x
    the converting GEMM at 1-512 rows (1.5-1.9x on most layers); a Xeon with its tiles turned
    off (VNNI, and AMX-BF16 for the converting GEMM), 0.8x at 16 rows; the AVX2 build
    (``vpmaddubsw``, no VNNI), 0.6-0.8x from 16 rows. So the converting GEMM runs elsewhere.
    """
    ops = gemm_ops()
    if ops is None:
        return False
    if ops.has_amx_int8():
        return k % 64 == 0
    return ops.int8_dot_isa() == "avx512vnni" and not ops.has_amx()


def make_int8_linear(
    weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None
) -> LinearKernel:
    """The fastest correct GEMM for an int8 weight-only ``weight [N, K]``, and its path's name:
    the split planes where ``int8_split_planes`` says they are faster, else the converting GEMM.
    In builds with ``vdpbf16ps`` and no AMX-INT8 the split GEMM hands bf16 batches of
    ``int8_dp_min_rows()`` rows or more to a converting path over the same packed weights (each
    K-block converted once for all rows: a prefill at ~0.97x of the bf16 rate instead of ~0.8x
    on a Zen 4); the path's name then ends in ``+bf16dp<rows>``.
    """
    ops = gemm_ops()
    if int8_split_planes(weight.shape[-1]):
        fn = make_int8_split_linear(weight, scale, bias)
        if fn is not None:
            if ops.has_amx_int8():
                suffix = "+amx"
            elif ops.int8_dp_min_rows():  # bf16 batches this large convert the weights
                suffix = f"+bf16dp{ops.int8_dp_min_rows()}"
            else:
                suffix = ""
            return LinearKernel(fn, f"cpp-int8-split-{ops.int8_dot_isa()}{suffix}")
    fn = make_cpp_linear(weight, scale, bias)
    return LinearKernel(fn, f"cpp-int8-{_cpp_isa()}" if fn else "torch-int8")


def _sample_rows(n: int, *, edge: int = 48, spread: int = 128) -> torch.Tensor:
    """The first and last ``edge`` and a spread of output rows: every panel position and the
    tail panel."""
    return torch.unique(
        torch.cat(
            [
                torch.arange(min(n, edge)),
                torch.arange(max(0, n - edge), n),
                torch.linspace(0, n - 1, steps=min(n, spread)).long(),
            ]
        )
    )


def _cpp_isa() -> str:
    """The C++ GEMM's build level, ``+amx`` where bf16 batches run on AMX tiles."""
    ops = gemm_ops()
    return ops.built_isa() + ("+amx" if ops.has_amx() else "")


def make_dense_linear(weight: torch.Tensor, bias: torch.Tensor | None) -> LinearKernel:
    """The fastest correct GEMM for a float32 / bf16 / fp16 ``weight [N, K]``, and its path's
    name (a dense layer, a dense run of a fused layer's parts, an expert)."""
    if weight.dtype == torch.float32:
        fn = make_packed_linear(weight, bias) if _ops_available() else None
        return LinearKernel(fn, "onednn-float32" if fn else "torch-float32")
    return make_16bit_linear(weight, bias)


def cpp_gemm_first(dtype: torch.dtype) -> bool:
    """Whether our GEMM beats oneDNN's for 16-bit ``dtype`` weights on this processor.

    bf16 on processors with avx512_bf16 and no AMX: two panels per vdpbf16ps tile (gemm_dp.h)
    ran 0.99-1.11x oneDNN's packed bf16 GEMM from 16 to 1,024 rows and 1.35-1.61x at one row
    on a Zen 4 EPYC (1B shapes, ``benchmarks/linear_cpu.py``), where decode steps of a few
    sequences spend their time. With AMX, oneDNN's tiles are ahead of ours from 16 rows; without
    bf16 arithmetic oneDNN does not pack 16-bit weights at all.
    """
    ops = gemm_ops()
    return (
        dtype == torch.bfloat16
        and ops is not None
        and ops.built_isa() == "avx512bf16"
        and not ops.has_amx()
    )


def make_16bit_linear(weight: torch.Tensor, bias: torch.Tensor | None) -> LinearKernel:
    """The fastest correct GEMM for a bf16/fp16 ``weight [N, K]``, and its path's name:
    oneDNN's packed weights where the processor computes the dtype natively, our GEMM elsewhere
    and where ``cpp_gemm_first`` says it is faster; either one when the other is refused."""
    dtype = str(weight.dtype).removeprefix("torch.")

    def onednn() -> LinearKernel:
        fn = make_packed_linear(weight, bias) if _ops_available() else None
        return LinearKernel(fn, f"onednn-{dtype}")

    def cpp() -> LinearKernel:
        fn = make_cpp_linear(weight, None, bias) if weight.dtype in _NATIVE_16BIT else None
        return LinearKernel(fn, f"cpp-{dtype}-{_cpp_isa()}" if fn is not None else "")

    for make in (cpp, onednn) if cpp_gemm_first(weight.dtype) else (onednn, cpp):
        kernel = make()
        if kernel.fn is not None:
            return kernel
    return LinearKernel(None, f"torch-{dtype}")

"""Linear layers on repacked weights: the CPU backend's GEMM path, chosen per layer.

PyTorch's default CPU GEMM streams a row-major weight poorly when few rows of activations meet a
large weight (decode steps; above all the LM head), and its bf16 GEMM is slower than float32 on
processors without bf16 arithmetic. So each layer gets, by weight dtype and processor:

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
- W8A8 (int8 weights, int8 activations per token): our integer GEMM (``csrc/gemm_i8.cpp``);
- group-wise 4-bit / 8-bit weights (``int4``: GGUF Q4_0 / Q4_1 / Q4_K, ``quantization="int4"``;
  ``q8_0``; ``q6_k``): our group-wise GEMM on the packed blocks (``groupwise_linear.py``,
  ``csrc/gemm_q4.cpp``), column/row-parallel layers only; a fused layer whose parts differ in
  format (``mixed``) runs one such GEMM per part.

Every packed layer is checked against a PyTorch reference when it is packed; a layer whose result
differs, or a missing op / extension, keeps the layer's own forward. The unpacked weight is then
dropped (the packed copy is the only one used), except for a tied LM head, whose rows the
embedding still reads.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType, ModuleType
from typing import TYPE_CHECKING, Protocol

import torch
import torch.nn.functional as F
from torch import nn

if TYPE_CHECKING:
    from pagedllm.backends.cpu.groupwise_pack import PackedGroupwise

logger = logging.getLogger(__name__)

LinearFn = Callable[[torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class LinearKernel:
    """What a linear factory chose for one layer (or one expert's weight).

    A factory that cannot run the layer (no extension, a check that failed, an unpackable
    layout) still returns one, with ``fn`` None and a ``torch-...`` path: the name is what the
    log and benchmarks report either way.
    """

    fn: LinearFn | None  # x [..., K] -> [..., N]; None: the layer keeps its own forward
    path: str  # e.g. "cpp-int4-avx2+split", "onednn-float32", "torch-int8"
    # float32 rows [R, K] of W read back from the packed copy (the definition's values): what
    # an embedding tied to this head reads instead of keeping its table a second time.
    packed_rows: LinearFn | None = None
    # A group-wise GEMM's panels: what a grouped call over many such layers needs
    # (fused_moe.make_grouped_gemm).
    groupwise: PackedGroupwise | None = None
    # Up to how many rows of each activation dtype take the group-wise dot path.
    dot_rows: Mapping[torch.dtype, int] = field(default_factory=lambda: MappingProxyType({}))


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
    from pagedllm.backends.cpu._ops import load_gemm_ops

    try:
        return load_gemm_ops()
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


def _kind(module: nn.Module, head: nn.Module | None) -> str:
    return "lm_head" if module is head else type(module).__name__


class _Maker(Protocol):
    def __call__(
        self, module: nn.Module, bias: torch.Tensor | None, *, dot: bool, checked: set[tuple] | None
    ) -> LinearKernel: ...


def _float_kernel(
    module: nn.Module, bias: torch.Tensor | None, *, dot: bool, checked: set[tuple] | None
) -> LinearKernel:
    return make_dense_linear(module.weight, bias)


def _int8_kernel(
    module: nn.Module, bias: torch.Tensor | None, *, dot: bool, checked: set[tuple] | None
) -> LinearKernel:
    from pagedllm.layers.quantization import weight_scale

    return make_int8_linear(module.weight, weight_scale(module), bias)


def _w8a8_kernel(
    module: nn.Module, bias: torch.Tensor | None, *, dot: bool, checked: set[tuple] | None
) -> LinearKernel:
    from pagedllm.layers.quantization import weight_scale

    fn = make_w8a8_linear(module.weight, weight_scale(module), bias)
    ops = gemm_ops()
    if fn is None or ops is None:
        return LinearKernel(None, "torch-w8a8")
    amx = "+amx" if ops.has_amx_int8() else ""
    return LinearKernel(fn, f"cpp-w8a8-{ops.int8_dot_isa()}{amx}")


def _groupwise_kernel(
    module: nn.Module, bias: torch.Tensor | None, *, dot: bool, checked: set[tuple] | None
) -> LinearKernel:
    from pagedllm.backends.cpu.groupwise_linear import make_groupwise_linear

    return make_groupwise_linear(module, bias, dot=dot, checked=checked)


def _parts_kernel(
    module: nn.Module, bias: torch.Tensor | None, *, dot: bool, checked: set[tuple] | None
) -> LinearKernel:
    from pagedllm.backends.cpu.groupwise_linear import make_parts_linear

    return make_parts_linear(module, bias, dot=dot, checked=checked)


@functools.cache
def linear_makers() -> Mapping[str, _Maker]:
    """The kernel factory of each weight format this backend runs packed, by the format a
    quantization method declares (``LinearMethod.weight_format``); the group-wise formats are
    ``groupwise.FORMATS``' names, one factory for all of them. A format not here keeps the
    layer's own forward."""
    from pagedllm.layers.quantization.base import FLOAT
    from pagedllm.layers.quantization.groupwise import FORMATS
    from pagedllm.layers.quantization.groupwise_parts import MIXED
    from pagedllm.layers.quantization.int8 import Int8WeightOnly
    from pagedllm.layers.quantization.w8a8 import Int8W8A8

    makers: dict[str, _Maker] = {
        FLOAT: _float_kernel,
        Int8WeightOnly.weight_format: _int8_kernel,
        Int8W8A8.weight_format: _w8a8_kernel,
        MIXED: _parts_kernel,
    }
    makers.update(dict.fromkeys(FORMATS, _groupwise_kernel))
    return MappingProxyType(makers)


def groupwise_formats() -> frozenset[str]:
    """The group-wise formats whose layers stay packed here (a GGUF's blocks kept, not
    dequantised at load): all of ``groupwise.FORMATS``."""
    from pagedllm.layers.quantization.groupwise import FORMATS

    return frozenset(FORMATS) & frozenset(linear_makers())


def make_linear_kernel(
    module: nn.Module,
    *,
    is_head: bool = False,
    int8_activations: bool = False,
    checked: set[tuple] | None = None,
) -> LinearKernel:
    """The fastest correct GEMM for one layer, chosen by the format its method declares;
    ``checked``: the group-wise shapes this load has already checked in full (see
    ``make_groupwise_linear``)."""
    from pagedllm.layers.quantization.base import UNQUANTIZED

    bias = getattr(module, "bias", None) if module.fast_linear_has_bias else None
    fmt = (getattr(module, "quant_method", None) or UNQUANTIZED).layer_format(module)
    make = linear_makers().get(fmt)
    if make is None:
        return LinearKernel(None, f"torch-{fmt}")
    # Linear layers and a quantised LM head alike (a GGUF's Q8_0 / 4-bit output table). An LM
    # head keeps x unrounded even so: its outputs are the logits sampling reads, with no later
    # layer to average the rounding out (SmolLM2's Q8_0 head on the dot path turned the demo's
    # batched "capital of France" answer from Paris into a loop).
    return make(module, bias, dot=int8_activations and not is_head, checked=checked)


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


def _drop_group_scales(module: nn.Module) -> None:
    """A packed group-wise layer's scale/offset buffers: in the packed copy now (they were as
    large as half the 4-bit weights)."""
    from pagedllm.layers.quantization.base import UNQUANTIZED
    from pagedllm.layers.quantization.groupwise import FORMATS
    from pagedllm.layers.quantization.groupwise_parts import MIXED

    fmt = (getattr(module, "quant_method", None) or UNQUANTIZED).layer_format(module)
    if fmt == MIXED:  # each part's own tensors
        for part in module.parts:
            part.weight = torch.empty(0, dtype=part.weight.dtype)
            _drop_group_scales(part)
        return
    if fmt not in FORMATS:
        return
    for name in ("weight_scale_bits", "weight_offset_bits", "weight_super_bits"):
        if hasattr(module, name):
            setattr(module, name, torch.empty(0, dtype=torch.int32))


def _embedding_rows(
    weight_rows: Callable[[torch.Tensor], torch.Tensor], dtype: torch.dtype
) -> Callable[[torch.Tensor], torch.Tensor]:
    """An embedding's look-up from its tied head's panels: ``GroupwiseMethod.embed``'s rows
    (float32 from the same integers and scales, then the compute dtype), bit for bit."""

    def rows(ids: torch.Tensor) -> torch.Tensor:
        flat = weight_rows(ids.reshape(-1).long())
        return flat.to(dtype).reshape(*ids.shape, flat.shape[-1])

    return rows


def pack_linear_layers(model: nn.Module, *, int8_activations: bool = False) -> dict[str, str]:
    """Install the chosen GEMM on every layer that offers the ``fast_linear`` slot.

    Returns ``{layer kind: path}`` (e.g. ``{"QKVParallelLinear": "cpp-bf16-avx2"}``), which the
    backend logs and benchmarks report; a kind whose layers got different paths lists them all.
    """
    from pagedllm.layers.linear import ColumnParallelLinear, ParallelLMHead, RowParallelLinear

    head = getattr(model, "lm_head", None)
    paths: dict[str, set[str]] = {}
    checked: set[tuple] = set()
    with torch.inference_mode():
        for module in model.modules():
            is_linear = isinstance(module, (ColumnParallelLinear, RowParallelLinear))
            if not (is_linear or module is head):
                continue
            kernel = make_linear_kernel(
                module, is_head=module is head, int8_activations=int8_activations, checked=checked
            )
            paths.setdefault(_kind(module, head), set()).add(kernel.path)
            if kernel.fn is None:
                continue
            module.fast_linear = kernel.fn
            # A tied head is the embedding, which still needs its rows: a group-wise one
            # reads them back from the head's panels (a Gemma 2 2B table: ~0.7 GB not held
            # twice); a 16-bit or int8 one keeps both.
            tied = module is head and not isinstance(module, ParallelLMHead)
            if tied and kernel.packed_rows is not None:
                module.fast_rows = _embedding_rows(kernel.packed_rows, module.compute_dtype)
            read_back = getattr(module, "fast_rows", None) is not None
            if is_linear or isinstance(module, ParallelLMHead) or read_back:
                # The packed copy is the only one used from now on: do not keep two.
                module.weight.data = torch.empty(0, dtype=module.weight.dtype)
                _drop_group_scales(module)
    summary = {kind: "+".join(sorted(p)) for kind, p in paths.items()}
    logger.info("linear layers: %s", ", ".join(f"{k}={v}" for k, v in summary.items()))
    return summary

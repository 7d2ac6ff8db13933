"""Group-wise quantised layers (4-bit ``int4`` / GGUF Q4_0, Q4_1, Q4_K and 8-bit ``q8_0`` /
``q6_k``, groups of 32 along K) on the CPU backend's C++ GEMM (``csrc/gemm_q4.cpp``).

The weights stay quantised, packed once per layer (:mod:`.groupwise_pack`: the layout and the
smallest exact form of its scales). Two paths run on the same packed weights:

- **float** (``dot=False``): x is not rounded; every weight is dequantised as
  :func:`~pagedllm.layers.quantization.groupwise.dequantize_layer` does (float32 x), or q meets
  bf16 x in ``vdpbf16ps`` and is scaled per group (bf16 x, avx512bf16 builds; on processors
  with AMX-BF16, batches of ``groupwise_amx_rows()`` rows or more take one tile product per
  group instead, scaled the same way: 3-6x faster at 16-256 rows). Results differ from
  ``F.linear(x, dequantize_layer(layer))`` only by float32 summation order.
- **dot** (``dot=True``): each row of x is rounded to int8 per group of 32
  (:func:`~.groupwise_reference.quantize_activation_groups`), integer dot products (VNNI /
  AVX2), float32 scales per group; its definition is
  :func:`~.groupwise_reference.dot_linear_reference`. It costs accuracy (x to ~8 bits per
  group, as llama.cpp does) and saves arithmetic, so it runs by default only where the user
  asks for it (``int8_activations``) and :func:`dot_rows` says so: bf16/fp16 batches of every
  size (decode steps and prefill, as llama.cpp rounds them), never float32, never an LM head,
  and never an 8-bit or IQ4 layer where the int16 tiles run (:func:`takes_dot`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from functools import partial
from types import MappingProxyType, ModuleType

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.backends.cpu import dense_gemm as dg
from pagedllm.backends.cpu.groupwise_pack import (
    PackedGroupwise,
    Storage,
    check_k,
    iq4_levels,
    pack_groupwise,
    six_bits,
)
from pagedllm.backends.cpu.groupwise_reference import (
    dequantize_rows,
    dot_linear_reference,
    weight_integers,
)
from pagedllm.backends.cpu.linear_kernel import LinearKernel
from pagedllm.layers.quantization.groupwise import (
    weight_groups,
    weight_super_scale,
)

logger = logging.getLogger(__name__)

_ACT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
LinearFn = Callable[[torch.Tensor], torch.Tensor]


# Rows up to which bf16/fp16 x takes the dot path where the user asked for it
# (``int8_activations``), per integer dot product (``ops.int8_dot_isa()``); None: every
# batch. Measured by ``benchmarks/linear_cpu.py --dot-rows`` on a Zen 4 EPYC (1B shapes, fused
# q/k/v and gate/up, Q4_0 / Q4_K / Q8_0 / Q6_K, bf16 x): VNNI ran 1.1-1.2x the float path at
# one row, 1.3-1.9x at 2-64 and 1.2-2.8x at 128-1024 (vpdpbusd does twice the multiply-adds of
# vdpbf16ps, and the float path's weight conversion is not cheaper per row), with no crossover:
# prefill batches round x as llama.cpp's do. AVX2's vpmaddubsw (the avx2 and avx512 builds) ran
# 2-2.6x its float path at 1-16 rows and 1.0-1.6x at 256-512 (a run on a loaded host; Q4_0 and
# Q8_0, o_proj and down_proj): no crossover either. Since its 4-bit register tiles
# (gemm_q4_dot_tiles.h, past 4 rows), 155-172 GMAC/s at 16-256 rows on a Zen 3 against the
# int16 tiles' ~95 for the same bf16 rows (1.5-1.8x).
DOT_ROWS: dict[str, int | None] = {"avx512vnni": None, "avx2": None}
# What ``dot_rows`` returns for "every batch".
EVERY_BATCH = 1 << 62


def dot_rows(ops: ModuleType, dtype: torch.dtype, *, enabled: bool = True) -> int:
    """Up to how many rows of ``dtype`` x the dot path runs by default (0: never,
    ``EVERY_BATCH``: every batch).

    Only where ``enabled`` (the user's ``int8_activations``): rounding x to int8 per group is
    llama.cpp's arithmetic, not the reference's. On SmolLM2-135M-Instruct (bf16) it answers
    "What is the capital of France?" with "L'Étoile, la Cité, ..." exactly as llama.cpp does on
    the same file, where transformers in float32 (and our bf16 float path) answer "The capital
    of France is Paris." (the first token is a near tie: 0.08 nats in float32).
    float32 x never: float32 models are held to transformers' tokens. The scalar build never:
    it is the correctness fallback.
    """
    isa = ops.int8_dot_isa()
    if not enabled or dtype == torch.float32 or isa not in DOT_ROWS:
        return 0
    rows = DOT_ROWS[isa]
    return EVERY_BATCH if rows is None else rows


# Formats whose layers keep the default's int16 kernels under ``int8_activations`` where the
# build runs the int16 tiles (``takes_dot``): every 8-bit one (IQ4 files' layers are q8_0).
_INT16_UNDER_DOT = frozenset({"q6_k", "q5_k", "q8_0"})


def takes_dot(ops: ModuleType, name: str, *, dot: bool) -> bool:
    """Whether a ``name`` layer (a ``groupwise.FORMATS`` name, or a packed layer's) takes the
    dot path where the user allows it (``dot``).

    Where the build has the int16 register tiles (AVX2 without AVX-512), 8-bit layers (Q8_0,
    Q6_K, Q5_K) keep the default's int16 arithmetic: the dot path has register tiles there for
    4-bit layers only, and 8-bit rows on its four-row kernel ran slower than the int16 tiles,
    which are exact for bf16 x. Measured on a Zen 3 EPYC (2 cores), 1B Llama-shaped files at 64
    sequences: the Q4_K_M file's Q6_K layers (a seventh of its products) took 26% of its
    ``int8_activations`` run against 62% for the 4-bit tiles' six sevenths; with them on the
    int16 tiles its decode steps ran 502.6 ms against 551.7, its prefill 17.0 s against 23.6;
    a Q8_0 file's steps 683-714 ms against 814-823. Q6_K then keeps its 6-bit packing
    (``six_bits``), and IQ4_NL / IQ4_XS tensors (``q8_0`` layers of the IQ4 levels) their
    4-bit one (``iq4_levels``), which the int16 kernels read through a table."""
    return dot and not (name in _INT16_UNDER_DOT and ops.groupwise_int16_tiles_from())


def default_dot_rows(ops: ModuleType, *, dot: bool) -> dict[torch.dtype, int]:
    """Per activation dtype, up to how many rows take the dot path by default (``dot_rows``)."""
    return {dt: dot_rows(ops, dt, enabled=dot) for dt in _ACT_DTYPES}


def make_groupwise_gemm(
    ops: ModuleType, pw: PackedGroupwise, bias: torch.Tensor | None, *, dot: bool = False
) -> Callable[..., torch.Tensor]:
    """``gemm(x [T, K], dot=None) -> [T, N]``: ``dot=None`` takes the default for x's rows
    (the float path for every batch unless ``dot``)."""
    bias32 = None if bias is None else bias.detach().float().contiguous()
    defaults = default_dot_rows(ops, dot=dot)
    # PackedGroupwise.gemm's call with its arguments bound once: this runs per layer per step.
    kernel = ops.groupwise_gemm
    weights = (pw.packed, pw.n, pw.bits, pw.half_scales, pw.with_offset, pw.factored, bias32)
    k, levels = pw.k, pw.levels

    def gemm(x: torch.Tensor, dot: bool | None = None) -> torch.Tensor:
        check_k(x, k)
        if dot is None:
            dot = x.shape[0] <= defaults.get(x.dtype, 0)
        return kernel(x, *weights, dot, levels)

    return gemm


def _pack_layer(
    ops: ModuleType, module: nn.Module, *, dot: bool, storage: Storage | None
) -> PackedGroupwise:
    """The layer's panels in its smallest exact layout: IQ4 levels at 4 bits where
    :func:`iq4_levels` says so, else its format's (q6_k at six bits where :func:`six_bits`
    says so). ValueError where the layer's values fit no layout."""
    name = module.quant_method.weight_format
    scale, offset = weight_groups(module)
    weight = module.weight.detach()
    if iq4_levels(name, weight, dot=dot):
        try:
            return pack_groupwise(ops, weight, scale, offset, levels=True, storage=storage)
        except ValueError as e:  # some q outside the levels: the 8-bit layout
            logger.debug("q8_0 layer kept at 8 bits: %s", e)
    six = six_bits(ops, name, dot=dot)
    sup = weight_super_scale(module)
    return pack_groupwise(ops, weight, scale, offset, sup, six=six, storage=storage)


def _float_probes(
    ops: ModuleType, k: int, *, repeat: bool
) -> tuple[tuple[torch.Tensor, float], ...]:
    """The float path as every batch can meet it: float32 rows in registers and through the
    scratch, bf16 rows in registers (avx512bf16) and through the scratch; one float32 row for
    a layout already proven in this load (``repeat``: the tightest tolerance)."""
    if repeat:
        return ((torch.randn(1, k), 1e-4),)
    f32_rows = ops.groupwise_rows()[0]
    return (
        (torch.randn(3, k), 1e-4),
        (torch.randn(f32_rows + 4, k), 1e-4),
        (torch.randn(3, k).bfloat16(), 2e-2),
        (torch.randn(16, k).bfloat16(), 2e-2),
    )


def _check_paths(
    ops: ModuleType,
    module: nn.Module,
    gemm: Callable[..., torch.Tensor],
    pw: PackedGroupwise,
    bias: torch.Tensor | None,
    *,
    dot: bool,
    repeat: bool,
) -> bool:
    """Whether the packed layer matches its definition on sampled output rows: the float path
    against ``dequantize_layer``, and (first of its layout, where the dot path runs by default)
    the dot path against :func:`dot_linear_reference`. A repeated layout: a panel at each end
    and a spread (a float32 copy of fewer rows)."""
    rows = dg._sample_rows(pw.n, edge=16, spread=32) if repeat else dg._sample_rows(pw.n)
    dequant = dequantize_rows(module, rows)  # [rows, K]
    bias_rows = None if bias is None else bias.detach().float()[rows]

    def reference(probe: torch.Tensor) -> torch.Tensor:
        return F.linear(probe.float(), dequant, bias_rows)

    def forced(dot: bool) -> LinearFn:
        return dg._reshaped(lambda x: gemm(x, dot=dot), pw.k, pw.n)

    weight = module.weight
    what = f"C++ {module.quant_method.weight_format} GEMM"
    probes = _float_probes(ops, pw.k, repeat=repeat)
    if dg._checked(forced(False), weight, reference, rows, probes, what) is None:
        return False
    if repeat or not dot_rows(ops, torch.bfloat16, enabled=dot):
        return True
    q = weight_integers(module)[rows]
    scale, offset = weight_groups(module)
    off = None if offset is None else offset[rows]

    def dot_reference(probe: torch.Tensor) -> torch.Tensor:
        return dot_linear_reference(probe, q, scale[rows], off, bias_rows).float()

    probe = ((torch.randn(3, pw.k).bfloat16(), 2e-2),)
    what = f"{what} (dot path)"
    return dg._checked(forced(True), weight, dot_reference, rows, probe, what) is not None


def make_groupwise_linear(
    module: nn.Module,
    bias: torch.Tensor | None,
    *,
    dot: bool = False,
    checked: set[tuple] | None = None,
    storage: Storage | None = None,
) -> LinearKernel:
    """The C++ GEMM on a group-wise layer's packed weights, checked on sampled output rows
    (:func:`_check_paths`), with its path name: ``cpp-<int4|q8_0|q6_k|q5_k|iq4>-<isa>``
    (``iq4``: a q8_0 layer of IQ4 levels at 4 bits), ``+dot`` where every bf16/fp16 batch
    takes the dot path (``+dot<rows>``: batches of up to ``rows`` rows), only where ``dot``
    (the user's ``int8_activations``), and never in an LM head (see packed_linear).

    ``checked``: the layouts (format, shape) already checked with every probe in this load (the
    caller's set, updated here). A layer of such a key gets one float32 row on fewer sampled
    rows: what depends on its values (the packed scales, offsets and q) is still compared,
    while the kernel paths (register and scratch rows, float32 and bf16, the dot path) were
    proven on the same layout once. A 1B model's 16 layers of each shape made ~260 checking
    GEMMs otherwise. ``storage``: where the panels go (an expert's slice of its stack's
    buffer), as :func:`pack_groupwise` takes it.
    """
    name = module.quant_method.weight_format
    refused = LinearKernel(None, f"torch-{name}")
    ops = dg.gemm_ops()
    if ops is None:
        return refused
    dot = takes_dot(ops, name, dot=dot)
    try:
        pw = _pack_layer(ops, module, dot=dot, storage=storage)
    except ValueError as e:
        logger.warning("%s kept on PyTorch: %s", name, e)
        return refused
    gemm = make_groupwise_gemm(ops, pw, bias, dot=dot)
    key = (name, *pw.layout, bias is None, dot)
    repeat = checked is not None and key in checked
    if not _check_paths(ops, module, gemm, pw, bias, dot=dot, repeat=repeat):
        return refused
    if checked is not None:
        checked.add(key)
    return _kernel_of(ops, pw, gemm, dot=dot)


def packed_groupwise_linear(
    pw: PackedGroupwise, bias: torch.Tensor | None, *, dot: bool = False
) -> LinearKernel:
    """The C++ GEMM on panels packed (and checked) by an earlier start under the same build
    (``pack_cache``): what :func:`make_groupwise_linear` returns, without packing or checking."""
    ops = dg.gemm_ops()
    if ops is None:
        return LinearKernel(None, f"torch-{pw.name}")
    # Panels that never take the dot path (IQ4 levels, q6_k at six bits) were packed so because
    # the load that packed them decided so (``_pack_layer``): the same decision here.
    dot = dot and not pw.levels and pw.bits != 6 and takes_dot(ops, pw.name, dot=dot)
    return _kernel_of(ops, pw, make_groupwise_gemm(ops, pw, bias, dot=dot), dot=dot)


def _kernel_of(
    ops: ModuleType, pw: PackedGroupwise, gemm: Callable[..., torch.Tensor], *, dot: bool
) -> LinearKernel:
    return LinearKernel(
        dg._reshaped(gemm, pw.k, pw.n),
        path_name(ops, pw.name, dot=dot, four_bit=pw.bits == 4, levels=pw.levels),
        packed_rows=partial(pw.rows, ops),
        groupwise=pw,
        dot_rows=MappingProxyType(default_dot_rows(ops, dot=dot)),
    )


def make_parts_linear(
    module: nn.Module,
    bias: torch.Tensor | None,
    *,
    dot: bool = False,
    checked: set[tuple] | None = None,
    packed: Sequence[PackedGroupwise | None] = (),
) -> LinearKernel:
    """A fused layer whose parts keep their own formats (``mixed``, Q4_K q/k with a Q6_K v):
    one GEMM per run of parts in one format (q/k, v), packed and checked as a layer of its own
    (``checked``: as there; a ``dense`` run gets a dense layer's GEMM), the outputs side by
    side. ``packed``: a run's panels already packed (the packed-weight cache's), by run; a run
    without them is packed here. The path: ``cpp-mixed(<format per part>)-<isa>``; a run that
    cannot be packed leaves the whole layer on PyTorch."""
    from pagedllm.layers.quantization.base import FLOAT

    ops = dg.gemm_ops()
    if ops is None:
        return LinearKernel(None, "torch-mixed")
    kernels: list[LinearKernel] = []
    fns: list[LinearFn] = []
    start = 0
    for i, part in enumerate(module.parts):
        rows = part.weight.shape[0]
        part_bias = None if bias is None else bias[start : start + rows]
        pw = packed[i] if i < len(packed) else None
        if part.quant_method.weight_format == FLOAT:
            kernel = dg.make_dense_linear(part.weight, part_bias)
        elif pw is not None:
            kernel = packed_groupwise_linear(pw, part_bias, dot=dot)
        else:
            kernel = make_groupwise_linear(part, part_bias, dot=dot, checked=checked)
        if kernel.fn is None:
            return LinearKernel(None, "torch-mixed")
        kernels.append(kernel)
        fns.append(kernel.fn)
        start += rows

    def linear(x: torch.Tensor) -> torch.Tensor:
        return torch.cat([fn(x) for fn in fns], dim=-1)

    # Each part under its run's layout (iq4 for IQ4 levels), in part order.
    layouts = [
        k.groupwise.name if k.groupwise else p.quant_method.name
        for k, p in zip(kernels, module.parts, strict=True)
    ]
    names, run, previous = [], -1, None
    for fmt in module.quant_method.formats:
        run += fmt != previous
        previous = fmt
        names.append(layouts[run])
    fours = [k.groupwise for k in kernels if k.groupwise is not None and k.groupwise.bits == 4]
    four_bit, levels = bool(fours), all(pw.levels for pw in fours)
    # Where some parts take the dot path (a Q4_K q/k) and others not (a Q6_K v: takes_dot),
    # each part's own GEMM decides: the layer's rows are those of the parts that do.
    dot = any(rows for k in kernels for rows in k.dot_rows.values())
    mixed = f"mixed({','.join(names)})"
    path = path_name(ops, mixed, dot=dot, four_bit=four_bit, levels=levels)
    return LinearKernel(
        linear,
        path,
        dot_rows=MappingProxyType(default_dot_rows(ops, dot=dot)),
        parts=tuple(kernels),
    )


def path_name(
    ops: ModuleType, name: str, *, dot: bool = False, four_bit: bool = False, levels: bool = False
) -> str:
    """``cpp-<int4|q8_0|q6_k>-<isa>``, ``+amx<rows>`` where bf16 batches of that many rows or
    more run on AMX tiles, ``+split`` where a 4-bit layer's few bf16 rows take the split
    kernel (x as two int8 rows; not IQ4 ``levels``; builds with ``vdpbf16ps``), ``+i16r<rows>``
    where up to that many bf16 rows are rounded to int16 per group (AVX2 builds without
    AVX-512; every layout, IQ4 ``levels`` too), ``+i16t<rows>`` where batches of that many bf16
    rows or more are, on register tiles (the same builds, the same layers), ``+dot`` where every
    bf16 batch takes the dot path, ``+dot<rows>`` where batches of up to that many rows do."""
    rows = dot_rows(ops, torch.bfloat16, enabled=dot)
    suffix = "" if not rows else "+dot" if rows == EVERY_BATCH else f"+dot{rows}"
    i16 = ops.groupwise_int16_rows() if rows != EVERY_BATCH else 0
    i16_tiles = ops.groupwise_int16_tiles_from() if rows != EVERY_BATCH else 0
    if i16_tiles:  # past the dot path's rows where it takes the first ones
        suffix = f"+i16t{max(i16_tiles, rows + 1)}{suffix}"
    if i16:
        suffix = f"+i16r{i16}{suffix}"
    split = four_bit and not levels and rows != EVERY_BATCH
    split = split and "split" in ops.groupwise_bf16_rows_kernels()
    # The split kernel keeps a 4-bit layer's rows off the tiles longer (the C++ tile_rows).
    tiles = ops.groupwise_amx_rows(split) if rows != EVERY_BATCH else 0
    if split:
        suffix = f"+split{suffix}"
    if tiles:
        suffix = f"+amx{tiles}{suffix}"
    return f"cpp-{name}-{ops.built_isa()}" + suffix

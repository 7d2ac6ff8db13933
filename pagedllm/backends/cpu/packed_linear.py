"""Linear layers on repacked weights: the CPU backend's GEMM, chosen per layer and installed.

A layer's quantization method declares its weight format (``LinearMethod.weight_format``), and
the format picks the factory (``linear_makers``):

- float (float32 / bf16 / fp16), int8 weight-only and W8A8: the dense GEMMs of
  ``dense_gemm.py``, which choose by dtype and processor (oneDNN's packed weights, our C++
  GEMM, the int8 split planes, the integer GEMM);
- group-wise 4-bit / 8-bit weights (``int4``: GGUF Q4_0 / Q4_1 / Q4_K, ``quantization="int4"``;
  ``q8_0``; ``q6_k``): our group-wise GEMM on the packed blocks (``groupwise_linear.py``,
  ``csrc/gemm_q4.cpp``), column/row-parallel layers only; a fused layer whose parts differ in
  format (``mixed``) runs one such GEMM per part.

A format not in the table, or a factory that refuses the layer (its check at packing failed, an
op or the extension is missing), keeps the layer's own forward. The unpacked weight is then
dropped (the packed copy is the only one used), except for a tied LM head, whose rows the
embedding still reads.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Mapping, Sequence
from types import MappingProxyType
from typing import Protocol

import torch
from torch import nn

# The factories through their module, not bound names: tests swap ``dense_gemm.gemm_ops`` for
# one ISA level's build, and every path name must then come from that build.
from pagedllm.backends.cpu import dense_gemm
from pagedllm.backends.cpu.groupwise_pack import PackedGroupwise
from pagedllm.backends.cpu.linear_kernel import LinearKernel
from pagedllm.backends.cpu.pack_cache import PackCache

logger = logging.getLogger(__name__)


def _kind(module: nn.Module, head: nn.Module | None) -> str:
    return "lm_head" if module is head else type(module).__name__


class _Maker(Protocol):
    def __call__(
        self, module: nn.Module, bias: torch.Tensor | None, *, dot: bool, checked: set[tuple] | None
    ) -> LinearKernel: ...


def _float_kernel(
    module: nn.Module, bias: torch.Tensor | None, *, dot: bool, checked: set[tuple] | None
) -> LinearKernel:
    return dense_gemm.make_dense_linear(module.weight, bias)


def _int8_kernel(
    module: nn.Module, bias: torch.Tensor | None, *, dot: bool, checked: set[tuple] | None
) -> LinearKernel:
    from pagedllm.layers.quantization import weight_scale

    return dense_gemm.make_int8_linear(module.weight, weight_scale(module), bias)


def _w8a8_kernel(
    module: nn.Module, bias: torch.Tensor | None, *, dot: bool, checked: set[tuple] | None
) -> LinearKernel:
    from pagedllm.layers.quantization import weight_scale

    fn = dense_gemm.make_w8a8_linear(module.weight, weight_scale(module), bias)
    ops = dense_gemm.gemm_ops()
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
    module: nn.Module,
    bias: torch.Tensor | None,
    *,
    dot: bool,
    checked: set[tuple] | None,
    packed: Sequence[PackedGroupwise | None] = (),
) -> LinearKernel:
    from pagedllm.backends.cpu.groupwise_linear import make_parts_linear

    return make_parts_linear(module, bias, dot=dot, checked=checked, packed=packed)


def _part_name(layer: str, index: int) -> str:
    """A fused layer's run of parts in the packed-weight cache: its module's own name."""
    return f"{layer}.parts.{index}"


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


def _drop_weight(module: nn.Module) -> None:
    """The packed copy is the only one used from now on: do not keep two."""
    empty = torch.empty(0, dtype=module.weight.dtype)
    if module.weight.is_meta:  # a placeholder the loader left unread: no storage
        module.weight = nn.Parameter(empty, requires_grad=False)
    else:
        module.weight.data = empty
    _drop_group_scales(module)


def _read_rows_back(table: nn.Module, kernel: LinearKernel) -> bool:
    """An untied table's look-up from its own panels (:func:`_row_tables`), its weight and
    scales dropped; False where the factory gave no group-wise panels (the method's look-up
    stays; a table the loader left unread cannot get here: its panels were cached)."""
    if kernel.groupwise is None or kernel.packed_rows is None:
        return False
    table.fast_rows = _embedding_rows(kernel.packed_rows, table.compute_dtype)
    table.fast_rows_packed = kernel.groupwise
    _drop_weight(table)
    return True


def _embedding_rows(
    weight_rows: Callable[[torch.Tensor], torch.Tensor], dtype: torch.dtype
) -> Callable[[torch.Tensor], torch.Tensor]:
    """An embedding's look-up from packed panels (its tied head's or its own):
    ``GroupwiseMethod.embed``'s rows (float32 from the same integers and scales, then the
    compute dtype), bit for bit."""

    def rows(ids: torch.Tensor) -> torch.Tensor:
        if ids.dim() == 1:  # the flat batch's own case: no reshapes (a view each, every step)
            return weight_rows(ids.long()).to(dtype)
        flat = weight_rows(ids.reshape(-1).long())
        return flat.to(dtype).reshape(*ids.shape, flat.shape[-1])

    return rows


def _open_cache(
    model: nn.Module, *, dot: bool
) -> tuple[PackCache | None, Mapping[str, PackedGroupwise]]:
    """The packed-weight cache of the file the model was loaded from (``model.packed_source``,
    set by the loader where the cache is on), and the panels it holds (empty on a miss); what
    :func:`preload_packed_layers` already opened for this model where it ran."""
    preloaded = model.__dict__.pop("packed_preload", None)
    if preloaded is not None:
        return preloaded
    source = getattr(model, "packed_source", None)
    ops = dense_gemm.gemm_ops() if source is not None else None
    if source is None or ops is None:
        return None, {}
    cache = PackCache.for_source(source, ops, dot=dot)
    layers = cache.load() if cache is not None else None
    if layers:
        logger.info("packed weights read from %s", cache.path)
    return cache, layers or {}


def preload_packed_layers(model: nn.Module, *, int8_activations: bool = False) -> frozenset[str]:
    """The linear layers and the LM head whose panels the cache holds for the model's file,
    opened before its weights load so that the loader leaves those layers' checkpoint tensors
    undecoded (``models/model_loader.load_model``'s ``packed_layers``): on the demo model that
    decoding and copying was most of a cached start's load. Called on the model as built, with
    its quantization methods attached; the cache it opened is kept on the model for
    :func:`pack_linear_layers`, which installs these panels. A layer is named only where
    :func:`_cached_kernel` will take its panels, since its weights will not be there to pack.

    A tied head is the input embedding too: left unread, its look-ups read the rows back from
    the cached panels (``fast_rows``, as every packed tied head does: the integers and scales
    are the file's, so the rows are the decoded table's bit for bit). On the demo model that
    table (49,152 x 576 Q8_0) was decoded at every start only to be dropped for the panels."""
    from pagedllm.layers.linear import ColumnParallelLinear, RowParallelLinear

    cache, cached = _open_cache(model, dot=int8_activations)
    model.packed_preload = (cache, cached)
    head = getattr(model, "lm_head", None)
    tables = _row_tables(model, head)
    return frozenset(
        name
        for name, module in model.named_modules()
        if (
            isinstance(module, (ColumnParallelLinear, RowParallelLinear))
            or module is head
            or module in tables
        )
        and _fits(module, cached.get(name), loaded=False)
    )


def _row_tables(model: nn.Module, head: nn.Module | None) -> list[nn.Module]:
    """The model's untied group-wise embedding tables (a GGUF's Q4_0 / Q8_0 ``token_embd``
    beside its own ``output``): packed like a head, their rows read back from the panels
    (``fast_rows``). A table read through its method looked up each step's rows in Python
    (~0.35 ms a token on the 1B Llama-shaped files), and kept the decode stack from taking
    the model's ends; the panels hold the same integers and scales, so the rows are the
    method's bit for bit, and the table is not held twice."""
    from pagedllm.layers.linear import ParallelLMHead, VocabParallelEmbedding
    from pagedllm.layers.quantization.groupwise import FORMATS

    return [
        module
        for module in model.modules()
        if isinstance(module, VocabParallelEmbedding)
        and not isinstance(module, ParallelLMHead)
        and module is not head
        and getattr(module, "quant_method", None) is not None
        and module.quant_method.weight_format in FORMATS
    ]


def _fits(module: nn.Module, pw: PackedGroupwise | None, *, loaded: bool = True) -> bool:
    """Whether ``pw`` are panels of this layer's shape and format (a file changed in a way the
    cache's key missed would give others). ``loaded``: the layer's format now, else the one
    its method gives it once loaded."""
    from pagedllm.layers.quantization.groupwise import FORMATS

    method = getattr(module, "quant_method", None)
    if pw is None or method is None:
        return False
    fmt = method.layer_format(module) if loaded else method.weight_format
    return fmt in FORMATS and pw.n == module.weight.shape[0]


def _cached_kernel(
    module: nn.Module, pw: PackedGroupwise | None, *, is_head: bool, dot: bool
) -> LinearKernel | None:
    """The kernel on a layer's cached panels, or None to pack it (no panels, or panels that
    do not fit the layer: :func:`_fits`)."""
    from pagedllm.backends.cpu.groupwise_linear import packed_groupwise_linear

    if pw is None or not _fits(module, pw):
        return None
    bias = getattr(module, "bias", None) if module.fast_linear_has_bias else None
    kernel = packed_groupwise_linear(pw, bias, dot=dot and not is_head)
    return kernel if kernel.fn is not None else None


def _cached_parts_kernel(
    module: nn.Module, name: str, cached: Mapping[str, PackedGroupwise], *, dot: bool
) -> LinearKernel | None:
    """A fused layer of several formats on its runs' cached panels (every group-wise run's,
    each fitting it; a dense run is built from its weight as always), or None to pack it."""
    from pagedllm.layers.quantization.base import FLOAT, UNQUANTIZED
    from pagedllm.layers.quantization.groupwise_parts import MIXED

    fmt = (getattr(module, "quant_method", None) or UNQUANTIZED).layer_format(module)
    if fmt != MIXED:
        return None
    packed = [cached.get(_part_name(name, i)) for i in range(len(module.parts))]
    for part, pw in zip(module.parts, packed, strict=True):
        if part.quant_method.weight_format != FLOAT and not _fits(part, pw):
            return None
    bias = getattr(module, "bias", None) if module.fast_linear_has_bias else None
    kernel = _parts_kernel(module, bias, dot=dot, checked=None, packed=packed)
    return kernel if kernel.fn is not None else None


def _unread(module: nn.Module, cache: PackCache | None) -> RuntimeError:
    """A layer the loader left unread for its cached panels got none: the cache is removed so
    that the next start loads and packs the whole file."""
    if cache is not None:
        cache.path.unlink(missing_ok=True)
    where = cache.path if cache is not None else "the packed-weight cache"
    return RuntimeError(
        f"{type(module).__name__}: its weights were left unread for the panels of {where}, "
        "which no longer fit it; the cache file is removed, start again"
    )


def pack_linear_layers(model: nn.Module, *, int8_activations: bool = False) -> dict[str, str]:
    """Install the chosen GEMM on every layer that offers the ``fast_linear`` slot.

    Returns ``{layer kind: path}`` (e.g. ``{"QKVParallelLinear": "cpp-bf16-avx2"}``), which the
    backend logs and benchmarks report; a kind whose layers got different paths lists them all.
    """
    from pagedllm.layers.linear import ColumnParallelLinear, ParallelLMHead, RowParallelLinear

    head = getattr(model, "lm_head", None)
    tables = _row_tables(model, head)
    paths: dict[str, set[str]] = {}
    checked: set[tuple] = set()
    cache, cached = _open_cache(model, dot=int8_activations)
    packed: dict[str, PackedGroupwise] = {}
    with torch.inference_mode():
        for name, module in model.named_modules():
            is_linear = isinstance(module, (ColumnParallelLinear, RowParallelLinear))
            is_table = module in tables
            if not (is_linear or module is head or is_table):
                continue
            # (a table's x is never rounded: it multiplies nothing, its rows are read back)
            rows_only = module is head or is_table
            kernel = _cached_kernel(
                module, cached.get(name), is_head=rows_only, dot=int8_activations
            ) or _cached_parts_kernel(module, name, cached, dot=int8_activations)
            if kernel is None and module.weight.is_meta:
                raise _unread(module, cache)
            if kernel is None:
                kernel = make_linear_kernel(
                    module,
                    is_head=rows_only,
                    int8_activations=int8_activations,
                    checked=checked,
                )
            if is_table:
                if _read_rows_back(module, kernel):
                    packed[name] = kernel.groupwise
                continue
            if kernel.groupwise is not None:
                packed[name] = kernel.groupwise
            for i, part in enumerate(kernel.parts):
                if part.groupwise is not None:
                    packed[_part_name(name, i)] = part.groupwise
            paths.setdefault(_kind(module, head), set()).add(kernel.path)
            if kernel.fn is None:
                continue
            module.fast_linear = kernel.fn
            if is_linear or module is head:  # what the decode stack reads (decode_stack.py)
                module.fast_linear_packed = kernel
            # A tied head is the embedding, which still needs its rows: a group-wise one
            # reads them back from the head's panels (a Gemma 2 2B table: ~0.7 GB not held
            # twice); a 16-bit or int8 one keeps both.
            tied = module is head and not isinstance(module, ParallelLMHead)
            if tied and kernel.packed_rows is not None:
                module.fast_rows = _embedding_rows(kernel.packed_rows, module.compute_dtype)
                module.fast_rows_packed = kernel.groupwise
            read_back = getattr(module, "fast_rows", None) is not None
            if is_linear or isinstance(module, ParallelLMHead) or read_back:
                _drop_weight(module)
    if cache is not None and packed and packed.keys() != cached.keys():
        cache.save(packed)
    summary = {kind: "+".join(sorted(p)) for kind, p in paths.items()}
    logger.info("linear layers: %s", ", ".join(f"{k}={v}" for k, v in summary.items()))
    return summary

"""Group-wise quantised weights: 4-bit (GGUF Q4_0 / Q4_1 / Q4_K, ``quantization="int4"``,
compressed-tensors W4A16) and 8-bit (GGUF Q8_0), groups of 32 along the input dimension.

One representation serves every 4-bit source, so one kernel per device runs them all:

- int4: ``W[n, k] = q[n, k] * scale[n, g] + offset[n, g]`` with ``q`` in 0..15 and
  ``g = k // 32``. Q4_0 is ``scale = d, offset = -8 d``; Q4_1 ``scale = d, offset = m``; Q4_K
  ``scale = d * sc_j, offset = -dmin * m_j`` per 32-wide sub-block; a symmetric signed int4
  checkpoint is ``offset = -8 scale``. Each of these products is exact in float32, so the
  dequantised weight equals ggml's own dequantisation bit for bit (see ``dequantize_int4``).
  ``q`` is stored two to a byte, the even ``k`` in the low nibble: ``packed [N, K/2]``.
- int8 groups: ``W[n, k] = q[n, k] * scale[n, g]`` with ``q`` in -127..127 (Q8_0), or with a
  scale per 16 k, ``W[n, k] = q[n, k] * scale[n, k // 16]`` (``q6_k``: GGUF Q6_K, whose 6-bit
  ``q - 32`` is kept in an int8 and whose ``d * sc`` products are exact in float32). A q6_k
  layer also keeps the super-block factor ``d`` per 256 k (``weight_super_bits``), so that the
  CPU kernel can store ``d`` once per 256 and ``sc`` as a byte (8.625 bits a weight with q as
  int8; 6.625 with q at 6 bits, where its build reads them).
- int8 groups with offsets (``q5_k``: GGUF Q5_K): ``W[n, k] = q[n, k] * scale[n, g] +
  offset[n, g]`` with ``q`` in 0..31 held in an int8, ``scale = d * sc`` and ``offset =
  -dmin * m`` (products exact in float32, so one rounding as ggml's).

Scales and offsets are float32, kept as their bits in ``int32`` buffers (``weight_scale_bits``,
``weight_offset_bits``) for the reason :mod:`.int8` gives. The PyTorch ``apply`` dequantises the
layer per call (correct on any device, slow); the CPU backend runs the packed weights in its
C++ GEMM instead, and GPU/XPU dequantise GGUF weights at load.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.layers.quantization.base import LinearMethod

GROUP_SIZE = 32
Q6_K_SCALE_GROUP = 16  # k per scale of a q6_k layer
Q6_K_SUPER = 256  # k per super-block factor d of a q6_k layer
_INT4_MAX = 15
# Group-wise format name -> (bits, k per scale, offsets stored): the one list of these names
# (methods declare them as their ``weight_format``; backends claim them from here).
FORMATS: dict[str, tuple[int, int, bool]] = {
    "int4": (4, GROUP_SIZE, True),
    "q8_0": (8, GROUP_SIZE, False),
    "q6_k": (8, Q6_K_SCALE_GROUP, False),
    "q5_k": (8, GROUP_SIZE, True),
}


def pack_nibbles(q: torch.Tensor) -> torch.Tensor:
    """``q [N, K]`` (values 0..15, K even) -> uint8 ``[N, K/2]``, even ``k`` in the low nibble."""
    if q.shape[-1] % 2:
        raise ValueError(f"int4 weights need an even input size, got {q.shape[-1]}")
    q = q.to(torch.uint8)
    return q[..., 0::2] | (q[..., 1::2] << 4)


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """uint8 ``[N, K/2]`` -> uint8 ``[N, K]`` in 0..15 (the inverse of :func:`pack_nibbles`)."""
    low = packed & 0x0F
    high = packed >> 4
    return torch.stack((low, high), dim=-1).reshape(*packed.shape[:-1], packed.shape[-1] * 2)


def _per_column(groups: torch.Tensor, size: int = GROUP_SIZE) -> torch.Tensor:
    """float32 ``[N, K/size]`` -> ``[N, K]``, each group's value repeated over its columns."""
    return groups.float().repeat_interleave(size, dim=-1)


def dequantize_int4(
    packed: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor
) -> torch.Tensor:
    """float32 ``[N, K]``: ``q * scale + offset`` per group, rounded once as ggml rounds it."""
    q = unpack_nibbles(packed).float()
    return q * _per_column(scale) + _per_column(offset)


def dequantize_groups(
    weight: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor | None
) -> torch.Tensor:
    """float32 ``[N, K]`` of any group-wise layer's tensors, by the weight's storage: nibbles
    (int4) or int8 (q8_0, q6_k; q5_k with offsets, ``q * scale + offset`` rounded once)."""
    if weight.dtype == torch.uint8:
        return dequantize_int4(weight, scale, offset)
    w = dequantize_int8_groups(weight, scale)
    return w if offset is None else w + _per_column(offset)


def dequantize_int8_groups(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """float32 ``[N, K]``: ``q * scale`` per group of 32 (q8_0) or 16 (q6_k: ``scale`` has
    ``K/16`` columns), one rounding as ggml's ``(d * sc) * q``."""
    return q.float() * _per_column(scale, q.shape[-1] // scale.shape[-1])


def quantize_int4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``weight [N, K]`` -> (packed uint8 ``[N, K/2]``, scale, offset float32 ``[N, K/32]``).

    Asymmetric per group (as GGUF's Q4_1): ``offset = min``, ``scale = (max - min) / 15``, so
    both ends of every group are represented; a constant group gets ``scale = 1``. Scale and
    offset are rounded to float16 where that keeps them finite and the scale non-zero (as Q4_1
    stores them; ``q`` is computed against the rounded values), so that the CPU kernels keep
    them in 2 bytes each: 5 bits a weight streamed instead of 6.
    """
    n, k = weight.shape
    if k % GROUP_SIZE:
        raise ValueError(f"int4 needs the input size to be a multiple of {GROUP_SIZE}, got {k}")
    packed = torch.empty(n, k // 2, dtype=torch.uint8, device=weight.device)
    scale = torch.empty(n, k // GROUP_SIZE, dtype=torch.float32, device=weight.device)
    offset = torch.empty_like(scale)
    step = 1024  # rows at a time: no float32 copy of a whole weight
    for start in range(0, n, step):
        rows = weight[start : start + step].float().reshape(-1, k // GROUP_SIZE, GROUP_SIZE)
        low = rows.amin(dim=-1)
        high = rows.amax(dim=-1)
        s = (high - low) / _INT4_MAX
        s = torch.where(s > 0, s, torch.ones_like(s))
        s, low = _half_where_fit(s, nonzero=True), _half_where_fit(low, nonzero=False)
        q = torch.round((rows - low[..., None]) / s[..., None]).clamp_(0, _INT4_MAX)
        packed[start : start + step] = pack_nibbles(q.reshape(-1, k))
        scale[start : start + step] = s
        offset[start : start + step] = low
    return packed, scale, offset


def _half_where_fit(t: torch.Tensor, *, nonzero: bool) -> torch.Tensor:
    """``t`` rounded to float16 (kept float32) where the result is finite (and non-zero)."""
    h = t.half().float()
    fits = torch.isfinite(h) & (h != 0 if nonzero else True)
    return torch.where(fits, h, t)


def weight_groups(layer: nn.Module) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A group-quantised layer's float32 (scale, offset) ``[N, K/32]``; offset None for int8."""
    scale = layer.weight_scale_bits.view(torch.float32)
    offset = getattr(layer, "weight_offset_bits", None)
    return scale, None if offset is None else offset.view(torch.float32)


def weight_super_scale(layer: nn.Module) -> torch.Tensor | None:
    """A q6_k layer's float32 ``d [N, K/256]`` (``scale = d * sc``); None for other layers."""
    bits = getattr(layer, "weight_super_bits", None)
    return None if bits is None else bits.view(torch.float32)


def dequantize_layer(layer: nn.Module) -> torch.Tensor:
    """The layer's weight in float32 ``[N, K]`` (the reference every kernel is checked against)."""
    scale, offset = weight_groups(layer)
    return dequantize_groups(layer.weight, scale, offset)


def _row_loader(layer: nn.Module, columns_per_stored: int) -> object:
    """The loader of one stored tensor of a group-quantised layer.

    Column-parallel layers keep whole rows (their own loader narrows rows); row-parallel
    layers split the input features, so each rank keeps ``input_shard / columns_per_stored``
    stored columns (2 per byte of nibbles, 32 per group scale).
    """
    from pagedllm.layers.linear import ColumnParallelLinear, VocabParallelEmbedding

    if isinstance(layer, ColumnParallelLinear):
        return layer.load_shard
    if isinstance(layer, VocabParallelEmbedding):
        return layer.load_weight  # vocabulary rows, whatever each row stores
    per_rank = layer.input_shard // columns_per_stored
    return _ColumnsLoader(layer.tp.rank * per_rank, per_rank)


class _ColumnsLoader:
    """A row-parallel rank's stored columns ``start .. start + size`` of a tensor.

    Only a narrowing (``reads_slices``): the checkpoint loader may adopt a whole tensor it
    reads (one rank) as the parameter instead of copying it (a GGUF's o_proj and down_proj).
    """

    reads_slices = True

    def __init__(self, start: int, size: int) -> None:
        self.start, self.size = start, size

    def __call__(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        from pagedllm.layers.linear import default_weight_loader

        default_weight_loader(param, loaded.narrow(1, self.start, self.size))


class GroupwiseMethod(LinearMethod):
    """Weights quantised in groups along K: 4-bit (``bits=4``), 8-bit with a scale per 32 k
    (``bits=8``: q8_0) or per 16 k (``bits=8, scale_group=16``: q6_k).

    ``prequantized``: the checkpoint (GGUF, compressed-tensors) supplies ``weight`` (packed
    nibbles or int8), ``weight_scale`` and, for 4-bit, ``weight_offset`` per group (q6_k:
    ``weight_scale`` per 16 k and ``weight_super``, its factor ``d`` per 256 k); otherwise
    the float weight is loaded and quantised by :func:`quantize_int4` once the layer is whole
    (8-bit groups are only read, never made).
    """

    def __init__(
        self,
        *,
        bits: int,
        prequantized: bool,
        scale_group: int = GROUP_SIZE,
        offsets: bool | None = None,
    ) -> None:
        if bits not in (4, 8):
            raise ValueError(f"bits: group-wise weights are 4- or 8-bit, got {bits}")
        if bits == 8 and not prequantized:
            raise ValueError("prequantized: 8-bit group weights come from checkpoints only")
        if scale_group not in (GROUP_SIZE, Q6_K_SCALE_GROUP) or (bits == 4 and scale_group != 32):
            raise ValueError(f"scale_group: 32 (or 16 for 8-bit q6_k), got {scale_group}")
        if offsets is None:
            offsets = bits == 4
        if (bits == 4 and not offsets) or (offsets and scale_group != GROUP_SIZE):
            raise ValueError("offsets: 4-bit groups have them; 8-bit ones only per 32 (q5_k)")
        self.bits = bits
        self.prequantized = prequantized
        self.scale_group = scale_group
        self.offsets = offsets  # weight_offset per group: int4, and q5_k's 8-bit q in 0..31
        key = (bits, scale_group, offsets)
        self.name = next((fmt for fmt, spec in FORMATS.items() if spec == key), "")
        if not self.name:
            raise ValueError(f"no group-wise format of {bits} bits, scale per {scale_group} k")
        self.weight_format = self.name

    @classmethod
    def for_format(cls, fmt: str) -> GroupwiseMethod:
        """The prequantized method of a format name (``int4``, ``q8_0``, ``q6_k``)."""
        if fmt not in FORMATS:
            raise ValueError(f"format: one of {sorted(FORMATS)}, got {fmt!r}")
        bits, scale_group, offsets = FORMATS[fmt]
        return cls(bits=bits, prequantized=True, scale_group=scale_group, offsets=offsets)

    def stored_tensors(self, n: int, k: int) -> dict[str, tuple[torch.Tensor, int]]:
        """The empty tensors a prequantized ``[n, k]`` layer reads from its checkpoint, by
        name: (tensor, input columns per stored column). ValueError where ``k`` does not fit."""
        self.check_input_size(k)
        per, dtype = (2, torch.uint8) if self.bits == 4 else (1, torch.int8)
        sg = self.scale_group
        tensors = {
            "weight": (torch.empty(n, k // per, dtype=dtype), per),
            "weight_scale": (torch.empty(n, k // sg), sg),
        }
        if self.offsets:
            tensors["weight_offset"] = (torch.empty(n, k // GROUP_SIZE), GROUP_SIZE)
        if self.name == "q6_k":
            tensors["weight_super"] = (torch.empty(n, k // Q6_K_SUPER), Q6_K_SUPER)
        return tensors

    def check_input_size(self, k: int) -> None:
        multiple = Q6_K_SUPER if self.name == "q6_k" else GROUP_SIZE
        if k % multiple:
            raise ValueError(
                f"{self.name} weights need the input size to be a multiple of {multiple}, "
                f"got a layer of {k} inputs"
            )

    def create_weights(self, layer: nn.Module) -> None:
        n, k = layer.weight.shape
        self.check_input_size(k)
        layer.compute_dtype = layer.weight.dtype  # what the float weight would have been
        if not self.prequantized:
            return
        for name, (tensor, per) in self.stored_tensors(n, k).items():
            setattr(layer, name, _stored(tensor, _row_loader(layer, per)))

    def finish_loading(self, layer: nn.Module) -> None:
        if self.is_quantized(layer):
            return
        if self.prequantized:
            scale = layer.weight_scale.detach().float().contiguous()
            del layer.weight_scale
            if self.offsets:
                offset = layer.weight_offset.detach().float().contiguous()
                del layer.weight_offset
            if self.name == "q6_k":
                d = layer.weight_super.detach().float().contiguous()
                del layer.weight_super
                layer.register_buffer("weight_super_bits", d.view(torch.int32))
        else:
            packed, scale, offset = quantize_int4(layer.weight.detach())
            layer.weight = nn.Parameter(packed, requires_grad=False)
        layer.register_buffer("weight_scale_bits", scale.view(torch.int32))
        if self.offsets:
            layer.register_buffer("weight_offset_bits", offset.view(torch.int32))

    def is_quantized(self, layer: nn.Module) -> bool:
        return hasattr(layer, "weight_scale_bits")

    def embed(self, layer: nn.Module, ids: torch.Tensor) -> torch.Tensor:
        """Rows ``ids`` of a quantised embedding table, dequantised (float32, then the compute
        dtype of the layer's neighbours: the scale buffers' float32 is no guide to it)."""
        scale, offset = weight_groups(layer)
        off = None if offset is None else offset[ids]
        return dequantize_groups(layer.weight[ids], scale[ids], off).to(layer.compute_dtype)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """PyTorch path: the weight dequantised per call (the C++ GEMM replaces it on CPUs)."""
        return F.linear(x, dequantize_layer(layer).to(x.dtype), bias)


def _stored(tensor: torch.Tensor, loader: object) -> nn.Parameter:
    from pagedllm.layers.linear import with_loader

    return with_loader(nn.Parameter(tensor, requires_grad=False), loader)

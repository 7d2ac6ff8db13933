"""A fused layer whose parts a checkpoint stores in different group-wise formats.

llama.cpp's Q4_K_M files keep a Q6_K ``attn_v`` beside Q4_K ``attn_q`` and ``attn_k`` in half
the layers; fused into one ``qkv_proj``, such a layer holds no single format, and dequantising it
whole made it stream 3x the bytes of its parts as stored (bf16 against ~4.6 bits a weight). So
each run of neighbouring parts in one format is kept in that format as a :class:`GroupwisePart`
(the tensors a layer of that format holds, read by that format's functions as if it were one:
q and k together, v alone), and the layer's output is the runs' outputs side by side, in the
order of the fused ``output_sizes``. (One GEMM per run, not per part: each call costs a thread
team's start and a dispatch, as much as a small part's weights take to stream at one row.)

A part in a type no group-wise format holds (a Q5_K ``attn_v`` beside IQ4_XS q and k, as
llama.cpp's IQ4_XS and Q3_K_M files keep them) is a ``dense`` run: dequantised at load to the
compute dtype, while its neighbours stay quantised (dequantising the layer whole made q and k
stream 16 bits a weight).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.layers.quantization.base import FLOAT, LinearMethod
from pagedllm.layers.quantization.groupwise import GroupwiseMethod

DENSE = "dense"  # a run kept as a float weight in the compute dtype
MIXED = "mixed"  # the fused layer's format: one group-wise format (or dense) per run of parts


class DenseRows(LinearMethod):
    """A run of parts dequantised at load: ``weight [rows, K]`` in the compute dtype."""

    name = DENSE
    weight_format = FLOAT  # the run's rows in the compute dtype, as an unquantised layer's
    prequantized = True

    def stored_tensors(self, n: int, k: int) -> dict[str, tuple[torch.Tensor, int]]:
        return {"weight": (torch.empty(n, k), 1)}  # in the compute dtype once a part's

    def is_quantized(self, layer: nn.Module) -> bool:
        return True  # nothing to finish

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return F.linear(x, layer.weight.to(x.dtype), bias)


def part_method(fmt: str) -> LinearMethod:
    """The method of one run: a group-wise format's, or :class:`DenseRows`."""
    return DenseRows() if fmt == DENSE else GroupwiseMethod.for_format(fmt)


class GroupwisePart(nn.Module):
    """The rows of a run of parts in their group-wise format (``quant_method``): ``weight``,
    ``weight_scale`` ... as buffers, so that loading checks only the fused layer's parameters
    (a dense run: ``weight`` alone, in the compute dtype)."""

    def __init__(self, method: LinearMethod, rows: int, input_size: int, dtype: torch.dtype):
        super().__init__()
        self.quant_method = method
        self.input_size = input_size
        self.compute_dtype = dtype
        for name, (tensor, _) in method.stored_tensors(rows, input_size).items():
            self.register_buffer(name, tensor.to(dtype) if method.name == DENSE else tensor)


class _PartLoader:
    """Loads the rows of checkpoint tensor ``name`` of part ``shard_id`` into its run's rows.

    Narrows rows only (``reads_slices``: a tensor-parallel rank reads its own part of a lazily
    read tensor); the fused layer's parameter of that name is an empty placeholder.
    """

    reads_slices = True

    def __init__(self, layer: nn.Module, name: str, places: list[tuple[int, int]]) -> None:
        self.layer, self.name, self.places = layer, name, places

    def __call__(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: int = 0) -> None:
        if not 0 <= shard_id < len(self.places):
            raise ValueError(f"part {shard_id} of a layer of {len(self.places)} parts")
        run, start = self.places[shard_id]
        part = self.layer.parts[run]
        stored = getattr(part, self.name, None)
        if stored is None:
            raise ValueError(f"{self.name}: part {shard_id} is {part.quant_method.name}")
        piece = self.layer.shard_rows(loaded, shard_id)
        dst = stored.narrow(0, start, min(piece.shape[0], stored.shape[0] - start))
        if dst.shape != piece.shape:
            raise ValueError(f"weight shape {tuple(piece.shape)} != expected {tuple(dst.shape)}")
        dst.copy_(piece)


class GroupwisePartsMethod(LinearMethod):
    """A column-parallel fused layer (q/k/v, gate/up) with a group-wise format per part
    (``formats``, in the order of the layer's ``output_sizes``; ``dense`` for a part kept as a
    float weight), at least one part group-wise."""

    name = MIXED
    weight_format = MIXED
    prequantized = True  # read as stored: finished with the model, never quantised at load

    def __init__(self, formats: tuple[str, ...]) -> None:
        if len(formats) < 2:
            raise ValueError(f"formats: a fused layer of 2 or more parts, got {formats!r}")
        if all(f == DENSE for f in formats):
            raise ValueError(f"formats: no group-wise part in {formats!r}")
        self.formats = tuple(formats)
        self.part_methods = tuple(part_method(f) for f in self.formats)

    def create_weights(self, layer: nn.Module) -> None:
        from pagedllm.layers.linear import with_loader

        sizes = getattr(layer, "shard_sizes", None)
        if sizes is None or len(sizes) != len(self.formats):
            raise ValueError(
                f"formats: {len(self.formats)} parts for a layer of "
                f"{0 if sizes is None else len(sizes)} fused parts"
            )
        runs: list[tuple[int, int]] = []  # (first part, rows) of each run of one format
        places: list[tuple[int, int]] = []  # each part's (run, first row in the run)
        for i, rows in enumerate(sizes):
            if runs and self.formats[i] == self.formats[runs[-1][0]]:
                places.append((len(runs) - 1, runs[-1][1]))
                runs[-1] = (runs[-1][0], runs[-1][1] + rows)
            else:
                places.append((len(runs), 0))
                runs.append((i, rows))
        dtype = layer.weight.dtype
        layer.compute_dtype = dtype
        layer.parts = nn.ModuleList(
            GroupwisePart(self.part_methods[first], rows, layer.input_size, dtype)
            for first, rows in runs
        )
        names = {n for m in self.part_methods for n in m.stored_tensors(1, layer.input_size)}
        for name in sorted(names):  # placeholders: what the checkpoint names, routed to parts
            param = nn.Parameter(torch.empty(0), requires_grad=False)
            setattr(layer, name, with_loader(param, _PartLoader(layer, name, places)))

    def finish_loading(self, layer: nn.Module) -> None:
        for part in layer.parts:
            part.quant_method.finish_loading(part)

    def is_quantized(self, layer: nn.Module) -> bool:
        parts = getattr(layer, "parts", ())
        return bool(parts) and all(p.quant_method.is_quantized(p) for p in parts)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """PyTorch path: each run dequantised per call, the outputs side by side."""
        y = torch.cat([p.quant_method.apply(p, x, None) for p in layer.parts], dim=-1)
        return y if bias is None else y + bias

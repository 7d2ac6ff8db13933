"""Linear layers that know how to load (and shard) Hugging Face weights.

Fused projections are built at load time: q/k/v become one ``qkv_proj`` and gate/up one
``gate_up_proj``, so each layer runs one matmul for all tokens of a step. Column-parallel layers
split output features across tensor-parallel ranks; row-parallel layers split input features and
all-reduce their outputs.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.layers.parallel import SINGLE, TPContext

if TYPE_CHECKING:
    from pagedllm.layers.quantization.base import LinearMethod

# A backend may install a faster ``x -> x @ W^T (+ b)`` on a layer after loading (for example
# weights repacked for the CPU's GEMM library); the layer then calls it instead of F.linear.
LinearFn = Callable[[torch.Tensor], torch.Tensor]


def with_loader(param: nn.Parameter, loader: object) -> nn.Parameter:
    """``param``, filled from a checkpoint by ``loader(param, tensor[, shard])`` (its
    ``weight_loader``, which ``models/checkpoint.py`` reads): the one place it is attached."""
    param.weight_loader = loader  # type: ignore[attr-defined]
    return param


def _param(shape: tuple[int, ...], loader: object) -> nn.Parameter:
    return with_loader(nn.Parameter(torch.empty(shape), requires_grad=False), loader)


def default_weight_loader(param: nn.Parameter, loaded: torch.Tensor) -> None:
    if param.shape != loaded.shape:
        raise ValueError(f"weight shape {tuple(loaded.shape)} != expected {tuple(param.shape)}")
    param.data.copy_(loaded)


class ColumnParallelLinear(nn.Module):
    """``y = x W^T + b`` with W's rows (output features) split across ranks."""

    def __init__(
        self,
        input_size: int,
        output_sizes: list[int],
        *,
        bias: bool = False,
        tp: TPContext = SINGLE,
        shard_sizes: list[int] | None = None,
    ) -> None:
        super().__init__()
        self.tp = tp
        self.input_size = input_size  # the weight's columns, whatever form quantisation gives it
        self.output_sizes = output_sizes
        # Per-rank size of each fused part (heads may be replicated rather than split).
        self.shard_sizes = shard_sizes or [tp.shard(s, "output features") for s in output_sizes]
        out = sum(self.shard_sizes)
        self.weight = _param((out, input_size), self.load_shard)
        self.bias = _param((out,), self.load_shard) if bias else None

    def _offset(self, shard_id: int) -> int:
        return sum(self.shard_sizes[:shard_id])

    def shard_rows(self, loaded: torch.Tensor, shard_id: int = 0) -> torch.Tensor:
        """This rank's rows of part ``shard_id`` of a checkpoint tensor (whatever each row
        stores: float weights, packed nibbles, group scales)."""
        size = self.shard_sizes[shard_id]
        full = self.output_sizes[shard_id]
        if loaded.shape[0] != full:
            raise ValueError(f"weight has {loaded.shape[0]} rows, expected {full}")
        return loaded.narrow(0, self.tp.rank * size, size)

    def load_shard(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: int = 0) -> None:
        piece = self.shard_rows(loaded, shard_id)
        dst = param.data.narrow(0, self._offset(shard_id), self.shard_sizes[shard_id])
        if dst.shape != piece.shape:
            raise ValueError(f"weight shape {tuple(piece.shape)} != expected {tuple(dst.shape)}")
        dst.copy_(piece)

    fast_linear: LinearFn | None = None
    fast_linear_has_bias = True  # the installed function adds the bias itself
    # What the backend built fast_linear from (its packed weights), for a backend's
    # whole-stack decode step that calls the same kernel; None where it keeps nothing.
    fast_linear_packed: object | None = None
    # Set by layers/quantization before loading; None is the plain float weight.
    quant_method: LinearMethod | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fast_linear is not None:
            return self.fast_linear(x)
        if self.quant_method is not None:
            return self.quant_method.apply(self, x, self.bias)
        return F.linear(x, self.weight, self.bias)


class QKVParallelLinear(ColumnParallelLinear):
    """q, k and v projections fused; KV heads are replicated when there are fewer than ranks."""

    def __init__(
        self,
        hidden_size: int,
        head_size: int,
        num_heads: int,
        num_kv_heads: int,
        *,
        bias: bool = False,
        tp: TPContext = SINGLE,
    ) -> None:
        self.num_heads = tp.shard(num_heads, "num_attention_heads")
        if num_kv_heads >= tp.size:
            self.num_kv_heads = tp.shard(num_kv_heads, "num_key_value_heads")
        else:
            self.num_kv_heads = 1
        sizes = [num_heads * head_size, num_kv_heads * head_size, num_kv_heads * head_size]
        shards = [
            self.num_heads * head_size,
            self.num_kv_heads * head_size,
            self.num_kv_heads * head_size,
        ]
        super().__init__(hidden_size, sizes, bias=bias, tp=tp, shard_sizes=shards)
        self.head_size = head_size

    def shard_rows(self, loaded: torch.Tensor, shard_id: int = 0) -> torch.Tensor:
        total_kv = self.output_sizes[1] // self.head_size
        if shard_id == 0 or total_kv >= self.tp.size:
            return super().shard_rows(loaded, shard_id)
        # Fewer KV heads than ranks: each is replicated; rank r uses head r * total_kv // tp.
        head = self.tp.rank * total_kv // self.tp.size
        return loaded.narrow(0, head * self.head_size, self.head_size)

    def split(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        # (split_with_sizes: Tensor.split's Python wrapper costs twice the split itself)
        q, k, v = qkv.split_with_sizes(self.shard_sizes, -1)
        return q, k, v


class RowParallelLinear(nn.Module):
    """``y = x W^T + b`` with W's columns (input features) split and the partial sums reduced."""

    def __init__(
        self, input_size: int, output_size: int, *, bias: bool = False, tp: TPContext = SINGLE
    ) -> None:
        super().__init__()
        self.tp = tp
        self.input_shard = tp.shard(input_size, "input features")
        self.weight = _param((output_size, self.input_shard), self.load_weight)
        self.bias = _param((output_size,), default_weight_loader) if bias else None

    def load_weight(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        piece = loaded.narrow(1, self.tp.rank * self.input_shard, self.input_shard)
        default_weight_loader(param, piece)

    fast_linear: LinearFn | None = None
    fast_linear_has_bias = False  # the bias is added after the all-reduce
    fast_linear_packed: object | None = None  # see ColumnParallelLinear
    quant_method: LinearMethod | None = None  # see ColumnParallelLinear

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fast_linear is not None:
            partial = self.fast_linear(x)
        elif self.quant_method is not None:
            partial = self.quant_method.apply(self, x, None)
        else:
            partial = F.linear(x, self.weight)
        y = self.tp.all_reduce(partial)
        if self.bias is not None:
            y = y + self.bias
        return y


class VocabParallelEmbedding(nn.Module):
    """Embedding rows split across ranks; tokens outside a rank's range contribute zeros."""

    # Used when the module also serves as the (tied) LM head.
    fast_linear: LinearFn | None = None
    fast_linear_has_bias = False
    fast_linear_packed: object | None = None  # see ColumnParallelLinear
    # A checkpoint's group-quantised table (GGUF Q8_0 / 4-bit embeddings): rows are dequantised
    # as they are looked up, and the head multiplies by the quantised table.
    quant_method: LinearMethod | None = None
    # A backend's look-up when the table lives only in packed panels, its tied head's or its
    # own (``ids -> rows`` in the compute dtype, as ``quant_method.embed`` gives them),
    # installed by its prepare_model; ``fast_rows_packed``: those panels (a backend's type),
    # which a decode stack reads the rows from too.
    fast_rows: LinearFn | None = None
    fast_rows_packed: object | None = None

    def __init__(self, vocab_size: int, hidden_size: int, *, tp: TPContext = SINGLE) -> None:
        super().__init__()
        self.tp = tp
        self.vocab_size = vocab_size
        self.shard = (vocab_size + tp.size - 1) // tp.size
        self.start = tp.rank * self.shard
        self.input_size = hidden_size
        self.weight = _param((self.shard, hidden_size), self.load_weight)

    def load_weight(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        rows = max(0, min(self.shard, loaded.shape[0] - self.start))
        param.data.zero_()
        param.data[:rows].copy_(loaded[self.start : self.start + rows])

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Output projection (tied or untied head); gathered to full vocabulary width."""
        if self.fast_linear is not None:
            local = self.fast_linear(hidden)  # [n, shard]
        elif self.quant_method is not None:
            local = self.quant_method.apply(self, hidden, None)  # [n, shard]
        else:
            local = F.linear(hidden, self.weight)  # [n, shard]
        full = self.tp.all_gather_last_dim(local)
        # (the slice only where padding made the table wider: a view per step otherwise)
        return full if full.shape[-1] == self.vocab_size else full[:, : self.vocab_size]

    def _rows(self, ids: torch.Tensor) -> torch.Tensor:
        if self.fast_rows is not None:
            return self.fast_rows(ids)
        if self.quant_method is not None:
            return self.quant_method.embed(self, ids)  # type: ignore[attr-defined]
        return F.embedding(ids, self.weight)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return self._rows(ids)
        local = ids - self.start
        mask = (local < 0) | (local >= self.shard)
        out = self._rows(local.masked_fill(mask, 0))
        out.masked_fill_(mask[:, None], 0.0)
        return self.tp.all_reduce(out)


class ParallelLMHead(VocabParallelEmbedding):
    """An untied vocabulary-split output projection (``logits`` comes from the base class)."""

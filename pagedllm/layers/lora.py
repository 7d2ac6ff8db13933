"""LoRA-wrapped linear layers: the base projection plus ``scale * (x @ A_s^T) @ B_s^T`` per slot.

Each wrapped layer holds ``max_loras`` device slots of stacked adapter weights. A fused layer
(q/k/v, gate/up) has one *slice* per part: ``lora_a`` stacks the parts' A matrices along its
rows (``[max_loras, slices * R, in]``) and ``lora_b`` places each part's B block-diagonally
(``[max_loras, out, slices * R]``), so the whole adapter is one shrink and one expand GEMM.
``R`` is ``max_lora_rank``; smaller ranks are zero-padded and the scale is folded into B.

Tensor parallelism follows the base layer: a column-parallel layer keeps this rank's rows of B
(A is whole); a row-parallel layer keeps this rank's columns of A, and the partial shrink sums
are all-reduced before the expand. The step's :class:`LoRAMapping` is read from a
:class:`LoRAContext` the runner fills per step (an explicit object, never a global).
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any, Protocol

import torch
from torch import nn

from pagedllm.layers.linear import ColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from pagedllm.lora.ops import LoRAMapping

# One adapter part: A [r, in], B [out, r] (unsharded, as in the checkpoint) and its scale.
LoRAPart = tuple[torch.Tensor, torch.Tensor, float]


class LoRAKernel(Protocol):
    name: str

    def __call__(
        self,
        y: torch.Tensor,
        x: torch.Tensor,
        lora_a: torch.Tensor,
        lora_b: torch.Tensor,
        mapping: LoRAMapping,
    ) -> None:
        """``y += `` each adapter token's ``(x A_s^T) B_s^T`` (shrink then expand)."""

    def shrink(self, x: torch.Tensor, lora_a: torch.Tensor, mapping: LoRAMapping) -> torch.Tensor:
        """``[num_lora_tokens, k]`` in slot order: each token's row times its slot's A^T."""

    def expand(
        self, y: torch.Tensor, s: torch.Tensor, lora_b: torch.Tensor, mapping: LoRAMapping
    ) -> None:
        """Add each shrunk row times its slot's B^T into ``y`` at the token's flat index."""


@dataclass
class LoRAContext:
    """What every wrapped layer of one model reads in a step: the mapping (None: no adapter)."""

    kernel: LoRAKernel
    mapping: LoRAMapping | None = None


class LoRALinear(nn.Module):
    """A column- or row-parallel linear layer with LoRA slots; forwards ``split`` (QKV)."""

    def __init__(
        self,
        base: ColumnParallelLinear | RowParallelLinear,
        *,
        ctx: LoRAContext,
        max_loras: int,
        max_rank: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        super().__init__()
        self.base = base
        self.ctx = ctx
        self.max_rank = max_rank
        self.row_parallel = isinstance(base, RowParallelLinear)
        if self.row_parallel:
            self.in_features = base.input_shard
            self.slice_sizes = [base.weight.shape[0]]
            self.full_sizes = list(self.slice_sizes)
        else:
            self.in_features = base.input_size  # (a packed 4-bit weight has half the columns)
            self.slice_sizes = list(base.shard_sizes)
            self.full_sizes = list(base.output_sizes)
        k = len(self.slice_sizes) * max_rank
        out = sum(self.slice_sizes)
        self.register_buffer(
            "lora_a", torch.zeros(max_loras, k, self.in_features, dtype=dtype, device=device)
        )
        self.register_buffer("lora_b", torch.zeros(max_loras, out, k, dtype=dtype, device=device))

    @property
    def num_slices(self) -> int:
        return len(self.slice_sizes)

    def split(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        assert isinstance(self.base, QKVParallelLinear)
        return self.base.split(qkv)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)  # [num_tokens, out]
        mapping = self.ctx.mapping
        if mapping is None:
            return y
        kernel = self.ctx.kernel
        if not (self.row_parallel and self.base.tp.size > 1):
            kernel(y, x, self.lora_a, self.lora_b, mapping)
            return y
        s = kernel.shrink(x, self.lora_a, mapping)  # [num_lora_tokens, slices * R]
        s = self.base.tp.all_reduce(s)  # partial sums over this rank's input columns
        kernel.expand(y, s, self.lora_b, mapping)
        return y

    # -- adapters ------------------------------------------------------------------------------
    def pack(self, parts: dict[int, LoRAPart]) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's slot contents ``(A [slices*R, in], B [out, slices*R])`` on the host.

        ``parts`` maps a slice index to its unsharded A, B and scale; slices without an
        adapter part stay zero. A ValueError (naming no adapter; the caller adds it) when a
        shape does not fit the layer.
        """
        r_max = self.max_rank
        a = torch.zeros(self.num_slices * r_max, self.in_features, dtype=self.lora_a.dtype)
        b = torch.zeros(sum(self.slice_sizes), self.num_slices * r_max, dtype=self.lora_b.dtype)
        for i, (lora_a, lora_b, scale) in sorted(parts.items()):
            r = lora_a.shape[0]
            if lora_b.dim() != 2 or lora_b.shape[1] != r:
                raise ValueError(f"lora_B is {tuple(lora_b.shape)}, expected [*, {r}]")
            a_dst = a[i * r_max : i * r_max + r]  # [r, in_shard]
            b_dst = b[:, i * r_max : i * r_max + r]  # [out_shard, r]
            scaled_b = lora_b.to(torch.float32) * scale
            if self.row_parallel:
                full_in = self.in_features * self.base.tp.size
                if lora_a.dim() != 2 or lora_a.shape[1] != full_in:
                    raise ValueError(f"lora_A is {tuple(lora_a.shape)}, expected [{r}, {full_in}]")
                self.base.load_weight(_as_param(a_dst), lora_a.to(a.dtype))
                _copy_checked(b_dst, scaled_b, "lora_B")
            else:
                _copy_checked(a_dst, lora_a.to(a.dtype), "lora_A")
                self.base.load_shard(_as_param(b_dst), scaled_b.to(b.dtype), i)
        return a, b

    def load_slot(self, slot: int, a: torch.Tensor, b: torch.Tensor) -> None:
        self.lora_a[slot].copy_(a, non_blocking=True)
        self.lora_b[slot].copy_(b, non_blocking=True)

    def clear_slot(self, slot: int) -> None:
        self.lora_a[slot].zero_()
        self.lora_b[slot].zero_()


def _as_param(view: torch.Tensor) -> Any:
    """The base layer's own sharding loaders write into ``param.data``; give them a view."""
    return SimpleNamespace(data=view, shape=view.shape)


def _copy_checked(dst: torch.Tensor, src: torch.Tensor, what: str) -> None:
    if dst.shape != src.shape:
        raise ValueError(f"{what} is {tuple(src.shape)}, expected {tuple(dst.shape)}")
    dst.copy_(src)


def wrap_linear_layers(
    model: nn.Module,
    *,
    ctx: LoRAContext,
    max_loras: int,
    max_rank: int,
    dtype: torch.dtype,
    device: torch.device,
) -> dict[str, LoRALinear]:
    """Replace every column/row-parallel linear layer of ``model`` by its LoRA wrapper.

    Returns the wrappers by module path (the path of the layer they replace). Called after
    the weights are loaded, so checkpoint names never see the wrappers.
    """
    targets = [
        (name, module)
        for name, module in model.named_modules()
        if isinstance(module, (ColumnParallelLinear, RowParallelLinear))
    ]
    wrapped: dict[str, LoRALinear] = {}
    for name, module in targets:
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        layer = LoRALinear(
            module, ctx=ctx, max_loras=max_loras, max_rank=max_rank, dtype=dtype, device=device
        )
        setattr(parent, attr, layer)
        wrapped[name] = layer
    return wrapped

"""The fused MoE layer: stacked expert weights, routing, grouped expert GEMMs, a shared expert.

Expert weights are stacked per layer (``w13 [E, 2I, H]`` = gate and up, ``w2 [E, H, I]``), filled
expert by expert from the checkpoint's per-expert tensors, each copied straight into its slice.
A step's (token, choice) pairs are sorted by expert once (:func:`group_by_expert`); each expert's
two GEMMs then run once over all its tokens and the results are added back to their tokens,
weighted by the router. A backend may install a faster implementation of that middle part in the
``fast_moe`` slot (the CPU's packed GEMMs, the GPU's Triton kernel); the layer stays
device-agnostic and its own forward is the PyTorch path (XPU, and everything else).

Parallelism: under tensor parallelism each rank holds every expert's slice of the intermediate
dimension (as for dense MLPs); with ``expert_parallel`` each rank holds whole experts, a
contiguous range of them. Either way every rank sees every token of the step (attention leaves
the hidden states replicated), computes a partial sum, and one all-reduce completes it. So
expert parallelism here exchanges partial outputs by all-reduce, not tokens by all-to-all: the
same bytes move as for a TP MLP, and no rank waits on a token shuffle.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.layers.fused_moe.routing import RoutingConfig, group_by_expert, select_experts
from pagedllm.layers.linear import default_weight_loader, with_loader
from pagedllm.layers.parallel import SINGLE, TPContext

if TYPE_CHECKING:
    from pagedllm.layers.quantization import WeightQuantizer

# (hidden [T, H], topk_weights [T, k], topk_ids [T, k]) -> this rank's partial output [T, H]
MoEFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


class ReplicatedLinear(nn.Module):
    """``x W^T`` with the whole weight on every rank (routers, the shared-expert gate).

    Not a column/row-parallel layer on purpose: quantization and GEMM repacking leave it alone,
    so routing decisions are computed from the checkpoint's own weights, as transformers does.
    """

    def __init__(self, input_size: int, output_size: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(output_size, input_size), requires_grad=False)
        with_loader(self.weight, default_weight_loader)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)


class _ExpertLoader:
    """Copies one expert's checkpoint tensor (or this rank's slice of it) into the stack.

    ``shard`` is ``(expert id, part)``: part 0/1 = gate/up rows of ``w13``, None = ``w2``. It only
    narrows what it is given, so tensor-parallel ranks read their slices lazily
    (``reads_slices``); experts placed on other ranks are not read at all.
    """

    reads_slices = True

    def __init__(self, layer: FusedMoE, stack: str) -> None:
        self.layer, self.stack = layer, stack  # "w13_weight" or "w2_weight"

    def __call__(
        self, param: nn.Parameter, loaded: Any, shard: tuple[int, int | None] | None = None
    ) -> None:
        layer = self.layer
        if shard is None:  # a whole stack [E, 2I or H, ...] (a GGUF file's, decoded at once)
            if loaded.shape[0] != layer.num_experts:
                raise ValueError(f"{loaded.shape[0]} experts stacked, not {layer.num_experts}")
            half = layer.intermediate_size
            for e in range(layer.expert_start, layer.expert_start + layer.num_local_experts):
                if self.stack == "w2_weight":
                    self(param, loaded[e], (e, None))
                else:
                    self(param, loaded[e, :half], (e, 0))
                    self(param, loaded[e, half:], (e, 1))
            return
        expert, part = shard
        local = expert - layer.expert_start
        if not 0 <= expert < layer.num_experts:
            raise ValueError(f"expert {expert} is outside num_experts ({layer.num_experts})")
        if not 0 <= local < layer.num_local_experts:
            return  # another rank's expert (expert parallelism)
        size, full = layer.intermediate_shard, layer.intermediate_size
        start = 0 if layer.expert_parallel else layer.tp.rank * size
        # A group-wise expert's tensors store fewer columns than the weight has inputs (2 per
        # byte of nibbles, 16 or 32 per scale): ``per`` inputs a stored column.
        columns = param.shape[-1]
        if part is None:  # down: [H, I] -> columns of this rank
            per = full // loaded.shape[-1] if loaded.shape[-1] else 0
            if (
                per < 1
                or loaded.shape[-1] * per != full
                or tuple(loaded.shape[:1]) != (layer.hidden_size,)
            ):
                raise ValueError(f"shape {tuple(loaded.shape)} != {(layer.hidden_size, full)}")
            if start % per or size % per or size // per != columns:
                raise ValueError(
                    f"expert down projection: {size} inputs a rank do not split {per}-column "
                    "groups (tensor_parallel_size too large for this group-wise checkpoint)"
                )
            param.data[local].copy_(loaded.narrow(1, start // per, size // per))
        else:  # gate / up: [I, H] -> rows of this rank
            if tuple(loaded.shape) != (full, columns):
                raise ValueError(f"shape {tuple(loaded.shape)} != {(full, columns)}")
            param.data[local].narrow(0, part * size, size).copy_(loaded.narrow(0, start, size))


class FusedMoE(nn.Module):
    """The routed experts of one layer; ``forward`` takes the router's choice and returns the
    weighted sum of the chosen experts' outputs (complete on every rank)."""

    fast_moe: MoEFn | None = None  # installed by a backend's prepare_model
    path = "torch"  # which implementation runs, for logs and benchmark JSON
    groupwise: dict[str, str] = {}  # noqa: RUF012 (replaced, never mutated) stack -> format

    def __init__(
        self,
        *,
        num_experts: int,
        hidden_size: int,
        intermediate_size: int,
        tp: TPContext = SINGLE,
    ) -> None:
        super().__init__()
        self.tp = tp
        self.num_experts = num_experts
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.expert_parallel = bool(getattr(tp, "expert_parallel", False)) and tp.size > 1
        if self.expert_parallel:
            self.num_local_experts = tp.shard(num_experts, "num_experts (expert parallel)")
            self.expert_start = tp.rank * self.num_local_experts
            self.intermediate_shard = intermediate_size
        else:
            self.num_local_experts, self.expert_start = num_experts, 0
            self.intermediate_shard = tp.shard(intermediate_size, "moe intermediate size")
        e, i = self.num_local_experts, self.intermediate_shard
        self.w13_weight = nn.Parameter(torch.empty(e, 2 * i, hidden_size), requires_grad=False)
        self.w2_weight = nn.Parameter(torch.empty(e, hidden_size, i), requires_grad=False)
        with_loader(self.w13_weight, _ExpertLoader(self, "w13_weight"))
        with_loader(self.w2_weight, _ExpertLoader(self, "w2_weight"))

    # -- group-wise experts (a GGUF file's quantised stacks, kept as they are) -----------------
    def use_groupwise(self, name: str, fmt: str) -> None:
        """Store stack ``name`` (``w13_weight`` / ``w2_weight``) in group-wise format ``fmt``
        (``int4``, ``q8_0``, ``q6_k``, ``q5_k``): the checkpoint then fills each expert's packed
        q and factors (``<name>``, ``<name>_scale``, ``_offset``, ``_super``), which
        :meth:`finish_groupwise` turns into float32 buffers. Called before loading."""
        from pagedllm.layers.quantization.groupwise import GroupwiseMethod

        stack = getattr(self, name)
        e, n, k = stack.shape
        loader = stack.weight_loader
        stored = GroupwiseMethod.for_format(fmt).stored_tensors(n, k)
        for suffix, (tensor, _) in stored.items():
            full = name + suffix.removeprefix("weight")
            param = nn.Parameter(
                torch.empty(e, *tensor.shape, dtype=tensor.dtype, device=stack.device),
                requires_grad=False,
            )
            setattr(self, full, with_loader(param, loader))
        self.groupwise = {**self.groupwise, name: fmt}

    def finish_groupwise(self) -> None:
        """Scales, offsets and super-scales as float32 buffers kept as int32 bits (a later
        cast of floating tensors must not round them), as the dense group-wise layers keep
        theirs."""
        for name in self.groupwise:
            for suffix in ("_scale", "_offset", "_super"):
                param = getattr(self, name + suffix, None)
                if isinstance(param, nn.Parameter):
                    delattr(self, name + suffix)
                    bits = param.detach().float().contiguous().view(torch.int32)
                    self.register_buffer(f"{name}{suffix}_bits", bits)

    def groupwise_expert(self, name: str, e: int) -> tuple[torch.Tensor, ...]:
        """Expert ``e``'s (q, scale, offset or None, super-scale or None) of a group-wise
        stack (its local index)."""

        def factor(suffix: str) -> torch.Tensor | None:
            bits = getattr(self, f"{name}{suffix}_bits", None)
            return None if bits is None else bits[e].view(torch.float32)

        scale = factor("_scale")
        assert scale is not None, f"{name} is not group-wise"
        return getattr(self, name)[e], scale, factor("_offset"), factor("_super")

    def dequantized_expert(self, name: str, e: int) -> torch.Tensor:
        """Expert ``e``'s weight ``[N, K]`` in float32, from whatever the stack stores."""
        if name in self.groupwise:
            from pagedllm.layers.quantization.groupwise import dequantize_groups

            q, scale, offset, _ = self.groupwise_expert(name, e)
            return dequantize_groups(q, scale, offset)
        w = getattr(self, name)[e].float()
        scale = self.scales(name)
        return w if scale is None else w * scale[e][:, None]

    # -- int8 (weight-only, per expert and output channel, like the dense layers) --------------
    def quantize_int8(self, quantize: WeightQuantizer | None = None) -> None:
        """Replace both stacks by int8 values and float32 per-row scales (kept as int32 bits,
        so that a later cast of floating tensors cannot round them); ``quantize`` computes
        ``quantize_per_channel`` (the dense layers' method's, the backend's kernel)."""
        from pagedllm.layers.quantization import quantize_per_channel

        for name in ("w13_weight", "w2_weight"):
            w = getattr(self, name)  # [E, N, K]
            e, n, k = w.shape
            q, scale = (quantize or quantize_per_channel)(w.detach().reshape(e * n, k), None)
            setattr(self, name, nn.Parameter(q.reshape(e, n, k), requires_grad=False))
            self.register_buffer(f"{name}_scale_bits", scale.reshape(e, n).view(torch.int32))

    @property
    def is_int8(self) -> bool:
        return hasattr(self, "w13_weight_scale_bits") and not self.groupwise

    def scales(self, name: str) -> torch.Tensor | None:
        """Float32 scales ``[E, N]`` of an int8 stack, None for float (or group-wise) ones."""
        if self.groupwise:
            return None
        bits = getattr(self, f"{name}_scale_bits", None)
        return None if bits is None else bits.view(torch.float32)

    # -- compute -------------------------------------------------------------------------------
    def forward(
        self,
        hidden: torch.Tensor,  # [T, H]
        topk_weights: torch.Tensor,  # [T, k]
        topk_ids: torch.Tensor,  # [T, k]
    ) -> torch.Tensor:  # [T, H]
        if self.fast_moe is not None:
            out = self.fast_moe(hidden, topk_weights, topk_ids)
        else:
            out = fused_experts_torch(self, hidden, topk_weights, topk_ids)
        return self.tp.all_reduce(out)


def _expert_linear(layer: FusedMoE, name: str, e: int, x: torch.Tensor) -> torch.Tensor:
    if name in layer.groupwise:  # dequantised per call: devices without group-wise kernels
        return F.linear(x, layer.dequantized_expert(name, e).to(x.dtype))
    w = getattr(layer, name)[e]  # [N, K]
    scale = layer.scales(name)
    if scale is None:
        return F.linear(x, w)
    return F.linear(x, w.to(x.dtype)) * scale[e].to(x.dtype)  # int8 values are exact in 16-bit


def _per_expert(
    layer: FusedMoE,
    expert_fns: list[tuple[Callable, Callable]] | None,
    which: int,  # 0: w13, 1: w2
    inp: torch.Tensor,  # [P, K] rows grouped by expert
    width: int,
    bounds: list[int],
) -> torch.Tensor:  # [P, width]
    out = inp.new_empty(inp.shape[0], width)
    name = ("w13_weight", "w2_weight")[which]
    for e in range(layer.num_local_experts):
        lo, hi = bounds[e], bounds[e + 1]
        if lo == hi:
            continue  # an expert without tokens costs nothing
        if expert_fns is None:
            out[lo:hi] = _expert_linear(layer, name, e, inp[lo:hi])
        else:
            out[lo:hi] = expert_fns[e][which](inp[lo:hi])
    return out


def fused_experts_torch(
    layer: FusedMoE,
    hidden: torch.Tensor,  # [T, H]
    topk_weights: torch.Tensor,  # [T, k]
    topk_ids: torch.Tensor,  # [T, k]
    expert_fns: list[tuple[Callable, Callable]] | None = None,
    grouped: tuple[Callable | None, Callable | None] = (None, None),
) -> torch.Tensor:  # [T, H]
    """The grouped computation with a pluggable GEMM per expert (``expert_fns[e] = (w13, w2)``);
    a loop over the experts that received tokens, one GEMM pair per expert. ``grouped``
    (w13, w2): a projection's every expert with tokens in one call instead,
    ``fn(rows [P, K], experts, starts) -> [P, N]`` with rows ``starts[i]..starts[i + 1]``
    expert ``experts[i]``'s (None: that projection loops)."""
    groups = group_by_expert(
        topk_ids, layer.num_local_experts, layer.expert_start, layer.num_experts
    )
    num_tokens, top_k = topk_ids.shape
    if groups.order.numel() == 0:
        return torch.zeros_like(hidden)
    x = hidden.index_select(0, groups.tokens)  # [P, H] rows grouped by expert
    bounds = groups.offsets.tolist()
    # Two passes over the experts with the activation between them over all rows at once: per
    # expert only its GEMMs run (few, larger ops matter on a CPU shared with other work).
    experts: list[int] = []
    starts: list[int] = []
    if grouped[0] is not None or grouped[1] is not None:
        experts = [e for e in range(layer.num_local_experts) if bounds[e + 1] > bounds[e]]
        starts = [bounds[e] for e in experts] + [bounds[-1]]

    def project(which: int, inp: torch.Tensor, width: int) -> torch.Tensor:
        fn = grouped[which]
        if fn is not None:
            return fn(inp, experts, starts)
        return _per_expert(layer, expert_fns, which, inp, width, bounds)

    gate_up = project(0, x, 2 * layer.intermediate_shard)
    gate, up = gate_up.chunk(2, dim=-1)
    act = F.silu(gate) * up  # [P, I]
    rows = project(1, act, hidden.shape[1])  # [P, H]
    weights = topk_weights.reshape(-1).index_select(0, groups.order)  # [P]
    # Back to (token, choice) order, then each token's top_k rows summed: a plain scatter and a
    # reduction, cheaper than index_add_ and independent of thread scheduling.
    size = (num_tokens * top_k, hidden.shape[1])
    every = groups.order.numel() == size[0]  # else pairs of other ranks' experts stay zero
    per_pair = hidden.new_empty(size) if every else hidden.new_zeros(size)  # [T*k, H]
    per_pair[groups.order] = (rows * weights[:, None]).to(hidden.dtype)
    return per_pair.view(num_tokens, top_k, -1).sum(1)


class SparseMoeBlock(nn.Module):
    """Router + routed experts (+ Qwen2-MoE's shared expert behind a sigmoid gate).

    Names follow the checkpoints: ``gate`` (router), ``experts``, ``shared_expert``,
    ``shared_expert_gate``.
    """

    def __init__(
        self,
        *,
        hidden_size: int,
        intermediate_size: int,
        routing: RoutingConfig,
        tp: TPContext = SINGLE,
        shared_expert: nn.Module | None = None,
    ) -> None:
        super().__init__()
        self.routing = routing
        self.gate = ReplicatedLinear(hidden_size, routing.num_experts)
        self.experts = FusedMoE(
            num_experts=routing.num_experts,
            hidden_size=hidden_size,
            intermediate_size=intermediate_size,
            tp=tp,
        )
        self.shared_expert = shared_expert
        self.shared_expert_gate = (
            ReplicatedLinear(hidden_size, 1) if shared_expert is not None else None
        )

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:  # [T, H] -> [T, H]
        router_logits = self.gate(hidden)  # [T, E]
        weights, ids = select_experts(router_logits, self.routing)
        out = self.experts(hidden, weights, ids)
        if self.shared_expert is not None:
            assert self.shared_expert_gate is not None
            gate = torch.sigmoid(self.shared_expert_gate(hidden))  # [T, 1]
            out = out + gate * self.shared_expert(hidden)
        return out

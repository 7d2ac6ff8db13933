"""The fused MoE layer against a plain per-token, per-choice PyTorch loop on random inputs.

Cases cover a balanced random routing, experts that receive no tokens, one expert receiving every
token, a single token, and no tokens at all; the layer's PyTorch path and the CPU backend's packed
GEMMs (float32, bfloat16, int8) must all agree with the loop. Tensor and expert parallelism are
checked by summing the partial outputs of per-rank layers, which is what their all-reduce does.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pagedllm.layers.fused_moe import (
    FusedMoE,
    RoutingConfig,
    fused_experts_torch,
    group_by_expert,
    select_experts,
)
from pagedllm.layers.parallel import TPContext

E, H, INTER, TOP_K = 6, 48, 40, 2


def reference_moe(
    x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor
) -> torch.Tensor:
    """Token by token, choice by choice: sum_j w_j * down(silu(gate(x)) * up(x)) in float64."""
    out = torch.zeros(x.shape, dtype=torch.float64)
    inter = w13.shape[1] // 2
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            xt = x[t].double()
            gate = w13[e, :inter].double() @ xt
            up = w13[e, inter:].double() @ xt
            out[t] += float(weights[t, j]) * (w2[e].double() @ (F.silu(gate) * up))
    return out


def make_layer(dtype: torch.dtype = torch.float32, **kw) -> FusedMoE:
    torch.manual_seed(1)
    layer = FusedMoE(num_experts=E, hidden_size=H, intermediate_size=INTER, **kw)
    layer.w13_weight.data = (torch.randn(layer.w13_weight.shape) * 0.2).to(dtype)
    layer.w2_weight.data = (torch.randn(layer.w2_weight.shape) * 0.2).to(dtype)
    return layer


def routing_case(name: str, num_tokens: int = 13) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [T, k], ids [T, k]) for a named routing pattern."""
    g = torch.Generator().manual_seed(2)
    weights = torch.rand(num_tokens, TOP_K, generator=g) + 0.1
    if name == "random":
        ids = torch.stack([torch.randperm(E, generator=g)[:TOP_K] for _ in range(num_tokens)])
    elif name == "some_experts_idle":  # experts 1, 3 and 4 get nothing
        ids = torch.stack([torch.tensor([0, 2]), torch.tensor([5, 0])] * num_tokens)[:num_tokens]
    elif name == "one_expert_gets_all":  # every token's first choice is expert 3
        others = [e % E if e % E != 3 else 0 for e in range(num_tokens)]
        ids = torch.stack([torch.tensor([3, o]) for o in others])
    else:
        raise AssertionError(name)
    return weights, ids


CASES = ["random", "some_experts_idle", "one_expert_gets_all"]


def check(got: torch.Tensor, want: torch.Tensor, atol: float, label: str) -> None:
    diff = (got.double() - want).abs().max().item() if got.numel() else 0.0
    assert diff <= atol, f"{label}: max difference {diff:.3g} > {atol}"


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("num_tokens", [1, 13])
def test_torch_path_equals_per_token_loop(case: str, num_tokens: int) -> None:
    layer = make_layer()
    weights, ids = routing_case(case, num_tokens)
    x = torch.randn(num_tokens, H)
    want = reference_moe(x, layer.w13_weight, layer.w2_weight, weights, ids)
    check(layer(x, weights, ids), want, 1e-5, case)


def test_no_tokens() -> None:
    layer = make_layer()
    out = layer(torch.empty(0, H), torch.empty(0, TOP_K), torch.empty(0, TOP_K, dtype=torch.long))
    assert out.shape == (0, H)


def test_grouping_is_one_stable_sort_by_expert() -> None:
    ids = torch.tensor([[2, 0], [0, 2], [2, 1]])
    groups = group_by_expert(ids, 3)
    assert groups.counts.tolist() == [2, 1, 3]
    assert groups.offsets.tolist() == [0, 2, 3, 6]
    assert groups.order.tolist() == [1, 2, 5, 0, 3, 4]  # pairs t*k+j, tokens in order per expert
    assert groups.tokens.tolist() == [0, 1, 2, 0, 1, 2]
    # expert parallelism: a rank with experts [1, 3) keeps only their pairs
    local = group_by_expert(ids, 2, expert_start=1)
    assert local.counts.tolist() == [1, 3] and local.order.tolist() == [5, 0, 3, 4]


@pytest.mark.parametrize("renormalize", [False, True])
@pytest.mark.parametrize("round_weights", [False, True])
def test_routing_matches_transformers_formula(renormalize: bool, round_weights: bool) -> None:
    logits = torch.randn(9, E).to(torch.bfloat16)
    cfg = RoutingConfig(E, 3, renormalize=renormalize, round_weights=round_weights)
    weights, ids = select_experts(logits, cfg)
    probs = torch.softmax(logits.float(), dim=-1)
    want_w, want_ids = torch.topk(probs, 3, dim=-1)
    if renormalize:
        want_w /= want_w.sum(-1, keepdim=True)
    assert torch.equal(ids, want_ids)
    assert weights.dtype == (torch.bfloat16 if round_weights else torch.float32)
    torch.testing.assert_close(weights.float(), want_w.to(weights.dtype).float())


@pytest.mark.parametrize("case", CASES)
def test_tensor_parallel_shards_sum_to_the_whole(case: str) -> None:
    """Rank r holds every expert's r-th slice of the intermediate dimension."""
    full = make_layer()
    weights, ids = routing_case(case)
    x = torch.randn(13, H)
    total = torch.zeros(13, H)
    for rank in range(2):
        part = FusedMoE(
            num_experts=E, hidden_size=H, intermediate_size=INTER, tp=TPContext(rank=rank, size=2)
        )
        for e in range(E):
            for which in (0, 1):
                rows = full.w13_weight[e, which * INTER : (which + 1) * INTER]
                part.w13_weight.weight_loader(part.w13_weight, rows, (e, which))
            part.w2_weight.weight_loader(part.w2_weight, full.w2_weight[e], (e, None))
        total += fused_experts_torch(part, x, weights, ids)
    check(total, reference_moe(x, full.w13_weight, full.w2_weight, weights, ids), 1e-5, case)


@pytest.mark.parametrize("case", CASES)
def test_expert_parallel_ranks_sum_to_the_whole(case: str) -> None:
    """Rank r holds experts [3r, 3r + 3) whole; the other rank's experts are not read."""
    full = make_layer()
    weights, ids = routing_case(case)
    x = torch.randn(13, H)
    total = torch.zeros(13, H)
    for rank in range(2):
        tp = TPContext(rank=rank, size=2, expert_parallel=True)
        part = FusedMoE(num_experts=E, hidden_size=H, intermediate_size=INTER, tp=tp)
        assert part.w13_weight.shape == (E // 2, 2 * INTER, H)
        for e in range(E):
            for which in (0, 1):
                rows = full.w13_weight[e, which * INTER : (which + 1) * INTER]
                part.w13_weight.weight_loader(part.w13_weight, rows, (e, which))
            part.w2_weight.weight_loader(part.w2_weight, full.w2_weight[e], (e, None))
        total += fused_experts_torch(part, x, weights, ids)
    check(total, reference_moe(x, full.w13_weight, full.w2_weight, weights, ids), 1e-5, case)


# -- the CPU backend's packed GEMMs ------------------------------------------------------------
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, "int8"])
def test_cpu_packed_path_equals_loop(case: str, dtype) -> None:
    from pagedllm.backends.cpu.fused_moe import pack_moe_layer

    layer = make_layer(torch.float32 if dtype == "int8" else dtype)
    if dtype == "int8":
        layer.quantize_int8()
        scales13, scales2 = layer.scales("w13_weight"), layer.scales("w2_weight")
        w13 = layer.w13_weight.float() * scales13[..., None]
        w2 = layer.w2_weight.float() * scales2[..., None]
    else:
        w13, w2 = layer.w13_weight.float(), layer.w2_weight.float()
    weights, ids = routing_case(case)
    act_dtype = torch.bfloat16 if dtype == torch.bfloat16 else torch.float32
    x = torch.randn(13, H).to(act_dtype)
    want = reference_moe(x, w13, w2, weights, ids)
    torch_out = layer(x, weights.to(act_dtype), ids)
    path = pack_moe_layer(layer)
    assert path != "torch" and layer.fast_moe is not None, path
    assert layer.w13_weight.numel() == 0  # the packed copies are the only ones kept
    packed_out = layer(x, weights.to(act_dtype), ids)
    atol = 5e-2 if dtype == torch.bfloat16 else 1e-4
    check(torch_out, want, atol, f"{case}/{dtype}/torch")
    if "split" in path:
        # The split planes keep x to max|x| / 64516 per row (tests/backends/test_cpu_w8a8.py):
        # 2e-4 of the largest output, as for one split GEMM, here through two of them.
        atol = 2e-4 * want.abs().max().item()
    check(packed_out, want, atol, f"{case}/{dtype}/{path}")


class SliceOnly:
    """A checkpoint tensor that may only be narrowed (what a lazily read rank may touch)."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor, self.shape, self.reads = tensor, tensor.shape, []

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor:
        self.reads.append((dim, start, length))
        return self.tensor.narrow(dim, start, length)

    def materialize(self) -> torch.Tensor:
        raise AssertionError("the whole tensor was read")


def test_tensor_parallel_rank_reads_only_its_slices_into_the_stack() -> None:
    from pagedllm.models.checkpoint import _reads_slices

    layer = FusedMoE(
        num_experts=E, hidden_size=H, intermediate_size=INTER, tp=TPContext(rank=1, size=2)
    )
    loader = layer.w13_weight.weight_loader
    assert _reads_slices(loader)  # the checkpoint reader hands it lazy slices
    storage = layer.w13_weight.data_ptr()
    gate, down = SliceOnly(torch.randn(INTER, H)), SliceOnly(torch.randn(H, INTER))
    loader(layer.w13_weight, gate, (4, 0))
    layer.w2_weight.weight_loader(layer.w2_weight, down, (4, None))
    half = INTER // 2
    assert gate.reads == [(0, half, half)] and down.reads == [(1, half, half)]
    assert layer.w13_weight.data_ptr() == storage  # copied into the stack, no second tensor
    torch.testing.assert_close(layer.w13_weight[4, :half], gate.tensor[half:])
    torch.testing.assert_close(layer.w2_weight[4], down.tensor[:, half:])

"""Top-k routing as transformers computes it, and the one sort that groups a step by expert.

Every family here scores experts with a softmax over the router logits in float32, keeps the
top-k probabilities and optionally renormalises them to sum to one (Mixtral always, the others
when ``norm_topk_prob``). Families differ in whether the kept weights are rounded back to the
activations' dtype before weighting the expert outputs (Qwen and OLMoE) or stay float32 (Mixtral);
in float32 the two agree, in 16-bit the rounding must match to stay token-exact.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class RoutingConfig:
    num_experts: int
    top_k: int
    renormalize: bool
    # Round the kept weights to the activations' dtype (Qwen, OLMoE) or keep float32 (Mixtral).
    round_weights: bool = True


def select_experts(
    router_logits: torch.Tensor,  # [T, E] in the activations' dtype
    routing: RoutingConfig,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(topk_weights [T, k], topk_ids [T, k] int64)``: softmax, then top-k, then renormalise."""
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)  # [T, E]
    weights, ids = torch.topk(probs, routing.top_k, dim=-1)  # [T, k]
    if routing.renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    if routing.round_weights:
        weights = weights.to(router_logits.dtype)
    return weights, ids


@dataclass(frozen=True)
class ExpertGroups:
    """The (token, slot) pairs of a step sorted by expert: one ``argsort``, no Python loop.

    Pair ``p = t * top_k + j`` is token ``t``'s ``j``-th choice. ``order`` lists the pairs routed
    to local experts, expert 0's first; ``counts[e]`` is how many go to local expert ``e`` and
    ``offsets`` their running start. Pairs routed to experts on other ranks (expert parallelism)
    are left out.
    """

    order: torch.Tensor  # [P] int64 pair ids, grouped by expert
    tokens: torch.Tensor  # [P] int64 token of each sorted pair (order // top_k)
    counts: torch.Tensor  # [E_local] int64
    offsets: torch.Tensor  # [E_local + 1] int64, offsets[0] == 0


def group_by_expert(
    topk_ids: torch.Tensor,  # [T, k]
    num_local_experts: int,
    expert_start: int = 0,
    num_experts: int | None = None,  # all experts of the layer; None: assume some are remote
) -> ExpertGroups:
    top_k = topk_ids.shape[1]
    key = topk_ids.reshape(-1)  # [T*k]
    # Only under expert parallelism can a choice fall outside this rank's experts.
    partial = expert_start != 0 or num_local_experts != num_experts
    if partial:  # expert parallelism: other ranks' experts sort last and are dropped
        key = key - expert_start
        key = key.masked_fill((key < 0) | (key >= num_local_experts), num_local_experts)
    counts = torch.bincount(key, minlength=num_local_experts + 1)[:num_local_experts]
    order = torch.argsort(key, stable=True)  # [T*k]: stable keeps tokens in order per expert
    offsets = torch.zeros(num_local_experts + 1, dtype=torch.int64, device=topk_ids.device)
    torch.cumsum(counts, 0, out=offsets[1:])
    kept = order[: int(offsets[-1])] if partial else order
    return ExpertGroups(kept, kept // top_k, counts, offsets)

"""The data-parallel router on synthetic traces: no engine, no torch.

The prefix policy must key prompts exactly as the block manager keys its cache (the chain is
checked against a real ``BlockSpaceManager``), keep each shared-prefix group on one replica,
spread new groups by load, spill a flooding group to the least loaded replica, and route around
replicas that are down.
"""

from __future__ import annotations

import random

import pytest

from pagedllm.core.block_manager import BlockSpaceManager
from pagedllm.engine.router import (
    BALANCED,
    LEAST_LOADED,
    PREFIX_HIT,
    PrefixMirror,
    Router,
    prefix_chain,
)
from tests.core.helpers import make_group

BS = 4


def send(router: Router, rid: str, tokens: list[int], *, work: int | None = None) -> int:
    decision = router.choose(tokens)
    router.sent(rid, decision, tokens=len(tokens) if work is None else work)
    return decision.replica


def group_trace(
    num_groups: int, per_group: int, *, prefix_blocks: int = 8
) -> list[tuple[int, list[int]]]:
    """``num_groups`` system prompts, each followed by distinct user turns, interleaved."""
    rng = random.Random(0)
    heads = [[rng.randrange(1000) for _ in range(prefix_blocks * BS)] for _ in range(num_groups)]
    trace = []
    for turn in range(per_group):
        order = list(range(num_groups))
        rng.shuffle(order)  # a fixed interleaving would let round robin keep groups in place
        for g in order:
            trace.append((g, heads[g] + [2000 + g, 3000 + turn, rng.randrange(1000)]))
    return trace


def test_chain_is_the_block_managers_cache_key() -> None:
    bm = BlockSpaceManager(BS, 16, 0, watermark=0.0, enable_caching=True)
    tokens = list(range(40, 51))  # two full blocks and a partial one
    group = make_group("a", 0, tokens=tokens, block_size=BS)
    bm.allocate(group)
    seq = group.seqs[0]
    seq.num_computed_tokens = seq.get_len()
    bm.mark_computed(seq)
    table = bm.get_block_table(seq)
    assert prefix_chain(tokens, BS) == [bm.device.hashes[b] for b in table[:2]]
    assert prefix_chain(tokens, BS, root=7) != prefix_chain(tokens, BS)


def test_round_robin_cycles_and_least_loaded_follows_load() -> None:
    rr = Router(3, "round_robin", block_size=BS)
    assert [send(rr, f"r{i}", [1, 2, 3]) for i in range(6)] == [0, 1, 2, 0, 1, 2]
    ll = Router(3, "least_loaded", block_size=BS)
    assert send(ll, "a", [1] * 4, work=100) == 0
    assert send(ll, "b", [1] * 4, work=10) == 1
    assert send(ll, "c", [1] * 4, work=10) == 2
    assert send(ll, "d", [1] * 4, work=10) == 1  # 1 and 2 tie: the first in rotation
    assert ll.load == [100, 20, 10]
    ll.finished("a")
    assert ll.load == [0, 20, 10] and ll.in_flight == [0, 2, 1]
    assert send(ll, "e", [1] * 4) == 0


def test_prefix_keeps_groups_on_one_replica_and_spreads_them() -> None:
    router = Router(4, "prefix", block_size=BS)
    homes: dict[int, set[int]] = {}
    for i, (group, tokens) in enumerate(group_trace(16, 6)):
        homes.setdefault(group, set()).add(send(router, f"r{i}", tokens))
        if i >= 16 and i % 3 == 0:
            router.finished(f"r{i}")  # some finish, so load moves
    assert all(len(h) == 1 for h in homes.values()), homes
    per_replica = [sum(1 for h in homes.values() if r in h) for r in range(4)]
    assert per_replica == [4, 4, 4, 4]
    # Every request after a group's first matched its whole system prompt.
    s = router.stats
    assert s.matched_blocks == 16 * 5 * 8
    assert s.decisions_by_reason() == {LEAST_LOADED: 16, PREFIX_HIT: 16 * 5}


def test_round_robin_scatters_the_same_trace() -> None:
    router = Router(4, "round_robin", block_size=BS)
    homes: dict[int, set[int]] = {}
    for i, (group, tokens) in enumerate(group_trace(16, 6)):
        homes.setdefault(group, set()).add(send(router, f"r{i}", tokens))
    assert sum(len(h) for h in homes.values()) / 16 > 2.5  # each group's turns scatter


def test_a_flooding_prefix_spills_to_the_least_loaded_replica() -> None:
    router = Router(2, "prefix", block_size=BS, balance_tokens=100, balance_ratio=1.0)
    hot = list(range(32))
    assert send(router, "a", [*hot, 1], work=60) == 0
    assert send(router, "b", [*hot, 2], work=60) == 0  # load 60 <= 0 + 100
    decision = router.choose([*hot, 3])  # 120 > 100: replica 0 is flooded
    assert (decision.replica, decision.reason) == (1, BALANCED)


def test_down_replicas_are_routed_around() -> None:
    router = Router(2, "prefix", block_size=BS)
    tokens = list(range(16))
    assert send(router, "a", tokens) == 0
    assert router.mark_down(0) == ["a"]
    assert router.load == [0, 0] and len(router.mirrors[0]) == 0
    assert send(router, "b", tokens) == 1
    router.mark_down(1)
    with pytest.raises(ValueError, match="^data_parallel_size: no replica is up"):
        router.choose(tokens)
    router.mark_up(0, capacity_blocks=8)
    assert router.choose(tokens).replica == 0 and router.mirrors[0].capacity == 8


def test_mirror_evicts_least_recently_used_keys() -> None:
    mirror = PrefixMirror(capacity=4)
    mirror.insert([1, 2, 3])
    mirror.insert([1, 9])  # touches 1
    mirror.insert([5])  # evicts 2, the oldest untouched
    assert len(mirror) == 4
    assert mirror.match([1, 2, 3]) == 1 and mirror.match([3]) == 1 and mirror.match([1, 9]) == 2


def test_bad_settings_name_their_field() -> None:
    with pytest.raises(ValueError, match="^router: "):
        Router(2, "random")
    with pytest.raises(ValueError, match="^data_parallel_size: "):
        Router(0)


def test_config_and_flags_name_their_field() -> None:
    from pagedllm.config import ParallelConfig
    from pagedllm.entrypoints.cli import build_parser, engine_kwargs

    with pytest.raises(ValueError, match="^router: "):
        ParallelConfig(router="random")
    with pytest.raises(ValueError, match="^data_parallel_size: "):
        ParallelConfig(data_parallel_size=0)
    args = build_parser().parse_args(
        ["serve", "m", "--data-parallel-size", "4", "--router", "round_robin"]
    )
    kwargs = engine_kwargs(args)
    assert kwargs["data_parallel_size"] == 4 and kwargs["router"] == "round_robin"

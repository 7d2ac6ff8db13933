"""Which data-parallel replica takes a request: round robin, least loaded, or prefix-aware.

Each replica keeps its own prefix cache, so a prompt whose leading blocks another request
already computed is cheap only on the replica that computed them. The prefix policy keeps, per
replica, an approximate mirror of that cache: the block keys of the prompts it was sent (the
same ``block_hash`` chain the block manager keys its cache by), bounded by the replica's KV
blocks and evicted least recently used, as the replica's own cache evicts. A request goes to the
replica with the longest matched leading run of blocks, unless that replica's load exceeds the
least loaded replica's by more than the balance bound: then to the least loaded, so a popular
prefix never floods one replica while the others idle.

Load is counted here, not asked of the replicas: the tokens of the requests a replica was sent
and has not finished (prompt plus ``max_tokens``), so a burst is balanced before any replica has
stepped. The router is pure Python (no torch, no I/O) and not thread-safe: its owner locks.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from pagedllm.core.block_allocator import block_hash
from pagedllm.names import ROUTERS

POLICIES = ROUTERS  # the names config.py and the CLI offer
# Reasons a decision is counted under (the ``reason`` label of the router's metrics).
PREFIX_HIT, BALANCED, LEAST_LOADED, ROUND_ROBIN = "prefix", "balanced", "least_loaded", "rr"


def prefix_chain(token_ids: Sequence[int], block_size: int, root: int | None = None) -> list[int]:
    """The prefix cache's keys of the prompt's full blocks, first block first."""
    keys, parent = [], root
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = block_hash(parent, token_ids[start : start + block_size])
        keys.append(parent)
    return keys


class PrefixMirror:
    """One replica's cached block keys as the router believes them (LRU, bounded)."""

    def __init__(self, capacity: int) -> None:
        self.capacity = max(1, capacity)
        self._keys: OrderedDict[int, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._keys)

    def match(self, chain: Sequence[int]) -> int:
        """How many leading blocks of ``chain`` the replica holds (a chain key names all
        blocks before it, so the first miss ends the run)."""
        n = 0
        for key in chain:
            if key not in self._keys:
                break
            n += 1
        return n

    def insert(self, chain: Iterable[int]) -> None:
        for key in chain:
            self._keys[key] = None
            self._keys.move_to_end(key)
        while len(self._keys) > self.capacity:
            self._keys.popitem(last=False)

    def clear(self) -> None:
        self._keys.clear()


@dataclass
class Decision:
    replica: int
    matched_blocks: int  # leading blocks the chosen replica is believed to hold
    query_blocks: int  # full blocks of the prompt that could have matched
    reason: str
    chain: list[int] = field(default_factory=list, repr=False)  # the prompt's block keys


@dataclass
class RouterStats:
    """Cumulative numbers for /metrics: decisions by replica and reason, prefix blocks."""

    decisions: dict[tuple[int, str], int] = field(default_factory=dict)
    matched_blocks: int = 0
    query_blocks: int = 0

    def decisions_by_reason(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for (_, reason), count in self.decisions.items():
            out[reason] = out.get(reason, 0) + count
        return out


class Router:
    """Route requests over ``num_replicas``; see the module docstring.

    ``capacity_blocks``: each replica's mirror size (its KV blocks). ``balance_tokens`` and
    ``balance_ratio``: the prefix choice stands while its load is at most
    ``balance_ratio * least + balance_tokens``; past that the least loaded replica wins.
    """

    def __init__(
        self,
        num_replicas: int,
        policy: str = "prefix",
        *,
        block_size: int = 16,
        capacity_blocks: int = 4096,
        balance_tokens: int = 2048,
        balance_ratio: float = 2.0,
    ) -> None:
        if not isinstance(num_replicas, int) or num_replicas < 1:
            raise ValueError(f"data_parallel_size: must be an integer >= 1, got {num_replicas!r}")
        if policy not in POLICIES:
            raise ValueError(f"router: must be one of {', '.join(POLICIES)}, got {policy!r}")
        if balance_tokens < 0 or balance_ratio < 1.0:
            raise ValueError("balance_tokens: must be >= 0 (and balance_ratio >= 1)")
        self.num_replicas = num_replicas
        self.policy = policy
        self.block_size = block_size
        self.balance_tokens = balance_tokens
        self.balance_ratio = balance_ratio
        self.mirrors = [PrefixMirror(capacity_blocks) for _ in range(num_replicas)]
        self.load = [0] * num_replicas  # tokens sent and not finished
        self.in_flight = [0] * num_replicas
        self.up = [True] * num_replicas
        self.stats = RouterStats()
        self._next = 0  # round robin's cursor, also the tie-break of the other policies
        self._requests: dict[str, tuple[int, int]] = {}  # request id -> (replica, tokens)

    # -- choosing ------------------------------------------------------------------------------
    def choose(self, token_ids: Sequence[int], *, root: int | None = None) -> Decision:
        """The replica for a prompt (not yet counted: call ``sent`` once it was handed over).
        ValueError when no replica is up."""
        live = self._live_order()
        chain = prefix_chain(token_ids, self.block_size, root) if self.policy == "prefix" else []
        # The block holding the last prompt token is recomputed, never a cache hit.
        query = chain[: max(0, (len(token_ids) - 1) // self.block_size)]
        if self.policy == "round_robin":
            return Decision(live[0], 0, len(query), ROUND_ROBIN)
        least = min(live, key=lambda r: self.load[r])  # first in rotation among equals
        if self.policy == "least_loaded" or not query:
            return Decision(least, 0, len(query), LEAST_LOADED, chain)
        matches = {r: self.mirrors[r].match(query) for r in live}
        best = max(live, key=lambda r: (matches[r], -self.load[r]))
        if matches[best] == 0:
            return Decision(least, 0, len(query), LEAST_LOADED, chain)
        bound = self.balance_ratio * self.load[least] + self.balance_tokens
        if self.load[best] > bound:
            return Decision(least, matches[least], len(query), BALANCED, chain)
        return Decision(best, matches[best], len(query), PREFIX_HIT, chain)

    def _live_order(self) -> list[int]:
        """Replicas that are up, starting at the rotation cursor."""
        n = self.num_replicas
        live = [(self._next + i) % n for i in range(n) if self.up[(self._next + i) % n]]
        if not live:
            raise ValueError("data_parallel_size: no replica is up to take the request")
        return live

    # -- bookkeeping -------------------------------------------------------------------------
    def sent(self, request_id: str, decision: Decision, *, tokens: int) -> None:
        """Count the request on its replica; ``tokens``: its expected work (prompt + output)."""
        r = decision.replica
        self._next = (r + 1) % self.num_replicas
        self._requests[request_id] = (r, tokens)
        self.load[r] += tokens
        self.in_flight[r] += 1
        key = (r, decision.reason)
        self.stats.decisions[key] = self.stats.decisions.get(key, 0) + 1
        self.stats.matched_blocks += decision.matched_blocks
        self.stats.query_blocks += decision.query_blocks
        self.mirrors[r].insert(decision.chain)  # empty unless the policy is prefix

    def finished(self, request_id: str) -> int | None:
        """The request left its replica (finished, failed or aborted); its replica, if known."""
        entry = self._requests.pop(request_id, None)
        if entry is None:
            return None
        r, tokens = entry
        self.load[r] = max(0, self.load[r] - tokens)
        self.in_flight[r] = max(0, self.in_flight[r] - 1)
        return r

    def owners(self) -> dict[str, int]:
        """Every request in flight and its replica."""
        return {rid: r for rid, (r, _) in self._requests.items()}

    def replica_of(self, request_id: str) -> int | None:
        entry = self._requests.get(request_id)
        return None if entry is None else entry[0]

    def mark_down(self, replica: int) -> list[str]:
        """A replica is gone: no more requests, its cache is lost; the ids it held."""
        self.up[replica] = False
        self.mirrors[replica].clear()
        ids = [rid for rid, (r, _) in self._requests.items() if r == replica]
        for rid in ids:
            self.finished(rid)
        return ids

    def mark_up(self, replica: int, *, capacity_blocks: int | None = None) -> None:
        self.up[replica] = True
        if capacity_blocks is not None:
            self.mirrors[replica].capacity = max(1, capacity_blocks)

    def set_capacity(self, replica: int, capacity_blocks: int) -> None:
        self.mirrors[replica].capacity = max(1, capacity_blocks)

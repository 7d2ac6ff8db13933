"""The block manager and scheduler over a lower tier: what goes down, what comes back, when a
prompt waits for a read, and that pins and blocks are never leaked."""

from __future__ import annotations

import os
import subprocess
import sys
from collections import Counter

from pagedllm.config import SchedulerConfig
from pagedllm.core.block_manager import BlockSpaceManager, block_hash
from pagedllm.core.prefix_tier import MAX_READ_WAIT_S, TierProbe
from pagedllm.core.scheduler import Scheduler
from tests.core.helpers import fake_step, make_group

BS = 4


class FakeTier:
    """A lower tier in plain Python: keys in memory, on disk, or being read."""

    def __init__(self) -> None:
        self.memory: set[int] = set()
        self.disk: set[int] = set()
        self.reading: set[int] = set()
        self.pins: Counter[int] = Counter()
        self.prefetched: list[list[int]] = []

    def probe(self, keys: list[int]) -> TierProbe:
        resident = 0
        while resident < len(keys) and keys[resident] in self.memory:
            resident += 1
        on_disk, reading = 0, False
        for key in keys[resident:]:
            if key in self.reading:
                reading = True
            elif key not in self.disk:
                break
            on_disk += 1
        return TierProbe(resident, on_disk, reading)

    def prefetch(self, keys: list[int]) -> None:
        self.prefetched.append(list(keys))
        self.reading.update(keys)

    def finish_reads(self) -> None:
        self.memory |= self.reading
        self.reading.clear()

    def acquire(self, keys: list[int]) -> int:
        count = 0
        for key in keys:
            if key not in self.memory:
                break
            self.pins[key] += 1
            count += 1
        return count

    def release(self, keys: list[int]) -> None:
        for key in keys:
            self.pins[key] -= 1

    def unpin_loads(self, loads: list[tuple[int, int]]) -> None:
        """What the worker does once it loaded them."""
        self.release([key for key, _ in loads])


def chain(tokens: list[int], n: int) -> list[int]:
    keys, parent = [], None
    for i in range(n):
        parent = block_hash(parent, tokens[i * BS : (i + 1) * BS])
        keys.append(parent)
    return keys


def make(tier: FakeTier, *, num_blocks: int = 8, **config: object) -> Scheduler:
    config.setdefault("max_model_len", 64)
    config.setdefault("enable_chunked_prefill", False)  # written for whole-prompt steps
    bm = BlockSpaceManager(BS, num_blocks, 4, watermark=0.0, enable_caching=True, tier=tier)
    return Scheduler(SchedulerConfig(**config), bm)  # type: ignore[arg-type]


def test_block_keys_are_stable_across_processes() -> None:
    code = (
        "from pagedllm.core.block_manager import block_hash;"
        "print(block_hash(block_hash(None, [1, 2, 3, 4]), [5, 6, 7, 8]))"
    )
    values = set()
    for seed in ("1", "2"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
        values.add(out.stdout.strip())
    assert values == {str(block_hash(block_hash(None, [1, 2, 3, 4]), [5, 6, 7, 8]))}
    assert block_hash(None, [1, 2, 3, 4]) != block_hash(0, [1, 2, 3, 4])


def test_evicted_blocks_are_saved_in_the_step_that_reuses_them() -> None:
    tier = FakeTier()
    s = make(tier, num_blocks=4)
    a = make_group("a", 0, tokens=list(range(10, 22)), max_tokens=1)  # 3 full blocks
    fake_step(s)
    s.add(a)
    out = fake_step(s)
    assert out.kv_transfer is None  # nothing evicted: the pool was empty
    table_a = out.seqs[0].block_table
    keys_a = chain(list(range(10, 22)), 3)
    # The finished prompt's blocks are cached; a new prompt needing all 4 blocks evicts them.
    s.add(make_group("b", 0, tokens=list(range(50, 66)), max_tokens=1))
    out = fake_step(s)
    saves = out.kv_transfer.saves
    evicted = dict(saves)
    assert {b: k for b, k in zip(table_a, keys_a, strict=True)} == evicted
    assert set(evicted) <= set(out.seqs[0].block_table)  # reused in this very step
    fake_step(s)
    assert s.block_manager.get_num_free_device_blocks() == 4


def test_tier_hits_are_loaded_into_fresh_blocks_and_count_as_computed() -> None:
    tier = FakeTier()
    s = make(tier)
    tokens = list(range(30, 45))  # 15 tokens: 3 skippable full blocks
    keys = chain(tokens, 3)
    tier.memory.update(keys[:2])  # the first two are in host memory
    s.add(make_group("a", 0, tokens=tokens, max_tokens=2))
    s.add(make_group("b", 0, tokens=[*tokens[:8], 99, 98, 97], max_tokens=2))
    out = s.schedule()
    a, b = out.seqs
    assert a.start_pos == 8 and len(a.token_ids) == 7  # 2 blocks loaded, the rest computed
    assert out.kv_transfer.loads == [(keys[0], a.block_table[0]), (keys[1], a.block_table[1])]
    # Loaded blocks are device hits for a prompt planned after it in the same step.
    assert b.start_pos == 8 and b.block_table[:2] == a.block_table[:2]
    assert sum(tier.pins.values()) == 2
    tier.unpin_loads(out.kv_transfer.loads)
    assert s.block_manager.tier.stats.blocks_loaded == 2


def test_prompt_waits_once_for_a_read_while_others_run() -> None:
    tier = FakeTier()
    s = make(tier)
    tokens = list(range(30, 45))
    keys = chain(tokens, 3)
    tier.disk.update(keys)
    s.add(make_group("a", 0, tokens=tokens, max_tokens=2))
    s.add(make_group("c", 0, tokens=list(range(200, 206)), max_tokens=1))
    out = fake_step(s)
    assert [x.request_id for x in out.seqs] == ["c"]  # a waits for its blocks
    assert tier.prefetched == [keys]
    out = fake_step(s)
    assert [x.request_id for x in out.seqs] == []  # still being read
    tier.finish_reads()
    tier.memory.discard(keys[2])  # evicted from host memory before a was admitted
    out = s.schedule()
    assert out.seqs[0].request_id == "a" and out.seqs[0].start_pos == 8
    assert tier.prefetched == [keys]  # no second read for the block that left
    assert [k for k, _ in out.kv_transfer.loads] == keys[:2]


def test_pins_and_blocks_are_released_when_a_prompt_is_not_admitted() -> None:
    tier = FakeTier()
    s = make(tier, max_num_batched_tokens=16, enable_chunked_prefill=False, max_model_len=16)
    tokens = list(range(30, 45))
    tier.memory.update(chain(tokens, 3))
    s.add(make_group("x", 0, tokens=list(range(100, 110)), max_tokens=3))
    s.add(make_group("a", 0, tokens=tokens, max_tokens=2))
    out = s.schedule()
    # a's 3 loaded blocks leave 3 tokens to compute; 10 + 3 fit in 16: both admitted.
    assert [x.request_id for x in out.seqs] == ["x", "a"]
    tier.unpin_loads(out.kv_transfer.loads)
    s.abort(["x", "a"])
    assert sum(tier.pins.values()) == 0
    # A prompt whose tokens do not fit the budget alongside is released, not leaked.
    other = list(range(60, 75))
    s.add(make_group("y", 0, tokens=list(range(100, 110)), max_tokens=3))
    s.add(make_group("z", 0, tokens=other, max_tokens=2))
    tier.memory.update(chain(other, 1))  # one block: 11 tokens to compute, 10 + 11 > 16
    out = s.schedule()
    assert [x.request_id for x in out.seqs] == ["y"]
    assert sum(tier.pins.values()) == 0
    s.abort(["y", "z"])
    assert s.block_manager.get_num_free_device_blocks() == 8


def test_abort_while_waiting_for_a_read_forgets_the_prompt() -> None:
    tier = FakeTier()
    s = make(tier)
    tokens = list(range(30, 45))
    tier.disk.update(chain(tokens, 3))
    g = make_group("a", 0, tokens=tokens, max_tokens=2)
    s.add(g)
    assert s.schedule().seqs == []
    s.abort(["a"])
    assert not s.has_unfinished()
    assert not s.block_manager.tier._waited and not s.block_manager.tier._prefetched
    assert s.block_manager.get_num_free_device_blocks() == 8


def test_prompt_logprobs_never_load_from_a_tier() -> None:
    tier = FakeTier()
    s = make(tier)
    tokens = list(range(30, 45))
    tier.disk.update(chain(tokens, 3))
    g = make_group("a", 0, tokens=tokens, max_tokens=1)
    g.sampling_params = g.sampling_params.clone(prompt_logprobs=1)
    s.add(g)
    out = s.schedule()
    assert out.seqs[0].start_pos == 0 and out.kv_transfer is None
    assert tier.prefetched == []


def test_flush_saves_every_computed_keyed_block() -> None:
    tier = FakeTier()
    s = make(tier)
    s.add(make_group("a", 0, tokens=list(range(10, 21)), max_tokens=1))  # 2 full blocks
    out = fake_step(s)
    flushed = s.block_manager.flush_transfer()
    assert sorted(flushed.saves) == sorted(
        zip(out.seqs[0].block_table[:2], chain(list(range(10, 21)), 2), strict=True)
    )


def test_a_stalled_read_is_waited_for_a_bounded_time() -> None:
    tier = FakeTier()
    s = make(tier)
    clock = [100.0]
    s.block_manager.tier.clock = lambda: clock[0]
    tokens = list(range(30, 45))
    tier.disk.update(chain(tokens, 3))
    s.add(make_group("a", 0, tokens=tokens, max_tokens=2))
    assert s.schedule().seqs == []
    clock[0] += MAX_READ_WAIT_S  # the read never finishes (a stalled network disk)
    assert s.schedule().seqs == []
    clock[0] += 1.0
    out = s.schedule()
    assert out.seqs[0].start_pos == 0 and out.kv_transfer is None  # recomputed


def test_a_prompt_waiting_on_a_shared_read_still_reads_its_own_blocks() -> None:
    tier = FakeTier()
    s = make(tier, num_blocks=16)
    shared = list(range(30, 38))
    a_tokens, b_tokens = [*shared, *range(40, 49)], [*shared, *range(60, 69)]
    a_keys, b_keys = chain(a_tokens, 4), chain(b_tokens, 4)
    tier.disk.update(a_keys + b_keys)
    s.add(make_group("a", 0, tokens=a_tokens, max_tokens=2))
    s.add(make_group("b", 0, tokens=b_tokens, max_tokens=2))
    assert s.schedule().seqs == []
    assert tier.prefetched == [a_keys]  # b waits on the shared blocks a's read brings
    tier.finish_reads()
    out = s.schedule()
    assert [x.request_id for x in out.seqs] == ["a"]
    assert tier.prefetched == [a_keys, b_keys[2:]]  # then asks for its own
    tier.unpin_loads(out.kv_transfer.loads)
    tier.finish_reads()
    out = s.schedule()
    assert out.seqs[0].request_id == "b" and out.seqs[0].start_pos == 16

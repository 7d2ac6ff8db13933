"""The scheduler owns the block tables: forks and frees go through it, what it scheduled is read
back from its own output, and copy-on-write pairs travel in the step it planned."""

from __future__ import annotations

import dataclasses

from pagedllm.core.interfaces import ModelRunnerOutput, SampledToken
from pagedllm.core.sequence import SequenceStatus
from tests.core.helpers import make_group, make_scheduler


def test_fork_and_free_share_and_release_blocks() -> None:
    sched = make_scheduler(num_blocks=8, block_size=4)
    group = make_group("a", 6)
    sched.add(group)
    sched.schedule()
    parent = group.seqs[0]
    bm = sched.block_manager
    table = list(bm.get_block_table(parent))
    child = sched.fork(group, parent, index=1)
    assert child in group.seqs and child.index == 1
    assert bm.get_block_table(child) == table
    assert all(bm.device.ref_counts[b] == 2 for b in table)
    sched.free(group, child)
    assert child not in group.seqs and not bm.has_table(child)
    assert all(bm.device.ref_counts[b] == 1 for b in table)


def test_update_reads_what_ran_from_the_output() -> None:
    """A sequence left out of the output (its step was contained) is not advanced."""
    sched = make_scheduler(num_blocks=16, block_size=4)
    a, b = make_group("a", 5), make_group("b", 7)
    sched.add(a)
    sched.add(b)
    out = sched.schedule()
    assert {s.request_id for s in out.seqs} == {"a", "b"}
    only_a = dataclasses.replace(out, seqs=[s for s in out.seqs if s.request_id == "a"])
    sampled = {s.seq_id: SampledToken(s.seq_id, 9, -0.1) for s in only_a.seqs}
    touched = sched.update_from_output(only_a, ModelRunnerOutput(sampled=sampled))
    assert [g.request_id for g in touched] == ["a"]
    assert a.seqs[0].num_computed_tokens == 5 and a.seqs[0].output_token_ids == [9]
    assert b.seqs[0].num_computed_tokens == 0 and b.seqs[0].output_token_ids == []


def test_copy_on_write_pairs_travel_in_the_step() -> None:
    sched = make_scheduler(num_blocks=8, block_size=4)
    group = make_group("a", 6)  # 6 tokens: the second block is partly filled
    sched.add(group)
    out = sched.schedule()
    parent = group.seqs[0]
    sched.update_from_output(
        out, ModelRunnerOutput(sampled={parent.seq_id: SampledToken(parent.seq_id, 4, -0.1)})
    )
    child = sched.fork(group, parent, index=1)
    child.append_token(5, -0.2, None)
    shared = sched.block_manager.get_block_table(parent)[1]
    out = sched.schedule()
    assert len(out.blocks_to_copy) == 1 and out.blocks_to_copy[0][0] == shared
    assert {s.seq_id for s in out.seqs} == {parent.seq_id, child.seq_id}
    assert all(s.status is SequenceStatus.RUNNING for s in group.seqs)
    assert sched.schedule().blocks_to_copy == []  # nothing left over for the next step

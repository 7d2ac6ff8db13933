"""Pure functions that flatten a scheduler step into the tensors of one forward pass."""

from __future__ import annotations

from dataclasses import dataclass

from pagedllm.core.interfaces import SchedulerOutput


@dataclass
class FlatBatch:
    """Python lists for one step; the runner turns them into device tensors once."""

    input_ids: list[int]
    positions: list[int]
    slot_mapping: list[int]
    seq_lens: list[int]
    query_lens: list[int]
    block_tables: list[list[int]]
    sample_indices: list[int]  # flat index of each sampled row's last token
    sample_seq_positions: list[int]  # index into sched_out.seqs of each sampled row
    prompt_logprob_spans: list[tuple[int, int, int]]  # (seq index, flat start, count)


def slots_for(block_table: list[int], start: int, count: int, block_size: int) -> list[int]:
    """Slot of each position ``start .. start+count-1`` through the block table."""
    return [
        block_table[p // block_size] * block_size + p % block_size
        for p in range(start, start + count)
    ]


def flatten(sched_out: SchedulerOutput, block_size: int) -> FlatBatch:
    batch = FlatBatch([], [], [], [], [], [], [], [], [])
    for i, s in enumerate(sched_out.seqs):
        n = len(s.token_ids)
        flat_start = len(batch.input_ids)
        batch.input_ids.extend(s.token_ids)
        if n == 1:
            p = s.start_pos
            batch.positions.append(p)
            batch.slot_mapping.append(s.block_table[p // block_size] * block_size + p % block_size)
        else:
            batch.positions.extend(range(s.start_pos, s.start_pos + n))
            batch.slot_mapping.extend(slots_for(s.block_table, s.start_pos, n, block_size))
        batch.seq_lens.append(s.start_pos + n)
        batch.query_lens.append(n)
        batch.block_tables.append(s.block_table)
        if s.do_sample:
            batch.sample_indices.append(flat_start + n - 1)
            batch.sample_seq_positions.append(i)
        if s.next_token_ids is not None:
            batch.prompt_logprob_spans.append((i, flat_start, len(s.next_token_ids)))
    return batch

"""Pure functions that flatten a scheduler step into the tensors of one forward pass."""

from __future__ import annotations

from dataclasses import dataclass, field

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
    # Pooling requests' last prefill steps, pooled instead of sampled: (seq index, start, count).
    pool_spans: list[tuple[int, int, int]] = field(default_factory=list)
    # Text pairs' segment ids (BERT token types), flat; None when no sequence has them.
    token_type_ids: list[int] | None = None


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
        if not s.block_table:  # a bidirectional encoder's prompt: no KV cache to write
            batch.positions.extend(range(s.start_pos, s.start_pos + n))
            batch.slot_mapping.extend([-1] * n)
        elif n == 1:
            p = s.start_pos
            batch.positions.append(p)
            batch.slot_mapping.append(s.block_table[p // block_size] * block_size + p % block_size)
        else:
            batch.positions.extend(range(s.start_pos, s.start_pos + n))
            batch.slot_mapping.extend(slots_for(s.block_table, s.start_pos, n, block_size))
        batch.seq_lens.append(s.start_pos + n)
        batch.query_lens.append(n)
        batch.block_tables.append(s.block_table)
        types = s.pooling_params.token_type_ids if s.pooling_params is not None else None
        if types is not None or batch.token_type_ids is not None:
            if batch.token_type_ids is None:
                batch.token_type_ids = [0] * flat_start
            batch.token_type_ids.extend(types[s.start_pos : s.start_pos + n] if types else [0] * n)
        if s.do_sample and s.pooling_params is not None:
            batch.pool_spans.append((i, flat_start, n))
        elif s.do_sample:
            batch.sample_indices.append(flat_start + n - 1)
            batch.sample_seq_positions.append(i)
        if s.next_token_ids is not None:
            batch.prompt_logprob_spans.append((i, flat_start, len(s.next_token_ids)))
    return batch

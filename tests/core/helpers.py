"""Drive the scheduler without a model: every sampled row gets a fixed token."""

from __future__ import annotations

import itertools

from pagedllm.config import SchedulerConfig
from pagedllm.core.block_manager import BlockSpaceManager
from pagedllm.core.interfaces import ModelRunnerOutput, SampledToken, SchedulerOutput
from pagedllm.core.sampling_params import SamplingParams
from pagedllm.core.scheduler import Scheduler
from pagedllm.core.sequence import Sequence, SequenceGroup, SequenceStatus

_ids = itertools.count()


def make_group(
    request_id: str,
    prompt_len: int,
    *,
    block_size: int = 4,
    max_tokens: int = 4,
    arrival: float | None = None,
    priority: int = 0,
    tokens: list[int] | None = None,
) -> SequenceGroup:
    ids = tokens if tokens is not None else [(7 * i + 3) % 50 + 3 for i in range(prompt_len)]
    seq = Sequence(next(_ids), ids, block_size)
    return SequenceGroup(
        request_id=request_id,
        seqs=[seq],
        sampling_params=SamplingParams(temperature=0.0, max_tokens=max_tokens),
        arrival_time=float(next(_ids)) if arrival is None else arrival,
        priority=priority,
    )


def make_scheduler(
    *,
    num_blocks: int = 16,
    num_host_blocks: int = 16,
    block_size: int = 4,
    enable_caching: bool = False,
    sliding_window: int | None = None,
    clock: object = None,
    **config: object,
) -> Scheduler:
    config.setdefault("max_model_len", 64)
    # These tests were written for whole-prompt steps, the default before chunked prefill
    # became it; the chunked ones say so.
    config.setdefault("enable_chunked_prefill", False)
    bm = BlockSpaceManager(
        block_size,
        num_blocks,
        num_host_blocks,
        watermark=0.0,
        enable_caching=enable_caching,
        sliding_window=sliding_window,
    )
    kwargs = {"clock": clock} if clock is not None else {}
    return Scheduler(SchedulerConfig(**config), bm, **kwargs)  # type: ignore[arg-type]


def fake_step(scheduler: Scheduler, token: int = 1) -> SchedulerOutput:
    """One step: schedule, 'sample' ``token`` for every sampled row, finish by max_tokens."""
    out = scheduler.schedule()
    sampled = {s.seq_id: SampledToken(s.seq_id, token, -0.5) for s in out.seqs if s.do_sample}
    touched = scheduler.update_from_output(out, ModelRunnerOutput(sampled=sampled))
    for group in touched:
        for seq in group.get_seqs(SequenceStatus.RUNNING):
            if seq.get_output_len() >= (group.sampling_params.max_tokens or 1 << 30):
                seq.status = SequenceStatus.FINISHED_LENGTH_CAPPED
    scheduler.free_finished()
    return out

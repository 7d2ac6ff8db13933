"""Pooling requests in the scheduler: prefill-only, batched with generation in one step,
finished after their prefill with their blocks freed at once; an encoder's request holds no
blocks; a prompt pooled whole is never chunked."""

from __future__ import annotations

from pagedllm.core.interfaces import ModelRunnerOutput, SampledToken, SchedulerOutput
from pagedllm.core.pooling_params import PoolingParams
from pagedllm.core.scheduler import Scheduler
from pagedllm.core.sequence import SequenceGroup, SequenceStatus
from tests.core.helpers import make_group, make_scheduler


def pooling_group(request_id: str, prompt_len: int, **params: object) -> SequenceGroup:
    group = make_group(request_id, prompt_len, max_tokens=1)
    group.pooling_params = PoolingParams(**params)  # type: ignore[arg-type]
    return group


def run_step(scheduler: Scheduler) -> SchedulerOutput:
    """Sampled rows get token 1, pooled rows the vector [len(token_ids)]."""
    out = scheduler.schedule()
    sampled = {
        s.seq_id: SampledToken(s.seq_id, 1, -0.5)
        for s in out.seqs
        if s.do_sample and s.pooling_params is None
    }
    pooled = {
        s.seq_id: [float(s.start_pos + len(s.token_ids))]
        for s in out.seqs
        if s.do_sample and s.pooling_params is not None
    }
    scheduler.update_from_output(out, ModelRunnerOutput(sampled=sampled, pooled=pooled))
    scheduler.free_finished()
    return out


def all_free(scheduler: Scheduler) -> bool:
    bm = scheduler.block_manager
    return bm.get_num_free_device_blocks() == bm.num_device_blocks


def test_pooling_batched_with_generation_and_freed_after_prefill() -> None:
    s = make_scheduler(num_blocks=32, max_num_batched_tokens=64, enable_chunked_prefill=True)
    gen = make_group("gen", 6, max_tokens=5)
    emb = pooling_group("emb", 10)
    s.add(gen)
    s.add(emb)
    out = run_step(s)
    assert {x.request_id for x in out.seqs} == {"gen", "emb"}  # one step, both prompts
    assert emb.is_finished() and emb.pooled == [10.0]
    assert emb.seqs[0].status is SequenceStatus.FINISHED_STOPPED
    assert not s.block_manager.has_table(emb.seqs[0])  # its blocks went back at once
    assert [g.request_id for g in s.running] == ["gen"]
    while s.has_unfinished():
        run_step(s)
    assert all_free(s)


def test_encoder_request_holds_no_blocks() -> None:
    s = make_scheduler(num_blocks=4, max_num_batched_tokens=64)
    group = pooling_group("enc", 40, uses_kv_cache=False)  # more tokens than the cache holds
    s.add(group)
    out = s.schedule()
    assert out.seqs[0].block_table == [] and len(out.seqs[0].token_ids) == 40
    assert all_free(s)
    s.update_from_output(out, ModelRunnerOutput(sampled={}, pooled={out.seqs[0].seq_id: [1.0]}))
    s.free_finished()
    assert group.is_finished() and not s.has_unfinished() and all_free(s)


def test_whole_prompt_waits_rather_than_chunk() -> None:
    s = make_scheduler(num_blocks=32, max_num_batched_tokens=16, enable_chunked_prefill=True)
    s.add(make_group("gen", 10, max_tokens=3))
    s.add(pooling_group("emb", 12, whole_prompt=True))
    first = run_step(s)
    assert [x.request_id for x in first.seqs] == ["gen"]  # 10 + 12 > 16: emb waits whole
    second = run_step(s)
    emb = [x for x in second.seqs if x.request_id == "emb"]
    assert len(emb) == 1 and len(emb[0].token_ids) == 12 and emb[0].start_pos == 0
    while s.has_unfinished():
        run_step(s)
    assert all_free(s)


def test_last_token_pooling_may_chunk() -> None:
    s = make_scheduler(num_blocks=32, max_num_batched_tokens=8, enable_chunked_prefill=True)
    group = pooling_group("emb", 20)
    s.add(group)
    steps = 0
    while s.has_unfinished():
        run_step(s)
        steps += 1
    assert steps == 3 and group.pooled == [20.0]  # pooled once, at the prompt's end
    assert all_free(s)

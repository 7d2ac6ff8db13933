"""Verification: the target scores ``[fed token, proposals...]`` of every speculating sequence in
one forward pass, and each position is sampled exactly as plain decoding would sample it.

The acceptance rule. Every proposal here is a point mass ``q = 1`` at a token ``x`` (an n-gram
lookup, or a draft model's greedy choice). For such a proposal the rejection sampler (accept
with ``min(1, p(x) / q(x))``, else draw from ``normalise(max(0, p - q))``) is the same as
drawing ``y ~ p`` with the target's own sampler and accepting iff ``y == x``: acceptance has
probability ``p(x)``, and a rejected draw is distributed as ``p`` restricted to ``y != x``,
renormalised. So each emitted token has the target's distribution, greedy requests get exactly
the argmax, and a seeded request draws the same noise per output position as without
speculation (its generator is keyed by position), so it stays reproducible.
"""

from __future__ import annotations

import dataclasses
import time

import torch

from pagedllm.core.interfaces import (
    ModelRunnerOutput,
    SampledToken,
    ScheduledSeq,
    SchedulerOutput,
    SpecStepStats,
)
from pagedllm.executors.inputs import FlatBatch, flatten
from pagedllm.executors.model_runner import ModelRunner
from pagedllm.layers.sampler import SamplingRow
from pagedllm.spec_decode.draft import DraftProposer


def speculation_batch(
    sched_out: SchedulerOutput, proposals: dict[int, list[int]]
) -> SchedulerOutput:
    """The step with each speculating decode's proposals fed after its token.

    Several query tokens over cached context are what the kernels' prefill section computes,
    so those decodes move there: prompts, then speculating decodes, then one-token decodes.
    """
    n = sched_out.num_prefill_seqs
    prefills, decodes = sched_out.seqs[:n], sched_out.seqs[n:]
    spec = [
        dataclasses.replace(s, token_ids=s.token_ids + proposals[s.seq_id])
        for s in decodes
        if proposals.get(s.seq_id)
    ]
    plain = [s for s in decodes if not proposals.get(s.seq_id)]
    return dataclasses.replace(
        sched_out, seqs=prefills + spec + plain, num_prefill_seqs=n + len(spec)
    )


def verify_rows(s: ScheduledSeq, proposals: list[int]) -> list[SamplingRow]:
    """One sampling row per position ``0 .. k``: row ``j`` sees the proposals before it as
    generated tokens (penalties, min_tokens and the seeded generator's position follow)."""
    rows = []
    for j in range(len(proposals) + 1):
        history = None
        if s.history is not None:
            prompt, output = s.history
            history = (prompt, output + proposals[:j] if j else output)
        rows.append(
            SamplingRow(
                s.seq_id,
                s.sampling_params,
                s.output_len + j,
                history,
                sample_index=s.sample_index,
                eos_token_ids=s.eos_token_ids,
            )
        )
    return rows


def accepted_prefix(drawn: list[int], proposals: list[int]) -> int:
    """How many proposals are accepted: each while the target's draw there equals it."""
    a = 0
    while a < len(proposals) and drawn[a] == proposals[a]:
        a += 1
    return a


class SpecDecodeRunner:
    """The worker's step under speculation: propose (draft model), then verify on the target."""

    def __init__(self, target: ModelRunner, draft: DraftProposer | None) -> None:
        self.target = target
        self.draft = draft

    @torch.inference_mode()
    def execute(
        self, sched_out: SchedulerOutput, kv_caches: list[torch.Tensor]
    ) -> ModelRunnerOutput:
        t0 = time.perf_counter()
        if self.draft is not None and self.draft.cache is not None:
            cache = self.draft.cache  # the same block moves as the target's cache
            cache.swap_out(sched_out.blocks_to_swap_out)
            cache.swap_in(sched_out.blocks_to_swap_in)
            cache.copy(sched_out.blocks_to_copy)
        proposals = {
            s.seq_id: s.spec_token_ids
            for s in sched_out.seqs
            if s.num_spec_tokens and s.spec_token_ids
        }
        if self.draft is not None:
            proposals.update(self.draft.propose(sched_out))  # also keeps its cache in step
        t1 = time.perf_counter()
        if not proposals:
            out = self.target.execute(sched_out, kv_caches)
            return dataclasses.replace(out, spec_stats=SpecStepStats(draft_time=t1 - t0))
        step = speculation_batch(sched_out, proposals)
        batch = flatten(step, self.target.block_size)
        hidden = self.target.forward(batch, step.num_prefill_seqs, kv_caches)
        first = sched_out.num_prefill_seqs
        spec_positions = list(range(first, step.num_prefill_seqs))
        sampled = self.target._sample(hidden, _without_rows(batch, set(spec_positions)), step)
        prompt_lps = self.target._prompt_logprobs(hidden, batch, step.seqs)
        spec_tokens, accepted = self._verify(
            hidden, batch, step, spec_positions, proposals, sampled
        )
        stats = SpecStepStats(
            num_seqs=len(spec_positions),
            num_proposed=sum(len(proposals[step.seqs[i].seq_id]) for i in spec_positions),
            num_accepted=accepted,
            draft_time=t1 - t0,
            verify_time=time.perf_counter() - t1,
        )
        return ModelRunnerOutput(
            sampled=sampled, prompt_logprobs=prompt_lps, spec_tokens=spec_tokens, spec_stats=stats
        )

    def _verify(
        self,
        hidden: torch.Tensor,  # [num_tokens, hidden]
        batch: FlatBatch,
        step: SchedulerOutput,
        positions: list[int],
        proposals: dict[int, list[int]],
        sampled: dict[int, SampledToken],
    ) -> tuple[dict[int, list[SampledToken]], int]:
        """Sample every position of every run at once; keep each run's accepted prefix."""
        starts = [0]
        for q in batch.query_lens:
            starts.append(starts[-1] + q)
        flat: list[int] = []
        rows: list[SamplingRow] = []
        for i in positions:
            s = step.seqs[i]
            props = proposals[s.seq_id]
            flat.extend(range(starts[i], starts[i] + len(props) + 1))
            rows.extend(verify_rows(s, props))
        idx = torch.tensor(flat, dtype=torch.long, device=hidden.device)
        logits = self.target.model.compute_logits(hidden[idx])  # [rows, vocab]
        out = self.target.sampler(logits, rows)
        spec_tokens: dict[int, list[SampledToken]] = {}
        accepted, r = 0, 0
        for i in positions:
            s = step.seqs[i]
            props = proposals[s.seq_id]
            a = accepted_prefix(out.token_ids[r : r + len(props) + 1], props)
            # The accepted proposals, then the target's own draw where the run ends.
            tokens = [*props[:a], out.token_ids[r + a]]
            run = [
                SampledToken(s.seq_id, t, out.logprobs[r + j], out.top_logprobs[r + j])
                for j, t in enumerate(tokens)
            ]
            sampled[s.seq_id] = run[0]
            spec_tokens[s.seq_id] = run[1:]
            accepted += a
            r += len(props) + 1
        return spec_tokens, accepted


def _without_rows(batch: FlatBatch, positions: set[int]) -> FlatBatch:
    """The batch with the sampled rows of ``positions`` (speculating decodes) left out."""
    keep = [j for j, i in enumerate(batch.sample_seq_positions) if i not in positions]
    return dataclasses.replace(
        batch,
        sample_indices=[batch.sample_indices[j] for j in keep],
        sample_seq_positions=[batch.sample_seq_positions[j] for j in keep],
    )

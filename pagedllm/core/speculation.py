"""The scheduler's side of speculative decoding: n-gram proposals, lookahead slots, accepted runs.

Pure Python. A speculating decode gets slots for ``1 + k`` tokens; the target scores them in one
pass and accepts ``1 .. k + 1`` tokens. Slots of rejected tokens are given back here: the
sequence's computed count covers only accepted tokens, and trailing blocks past its length are
freed (they were never registered in the prefix cache, which keys only computed full blocks).
Lookahead is optional work: it is reserved only from blocks and tokens the step has left, so it
never preempts anyone.
"""

from __future__ import annotations

import dataclasses

from pagedllm.core.block_manager import BlockSpaceManager
from pagedllm.core.interfaces import ModelRunnerOutput, SampledToken, ScheduledSeq
from pagedllm.core.sequence import Sequence, SequenceGroup, SequenceStatus
from pagedllm.core.step_plan import Budget, StepPlan
from pagedllm.spec_decode.config import SpeculativeConfig


def propose_ngram(tokens: list[int], k: int, n_max: int, n_min: int) -> list[int]:
    """Up to ``k`` tokens that followed the most recent earlier occurrence of the longest
    trailing n-gram (``n_max`` down to ``n_min`` tokens); [] when none occurred before.

    One backwards scan: every earlier position holding the last token is a candidate end, and
    its match length is extended backwards up to ``n_max``.
    """
    length = len(tokens)
    if length < 2 or k <= 0:
        return []
    last = tokens[-1]
    best_len, best_end = 0, -1
    for end in range(length - 2, -1, -1):
        if tokens[end] != last:
            continue
        n = 1
        while n < n_max and end - n >= 0 and tokens[end - n] == tokens[length - 1 - n]:
            n += 1
        if n > best_len:
            best_len, best_end = n, end
            if n == n_max:
                break
    if best_len < n_min:
        return []
    return tokens[best_end + 1 : best_end + 1 + k]


def speculates(group: SequenceGroup) -> bool:
    """Requests whose features cannot be verified in a run decode one token at a time.

    Beam search ranks every candidate of every step; guided decoding advances a grammar
    matcher per token in the engine, so its mask for a later position is unknown at verify time.
    """
    p = group.sampling_params
    return p.allow_speculation and not p.use_beam_search and p.guided_decoding is None


MAX_BACKOFF_STEPS = 16


class LookaheadPlanner:
    """Decides per step how many tokens each running decode speculates, and reserves slots.

    A sequence whose proposals were all rejected waits 2, 4, .. up to 16 steps before it
    speculates again (one accepted proposal resets it): where the output does not repeat,
    verifying rejected proposals would only cost time. Outputs do not depend on this choice.
    """

    def __init__(self, config: SpeculativeConfig, *, max_model_len: int) -> None:
        self.config = config
        self.max_model_len = max_model_len
        # seq_id -> (consecutive all-rejected runs, steps left to wait); only sequences that
        # decoded in the last step are kept, so finished ones drop out.
        self._backoff: dict[int, tuple[int, int]] = {}

    def _proposal(self, group: SequenceGroup, seq: Sequence) -> tuple[int, list[int] | None]:
        cfg = self.config
        k = min(cfg.num_speculative_tokens, self.max_model_len - seq.get_len())
        max_tokens = group.sampling_params.max_tokens
        if max_tokens is not None:  # a proposal past max_tokens could never be kept
            k = min(k, max_tokens - seq.get_output_len() - 1)
        if k <= 0:
            return 0, None
        if cfg.uses_draft_model:
            return k, None
        props = propose_ngram(seq.get_token_ids(), k, cfg.prompt_lookup_max, cfg.prompt_lookup_min)
        return len(props), props or None

    def reserve(self, step: StepPlan, budget: Budget, bm: BlockSpaceManager) -> None:
        """Lookahead slots for the step's decodes, from what the step has left."""
        backoff, self._backoff = self._backoff, {}
        for group in step.decodes:
            if not speculates(group):
                continue
            for seq in group.get_seqs(SequenceStatus.RUNNING):
                fails, wait = backoff.get(seq.seq_id, (0, 0))
                self._backoff[seq.seq_id] = (fails, max(0, wait - 1))
                if wait > 0:
                    continue
                k, props = self._proposal(group, seq)
                k = min(k, budget.tokens_left)
                table = bm.get_block_table(seq)
                extra = seq.num_blocks_needed(seq.get_len() + k) - len(table)
                if extra > 0 and bm.get_num_free_device_blocks() - extra < bm.watermark_blocks:
                    k = min(k, len(table) * bm.block_size - seq.get_len())  # no new block
                if k <= 0:
                    continue
                step.copies.extend(bm.append_slots(seq, seq.get_len() + k))
                budget.num_tokens += k
                step.lookahead[seq.seq_id] = (k, props[:k] if props is not None else None)

    def decorate(self, item: ScheduledSeq, seq: Sequence, step: StepPlan) -> ScheduledSeq:
        """The decode's wire item with its lookahead (and, for a draft model, the token before)."""
        k, props = step.lookahead.get(seq.seq_id, (0, None))
        prev = None
        if self.config.uses_draft_model and item.start_pos > 0:
            prev = seq.token_slice(item.start_pos - 1, item.start_pos)[0]
        if not k and prev is None:
            return item
        return dataclasses.replace(
            item, num_spec_tokens=k, spec_token_ids=props, prev_token_id=prev
        )

    def record(self, seq: Sequence, num_accepted: int) -> None:
        """A verified run's outcome: all rejected doubles the wait before the next one."""
        fails = 0 if num_accepted else self._backoff.get(seq.seq_id, (0, 0))[0] + 1
        self._backoff[seq.seq_id] = (fails, min(2**fails, MAX_BACKOFF_STEPS) if fails else 0)


def accept_run(
    bm: BlockSpaceManager, seq: Sequence, item: ScheduledSeq, runner_out: ModelRunnerOutput
) -> int:
    """Record a verified run: KV of the fed token and accepted proposals, then the tokens.

    Every accepted token is appended while the blocks are marked computed (prefix hashes read
    the sequence's tokens); then all but the first go to ``seq.pending_tokens``, which the
    output processor appends one at a time (a stop inside the run drops the rest). Returns how
    many proposals were accepted.
    """
    first = runner_out.sampled[seq.seq_id]
    rest: list[SampledToken] = runner_out.spec_tokens.get(seq.seq_id, [])
    seq.append_token(first.token_id, first.logprob, first.top_logprobs)
    num_out, num_lps, cumulative = (
        seq.get_output_len(),
        len(seq.output_logprobs),
        seq.cumulative_logprob,
    )
    for t in rest:
        seq.append_token(t.token_id, t.logprob, t.top_logprobs)
    seq.update_num_computed_tokens(len(item.token_ids) + len(rest))
    bm.mark_computed(seq)
    bm.reclaim_out_of_window(seq)
    bm.trim(seq)
    if rest:
        del seq.output_token_ids[num_out:]
        del seq.output_logprobs[num_lps:]
        seq.cumulative_logprob = cumulative
        seq.pending_tokens = [(t.token_id, t.logprob, t.top_logprobs) for t in rest]
    return len(rest)  # accepted proposals

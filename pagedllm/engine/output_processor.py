"""After each step: detokenize, apply stop conditions, fork sequences, build RequestOutputs."""

from __future__ import annotations

from typing import Any

from pagedllm.core.beam_search import BlockTableOwner, beam_step, best_hypotheses
from pagedllm.core.sampling_params import SamplingParams
from pagedllm.core.sequence import Sequence, SequenceGroup, SequenceStatus
from pagedllm.engine.detokenizer import Detokenizer, find_stop_string, stream_holdback
from pagedllm.outputs import CompletionOutput, RequestMetricsView, RequestOutput


class OutputProcessor:
    def __init__(
        self,
        *,
        tokenizer: Any,
        eos_token_ids: frozenset[int] | set[int],
        max_model_len: int,
        tables: BlockTableOwner,
    ) -> None:
        self.detokenizer = Detokenizer(tokenizer) if tokenizer is not None else None
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len
        self.tables = tables  # the scheduler: beams fork and free through it

    # -- per step --------------------------------------------------------------------------
    def process(self, group: SequenceGroup) -> int:
        """Handle the tokens a group just received; returns how many accepted speculative
        tokens a stop dropped (the engine counted them as generated)."""
        params = group.sampling_params
        if params.use_beam_search:
            self._beam_step(group)
            return 0
        dropped = 0
        for seq in group.get_seqs(SequenceStatus.RUNNING):
            self._process_token(seq, params)
            # Speculative decoding: the rest of an accepted run, one token at a time, exactly
            # as if decoded one per step; a stop inside the run drops what follows it.
            while seq.pending_tokens and not seq.is_finished():
                seq.append_token(*seq.pending_tokens.pop(0))
                self._process_token(seq, params)
            dropped += len(seq.pending_tokens)
            seq.pending_tokens = []
        return dropped

    def _process_token(self, seq: Sequence, params: SamplingParams) -> None:
        new_chars = 0
        if self.detokenizer is not None:
            new_chars = len(self.detokenizer.decode_new(seq, params))
        self.check_stop(seq, params, new_chars)

    def _beam_step(self, group: SequenceGroup) -> None:
        beam_step(
            group,
            tables=self.tables,
            eos_token_ids=self.eos_token_ids,
            max_model_len=self.max_model_len,
        )
        if group.is_finished() and self.detokenizer is not None:
            skip = group.sampling_params.skip_special_tokens
            for seq in best_hypotheses(group):
                seq.output_text = self.detokenizer.tokenizer.decode(
                    seq.output_token_ids, skip_special_tokens=skip
                )

    def check_stop(self, seq: Sequence, params: SamplingParams, new_chars: int) -> None:
        out_len = seq.get_output_len()
        token = seq.get_last_token_id()
        if out_len >= params.min_tokens:
            if not params.ignore_eos and token in self.eos_token_ids:
                seq.status = SequenceStatus.FINISHED_STOPPED
                return
            if token in params.stop_token_ids:
                if new_chars and not params.include_stop_str_in_output:
                    seq.output_text = seq.output_text[:-new_chars]
                seq.status = SequenceStatus.FINISHED_STOPPED
                seq.stop_reason = token
                return
            match = find_stop_string(seq.output_text, new_chars, params)
            if match is not None:
                seq.stop_reason, cut = match
                seq.output_text = seq.output_text[:cut]
                seq.status = SequenceStatus.FINISHED_STOPPED
                return
        if (
            params.max_tokens is not None and out_len >= params.max_tokens
        ) or seq.get_len() >= self.max_model_len:
            seq.status = SequenceStatus.FINISHED_LENGTH_CAPPED

    # -- building outputs ------------------------------------------------------------------
    def make_output(
        self, group: SequenceGroup, *, error: str | None = None, failed: bool = False
    ) -> RequestOutput:
        params = group.sampling_params
        finished = group.is_finished()
        seqs = self._reported_seqs(group, finished)
        holdback = stream_holdback(params) if params.stop else 0
        want_logprobs = params.logprobs is not None
        outputs = []
        for index, seq in enumerate(seqs):
            text = seq.output_text
            if holdback and not seq.is_finished():
                text = text[: max(0, len(text) - holdback)]
            outputs.append(
                CompletionOutput(
                    index,
                    text,
                    list(seq.output_token_ids),
                    seq.cumulative_logprob,
                    list(seq.output_logprobs) if want_logprobs else None,
                    seq.status.finish_reason(),
                    seq.stop_reason,
                )
            )
        m = group.metrics
        return RequestOutput(
            request_id=group.request_id,
            prompt=group.prompt,
            prompt_token_ids=group.prompt_token_ids,
            outputs=outputs,
            finished=finished,
            prompt_logprobs=group.prompt_logprobs,
            metrics=RequestMetricsView(
                m.arrival_time,
                m.first_scheduled_time,
                m.first_token_time,
                m.finished_time,
                group.num_preemptions,
            ),
            error=error,
            failed=failed,
            pooled=group.pooled,
        )

    @staticmethod
    def _reported_seqs(group: SequenceGroup, finished: bool) -> list[Sequence]:
        """All sequences while running; the ``n`` best by cumulative logprob once finished."""
        params = group.sampling_params
        if params.use_beam_search:
            return best_hypotheses(group) if finished else group.get_unfinished_seqs()
        seqs = group.seqs
        if not finished or (params.best_of or 1) <= params.n:
            return seqs[: max(params.n, 1)] if finished else seqs
        return sorted(seqs, key=lambda s: s.cumulative_logprob, reverse=True)[: params.n]

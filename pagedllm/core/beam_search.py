"""Beam search over forked sequences that share KV blocks copy-on-write (the vLLM paper's way).

One call per step for a beam group: every running beam brought its top ``2 * beam_width``
(token, logprob) candidates; the best continuations across all beams become the next beams
(a beam picked twice is forked, a beam not picked is freed), and continuations that end (EOS or
the length limit) become finished hypotheses scored ``sum_logprob / length ** length_penalty``.
The stopping rules follow Hugging Face transformers' ``generate(num_beams=...)``, including its
``early_stopping`` heuristics, so results agree token for token.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from pagedllm.core.sequence import Sequence, SequenceGroup, SequenceStatus


class BlockTableOwner(Protocol):
    """Who holds the block tables (the scheduler): beams fork and free through it."""

    def next_seq_id(self) -> int: ...

    def fork(
        self, group: SequenceGroup, parent: Sequence, *, index: int | None = None
    ) -> Sequence: ...

    def free(self, group: SequenceGroup, seq: Sequence) -> None: ...


@dataclass
class BeamSearchState:
    finished: list[tuple[float, Sequence]] = field(default_factory=list)  # best first
    improvement_possible: bool = True


@dataclass
class _Candidate:
    total: float
    beam_pos: int
    token: int
    logprob: float
    parent: Sequence


def beam_step(
    group: SequenceGroup,
    *,
    tables: BlockTableOwner,
    eos_token_ids: frozenset[int] | set[int],
    max_model_len: int,
) -> None:
    params = group.sampling_params
    width = params.best_of or 1
    state: BeamSearchState = group.beam_state or BeamSearchState()
    group.beam_state = state
    beams = group.get_seqs(SequenceStatus.RUNNING)
    cands: list[_Candidate] = []
    for pos, beam in enumerate(beams):
        for token, lp in group.beam_candidates.get(beam.seq_id, []):
            cands.append(_Candidate(beam.cumulative_logprob + lp, pos, token, lp, beam))
    group.beam_candidates = {}
    # Ties break as a flat top-k over [beam, vocab] would: lower beam, then lower token id.
    cands.sort(key=lambda c: (-c.total, c.beam_pos, c.token))
    cands = cands[: 2 * width]
    gen_len = beams[0].get_output_len() + 1
    max_new = params.max_tokens or max_model_len

    def ends(c: _Candidate) -> bool:
        eos = c.token in eos_token_ids and not params.ignore_eos
        return eos or gen_len >= max_new or c.parent.get_prompt_len() + gen_len >= max_model_len

    accepting = state.improvement_possible and not (
        len(state.finished) >= width and params.early_stopping is True
    )
    selected: list[_Candidate] = []
    new_finished: list[tuple[float, _Candidate]] = []
    for rank, c in enumerate(cands):
        if ends(c):
            if rank < width and accepting:
                new_finished.append((c.total / (gen_len**params.length_penalty), c))
        elif len(selected) < width:
            selected.append(c)
    for score, c in new_finished:
        hyp = c.parent.fork(tables.next_seq_id())  # a finished hypothesis holds no blocks
        hyp.append_token(c.token, c.logprob, None)
        hyp.status = (
            SequenceStatus.FINISHED_STOPPED
            if c.token in eos_token_ids and not params.ignore_eos
            else SequenceStatus.FINISHED_LENGTH_CAPPED
        )
        state.finished.append((score, hyp))
    state.finished.sort(key=lambda x: -x[0])
    del state.finished[width:]
    _advance_beams(group, beams, selected, tables)
    _update_stopping(group, state, selected, gen_len, max_new, width)


def _advance_beams(
    group: SequenceGroup,
    beams: list[Sequence],
    selected: list[_Candidate],
    tables: BlockTableOwner,
) -> None:
    if not selected:
        return  # the search ends; the beams are finished (and freed) as they are
    by_parent: dict[int, list[_Candidate]] = {}
    for c in selected:
        by_parent.setdefault(c.parent.seq_id, []).append(c)
    for beam in beams:
        picks = by_parent.get(beam.seq_id)
        if not picks:
            beam.status = SequenceStatus.FINISHED_ABORTED
            tables.free(group, beam)
            continue
        # Fork before the parent takes its own token, so every child shares its blocks.
        for c in picks[1:]:
            child = tables.fork(group, beam)
            child.append_token(c.token, c.logprob, None)
        beam.append_token(picks[0].token, picks[0].logprob, None)


def _update_stopping(
    group: SequenceGroup,
    state: BeamSearchState,
    selected: list[_Candidate],
    gen_len: int,
    max_new: int,
    width: int,
) -> None:
    params = group.sampling_params
    if selected and len(state.finished) >= width:
        lp = params.length_penalty
        best_len = max_new if (params.early_stopping == "never" and lp > 0) else gen_len
        best_running = max(c.total for c in selected) / (best_len**lp)
        worst_finished = min(score for score, _ in state.finished)
        state.improvement_possible = state.improvement_possible and best_running > worst_finished
    done = (
        not selected
        or not state.improvement_possible
        or (len(state.finished) >= width and params.early_stopping is True)
    )
    if done:
        for beam in group.get_seqs(SequenceStatus.RUNNING):
            beam.status = SequenceStatus.FINISHED_STOPPED


def best_hypotheses(group: SequenceGroup) -> list[Sequence]:
    state: BeamSearchState | None = group.beam_state
    if state is None:
        return []
    return [seq for _, seq in state.finished[: group.sampling_params.n]]

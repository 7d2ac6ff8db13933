"""Per-sequence grammar matchers: the step's bitmask before the forward, advancing after it.

The engine owns one ``GuidedManager``. Matchers are keyed by sequence id and live as long as the
sequence, independent of where its KV cache is: preemption by recompute or swap leaves them
untouched, so generation resumes in the same grammar state. Each matcher remembers how many
output tokens it has consumed; ``advance`` feeds it whatever the sequence gained since, which
also covers forked samples (``n``/``best_of``): a new sequence gets a fresh copy of the start
state and replays its own tokens.
"""

from __future__ import annotations

import dataclasses
import logging
from concurrent.futures import Future
from typing import Any

import torch

from pagedllm.core.guided_params import GuidedDecodingParams
from pagedllm.core.interfaces import SchedulerOutput
from pagedllm.core.sequence import SequenceGroup, SequenceStatus
from pagedllm.structured.compiler import CompiledGrammar, GrammarCompiler

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class _SeqMatcher:
    matcher: Any
    consumed: int = 0


class GuidedManager:
    def __init__(self, compiler: GrammarCompiler) -> None:
        self.compiler = compiler
        self._grammars: dict[str, CompiledGrammar] = {}  # request_id -> compiled constraint
        self._matchers: dict[int, _SeqMatcher] = {}  # seq_id -> its matcher
        self._seq_ids: dict[str, set[int]] = {}  # request_id -> seq ids with a matcher
        self.words = (compiler.vocab_size + 31) // 32

    def submit(self, guided: GuidedDecodingParams) -> Future[CompiledGrammar]:
        return self.compiler.submit(guided)

    def attach(self, group: SequenceGroup, grammar: CompiledGrammar) -> None:
        """The request's constraint is compiled: its sequences may be scheduled."""
        self._grammars[group.request_id] = grammar
        self._seq_ids[group.request_id] = set()
        for seq in group.seqs:
            self._matcher(group.request_id, seq.seq_id)

    def _matcher(self, request_id: str, seq_id: int) -> _SeqMatcher:
        m = self._matchers.get(seq_id)
        if m is None:
            m = _SeqMatcher(self._grammars[request_id].new_matcher())
            self._matchers[seq_id] = m
            self._seq_ids[request_id].add(seq_id)
        return m

    # -- before the forward pass -----------------------------------------------------------
    def with_bitmask(self, sched_out: SchedulerOutput) -> SchedulerOutput:
        """The step with one bitmask row for every guided sequence it samples."""
        rows: dict[int, int] = {}
        pairs: list[tuple[Any, int]] = []
        for s in sched_out.seqs:
            if not s.do_sample or s.request_id not in self._grammars:
                continue
            rows[s.seq_id] = len(pairs)
            pairs.append((self._matcher(s.request_id, s.seq_id).matcher, len(pairs)))
        if not pairs:
            return sched_out
        bitmask = torch.full((len(pairs), self.words), -1, dtype=torch.int32)  # [rows, words]
        # Filled row by row on this thread (about 30 us a row): llguidance's parallel executor
        # was 20-30x slower here, its threads fighting torch's spinning intra-op threads for the
        # cores. llguidance.torch is not imported: it sets up torch.compile (seconds) on import.
        nbytes = self.words * 4
        base = bitmask.data_ptr()
        for matcher, row in pairs:
            matcher.unsafe_compute_mask_ptr(base + row * nbytes, nbytes)
        return dataclasses.replace(sched_out, token_bitmask=bitmask, bitmask_rows=rows)

    # -- after the step --------------------------------------------------------------------
    def advance(self, group: SequenceGroup) -> None:
        """Feed each sequence's new tokens to its matcher; end sequences the grammar completed.

        Call after the output processor: a sequence still running whose grammar admits nothing
        but the end of text stops here, with finish_reason "stop".
        """
        if group.request_id not in self._grammars:
            return
        for seq in group.seqs:
            m = self._matcher(group.request_id, seq.seq_id)
            new = seq.output_token_ids[m.consumed :]
            m.consumed = len(seq.output_token_ids)
            for token in new:
                if m.matcher.is_stopped():
                    break  # an EOS after the accept state; nothing more to check
                if not m.matcher.consume_token(token):
                    logger.warning(
                        "request %s: token %d rejected by its grammar (%s)",
                        group.request_id,
                        token,
                        m.matcher.get_error(),
                    )
                    break
            if seq.status == SequenceStatus.RUNNING and (
                m.matcher.is_stopped() or m.matcher.is_error()
            ):
                seq.status = SequenceStatus.FINISHED_STOPPED

    def release(self, request_id: str) -> None:
        self._grammars.pop(request_id, None)
        for seq_id in self._seq_ids.pop(request_id, ()):
            self._matchers.pop(seq_id, None)

    def shutdown(self) -> None:
        self.compiler.shutdown()

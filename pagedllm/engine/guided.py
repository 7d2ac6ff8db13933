"""The engine's side of structured output: requests wait for their grammar, then get matchers.

A guided request whose constraint is still compiling is held here, not in the scheduler, so it is
never scheduled while the others keep stepping; when its compilation finishes it moves to the
scheduler (or ends with the compiler's error). The grammar library is imported only when the first
guided request arrives, so an engine that never sees one does not need it.
"""

from __future__ import annotations

import concurrent.futures
import threading
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

from pagedllm.core.guided_params import GuidedDecodingParams
from pagedllm.core.interfaces import SchedulerOutput
from pagedllm.core.sequence import SequenceGroup, SequenceStatus

if TYPE_CHECKING:
    from pagedllm.structured.manager import GuidedManager


class GuidedRequests:
    def __init__(self, tokenizer: Any, *, vocab_size: int, eos_token_ids: set[int]) -> None:
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._eos = set(eos_token_ids)
        self._manager: GuidedManager | None = None
        self._lock = threading.Lock()  # the manager is made on first use, from any thread
        self._waiting: dict[str, tuple[SequenceGroup, Future[Any]]] = {}

    @property
    def manager(self) -> GuidedManager:
        with self._lock:
            if self._manager is None:
                from pagedllm.structured.compiler import GrammarCompiler
                from pagedllm.structured.manager import GuidedManager

                compiler = GrammarCompiler(
                    self._tokenizer, vocab_size=self._vocab_size, eos_token_ids=self._eos
                )
                self._manager = GuidedManager(compiler)
            return self._manager

    def submit(self, guided: GuidedDecodingParams) -> Future[Any]:
        """Start (or find) the compilation of a constraint: lets a caller check it early."""
        if self._tokenizer is None:
            raise ValueError("guided_decoding: needs a tokenizer (skip_tokenizer_init is set)")
        return self.manager.submit(guided)

    def admit(self, group: SequenceGroup) -> bool:
        """True if the group may be scheduled now; False if it waits for its grammar.

        A constraint already known to be invalid raises its ValueError (naming the field).
        """
        guided = group.sampling_params.guided_decoding
        if guided is None:
            return True
        fut = self.submit(guided)
        if fut.done():
            self.manager.attach(group, fut.result())
            return True
        self._waiting[group.request_id] = (group, fut)
        return False

    def ready(self) -> list[tuple[SequenceGroup, str | None]]:
        """Waiting groups whose compilation finished, each with its error (None if it compiled)."""
        done: list[tuple[SequenceGroup, str | None]] = []
        for rid, (group, fut) in list(self._waiting.items()):
            if not fut.done():
                continue
            del self._waiting[rid]
            try:
                self.manager.attach(group, fut.result())
                done.append((group, None))
            except Exception as exc:  # the compiler's ValueError, or a library failure
                for seq in group.seqs:
                    seq.status = SequenceStatus.FINISHED_ABORTED
                done.append((group, str(exc)))
        return done

    def wait(self, timeout: float) -> None:
        """Block until one waiting compilation finishes (or the timeout): an idle engine's nap."""
        futs = [fut for _, fut in self._waiting.values()]
        if futs:
            concurrent.futures.wait(futs, timeout, return_when=concurrent.futures.FIRST_COMPLETED)

    def abort(self, request_ids: list[str]) -> list[SequenceGroup]:
        groups = []
        for rid in request_ids:
            entry = self._waiting.pop(rid, None)
            if entry is not None:
                for seq in entry[0].seqs:
                    seq.status = SequenceStatus.FINISHED_ABORTED
                groups.append(entry[0])
        return groups

    def num_waiting(self) -> int:
        return len(self._waiting)

    def with_bitmask(self, sched_out: SchedulerOutput) -> SchedulerOutput:
        if self._manager is None:
            return sched_out
        return self._manager.with_bitmask(sched_out)

    def advance(self, group: SequenceGroup) -> None:
        if self._manager is not None and group.sampling_params.guided_decoding is not None:
            self._manager.advance(group)

    def release(self, request_id: str) -> None:
        if self._manager is not None:
            self._manager.release(request_id)

    def shutdown(self) -> None:
        if self._manager is not None:
            self._manager.shutdown()

"""When a batched step fails: find the request(s) that make it fail and run the others without.

A step is one forward pass over every scheduled request, so one poisoned row (a value a kernel
cannot take) fails everyone batched with it. Instead of failing them all, the step is retried on
halves of its requests (a bisection): a half that runs is innocent, a failing half is split again
until single requests remain. The culprits are then ended with an error and the step is run once
more without them, so the others get exactly the token they would have had.

Retrying is safe because nothing is committed before the scheduler's ``update_from_output``: a
failed attempt may have written KV for some rows, and the retry writes the same values to the
same slots; swap and copy-on-write pairs copy the same blocks again. The probes sample too, but
only the final run's tokens are kept (unseeded sampling draws fresh noise, as any step would).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable

from pagedllm.core.interfaces import ModelRunnerOutput, SchedulerOutput

logger = logging.getLogger(__name__)

Execute = Callable[[SchedulerOutput], ModelRunnerOutput]


class EngineBrokenError(RuntimeError):
    """A step fails whichever requests it runs: the engine itself is broken, not a request."""


def without(sched_out: SchedulerOutput, request_ids: set[str]) -> SchedulerOutput:
    """The same step with ``request_ids``' rows left out (block swaps and copies kept)."""
    seqs = [s for s in sched_out.seqs if s.request_id not in request_ids]
    return dataclasses.replace(
        sched_out,
        seqs=seqs,
        num_prefill_seqs=sum(1 for s in seqs if s.is_prompt),
        num_batched_tokens=sum(len(s.token_ids) for s in seqs),
    )


def only(sched_out: SchedulerOutput, request_ids: list[str]) -> SchedulerOutput:
    keep = set(request_ids)
    return without(sched_out, {s.request_id for s in sched_out.seqs} - keep)


def find_culprits(
    execute: Execute, sched_out: SchedulerOutput, request_ids: list[str]
) -> list[str]:
    """The requests that fail alone, given that ``request_ids`` together failed."""
    if len(request_ids) == 1:
        return list(request_ids)
    half = len(request_ids) // 2
    culprits: list[str] = []
    for part in (request_ids[:half], request_ids[half:]):
        try:
            execute(only(sched_out, part))
        except Exception:
            culprits += find_culprits(execute, sched_out, part)
    return culprits


def execute_contained(
    execute: Execute, sched_out: SchedulerOutput, first_error: Exception
) -> tuple[ModelRunnerOutput, dict[str, str]]:
    """After ``execute(sched_out)`` raised ``first_error``: the output without the culprits.

    Returns the runner output of the step without them and ``{request_id: error message}``.
    Raises :class:`EngineBrokenError` when every one of several requests fails on its own, or
    when no culprit can be found and the step still fails (then the engine is at fault).
    """
    ids = list(dict.fromkeys(s.request_id for s in sched_out.seqs))
    culprits = find_culprits(execute, sched_out, ids)
    if len(ids) > 1 and len(culprits) == len(ids):
        raise EngineBrokenError(f"every request fails on its own: {first_error}") from first_error
    message = f"this request made the engine step fail: {type(first_error).__name__}: {first_error}"
    logger.error("step failed; ending %s, serving the other %d", culprits, len(ids) - len(culprits))
    rest = without(sched_out, set(culprits))
    if not rest.seqs and rest.is_empty:
        return ModelRunnerOutput(sampled={}), dict.fromkeys(culprits, message)
    try:
        out = execute(rest)
    except Exception as exc:
        raise EngineBrokenError(f"the step fails without its culprits too: {exc}") from exc
    return out, dict.fromkeys(culprits, message)

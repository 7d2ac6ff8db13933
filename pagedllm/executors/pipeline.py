"""Pipeline parallelism's plumbing: which rank is which stage, and the activations between stages.

Ranks are laid out stage-major: global rank ``r`` is stage ``r // tp_size`` and tensor-parallel
rank ``r % tp_size``, so each stage's tensor-parallel group is a contiguous run of ranks (on one
machine under the multiprocess executor, usually one node's bundles under Ray's PACK strategy).
Stage ``s``'s TP rank ``t`` sends to stage ``s + 1``'s TP rank ``t``: after a stage's last
row-parallel all-reduce every TP rank holds the whole hidden state, so each pair carries a full
copy and no gather is needed on the receiving side.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from pagedllm.layers.parallel import PPContext


@dataclass(frozen=True)
class RankLayout:
    """Where global rank ``rank`` sits in a TP x PP world."""

    rank: int
    tp_size: int
    pp_size: int

    @property
    def stage(self) -> int:
        return self.rank // self.tp_size

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tp_size

    @property
    def world_size(self) -> int:
        return self.tp_size * self.pp_size

    def tp_group_ranks(self, stage: int) -> list[int]:
        return list(range(stage * self.tp_size, (stage + 1) * self.tp_size))

    def pp_context(self) -> PPContext:
        stage, tp = self.stage, self.tp_size
        return PPContext(
            stage=stage,
            size=self.pp_size,
            prev_rank=self.rank - tp if stage > 0 else None,
            next_rank=self.rank + tp if stage < self.pp_size - 1 else None,
        )


def output_rank(tp_size: int, pp_size: int) -> int:
    """The rank that answers for a step: TP rank 0 of the last stage (the one that samples)."""
    return (pp_size - 1) * tp_size


def rank_label(rank: int, tp_size: int, pp_size: int) -> str:
    """How errors name a rank: ``rank 3`` alone without stages, else with its stage and TP rank."""
    if pp_size == 1:
        return f"rank {rank}"
    where = RankLayout(rank, tp_size, pp_size)
    return f"rank {rank} (pipeline stage {where.stage}, tensor-parallel rank {where.tp_rank})"


class StageLink:
    """One worker's ends of the pipeline: activations in from the stage before, out to the next.

    What crosses is the decoder's ``(hidden, residual)`` stacked into one ``[2, num_tokens,
    hidden]`` tensor in the model dtype: the receiver knows the shape from the step it runs (every
    stage gets the same ``SchedulerOutput``), so no header travels. Sends are asynchronous, so a
    stage starts the next micro-batch while the last one's activations are on the wire; a send
    is waited for before the next one (its buffer must live until then).
    """

    def __init__(
        self, pp: PPContext, *, hidden_size: int, dtype: torch.dtype, device: torch.device
    ) -> None:
        self.pp = pp
        self.hidden_size = hidden_size
        self.dtype = dtype
        self.device = device
        self._pending: list[tuple[Any, torch.Tensor]] = []

    def recv(self, num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        import torch.distributed as dist

        assert self.pp.prev_rank is not None
        buf = torch.empty((2, num_tokens, self.hidden_size), dtype=self.dtype, device=self.device)
        dist.recv(buf, src=self.pp.prev_rank)
        return buf[0], buf[1]

    def send(self, intermediate: tuple[torch.Tensor, torch.Tensor]) -> None:
        import torch.distributed as dist

        assert self.pp.next_rank is not None
        self.wait_sent()
        buf = torch.stack(intermediate)  # [2, num_tokens, hidden]
        self._pending.append((dist.isend(buf, dst=self.pp.next_rank), buf))

    def wait_sent(self) -> None:
        for work, _ in self._pending:
            work.wait()
        self._pending.clear()

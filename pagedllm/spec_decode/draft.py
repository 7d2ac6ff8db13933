"""The draft-model proposer: a smaller model of the target's vocabulary proposes ``k`` tokens.

Its paged KV cache has as many blocks as the target's and is indexed by the same block tables
(one block manager, two cache tensors; copies and swaps apply to both). Every step it computes
every token the target computes, so its cache never falls behind; a decode also re-reads the
token before its own, whose draft KV is missing when the last run was accepted whole (the last
proposal is scored by the target but never fed to the draft). Proposals are the draft's argmax:
a point mass, which the verifier's acceptance rule needs (see ``verify``).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from pagedllm.backends.base import CacheEngine
from pagedllm.core.interfaces import ScheduledSeq, SchedulerOutput
from pagedllm.executors.inputs import flatten
from pagedllm.executors.model_runner import ModelRunner


def check_draft_config(draft_hf_config: Any, target_hf_config: Any) -> None:
    """A draft must share the target's vocabulary: its token ids are the target's."""
    draft_vocab = getattr(draft_hf_config, "vocab_size", None)
    target_vocab = getattr(target_hf_config, "vocab_size", None)
    if draft_vocab != target_vocab:
        raise ValueError(
            f"speculative_config.model: the draft's vocabulary ({draft_vocab} tokens) differs "
            f"from the target's ({target_vocab}); a draft must use the same tokenizer"
        )


class DraftProposer:
    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        self.cache: CacheEngine | None = None

    @torch.inference_mode()
    def propose(self, sched_out: SchedulerOutput) -> dict[int, list[int]]:
        """seq_id -> proposals for every decode with lookahead slots and no proposals yet."""
        assert self.cache is not None, "the draft's KV cache is not initialised"
        kv = self.cache.kv_caches
        n = sched_out.num_prefill_seqs
        items = [_catch_up(s) for s in sched_out.seqs]
        if not items:
            return {}
        # Pass 1: every scheduled token (prompt chunks as they are, decodes with the token
        # before), all as multi-token segments over cached context.
        batch = flatten(SchedulerOutput(seqs=items, num_prefill_seqs=len(items)), self.block_size)
        hidden = self.runner.forward(batch, len(items), kv)  # [num_tokens, hidden]
        spec = [
            (i, s)
            for i, s in enumerate(items)
            if i >= n and s.num_spec_tokens and s.spec_token_ids is None
        ]
        if not spec:
            return {}
        ends, total = [], 0
        for q in batch.query_lens:
            total += q
            ends.append(total - 1)
        last = torch.tensor([ends[i] for i, _ in spec], dtype=torch.long, device=hidden.device)
        firsts = self._greedy(hidden[last])
        proposals = {s.seq_id: [t] for (_, s), t in zip(spec, firsts, strict=True)}
        # Passes 2 .. k: one token each, for the sequences still short of their k (positions
        # counted from the scheduled item, not from pass 1's shifted start).
        fed = [sched_out.seqs[i] for i, _ in spec]
        for j in range(1, max(s.num_spec_tokens for s in fed)):
            active = [
                dataclasses.replace(
                    s,
                    token_ids=[proposals[s.seq_id][-1]],
                    start_pos=s.start_pos + j,
                    do_sample=True,
                )
                for s in fed
                if s.num_spec_tokens > j
            ]
            batch = flatten(SchedulerOutput(seqs=active, num_prefill_seqs=0), self.block_size)
            hidden = self.runner.forward(batch, 0, kv)
            for s, t in zip(active, self._greedy(hidden), strict=True):
                proposals[s.seq_id].append(t)
        return proposals

    @property
    def block_size(self) -> int:
        return self.runner.block_size

    def _greedy(self, hidden: torch.Tensor) -> list[int]:  # hidden: [rows, hidden]
        return self.runner.model.compute_logits(hidden).argmax(dim=-1).tolist()


def _catch_up(s: ScheduledSeq) -> ScheduledSeq:
    """The draft's share of pass 1: a decode re-reads the token before its own."""
    if s.is_prompt or s.prev_token_id is None:
        return dataclasses.replace(s, next_token_ids=None)
    return dataclasses.replace(
        s,
        token_ids=[s.prev_token_id, *s.token_ids],
        start_pos=s.start_pos - 1,
        next_token_ids=None,
    )

"""Batched sampling: every row of the step at once, no loop over the vocabulary.

Order of operations (as in vLLM and Hugging Face): penalties and logit bias on the raw logits,
then the min-tokens EOS mask, then greedy argmax or temperature, top-k, top-p, min-p and a draw.
Reported log-probabilities are those of the raw model distribution.

Draws use the exponential race (``argmax(p / E)`` with ``E ~ Exp(1)``), which samples exactly from
``p``. A seeded request draws its noise from a generator keyed by (seed, output position), so its
tokens do not depend on which other requests share the batch, nor on preemption.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedllm.core.sampling_params import SamplingParams
from pagedllm.structured.bitmask import apply_token_bitmask

_SEED_MASK = (1 << 63) - 1


@dataclass
class SamplingRow:
    """One row of logits and what to do with it."""

    seq_id: int
    params: SamplingParams
    output_len: int
    history: tuple[list[int], list[int]] | None = None
    sample_index: int = 0


@dataclass
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[float]
    top_logprobs: list[dict[int, float] | None]
    candidates: list[list[tuple[int, float]] | None]


def apply_penalties(logits: torch.Tensor, rows: list[SamplingRow]) -> None:
    """Repetition (HF: over prompt and output), frequency and presence (OpenAI: output only)."""
    vocab = logits.shape[1]
    for i, row in enumerate(rows):
        p = row.params
        if row.history is None:
            continue
        prompt, output = row.history
        if p.repetition_penalty != 1.0:
            seen = torch.tensor(prompt + output, dtype=torch.long, device=logits.device)
            seen = seen[seen < vocab]
            vals = logits[i, seen]
            vals = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
            logits[i, seen] = vals
        if (p.frequency_penalty or p.presence_penalty) and output:
            out = torch.tensor(output, dtype=torch.long, device=logits.device)
            out = out[out < vocab]
            counts = torch.zeros(vocab, dtype=logits.dtype, device=logits.device)
            counts.scatter_add_(0, out, torch.ones_like(out, dtype=logits.dtype))
            logits[i] -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0)


def apply_bias_and_min_tokens(
    logits: torch.Tensor, rows: list[SamplingRow], eos_token_id: int | None
) -> None:
    vocab = logits.shape[1]
    for i, row in enumerate(rows):
        p = row.params
        if p.logit_bias:
            ids = [t for t in p.logit_bias if 0 <= t < vocab]
            if ids:
                logits[i, ids] += torch.tensor(
                    [p.logit_bias[t] for t in ids], dtype=logits.dtype, device=logits.device
                )
        if row.output_len < p.min_tokens:
            banned = list(p.stop_token_ids)
            if eos_token_id is not None and not p.ignore_eos:
                banned.append(eos_token_id)
            banned = [t for t in banned if 0 <= t < vocab]
            if banned:
                logits[i, banned] = float("-inf")


def filter_logits(
    logits: torch.Tensor,  # [n, vocab], already divided by temperature
    top_k: torch.Tensor,  # [n] int64, vocab means off
    top_p: torch.Tensor,  # [n] float
    min_p: torch.Tensor,  # [n] float
) -> torch.Tensor:
    """Mask everything outside each row's top-k, nucleus (top-p) and min-p sets."""
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    ranks = torch.arange(logits.shape[1], device=logits.device)[None, :]
    mask = ranks >= top_k[:, None]
    probs = sorted_logits.masked_fill(mask, float("-inf")).softmax(dim=-1)
    before = probs.cumsum(dim=-1) - probs  # mass strictly above each token
    mask |= before > top_p[:, None]
    mask |= probs < (min_p[:, None] * probs[:, :1])
    mask[:, 0] = False  # always keep the most likely token
    sorted_logits = sorted_logits.masked_fill(mask, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)


class Sampler:
    def __init__(self, *, seed: int = 0, device: torch.device | None = None) -> None:
        self.generator = torch.Generator(device=device or "cpu").manual_seed(seed)

    def __call__(
        self,
        logits: torch.Tensor,  # [n, vocab] raw model logits
        rows: list[SamplingRow],
        *,
        eos_token_id: int | None = None,
        token_bitmask: torch.Tensor | None = None,  # [guided rows, words] int32
        bitmask_rows: dict[int, int] | None = None,  # seq_id -> its bitmask row
    ) -> SamplerOutput:
        logits = logits.float()
        raw_logprobs = torch.log_softmax(logits, dim=-1)
        if any(r.history is not None for r in rows):
            apply_penalties(logits, rows)
        apply_bias_and_min_tokens(logits, rows, eos_token_id)
        if token_bitmask is not None and bitmask_rows:
            # Structured output: after penalties, before temperature and the top-k/p filters.
            row_of = [bitmask_rows.get(r.seq_id, -1) for r in rows]
            apply_token_bitmask(logits, token_bitmask, row_of)
        greedy = torch.tensor([r.params.is_greedy for r in rows], device=logits.device)
        tokens = logits.argmax(dim=-1)
        if not bool(greedy.all()):
            sampled = self._sample(logits, rows)
            tokens = torch.where(greedy, tokens, sampled)
        return self._outputs(tokens, raw_logprobs, rows)

    def _sample(self, logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        vocab = logits.shape[1]
        dev = logits.device
        temps = torch.tensor([max(r.params.temperature, 1e-5) for r in rows], device=dev)
        logits = logits / temps[:, None]
        top_k = torch.tensor(
            [r.params.top_k if r.params.top_k > 0 else vocab for r in rows], device=dev
        )
        top_p = torch.tensor([r.params.top_p for r in rows], device=dev)
        min_p = torch.tensor([r.params.min_p for r in rows], device=dev)
        if bool((top_k < vocab).any() or (top_p < 1).any() or (min_p > 0).any()):
            logits = filter_logits(logits, top_k, top_p, min_p)
        probs = logits.softmax(dim=-1)
        noise = torch.empty_like(probs).exponential_(generator=self.generator)
        for i, row in enumerate(rows):
            if row.params.seed is not None and not row.params.is_greedy:
                g = torch.Generator(device=dev).manual_seed(
                    hash((row.params.seed, row.sample_index, row.output_len)) & _SEED_MASK
                )
                noise[i] = torch.empty(vocab, device=dev).exponential_(generator=g)
        return (probs / noise).argmax(dim=-1)

    @staticmethod
    def _outputs(
        tokens: torch.Tensor, raw_logprobs: torch.Tensor, rows: list[SamplingRow]
    ) -> SamplerOutput:
        token_list = tokens.tolist()
        chosen = raw_logprobs.gather(1, tokens[:, None])[:, 0].tolist()
        tops: list[dict[int, float] | None] = []
        cands: list[list[tuple[int, float]] | None] = []
        for i, row in enumerate(rows):
            k = row.params.logprobs
            if k is None:
                tops.append(None)
            else:
                top: dict[int, float] = {token_list[i]: chosen[i]}
                if k > 0:
                    vals, ids = raw_logprobs[i].topk(k)
                    top.update(zip(ids.tolist(), vals.tolist(), strict=True))
                tops.append(top)
            if row.params.use_beam_search:
                width = 2 * (row.params.best_of or 1)
                vals, ids = raw_logprobs[i].topk(width)
                cands.append(list(zip(ids.tolist(), vals.tolist(), strict=True)))
            else:
                cands.append(None)
        return SamplerOutput(token_list, chosen, tops, cands)

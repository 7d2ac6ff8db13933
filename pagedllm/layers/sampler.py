"""Batched sampling: every row of the step at once, no loop over the vocabulary.

Order of operations (as in vLLM and Hugging Face): penalties and logit bias on the raw logits,
then the min-tokens EOS mask, then greedy argmax or temperature, top-k, top-p, min-p and a draw.
Reported log-probabilities are those of the raw model distribution.

Draws are by inverse CDF: one uniform per row, the first token (in vocabulary order) where the
filtered distribution's running mass exceeds it, which samples exactly from that distribution and
needs one random number per row, not one per token. A seeded request draws its uniform from a
generator keyed by (seed, output position), so its tokens do not depend on which other requests
share the batch, nor on preemption. ``draw_reference`` is the definition; a backend may supply a
``SampleKernel`` that computes it in one call (the CPU backend's, ``csrc/sampling.cpp``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

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
    eos_token_ids: frozenset[int] = frozenset()  # banned with stop_token_ids under min_tokens


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


def apply_bias_and_min_tokens(logits: torch.Tensor, rows: list[SamplingRow]) -> None:
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
            if not p.ignore_eos:
                banned.extend(sorted(row.eos_token_ids))
            banned = [t for t in banned if 0 <= t < vocab]
            if banned:
                logits[i, banned] = float("-inf")


def filter_logits(
    logits: torch.Tensor,  # [n, vocab], already divided by temperature
    top_k: torch.Tensor,  # [n] int64, vocab means off
    top_p: torch.Tensor,  # [n] float
    min_p: torch.Tensor,  # [n] float
) -> torch.Tensor:
    """Mask everything outside each row's top-k, nucleus (top-p) and min-p sets.

    Every mask is a threshold, so equal values share their fate: top-k keeps every token at
    least the k-th largest value (transformers' TopKLogitsWarper), top-p keeps a token when the
    probability mass strictly above it is at most ``top_p``, min-p keeps probabilities at least
    ``min_p`` times the largest; top-p and min-p judge the distribution after top-k. The most
    likely token always stays.
    """
    vocab = logits.shape[1]
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    if bool((top_k < vocab).any()):
        kth = sorted_logits.gather(1, (top_k.clamp(1, vocab) - 1)[:, None])
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = logits.softmax(dim=-1)
    keep = torch.ones_like(logits, dtype=torch.bool)
    if bool((top_p < 1).any()):
        sorted_probs = probs.gather(1, order)  # the same values, so thresholds compare exactly
        before = sorted_probs.cumsum(dim=-1) - sorted_probs  # mass above, in sorted order
        last = (before <= top_p[:, None]).sum(dim=-1, keepdim=True) - 1
        keep &= probs >= sorted_probs.gather(1, last.clamp(min=0))
    if bool((min_p > 0).any()):
        keep &= probs >= min_p[:, None] * probs.amax(dim=-1, keepdim=True)
    return logits.masked_fill(~keep, float("-inf"))


def draw_reference(
    logits: torch.Tensor,  # [n, vocab] after penalties, bias and masks
    temperature: torch.Tensor,  # [n] float32, 0: greedy
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor,
    u: torch.Tensor,  # [n] float32 in [0, 1)
) -> torch.Tensor:
    """The tokens, by definition: greedy rows take the first maximum; the others divide by their
    temperature, filter (``filter_logits``) and draw by inverse CDF in vocabulary order with
    their uniform ``u``. A backend's ``SampleKernel`` computes exactly this."""
    logits = logits.float()
    tokens = logits.argmax(dim=-1)
    sampled = temperature > 0
    if bool(sampled.any()):
        vocab = logits.shape[1]
        x = logits / torch.where(sampled, temperature, 1.0)[:, None]
        if bool((top_k < vocab).any() or (top_p < 1).any() or (min_p > 0).any()):
            x = filter_logits(x, top_k, top_p, min_p)
        cdf = x.softmax(dim=-1).cumsum(dim=-1)
        target = u[:, None].to(cdf.dtype) * cdf[:, -1:]
        drawn = torch.searchsorted(cdf, target, right=True)[:, 0].clamp_(max=vocab - 1)
        tokens = torch.where(sampled, drawn, tokens)
    return tokens


def sample_reference(
    logits: torch.Tensor,
    raw: torch.Tensor | None,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor,
    u: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``SampleKernel``'s contract in PyTorch: ``draw_reference``'s tokens, raw logprobs."""
    tokens = draw_reference(logits, temperature, top_k, top_p, min_p, u)
    source = logits if raw is None else raw
    chosen = torch.log_softmax(source.float(), dim=-1).gather(1, tokens[:, None])[:, 0]
    return tokens, chosen


class SampleKernel(Protocol):
    """A backend's one-call sampler: ``(tokens, logprobs)``, tokens as ``draw_reference`` and
    ``logprobs = log_softmax(raw if raw is not None else logits)[token]``."""

    def __call__(
        self,
        logits: torch.Tensor,
        raw: torch.Tensor | None,
        temperature: torch.Tensor,
        top_k: torch.Tensor,
        top_p: torch.Tensor,
        min_p: torch.Tensor,
        u: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]: ...


def plain_greedy_params(
    params: SamplingParams, output_len: int, history: tuple[list[int], list[int]] | None
) -> bool:
    """Whether a row with these parameters takes :meth:`Sampler.greedy` (its first maximum of
    the unmodified logits, nothing reported but that token's log-probability): what
    ``_modifies`` and ``_plain_greedy`` decide for it, without building the row."""
    return (
        params.is_greedy
        and params.logprobs is None
        and not params.use_beam_search
        and history is None
        and not params.logit_bias
        and output_len >= params.min_tokens
    )


def _modifies(row: SamplingRow) -> bool:
    """Whether the row's logits change before the draw (penalties, bias, the min-tokens mask)."""
    p = row.params
    return row.history is not None or bool(p.logit_bias) or row.output_len < p.min_tokens


def _plain_greedy(rows: list[SamplingRow]) -> bool:
    """Whether every row takes its first maximum and reports nothing but that token's
    log-probability (no top log-probabilities, no beams)."""
    for r in rows:
        p = r.params
        if not p.is_greedy or p.logprobs is not None or p.use_beam_search:
            return False
    return True


class Sampler:
    """``kernel`` is the backend's ``SampleKernel`` (none: ``draw_reference`` in PyTorch, which
    sorts rows for top-k/top-p: fine on a GPU, 100+ ms for 64 rows on a CPU)."""

    def __init__(
        self,
        *,
        seed: int = 0,
        device: torch.device | None = None,
        kernel: SampleKernel | None = None,
    ) -> None:
        self.generator = torch.Generator(device=device or "cpu").manual_seed(seed)
        self.kernel = kernel
        # The greedy batch's constant row parameters, for the last (rows, vocabulary) seen.
        self._greedy_params: tuple[tuple[int, int], tuple[torch.Tensor, ...]] | None = None

    def __call__(
        self,
        logits: torch.Tensor,  # [n, vocab] raw model logits
        rows: list[SamplingRow],
        *,
        token_bitmask: torch.Tensor | None = None,  # [guided rows, words] int32
        bitmask_rows: dict[int, int] | None = None,  # seq_id -> its bitmask row
    ) -> SamplerOutput:
        raw = logits
        guided = token_bitmask is not None and bool(bitmask_rows)
        modified = guided or any(_modifies(r) for r in rows)
        if not modified and _plain_greedy(rows):
            return self.greedy(raw)
        work = raw
        if modified or self.kernel is None:
            work = raw.float()
        if modified:
            if work is raw:  # never change the caller's tensor: raw logprobs are read from it
                work = work.clone()
            if any(r.history is not None for r in rows):
                apply_penalties(work, rows)
            apply_bias_and_min_tokens(work, rows)
            if guided:
                # Structured output: after penalties, before temperature and the top-k/p filters.
                assert token_bitmask is not None and bitmask_rows is not None
                row_of = [bitmask_rows.get(r.seq_id, -1) for r in rows]
                apply_token_bitmask(work, token_bitmask, row_of)
        sample = self.kernel or sample_reference
        tokens, chosen = sample(
            work, raw if modified else None, *self._row_params(rows, raw.shape[1])
        )
        return self._outputs(tokens, chosen, raw, rows)

    def greedy(self, logits: torch.Tensor) -> SamplerOutput:
        """The full path's tokens and log-probabilities for a batch of plain greedy rows
        (:func:`plain_greedy_params`), without its per-row work: the kernel on
        row parameters built once per shape, else an argmax and one log_softmax (what
        ``sample_reference`` computes for greedy rows). One row's decode step spent more on
        building those parameters and the outputs' lists than on the kernel."""
        n, vocab = logits.shape
        if self.kernel is not None:
            tokens, chosen = self.kernel(logits, None, *self._greedy_rows(n, vocab))
        else:
            x = logits.float()
            tokens = x.argmax(dim=-1)
            chosen = torch.log_softmax(x, dim=-1).gather(1, tokens[:, None])[:, 0]
        nothing: list[None] = [None] * n
        return SamplerOutput(tokens.tolist(), chosen.tolist(), list(nothing), list(nothing))

    def _greedy_rows(self, n: int, vocab: int) -> tuple[torch.Tensor, ...]:
        """temperature 0, top_k off, top_p 1, min_p 0 and a zero uniform for ``n`` rows (a
        greedy row's draw reads none of them but its temperature)."""
        if self._greedy_params is None or self._greedy_params[0] != (n, vocab):
            dev = self.generator.device
            zeros = torch.zeros(n, dtype=torch.float32, device=dev)
            top_k = torch.full((n,), vocab, dtype=torch.long, device=dev)
            ones = torch.ones(n, dtype=torch.float32, device=dev)
            self._greedy_params = ((n, vocab), (zeros, top_k, ones, zeros.clone(), zeros.clone()))
        return self._greedy_params[1]

    def _row_params(self, rows: list[SamplingRow], vocab: int) -> tuple[torch.Tensor, ...]:
        """temperature (0: greedy), top_k (vocab: off), top_p, min_p and the draw's uniform.

        A seeded row draws its uniform from a generator keyed by (seed, sample, position), so
        its tokens depend neither on the batch nor on preemption.
        """
        dev = self.generator.device
        temps = [0.0 if r.params.is_greedy else r.params.temperature for r in rows]
        top_k = torch.tensor(
            [r.params.top_k if r.params.top_k > 0 else vocab for r in rows],
            dtype=torch.long,
            device=dev,
        )
        top_p = [r.params.top_p for r in rows]
        min_p = [r.params.min_p for r in rows]
        if not any(temps):
            # Nothing is drawn: the float rows and a zero uniform come from one tensor (five
            # small tensors a step were a visible share of a one-sequence decode step).
            floats = torch.tensor(
                [temps, top_p, min_p, [0.0] * len(rows)], dtype=torch.float32, device=dev
            )
            temp_t, top_p_t, min_p_t, u = floats.unbind(0)
            return temp_t, top_k, top_p_t, min_p_t, u
        u = torch.rand(len(rows), generator=self.generator, device=dev)
        for i, row in enumerate(rows):
            if row.params.seed is not None and temps[i]:
                g = torch.Generator(device=dev).manual_seed(
                    hash((row.params.seed, row.sample_index, row.output_len)) & _SEED_MASK
                )
                u[i] = torch.rand(1, generator=g, device=dev)[0]
        return (
            torch.tensor(temps, dtype=torch.float32, device=dev),
            top_k,
            torch.tensor(top_p, dtype=torch.float32, device=dev),
            torch.tensor(min_p, dtype=torch.float32, device=dev),
            u,
        )

    @staticmethod
    def _outputs(
        tokens: torch.Tensor, chosen: torch.Tensor, raw: torch.Tensor, rows: list[SamplingRow]
    ) -> SamplerOutput:
        token_list = tokens.tolist()
        chosen_list = chosen.tolist()
        # Full log-probabilities only for the rows that report top tokens or search beams.
        wanted = [
            i
            for i, r in enumerate(rows)
            if (r.params.logprobs or 0) > 0 or r.params.use_beam_search
        ]
        full: dict[int, torch.Tensor] = {}
        if wanted:
            index = torch.tensor(wanted, device=raw.device)
            lps = torch.log_softmax(raw[index].float(), dim=-1)
            full = {i: lps[j] for j, i in enumerate(wanted)}
        tops: list[dict[int, float] | None] = []
        cands: list[list[tuple[int, float]] | None] = []
        for i, row in enumerate(rows):
            k = row.params.logprobs
            if k is None:
                tops.append(None)
            else:
                top: dict[int, float] = {token_list[i]: chosen_list[i]}
                if k > 0:
                    vals, ids = full[i].topk(k)
                    top.update(zip(ids.tolist(), vals.tolist(), strict=True))
                tops.append(top)
            if row.params.use_beam_search:
                width = 2 * (row.params.best_of or 1)
                vals, ids = full[i].topk(width)
                cands.append(list(zip(ids.tolist(), vals.tolist(), strict=True)))
            else:
                cands.append(None)
        return SamplerOutput(token_list, chosen_list, tops, cands)

"""Runs one scheduler step through the model: inputs -> forward -> logits -> samples."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from pagedllm.backends.base import AttentionBackend
from pagedllm.backends.kv_layout import host_tensor
from pagedllm.core.interfaces import (
    ModelRunnerOutput,
    SampledToken,
    ScheduledSeq,
    SchedulerOutput,
)
from pagedllm.executors.inputs import FlatBatch, flatten
from pagedllm.executors.pipeline import StageLink
from pagedllm.executors.pooling import Pooler
from pagedllm.layers.sampler import SampleKernel, Sampler, SamplingRow, plain_greedy_params
from pagedllm.models.causal_lm import CausalLM


class ModelRunner:
    def __init__(
        self,
        model: nn.Module,
        attention: AttentionBackend,
        *,
        device: torch.device,
        block_size: int,
        seed: int,
        lora: Any = None,
        sample_kernel: SampleKernel | None = None,
        pipeline: StageLink | None = None,
        pooling: str | None = None,
    ) -> None:
        self.model = model
        self.pooler = Pooler(model, pooling)  # pooling requests; ``pooling``: --pooling
        # Pipeline parallelism: this stage's links to its neighbours (None: the whole model).
        self.pipeline = pipeline
        self.lora = lora  # a pagedllm.lora.manager.LoRAManager when LoRA is enabled
        self.attention = attention
        self.device = device
        self.block_size = block_size
        self.sampler = Sampler(seed=seed, device=device, kernel=sample_kernel)

    def execute(
        self, sched_out: SchedulerOutput, kv_caches: list[torch.Tensor]
    ) -> ModelRunnerOutput:
        # A plain decode step goes to the model's one decode call first, outside inference
        # mode (the call takes it itself): entering torch's context manager cost ~20 us of
        # Python a step, run with the caches the kernels had just flushed. The rest of the
        # step runs in inference mode, entered here unless the worker already did.
        if not sched_out.seqs:
            return ModelRunnerOutput(sampled={})
        if self.lora is None and self.pipeline is None and _plain_decode(sched_out):
            decoded = self._decode(sched_out, kv_caches)
            if decoded is not None:
                return decoded
        elif self.lora is not None:  # adapters: slots, the step ordered by slot, the mapping
            sched_out = self.lora.prepare_step(sched_out)
        if torch.is_inference_mode_enabled():
            return self._execute(sched_out, kv_caches)
        with torch.inference_mode():
            return self._execute(sched_out, kv_caches)

    def _execute(
        self, sched_out: SchedulerOutput, kv_caches: list[torch.Tensor]
    ) -> ModelRunnerOutput:
        batch = flatten(sched_out, self.block_size)
        hidden = self.forward(batch, sched_out.num_prefill_seqs, kv_caches)
        if hidden is None:  # a pipeline stage before the last: its activations went on
            return ModelRunnerOutput(sampled={})
        sampled = self._sample(hidden, batch, sched_out)
        prompt_lps = self._prompt_logprobs(hidden, batch, sched_out.seqs)
        pooled = self.pooler.step(hidden, batch, sched_out.seqs)
        return ModelRunnerOutput(sampled=sampled, prompt_logprobs=prompt_lps, pooled=pooled)

    def _decode(
        self, sched_out: SchedulerOutput, kv_caches: list[torch.Tensor]
    ) -> ModelRunnerOutput | None:
        """A decode-only step whose every sequence samples one row (:func:`_plain_decode`),
        from the scheduler's lists to logits in one backend call (``model.decode_logits``),
        which also answers plain greedy rows where the sampler would take its greedy path with
        the C++ kernel. None where the model has no such call or declines the step:
        :meth:`execute` then runs the general path, which gives the same tokens."""
        model = self.model
        if not isinstance(model, CausalLM):  # an encoder: no decode steps
            return None
        seqs = sched_out.seqs
        greedy = (
            self.sampler.kernel is not None
            and sched_out.token_bitmask is None
            and all(plain_greedy_params(s.sampling_params, s.output_len, s.history) for s in seqs)
        )
        done = model.decode_logits(
            [s.token_ids[0] for s in seqs],
            [s.start_pos for s in seqs],
            [s.block_table for s in seqs],
            self.block_size,
            kv_caches,
            greedy=greedy,
        )
        if done is None:
            return None
        logits, tokens, logprobs = done
        if greedy:
            return ModelRunnerOutput(
                sampled={
                    s.seq_id: SampledToken(s.seq_id, tokens[j], logprobs[j])
                    for j, s in enumerate(seqs)
                }
            )
        positions = list(range(len(seqs)))
        with torch.inference_mode():  # the sampler writes into its tensors
            return ModelRunnerOutput(sampled=self._sample_logits(logits, positions, sched_out))

    def forward(
        self, batch: FlatBatch, num_prefills: int, kv_caches: list[torch.Tensor]
    ) -> torch.Tensor | None:  # [num_tokens, hidden]; None on a pipeline stage before the last
        dev = self.device
        meta = self.attention.build_metadata(
            num_prefills=num_prefills,
            seq_lens=batch.seq_lens,
            query_lens=batch.query_lens,
            slot_mapping=batch.slot_mapping,
            block_tables=batch.block_tables,
            block_size=self.block_size,
            device=dev,
        )
        input_ids = host_tensor(batch.input_ids, torch.long, dev)
        positions = host_tensor(batch.positions, torch.long, dev)
        link = self.pipeline
        if batch.token_type_ids is not None:  # a cross-encoder's text pairs
            types = torch.tensor(batch.token_type_ids, dtype=torch.long, device=dev)
            return self.model(input_ids, positions, kv_caches, meta, token_type_ids=types)
        if link is None:
            return self.model(input_ids, positions, kv_caches, meta)
        intermediate = None if link.pp.is_first else link.recv(len(batch.input_ids))
        out = self.model(input_ids, positions, kv_caches, meta, intermediate)
        if link.pp.is_last:
            return out
        link.send(out)
        return None

    def _sample(
        self, hidden: torch.Tensor, batch: FlatBatch, sched_out: SchedulerOutput
    ) -> dict[int, SampledToken]:
        if not batch.sample_indices:
            return {}
        if len(batch.sample_indices) < hidden.shape[0]:
            idx = torch.tensor(batch.sample_indices, dtype=torch.long, device=hidden.device)
            hidden = hidden[idx]
        # (else every row samples: the indices, strictly increasing, are all rows in order)
        logits = self.model.compute_logits(hidden)  # [num_sampled, vocab]
        return self._sample_logits(logits, batch.sample_seq_positions, sched_out)

    def _sample_logits(
        self, logits: torch.Tensor, seq_positions: list[int], sched_out: SchedulerOutput
    ) -> dict[int, SampledToken]:
        """Samples logits row ``j``, which belongs to ``sched_out.seqs[seq_positions[j]]``."""
        seqs = sched_out.seqs
        rows: list[SamplingRow] = []
        source: list[int] = []  # logits row of each sampling row (best_of repeats a row)
        for j, i in enumerate(seq_positions):
            s = seqs[i]
            for k in range(s.num_samples):
                rows.append(
                    SamplingRow(
                        s.seq_id,
                        s.sampling_params,
                        s.output_len,
                        s.history,
                        sample_index=s.sample_index + k,
                        eos_token_ids=s.eos_token_ids,
                    )
                )
                source.append(j)
        if len(rows) != len(source) or len(rows) != logits.shape[0]:
            logits = logits[torch.tensor(source, device=logits.device)]
        out = self.sampler(
            logits,
            rows,
            token_bitmask=sched_out.token_bitmask,
            bitmask_rows=sched_out.bitmask_rows,
        )
        result: dict[int, SampledToken] = {}
        for j, row in enumerate(rows):
            token = SampledToken(
                seq_id=row.seq_id,
                token_id=out.token_ids[j],
                logprob=out.logprobs[j],
                top_logprobs=out.top_logprobs[j],
                candidates=out.candidates[j],
            )
            first = result.get(row.seq_id)
            if first is None:
                result[row.seq_id] = token
            else:
                if first.siblings is None:
                    result[row.seq_id] = first = SampledToken(
                        first.seq_id,
                        first.token_id,
                        first.logprob,
                        first.top_logprobs,
                        first.candidates,
                        siblings=[],
                    )
                assert first.siblings is not None
                first.siblings.append(token)
        return result

    def _prompt_logprobs(
        self, hidden: torch.Tensor, batch: FlatBatch, seqs: list[ScheduledSeq]
    ) -> dict[int, list[dict[int, float] | None]]:
        result: dict[int, list[dict[int, float] | None]] = {}
        for seq_index, flat_start, count in batch.prompt_logprob_spans:
            s = seqs[seq_index]
            assert s.next_token_ids is not None and s.sampling_params.prompt_logprobs is not None
            # Positions past the prompt predict generated tokens, not prompt tokens.
            count = min(count, max(0, s.prompt_len - 1 - s.start_pos))
            entries: list[dict[int, float] | None] = [None] if s.start_pos == 0 else []
            if count:
                logits = self.model.compute_logits(hidden[flat_start : flat_start + count])
                lps = torch.log_softmax(logits.float(), dim=-1)
                targets = s.next_token_ids[:count]
                entries.extend(_top_entries(lps, targets, s.sampling_params.prompt_logprobs))
            result[s.seq_id] = entries
        return result

    def dummy_run(self, num_tokens: int, num_seqs: int, kv_caches: list[torch.Tensor]) -> None:
        """A forward pass and sampling at the given size, for profiling and warm-up."""
        from pagedllm.core.sampling_params import SamplingParams

        num_seqs = max(1, min(num_seqs, num_tokens))
        lens = [
            num_tokens // num_seqs + (1 if i < num_tokens % num_seqs else 0)
            for i in range(num_seqs)
        ]
        seqs: list[ScheduledSeq] = []
        params = SamplingParams(temperature=1.0, top_p=0.9)
        block = 0
        for i, n in enumerate(lens):
            nblocks = (n + self.block_size - 1) // self.block_size
            table = list(range(block, block + nblocks))
            block += nblocks
            seqs.append(
                ScheduledSeq(
                    request_id=f"dummy-{i}",
                    seq_id=-1 - i,
                    is_prompt=True,
                    token_ids=[0] * n,
                    start_pos=0,
                    block_table=table,
                    do_sample=True,
                    sampling_params=params,
                    output_len=0,
                    prompt_len=n,
                )
            )
        self.execute(SchedulerOutput(seqs=seqs, num_prefill_seqs=len(seqs)), kv_caches)


def _plain_decode(sched_out: SchedulerOutput) -> bool:
    """Every sequence computes one token, on the KV cache, and samples it once (no prompt
    chunk, pooling, speculative run or parallel samples): what ``decode_logits`` covers."""
    if sched_out.num_prefill_seqs:
        return False
    for s in sched_out.seqs:
        if (
            len(s.token_ids) != 1
            or not s.do_sample
            or s.num_samples != 1
            or s.num_spec_tokens
            or s.pooling_params is not None
            or s.next_token_ids is not None
            or not s.block_table
        ):
            return False
    return True


def _top_entries(lps: torch.Tensor, targets: list[int], k: int) -> list[dict[int, float] | None]:
    chosen = lps.gather(1, torch.tensor(targets, device=lps.device)[:, None])[:, 0].tolist()
    entries: list[dict[int, float] | None] = []
    top_vals: Any = None
    top_ids: Any = None
    if k > 0:
        top_vals, top_ids = lps.topk(k, dim=-1)
        top_vals, top_ids = top_vals.tolist(), top_ids.tolist()
    for i, t in enumerate(targets):
        entry = {t: chosen[i]}
        if k > 0:
            entry.update(zip(top_ids[i], top_vals[i], strict=True))
        entries.append(entry)
    return entries

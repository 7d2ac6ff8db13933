"""Engine overhead: everything around the forward pass, at 256 running sequences.

Runs the real engine (scheduler, block manager, input preparation, output processing) with a
model stand-in that returns a token for every sampled row at once, and compares the time per
step with a real decode step of the benchmark model at the same batch. Prints JSON.

    python benchmarks/engine_overhead.py
    python benchmarks/engine_overhead.py --smoke
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from throughput import FULL_MODEL, SMOKE_MODEL, build_model

from pagedllm import Engine, SamplingParams
from pagedllm.core.interfaces import ModelRunnerOutput, SampledToken, SchedulerOutput
from pagedllm.executors.inputs import flatten


def fill(engine: Engine, num_seqs: int, prompt_len: int, vocab: int) -> None:
    # max_tokens=None: the rest of the context window, so sequences stay running
    params = SamplingParams(temperature=0.0, max_tokens=None, ignore_eos=True)
    for i in range(num_seqs):
        ids = [(i * 31 + j * 7) % (vocab - 3) + 3 for j in range(prompt_len)]
        engine.add_request(f"r{i}", {"prompt_token_ids": ids}, params)
    while engine.scheduler.waiting:
        engine.step()


def time_steps(engine: Engine, steps: int) -> float:
    engine.step()
    start = time.perf_counter()
    for _ in range(steps):
        engine.step()
    return (time.perf_counter() - start) / steps


def fake_executor(engine: Engine):
    """Input preparation as the real runner does it, then an instant 'model'."""
    worker = engine.executor.worker  # type: ignore[attr-defined]
    runner = worker.runner
    block_size = engine.config.cache.block_size

    def execute(sched_out: SchedulerOutput) -> ModelRunnerOutput:
        batch = flatten(sched_out, block_size)
        runner.attention.build_metadata(
            num_prefills=sched_out.num_prefill_seqs,
            seq_lens=batch.seq_lens,
            query_lens=batch.query_lens,
            slot_mapping=batch.slot_mapping,
            block_tables=batch.block_tables,
            block_size=block_size,
            device=runner.device,
        )
        torch.tensor(batch.input_ids)
        torch.tensor(batch.positions)
        return ModelRunnerOutput(
            sampled={
                s.seq_id: SampledToken(s.seq_id, 5, -1.0) for s in sched_out.seqs if s.do_sample
            }
        )

    return execute


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-seqs", type=int, default=256)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--model-dir", type=Path, default=None)
    parser.add_argument("--smoke", action="store_true")
    args = parser.parse_args(argv)
    spec = SMOKE_MODEL if args.smoke else FULL_MODEL
    num_seqs = 8 if args.smoke else args.num_seqs
    steps = 3 if args.smoke else args.steps
    with tempfile.TemporaryDirectory() as tmp:
        model = build_model(args.model_dir or Path(tmp) / "model", spec)
        engine = Engine(
            str(model),
            device="cpu",
            dtype="float32",
            skip_tokenizer_init=True,
            max_num_seqs=num_seqs,
            kv_cache_space=2,
        )
        fill(engine, num_seqs, args.prompt_len, spec["vocab_size"])
        real = time_steps(engine, steps)
        engine.executor.execute_model = fake_executor(engine)  # type: ignore[method-assign]
        overhead = time_steps(engine, steps * 5)
    print(
        json.dumps(
            {
                "benchmark": "engine_overhead",
                "running_sequences": num_seqs,
                "context_tokens": args.prompt_len,
                "overhead_us_per_step": overhead * 1e6,
                "real_step_ms": real * 1e3,
                "overhead_share_of_real_step": overhead / real,
                "note": "overhead = scheduling + block tables + input tensors + output processing "
                "(no detokenization: the benchmark model has no tokenizer)",
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()

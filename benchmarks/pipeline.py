"""Pipeline parallelism: two stages with virtual engines vs two stages taking turns.

Three engines on the same random-weight Llama and the same batch (``ignore_eos``, fixed
lengths), run alternately because the machine is shared: PP=2 with two virtual engines (two
micro-batches in flight, the default), PP=2 with one scheduler (``virtual_engines=1``: a step
goes through stage 0, then stage 1, and each stage idles half the time), and one process with
the whole model for reference. The stages run on the multiprocess executor, each with an even
share of the CPU threads. The figure quoted is the ratio of tokens/s, virtual engines over one
scheduler: what keeping every stage busy buys. Two workloads: ``decode`` (short prompts, 64
output tokens: on the CPU decoding is bound by reading the weights, and two micro-batches of half
the batch read them twice as often, which eats what the overlap gains) and ``prefill`` (prompts of
384-512 tokens, 8 output tokens: compute-bound, where overlapping the stages pays).

    python benchmarks/pipeline.py
    python benchmarks/pipeline.py --smoke
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from throughput import FULL_MODEL, SMOKE_MODEL, build_model

from pagedllm import Engine, SamplingParams

# name -> engine arguments besides the common ones
ENGINES: dict[str, dict[str, Any]] = {
    "pp2-virtual-engines": dict(pipeline_parallel_size=2, distributed_executor_backend="mp"),
    "pp2-one-scheduler": dict(
        pipeline_parallel_size=2, distributed_executor_backend="mp", virtual_engines=1
    ),
    "single-process": {},
}


def run(engine: Engine, prompts: list[list[int]], lengths: list[int]) -> dict[str, Any]:
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in lengths]
    start = time.perf_counter()
    outs = engine.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    wall = time.perf_counter() - start
    out_tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    return {
        "wall_s": wall,
        "output_tokens": out_tokens,
        "output_tok_s": out_tokens / wall,
        "total_tok_s": (out_tokens + sum(map(len, prompts))) / wall,
    }


# workload -> (prompt length range, output length range) at full size
WORKLOADS: dict[str, tuple[tuple[int, int], tuple[int, int]]] = {
    "decode": ((32, 128), (32, 64)),
    "prefill": ((384, 512), (8, 8)),
}


def make_batch(
    n: int, vocab: int, prompt_range: tuple[int, int], output_range: tuple[int, int]
) -> tuple[list[list[int]], list[int]]:
    rng = random.Random(0)
    lens = [rng.randint(*prompt_range) for _ in range(n)]
    prompts = [[rng.randrange(3, vocab) for _ in range(m)] for m in lens]
    return prompts, [rng.randint(*output_range) for _ in range(n)]


def measure(
    engines: dict[str, Engine], batch: tuple[list[list[int]], list[int]], repeats: int
) -> dict[str, Any]:
    prompts, lengths = batch
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in engines}
    for _ in range(repeats):  # alternating: load drifts
        for name, engine in engines.items():
            runs[name].append(run(engine, prompts, lengths))
    best = {k: max(v, key=lambda r: r["total_tok_s"]) for k, v in runs.items()}
    return {
        "num_requests": len(prompts),
        "prompt_tokens": sum(map(len, prompts)),
        "engines": best,
        "all_total_tok_s": {k: [r["total_tok_s"] for r in v] for k, v in runs.items()},
        "virtual_engines_over_one_scheduler": best["pp2-virtual-engines"]["total_tok_s"]
        / best["pp2-one-scheduler"]["total_tok_s"],
        "pp2_over_single_process": best["pp2-virtual-engines"]["total_tok_s"]
        / best["single-process"]["total_tok_s"],
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-requests", type=int, default=32)
    parser.add_argument(
        "--repeats", type=int, default=3, help="runs of each, alternating (best one reported)"
    )
    parser.add_argument("--smoke", action="store_true")
    args = parser.parse_args(argv)
    spec = SMOKE_MODEL if args.smoke else FULL_MODEL
    n = 4 if args.smoke else args.num_requests
    threads = os.cpu_count() or 1
    results: dict[str, Any] = {}
    peaks: dict[str, int] = {}
    with tempfile.TemporaryDirectory() as tmp:
        model = build_model(Path(tmp) / "model", spec)
        engines = {
            name: Engine(
                str(model),
                device="cpu",
                dtype="float32",
                max_num_seqs=n,
                kv_cache_space=1,
                cpu_threads=threads,
                skip_tokenizer_init=True,
                **extra,
            )
            for name, extra in ENGINES.items()
        }
        for name, (prompt_range, output_range) in WORKLOADS.items():
            if args.smoke:
                prompt_range, output_range = (8, 16), (2, 4)
            batch = make_batch(n, spec["vocab_size"], prompt_range, output_range)
            for engine in engines.values():
                run(engine, batch[0][:2], [2, 2])  # warm-up
            results[name] = measure(engines, batch, 1 if args.smoke else args.repeats)
        for name, engine in engines.items():
            peaks[name] = engine.executor.peak_in_flight
            engine.shutdown()
    from pagedllm.backends.cpu._ops import cpu_model_name, resolve_isa

    print(
        json.dumps(
            {
                "benchmark": "pipeline",
                "date": time.strftime("%Y-%m-%d"),
                "processor": cpu_model_name(),
                "isa": resolve_isa(),
                "cpu_threads": threads,
                "model": {k: spec[k] for k in ("hidden_size", "num_hidden_layers", "vocab_size")},
                "workloads": results,
                "peak_micro_batches_in_flight": peaks,
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()

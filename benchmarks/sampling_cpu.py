"""Sampling cost per step, side by side: the PyTorch definition (``draw_reference``, which sorts
rows for top-k/top-p) vs the CPU backend's C++ sampler, on random logits; JSON out."""

from __future__ import annotations

import argparse
import json
import time

import torch

from pagedllm.backends.cpu._ops import cpu_model_name, resolve_isa
from pagedllm.backends.cpu.layer_kernels import sample_kernel
from pagedllm.core.sampling_params import SamplingParams
from pagedllm.layers.sampler import Sampler, SamplingRow

SETTINGS = {
    "greedy": SamplingParams(temperature=0),
    "temperature=1": SamplingParams(temperature=1.0),
    "temperature=0.8, top_p=0.95": SamplingParams(temperature=0.8, top_p=0.95),
    "temperature=0.8, top_k=40": SamplingParams(temperature=0.8, top_k=40),
}


def timed_ms(fn, repeats: int) -> float:
    fn()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - start) / repeats * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vocab", default="32000,128256")
    parser.add_argument("--rows", default="16,64")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--smoke", action="store_true", help="small sizes, one repeat (CI)")
    args = parser.parse_args()
    vocabs = [512] if args.smoke else [int(v) for v in args.vocab.split(",")]
    row_counts = [4] if args.smoke else [int(n) for n in args.rows.split(",")]
    repeats = 1 if args.smoke else args.repeats
    kernel = sample_kernel()
    samplers = {"pytorch": Sampler(seed=0), "cpp": Sampler(seed=0, kernel=kernel)}
    results = []
    for vocab in vocabs:
        for n in row_counts:
            logits = torch.randn(n, vocab, generator=torch.Generator().manual_seed(0))
            for name, params in SETTINGS.items():
                rows = [SamplingRow(i, params, output_len=1) for i in range(n)]
                ms = {
                    k: timed_ms(lambda s=s, x=logits, r=rows: s(x, r), repeats)
                    for k, s in samplers.items()
                    if k == "pytorch" or kernel is not None
                }
                entry = {"vocab": vocab, "rows": n, "setting": name, "ms": ms}
                if "cpp" in ms:
                    entry["speedup"] = round(ms["pytorch"] / ms["cpp"], 1)
                results.append(entry)
    print(
        json.dumps(
            {
                "benchmark": "sampling_cpu",
                "processor": cpu_model_name(),
                "isa": resolve_isa(),
                "torch_threads": torch.get_num_threads(),
                "results": results,
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()

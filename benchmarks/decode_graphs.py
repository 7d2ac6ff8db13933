"""Decode steps with CUDA graphs against without (``enforce_eager``), at batch 1 and 32.

One random-weight Llama (``--model-size``, built in a temporary folder), two
engines one after the other in this process: ``enforce_eager=True`` (the layer loop) and the
default (on CUDA the ``decode_stack / cuda_graph`` row: steps replayed from graphs). For each
batch size, one untimed round first (Triton compiles its specialisations, the graphs are
captured), then the median wall time of the decode steps of a timed round (short prompts, past
the prefill steps). Prints one JSON object; ``--output`` also writes it.

    python benchmarks/decode_graphs.py --device cuda          # tools/gpu_check.sh
    python benchmarks/decode_graphs.py --smoke                # tiny model on the CPU (eager
                                                              # both times: graphs are CUDA's)
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))
from throughput import MODELS, build_model

BATCHES = (1, 32)
PROMPT_LEN = 16


def step_ms(engine: Any, num_seqs: int, new_tokens: int, vocab: int) -> float:
    """Median wall milliseconds of the decode-only steps of one round of ``num_seqs``."""
    from pagedllm import SamplingParams

    rng = random.Random(num_seqs)
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    for i in range(num_seqs):
        prompt = [rng.randrange(3, vocab) for _ in range(PROMPT_LEN)]
        engine.add_request(f"r{num_seqs}-{i}", {"prompt_token_ids": prompt}, params)
    times = []
    while engine.has_unfinished_requests():
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    decode = sorted(times[2:-1]) or sorted(times)  # past the prefill step, before the last
    return 1000 * decode[len(decode) // 2]


def measure(path: Path, args: argparse.Namespace, *, eager: bool) -> dict[str, Any]:
    from pagedllm import Engine

    engine = Engine(
        str(path),
        device=args.device,
        dtype=args.dtype,
        skip_tokenizer_init=True,
        max_num_seqs=max(BATCHES),
        enforce_eager=eager,
        **({"gpu_memory_utilization": 0.5} if args.device == "cuda" else {}),
    )
    vocab = MODELS[args.model_size]["vocab_size"]
    result: dict[str, Any] = {"layer_kernels": engine.executor.collective_rpc("layer_kernels")[0]}
    for batch in BATCHES:
        step_ms(engine, batch, 8, vocab)  # compiles and captures
        result[f"step_ms_batch{batch}"] = step_ms(engine, batch, args.new_tokens, vocab)
    engine.shutdown()
    return result


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-size", choices=sorted(MODELS), default="125m")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--smoke", action="store_true", help="tiny model, few tokens (CI)")
    parser.add_argument("--output", type=Path, default=None, help="also write the JSON here")
    args = parser.parse_args(argv)
    if args.smoke:
        args.model_size, args.new_tokens, args.dtype = "smoke", 8, "float32"
    spec = MODELS[args.model_size]
    with tempfile.TemporaryDirectory() as tmp:
        path = build_model(Path(tmp) / f"llama-{args.model_size}", spec)
        eager = measure(path, args, eager=True)
        graphs = measure(path, args, eager=False)
    report: dict[str, Any] = {
        "device": args.device,
        "model_size": args.model_size,
        "dtype": args.dtype,
        "eager": eager,
        "graphs": graphs,
    }
    for batch in BATCHES:
        key = f"step_ms_batch{batch}"
        report[f"speedup_batch{batch}"] = eager[key] / graphs[key]
    if args.device == "cuda":
        import torch

        report["gpu"] = torch.cuda.get_device_name(0)
    text = json.dumps(report, indent=2)
    print(text)
    if args.output is not None:
        args.output.write_text(text + "\n")


if __name__ == "__main__":
    main()

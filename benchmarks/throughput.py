"""Offline throughput, side by side in one run: pagedllm vs transformers static batching
(vs llama.cpp where llama-cpp-python is installed), on the same random-weight Llama.

Workload (reproducible, seeded): ``--num-requests`` requests, prompt lengths uniform in
[32, 512], output lengths uniform in [32, 256], every request generating exactly its output
length. Prints one JSON object: requests/s, output tokens/s, total tokens/s, the share of the
machine's fp32 matmul peak (model FLOPs over wall time; the peak is measured with ``torch.mm``
in the same run), and the ratios between engines. Also KV waste: the share of allocated KV slots
that held no token, averaged over steps.

    python benchmarks/throughput.py            # the full workload (a few minutes)
    python benchmarks/throughput.py --smoke    # a tiny model and workload, for CI
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

FULL_MODEL = dict(
    hidden_size=512, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=4,
    intermediate_size=1408, vocab_size=32000, tie_word_embeddings=False,
)
SMOKE_MODEL = dict(
    hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
    intermediate_size=128, vocab_size=1000, tie_word_embeddings=False,
)


@dataclass
class Request:
    prompt: list[int]
    output_len: int


def build_model(folder: Path, spec: dict[str, Any], max_positions: int = 1024) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    if (folder / "config.json").exists():
        return folder
    config = LlamaConfig(
        max_position_embeddings=max_positions, bos_token_id=1, eos_token_id=2, **spec
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).to(torch.float32).save_pretrained(str(folder))
    return folder


def make_workload(n: int, vocab: int, prompt_range: tuple[int, int],
                  output_range: tuple[int, int], seed: int) -> list[Request]:
    rng = random.Random(seed)
    return [
        Request(
            [rng.randrange(3, vocab) for _ in range(rng.randint(*prompt_range))],
            rng.randint(*output_range),
        )
        for _ in range(n)
    ]


def matmul_peak_flops(seconds: float = 2.0, n: int = 2048) -> float:
    a, b = torch.randn(n, n), torch.randn(n, n)
    torch.mm(a, b)
    count, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        torch.mm(a, b)
        count += 1
    return 2 * n**3 * count / (time.perf_counter() - start)


def workload_flops(reqs: list[Request], spec: dict[str, Any]) -> float:
    """Linear layers for every computed token, attention over each token's context, and the
    LM head only for sampled rows."""
    h, layers, inter = spec["hidden_size"], spec["num_hidden_layers"], spec["intermediate_size"]
    kv = spec["num_key_value_heads"] * (h // spec["num_attention_heads"])
    per_token = 2 * layers * (h * (h + 2 * kv) + h * h + 3 * h * inter)
    flops = 0.0
    for r in reqs:
        total = len(r.prompt) + r.output_len - 1  # the last sampled token is never fed back
        flops += per_token * total
        flops += 4 * layers * h * total * (total + 1) / 2  # QK^T and PV over causal contexts
        flops += 2 * h * spec["vocab_size"] * r.output_len
    return flops


def run_pagedllm(model: Path, reqs: list[Request], **engine_args: Any) -> dict[str, Any]:
    from pagedllm import Engine, SamplingParams

    engine = Engine(str(model), device="cpu", dtype="float32", skip_tokenizer_init=True,
                    max_num_seqs=len(reqs), **engine_args)
    prompts = [{"prompt_token_ids": r.prompt} for r in reqs]
    params = [SamplingParams(temperature=0.0, max_tokens=r.output_len, ignore_eos=True)
              for r in reqs]
    engine.generate(prompts[:2], [p.clone(max_tokens=2) for p in params[:2]], use_tqdm=False)
    c = engine.counters
    alloc0, used0 = c.kv_slots_allocated, c.kv_slots_used
    start = time.perf_counter()
    outs = engine.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    assert all(len(o.outputs[0].token_ids) == r.output_len for o, r in zip(outs, reqs, strict=True))
    alloc, used = c.kv_slots_allocated - alloc0, c.kv_slots_used - used0
    return {
        "seconds": elapsed,
        "kv_waste": 1 - used / alloc if alloc else 0.0,
        "attention_backend": engine.executor.collective_rpc("attention_name")[0],
    }


def run_transformers(model: Path, reqs: list[Request], batch_size: int) -> dict[str, Any]:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(model), dtype=torch.float32).eval()
    start = time.perf_counter()
    with torch.inference_mode():
        for i in range(0, len(reqs), batch_size):
            batch = reqs[i : i + batch_size]
            width = max(len(r.prompt) for r in batch)
            ids = torch.zeros((len(batch), width), dtype=torch.long)
            mask = torch.zeros_like(ids)
            for j, r in enumerate(batch):  # left padding
                ids[j, width - len(r.prompt) :] = torch.tensor(r.prompt)
                mask[j, width - len(r.prompt) :] = 1
            new = max(r.output_len for r in batch)
            hf.generate(ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new,
                        do_sample=False, pad_token_id=0)
    return {"seconds": time.perf_counter() - start, "batch_size": batch_size}


def run_llama_cpp(model: Path, reqs: list[Request]) -> dict[str, Any] | None:
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        return None
    return {"skipped": "llama-cpp-python is installed but GGUF conversion is not wired up"}


def summarize(name: str, result: dict[str, Any], reqs: list[Request], flops: float,
              peak: float) -> dict[str, Any]:
    secs = result["seconds"]
    out_tokens = sum(r.output_len for r in reqs)
    in_tokens = sum(len(r.prompt) for r in reqs)
    return {
        "engine": name,
        **result,
        "requests_per_s": len(reqs) / secs,
        "output_tokens_per_s": out_tokens / secs,
        "total_tokens_per_s": (out_tokens + in_tokens) / secs,
        "matmul_peak_fraction": flops / secs / peak,
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--hf-batch-size", type=int, default=32)
    parser.add_argument("--model-dir", type=Path, default=None)
    parser.add_argument("--skip-hf", action="store_true")
    parser.add_argument("--smoke", action="store_true", help="tiny model and workload (CI)")
    args = parser.parse_args(argv)

    torch.manual_seed(args.seed)
    spec = SMOKE_MODEL if args.smoke else FULL_MODEL
    n = 4 if args.smoke else args.num_requests
    prompt_range, output_range = ((4, 16), (2, 6)) if args.smoke else ((32, 512), (32, 256))
    with tempfile.TemporaryDirectory() as tmp:
        folder = args.model_dir or Path(tmp) / ("smoke" if args.smoke else "llama-56m")
        model = build_model(folder, spec)
        reqs = make_workload(n, spec["vocab_size"], prompt_range, output_range, args.seed)
        peak = matmul_peak_flops(0.3 if args.smoke else 2.0)
        flops = workload_flops(reqs, spec)
        results = [summarize("pagedllm", run_pagedllm(model, reqs), reqs, flops, peak)]
        if not args.skip_hf:
            hf = run_transformers(model, reqs, args.hf_batch_size)
            results.append(summarize("transformers-static-batch", hf, reqs, flops, peak))
        cpp = run_llama_cpp(model, reqs)
        if cpp is not None and "seconds" in cpp:
            results.append(summarize("llama.cpp", cpp, reqs, flops, peak))
    ours = results[0]
    report = {
        "benchmark": "throughput",
        "date": time.strftime("%Y-%m-%d"),
        "torch_threads": torch.get_num_threads(),
        "num_requests": n,
        "input_tokens": sum(len(r.prompt) for r in reqs),
        "output_tokens": sum(r.output_len for r in reqs),
        "workload_gflop": flops / 1e9,
        "matmul_peak_gflops": peak / 1e9,
        "seconds_at_peak": flops / peak,
        "results": results,
        "speedup_vs": {
            r["engine"]: ours["output_tokens_per_s"] / r["output_tokens_per_s"]
            for r in results[1:]
        },
        "llama_cpp": "not installed" if cpp is None else cpp,
    }
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()

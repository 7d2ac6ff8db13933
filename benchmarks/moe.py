"""Mixture-of-experts throughput: pagedllm vs transformers' static batches on a random-weight
Mixtral-shaped model (8 experts, top-2), side by side in one run.

The workload is throughput.py's (seeded; prompts uniform in [32, 512] tokens, outputs uniform in
[32, 256], every request generating exactly its output length, greedy) and so is the machinery:
each engine runs in its own subprocess, so its load time and peak RSS are its own. The model is
small enough for a laptop-class CPU: hidden 512, 6 layers, 8 experts of intermediate 1024
(~113M parameters, ~40M active per token), a 32000-token vocabulary, float32. Prints one JSON
object with the processor, the CPU kernels' ISA level, which GEMM path the experts got, output
tokens/s per engine and the ratios between engines.

    python benchmarks/moe.py                    # 64 requests (several minutes on 2 cores)
    python benchmarks/moe.py --num-requests 32  # shorter
    python benchmarks/moe.py --smoke            # tiny model and workload, for CI
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).parent))
from throughput import Request, make_workload, run_pagedllm, run_transformers

MODELS: dict[str, dict[str, Any]] = {
    "smoke": dict(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=96, num_local_experts=4, num_experts_per_tok=2, vocab_size=1000,
    ),
    "mixtral-small": dict(
        hidden_size=512, num_hidden_layers=6, num_attention_heads=8, num_key_value_heads=4,
        intermediate_size=1024, num_local_experts=8, num_experts_per_tok=2, vocab_size=32000,
    ),
}  # fmt: skip
ENGINES = ["pagedllm-float32", "pagedllm-bfloat16", "transformers-float32"]


def build_random_mixtral(folder: Path, spec: dict[str, Any], seed: int = 0) -> Path:
    """A random ``MixtralForCausalLM`` saved in float32 (per-expert tensors, as real ones are);
    built on the meta device and filled in place, so only the checkpoint is ever allocated."""
    from transformers import MixtralConfig, MixtralForCausalLM

    config = MixtralConfig(
        max_position_embeddings=1024, bos_token_id=1, eos_token_id=2,
        tie_word_embeddings=False, **spec,
    )  # fmt: skip
    with torch.device("meta"):
        model = MixtralForCausalLM(config)
    model = model.to_empty(device="cpu")
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() == 1:
                param.fill_(1.0)
            else:  # routers a little wider so that routing is not uniform
                param.normal_(0.0, 0.1 if name.endswith("gate.weight") else 0.02, generator=gen)
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(folder))
    return folder


def run_one(engine: str, args: argparse.Namespace) -> dict[str, Any]:
    spec = {**MODELS[args.model_size], "dtype": "float32"}
    reqs = [Request(**r) for r in json.loads(args.requests.read_text())]
    if engine.startswith("pagedllm"):
        result = run_pagedllm(args.model_dir, reqs, engine, spec, args)
    else:
        result = run_transformers(args.model_dir, reqs, engine, args)
    result["peak_rss_gib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / (1 << 20)
    return result


def _in_subprocess(engine: str, args: argparse.Namespace, requests: Path) -> dict[str, Any]:
    cmd = [
        sys.executable, __file__, "--run-one", engine, "--model-size", args.model_size,
        "--model-dir", str(args.model_dir), "--requests", str(requests),
        "--hf-batch-size", str(args.hf_batch_size), "--kv-cache-space", str(args.kv_cache_space),
    ]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        tail = proc.stderr.strip().splitlines()[-3:]
        return {"error": " | ".join(tail) or f"exit code {proc.returncode}"}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def summarize(name: str, result: dict[str, Any], reqs: list[Request]) -> dict[str, Any]:
    if "seconds" not in result:
        return {"engine": name, **result}
    secs = result["seconds"]
    out_tokens = sum(r.output_len for r in reqs)
    in_tokens = sum(len(r.prompt) for r in reqs)
    return {
        "engine": name,
        **result,
        "requests_per_s": len(reqs) / secs,
        "output_tokens_per_s": out_tokens / secs,
        "total_tokens_per_s": (out_tokens + in_tokens) / secs,
    }


def ratios(results: list[dict[str, Any]]) -> dict[str, float]:
    speed = {r["engine"]: r["output_tokens_per_s"] for r in results if "output_tokens_per_s" in r}
    ours = [n for n in speed if n.startswith("pagedllm")]
    theirs = [n for n in speed if not n.startswith("pagedllm")]
    return {f"{a} / {b}": round(speed[a] / speed[b], 3) for a in ours for b in theirs}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-size", choices=sorted(MODELS), default="mixtral-small")
    parser.add_argument("--engines", default=",".join(ENGINES))
    parser.add_argument("--num-requests", type=int, default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--hf-batch-size", type=int, default=32)
    parser.add_argument("--kv-cache-space", type=float, default=1.0)
    parser.add_argument("--model-dir", type=Path, default=None)
    parser.add_argument("--smoke", action="store_true", help="tiny model and workload (CI)")
    parser.add_argument("--run-one", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--requests", type=Path, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.bandwidth = False  # run_pagedllm's optional decode-step timing
    if args.smoke:
        args.model_size = "smoke"
    if args.run_one:
        print(json.dumps(run_one(args.run_one, args)))
        return
    n = args.num_requests or (4 if args.smoke else 64)
    prompt_range, output_range = ((4, 16), (2, 6)) if args.smoke else ((32, 512), (32, 256))
    spec = MODELS[args.model_size]
    with tempfile.TemporaryDirectory() as tmp:
        args.model_dir = args.model_dir or Path(tmp) / f"moe-{args.model_size}"
        if not (args.model_dir / "config.json").exists():
            build_random_mixtral(args.model_dir, spec)
        reqs = make_workload(n, spec["vocab_size"], prompt_range, output_range, args.seed)
        requests = Path(tmp) / "requests.json"
        requests.write_text(json.dumps([asdict(r) for r in reqs]))
        results = [
            summarize(e, _in_subprocess(e, args, requests), reqs) for e in args.engines.split(",")
        ]
    print(json.dumps(report(args, spec, reqs, results), indent=2))


def report(
    args: argparse.Namespace, spec: dict[str, Any], reqs: list[Request], results: list[dict]
) -> dict[str, Any]:
    from pagedllm.backends.cpu._ops import cpu_model_name, resolve_isa

    return {
        "benchmark": "moe",
        "date": time.strftime("%Y-%m-%d"),
        "processor": cpu_model_name(),
        "isa": resolve_isa(),
        "torch_threads": torch.get_num_threads(),
        "model_size": args.model_size,
        "model": {**spec, "architecture": "MixtralForCausalLM", "dtype": "float32"},
        "num_requests": len(reqs),
        "input_tokens": sum(len(r.prompt) for r in reqs),
        "output_tokens": sum(r.output_len for r in reqs),
        "hf_batch_size": args.hf_batch_size,
        "results": results,
        "output_speed_ratios": ratios(results),
    }


if __name__ == "__main__":
    main()

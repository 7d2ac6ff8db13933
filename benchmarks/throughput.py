"""Offline throughput, side by side in one run: pagedllm (in each precision) vs transformers'
static batches vs llama.cpp (where llama-cpp-python and gguf are installed), on the same
random-weight Llama.

Workload (reproducible, seeded): ``--num-requests`` requests, prompt lengths uniform in
[32, 512], output lengths uniform in [32, 256], every request generating exactly its output
length, greedy. Each engine runs in its own subprocess, so its load time and peak RSS are its own.
Prints one JSON object: the processor and the CPU kernels' ISA path, output tokens/s, load
seconds, peak RSS, the share of the fp32 matmul peak (model FLOPs over wall time; the peak is
measured with ``torch.mm`` in the same run), KV waste, and the ratios between engines. With
``--bandwidth`` it also times decode steps at 64 running sequences and reports the share of the
machine's measured read bandwidth they reach (weight bytes streamed per step over step time).

    python benchmarks/throughput.py                      # 56M float32 Llama (a few minutes)
    python benchmarks/throughput.py --model-size 1b      # Llama-3.2-1B shape in bfloat16
    python benchmarks/throughput.py --smoke              # tiny model and workload, for CI
    python benchmarks/throughput.py --device cuda        # on a GPU: ours vs transformers,
                                                         # bf16 and fp32 (tools/gpu_check.sh)

On a GPU the host's matmul peak and bandwidth are not measured (null), our engine takes half the
card for its KV cache and runs the whole workload once untimed first (Triton compiles each
kernel specialisation on first use), and transformers' time ends at a device synchronisation.
"""

from __future__ import annotations

import argparse
import json
import random
import resource
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).parent))
from model_builder import LLAMA_1B, LLAMA_TINY, build_random_llama

MODELS: dict[str, dict[str, Any]] = {
    "smoke": {**LLAMA_TINY, "dtype": "float32"},
    "56m": dict(
        hidden_size=512,
        num_hidden_layers=8,
        num_attention_heads=8,
        num_key_value_heads=4,
        intermediate_size=1408,
        vocab_size=32000,
        tie_word_embeddings=False,
        dtype="float32",
    ),
    "125m": dict(
        hidden_size=768,
        num_hidden_layers=12,
        num_attention_heads=12,
        num_key_value_heads=4,
        intermediate_size=2048,
        vocab_size=32000,
        tie_word_embeddings=False,
        dtype="float32",
    ),
    # Llama-3.2-1B's shape with a 32000-token vocabulary, saved in bfloat16.
    "1b": {**LLAMA_1B, "dtype": "bfloat16"},
}
# The shapes the other benchmarks build (float32).
FULL_MODEL = MODELS["56m"]
SMOKE_MODEL = MODELS["smoke"]
# On a CUDA device (``--device cuda``): our engine and transformers in the same dtypes.
GPU_ENGINES = [
    "pagedllm-bfloat16",
    "transformers-bfloat16",
    "pagedllm-float32",
    "transformers-float32",
]
# Which engines each size compares by default (name -> how it runs).
ENGINES: dict[str, list[str]] = {
    "smoke": ["pagedllm-float32", "pagedllm-bfloat16", "pagedllm-w8a8", "transformers-float32"],
    "56m": [
        "pagedllm-float32",
        "pagedllm-bfloat16",
        "pagedllm-int8",
        "pagedllm-w8a8",
        "transformers-float32",
    ],
    "125m": ["pagedllm-float32", "pagedllm-bfloat16", "transformers-float32"],
    "1b": [
        "pagedllm-bfloat16",
        "pagedllm-float32",
        "pagedllm-int8",
        "pagedllm-w8a8",
        "transformers-bfloat16",
        "llama.cpp-f16",
        "llama.cpp-q8_0",
    ],
}


@dataclass
class Request:
    prompt: list[int]
    output_len: int


def build_model(folder: Path, spec: dict[str, Any], max_positions: int = 1024) -> Path:
    """A random-weight Llama saved in ``spec["dtype"]``, built in that dtype (a 1B model never
    exists in float32 here); reused when the folder already holds the same checkpoint."""
    shape = {k: v for k, v in spec.items() if k != "dtype"}
    dtype = getattr(torch, spec["dtype"])
    return build_random_llama(folder, shape, dtype=dtype, max_positions=max_positions)


def make_workload(
    n: int, vocab: int, prompt_range: tuple[int, int], output_range: tuple[int, int], seed: int
) -> list[Request]:
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


def read_bandwidth(seconds: float = 1.0, nbytes: int = 1 << 30) -> float:
    """Bytes/s of a streaming reduction over a buffer far larger than the caches."""
    buf = torch.ones(nbytes // 4)
    buf.sum()
    count, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds or count < 2:
        buf.sum()
        count += 1
    return nbytes * count / (time.perf_counter() - start)


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


def streamed_weight_bytes(spec: dict[str, Any], engine: str) -> int:
    """Weight bytes one decode step reads: every linear layer and the LM head (not the
    embedding, of which a step gathers a few rows)."""
    h, layers, inter = spec["hidden_size"], spec["num_hidden_layers"], spec["intermediate_size"]
    kv = spec["num_key_value_heads"] * (h // spec["num_attention_heads"])
    linear = layers * (h * (h + 2 * kv) + h * h + 3 * h * inter)
    head = h * spec["vocab_size"]
    dtype = engine.rsplit("-", 1)[1]
    if dtype in ("int8", "w8a8"):  # int8 linear layers, the head stays in the checkpoint's dtype
        return linear + head * (4 if spec["dtype"] == "float32" else 2)
    size = 4 if dtype == "float32" else 2
    return (linear + head) * size


# --- one engine, in its own process ----------------------------------------------------------


def _engine_kwargs(engine: str, spec: dict[str, Any]) -> dict[str, Any]:
    dtype = engine.rsplit("-", 1)[1]
    if dtype in ("int8", "w8a8"):  # int8 weight-only / int8 weights and activations
        return {"dtype": spec["dtype"], "quantization": dtype}
    return {"dtype": dtype}


def run_pagedllm(
    model: Path,
    reqs: list[Request],
    engine_name: str,
    spec: dict[str, Any],
    args: argparse.Namespace,
) -> dict[str, Any]:
    from pagedllm import Engine, SamplingParams
    from pagedllm.backends.cpu._ops import resolve_isa

    start = time.perf_counter()
    # The CPU's KV budget is given; a GPU's is half the card (others may share it).
    memory = (
        {"kv_cache_space": args.kv_cache_space}
        if args.device == "cpu"
        else {"gpu_memory_utilization": 0.5}
    )
    engine = Engine(
        str(model),
        device=args.device,
        skip_tokenizer_init=True,
        max_num_seqs=max(len(reqs), 64),
        **memory,
        **_engine_kwargs(engine_name, spec),
    )
    load_seconds = time.perf_counter() - start
    prompts = [{"prompt_token_ids": r.prompt} for r in reqs]
    params = [
        SamplingParams(temperature=0.0, max_tokens=r.output_len, ignore_eos=True) for r in reqs
    ]
    if args.device == "cpu":
        engine.generate(prompts[:2], [p.clone(max_tokens=2) for p in params[:2]], use_tqdm=False)
    else:  # every Triton specialisation the workload meets compiles here, not in the timing
        engine.generate(prompts, params, use_tqdm=False)
    c = engine.counters
    alloc0, used0 = c.kv_slots_allocated, c.kv_slots_used
    start = time.perf_counter()
    outs = engine.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    assert all(len(o.outputs[0].token_ids) == r.output_len for o, r in zip(outs, reqs, strict=True))
    alloc, used = c.kv_slots_allocated - alloc0, c.kv_slots_used - used0
    result = {
        "seconds": elapsed,
        "load_seconds": load_seconds,
        "kv_waste": 1 - used / alloc if alloc else 0.0,
        "attention_backend": engine.executor.collective_rpc("attention_name")[0],
        "isa": resolve_isa(),
        "linear_path": _worker_report(engine, "linear_path"),
        "layer_kernels": _worker_report(engine, "layer_kernels"),
    }
    if args.bandwidth:
        result["decode_step_seconds_64"] = _decode_step_seconds(engine, spec, 64)
    return result


def _worker_report(engine: Any, method: str) -> str | None:
    """A worker's description of what the backend chose (``linear_path``, ``layer_kernels``)."""
    try:
        return engine.executor.collective_rpc(method)[0]
    except (AttributeError, RuntimeError, TypeError):
        return None


def _decode_step_seconds(engine: Any, spec: dict[str, Any], num_seqs: int) -> float:
    """Median wall time of a decode step with ``num_seqs`` running sequences (short prompts)."""
    from pagedllm import SamplingParams

    rng = random.Random(1)
    params = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
    for i in range(num_seqs):
        prompt = [rng.randrange(3, spec["vocab_size"]) for _ in range(16)]
        engine.add_request(f"bw-{i}", {"prompt_token_ids": prompt}, params)
    times = []
    while engine.has_unfinished_requests():
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    decode = sorted(times[4:-4]) or sorted(times)  # past the prefill steps, before the tail
    return decode[len(decode) // 2]


def run_transformers(
    model: Path, reqs: list[Request], engine_name: str, args: argparse.Namespace
) -> dict[str, Any]:
    from transformers import AutoModelForCausalLM

    dtype = getattr(torch, engine_name.rsplit("-", 1)[1])
    device = torch.device(args.device)
    start = time.perf_counter()
    hf = AutoModelForCausalLM.from_pretrained(str(model), dtype=dtype).eval().to(device)
    load_seconds = time.perf_counter() - start
    start = time.perf_counter()
    with torch.inference_mode():
        for i in range(0, len(reqs), args.hf_batch_size):
            batch = reqs[i : i + args.hf_batch_size]
            width = max(len(r.prompt) for r in batch)
            ids = torch.zeros((len(batch), width), dtype=torch.long)
            mask = torch.zeros_like(ids)
            for j, r in enumerate(batch):  # left padding
                ids[j, width - len(r.prompt) :] = torch.tensor(r.prompt)
                mask[j, width - len(r.prompt) :] = 1
            new = max(r.output_len for r in batch)
            hf.generate(
                ids.to(device),
                attention_mask=mask.to(device),
                max_new_tokens=new,
                min_new_tokens=new,
                do_sample=False,
                pad_token_id=0,
            )
        if device.type == "cuda":
            torch.cuda.synchronize(device)  # the last batch's kernels may still be queued
    return {
        "seconds": time.perf_counter() - start,
        "load_seconds": load_seconds,
        "batch_size": args.hf_batch_size,
    }


def run_llama_cpp(
    model: Path, reqs: list[Request], engine_name: str, args: argparse.Namespace
) -> dict[str, Any]:
    sys.path.insert(0, str(Path(__file__).parent))
    import llama_cpp_bench

    quant = engine_name.rsplit("-", 1)[1]
    gguf = llama_cpp_bench.export_gguf(model, model / f"model-{quant}.gguf", quant)
    return llama_cpp_bench.run_llama_cpp(
        gguf, reqs, n_parallel=args.llama_cpp_parallel, threads=torch.get_num_threads()
    )


def run_one(engine: str, args: argparse.Namespace) -> dict[str, Any]:
    spec = MODELS[args.model_size]
    reqs = [Request(**r) for r in json.loads(args.requests.read_text())]
    if engine.startswith("pagedllm"):
        result = run_pagedllm(args.model_dir, reqs, engine, spec, args)
    elif engine.startswith("transformers"):
        result = run_transformers(args.model_dir, reqs, engine, args)
    else:
        result = run_llama_cpp(args.model_dir, reqs, engine, args)
    result["peak_rss_gib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / (1 << 20)
    return result


def _in_subprocess(engine: str, args: argparse.Namespace, requests: Path) -> dict[str, Any]:
    cmd = [
        sys.executable,
        __file__,
        "--run-one",
        engine,
        "--model-size",
        args.model_size,
        "--model-dir",
        str(args.model_dir),
        "--requests",
        str(requests),
        "--hf-batch-size",
        str(args.hf_batch_size),
        "--kv-cache-space",
        str(args.kv_cache_space),
        "--llama-cpp-parallel",
        str(args.llama_cpp_parallel),
        "--device",
        args.device,
        *(["--bandwidth"] if args.bandwidth else []),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        tail = proc.stderr.strip().splitlines()[-3:]
        return {"error": " | ".join(tail) or f"exit code {proc.returncode}"}
    return json.loads(proc.stdout.strip().splitlines()[-1])


# --- the side-by-side run ----------------------------------------------------------------------


def summarize(
    name: str, result: dict[str, Any], reqs: list[Request], flops: float, peak: float
) -> dict[str, Any]:
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
        "matmul_peak_fraction": flops / secs / peak if peak else None,
    }


def _engines(args: argparse.Namespace) -> list[str]:
    default = GPU_ENGINES if args.device != "cpu" else ENGINES[args.model_size]
    names = args.engines.split(",") if args.engines else default
    if args.skip_hf:
        names = [n for n in names if not n.startswith("transformers")]
    llama_missing = _llama_cpp_missing()
    return [n for n in names if not (n.startswith("llama.cpp") and llama_missing)]


def _llama_cpp_missing() -> str | None:
    sys.path.insert(0, str(Path(__file__).parent))
    import llama_cpp_bench

    return llama_cpp_bench.available()


def _ratios(results: list[dict[str, Any]]) -> dict[str, float]:
    speed = {r["engine"]: r["output_tokens_per_s"] for r in results if "output_tokens_per_s" in r}
    ours = [n for n in speed if n.startswith("pagedllm")]
    return {f"{a} / {b}": round(speed[a] / speed[b], 3) for a in ours for b in speed if a != b}


def _bandwidth(results: list[dict[str, Any]], spec: dict[str, Any], bw: float) -> dict[str, Any]:
    out = {}
    for r in results:
        step = r.get("decode_step_seconds_64")
        if step and bw:
            weights = streamed_weight_bytes(spec, r["engine"])
            out[r["engine"]] = {
                "weight_gib_per_step": round(weights / (1 << 30), 3),
                "step_seconds": round(step, 4),
                "fraction_of_read_bandwidth": round(weights / step / bw, 3),
            }
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-size", choices=sorted(MODELS), default="56m")
    parser.add_argument("--engines", default=None, help="comma-separated subset of the defaults")
    parser.add_argument("--num-requests", type=int, default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--hf-batch-size", type=int, default=None)
    parser.add_argument("--kv-cache-space", type=float, default=1.0)
    parser.add_argument("--llama-cpp-parallel", type=int, default=16)
    parser.add_argument("--bandwidth", action="store_true", help="time decode steps at 64 seqs")
    parser.add_argument("--model-dir", type=Path, default=None)
    parser.add_argument("--skip-hf", action="store_true")
    parser.add_argument("--smoke", action="store_true", help="tiny model and workload (CI)")
    parser.add_argument(
        "--device", choices=["cpu", "cuda"], default="cpu", help="cuda: ours vs transformers"
    )
    parser.add_argument("--output", type=Path, default=None, help="also write the JSON here")
    parser.add_argument("--run-one", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--requests", type=Path, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.smoke:
        args.model_size = "smoke"
    if args.run_one:
        print(json.dumps(run_one(args.run_one, args)))
        return
    big = args.model_size == "1b"
    n = args.num_requests or (4 if args.smoke else 16 if big else 64)
    args.hf_batch_size = args.hf_batch_size or (16 if big else 32)
    prompt_range, output_range = ((4, 16), (2, 6)) if args.smoke else ((32, 512), (32, 256))
    spec = MODELS[args.model_size]
    with tempfile.TemporaryDirectory() as tmp:
        args.model_dir = args.model_dir or Path(tmp) / f"llama-{args.model_size}"
        build_model(args.model_dir, spec)
        reqs = make_workload(n, spec["vocab_size"], prompt_range, output_range, args.seed)
        requests = Path(tmp) / "requests.json"
        requests.write_text(json.dumps([asdict(r) for r in reqs]))
        # The host's matmul peak and read bandwidth describe CPU engines only.
        on_cpu = args.device == "cpu"
        peak = matmul_peak_flops(0.3 if args.smoke else 2.0) if on_cpu else 0.0
        bw = (
            read_bandwidth(0.2 if args.smoke else 1.0, 1 << (26 if args.smoke else 30))
            if on_cpu
            else 0.0
        )
        flops = workload_flops(reqs, spec)
        results = [
            summarize(e, _in_subprocess(e, args, requests), reqs, flops, peak)
            for e in _engines(args)
        ]
    report = json.dumps(_report(args, spec, reqs, results, flops, peak, bw), indent=2)
    print(report)
    if args.output is not None:
        args.output.write_text(report + "\n")


def _report(
    args: argparse.Namespace,
    spec: dict[str, Any],
    reqs: list[Request],
    results: list[dict[str, Any]],
    flops: float,
    peak: float,
    bw: float,
) -> dict[str, Any]:
    from pagedllm.backends.cpu._ops import cpu_model_name, resolve_isa

    return {
        "benchmark": "throughput",
        "date": time.strftime("%Y-%m-%d"),
        "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
        "processor": cpu_model_name(),
        "isa": resolve_isa(),
        "torch_threads": torch.get_num_threads(),
        "model_size": args.model_size,
        "checkpoint_dtype": spec["dtype"],
        "num_requests": len(reqs),
        "input_tokens": sum(len(r.prompt) for r in reqs),
        "output_tokens": sum(r.output_len for r in reqs),
        "workload_gflop": flops / 1e9,
        "matmul_peak_gflops": peak / 1e9 or None,
        "read_bandwidth_gbps": bw / 1e9 or None,
        "results": results,
        "output_speed_ratios": _ratios(results),
        "decode_bandwidth": _bandwidth(results, spec, bw),
        "llama_cpp": _llama_cpp_missing() or "installed",
    }


if __name__ == "__main__":
    main()

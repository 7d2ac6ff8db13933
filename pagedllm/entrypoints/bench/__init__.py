"""``pagedllm bench throughput | latency | serve``: vLLM's three benchmark modes over pagedllm.

Each prints a summary table and, with ``--output-json FILE``, writes the full report there; a
progress bar runs on stderr unless ``--no-progress`` is given.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from typing import Any

from pagedllm.entrypoints.bench.stats import print_table
from pagedllm.entrypoints.cli_args import add_model_arg


def _common(p: argparse.ArgumentParser, *, seed: bool = True) -> None:
    """Dataset and output flags; offline modes share the engine's --seed instead."""
    p.add_argument(
        "--dataset", choices=["random", "sharegpt"], default="random", help="prompt source"
    )
    p.add_argument("--dataset-path", help="ShareGPT-format JSON file (for --dataset sharegpt)")
    p.add_argument("--num-prompts", type=int, default=100, help="requests to send")
    p.add_argument(
        "--input-len",
        type=int,
        default=128,
        help="random prompts: tokens offline, words against a server",
    )
    p.add_argument(
        "--output-len",
        type=int,
        default=128,
        help="tokens per answer (sharegpt: overrides the replies' lengths)",
    )
    if seed:
        p.add_argument("--seed", type=int, default=0, help="dataset and arrivals seed")
    p.add_argument("--output-json", help="write the whole report to this file")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def add_parser(sub: Any, add_engine_args: Callable[[argparse.ArgumentParser], None]) -> None:
    bench = sub.add_parser(
        "bench",
        help="benchmark the engine or a running server",
        description="Benchmarks: throughput (offline batch), latency "
        "(one batch end to end), serve (load against a server).",
    )
    modes = bench.add_subparsers(
        dest="bench_mode", metavar="{throughput,latency,serve}", required=True
    )
    thr = modes.add_parser("throughput", help="offline: all requests at once, requests/s")
    add_model_arg(thr, "Hugging Face model folder or GGUF file")
    _common(thr, seed=False)
    add_engine_args(thr)
    thr.set_defaults(handler=run_throughput)
    lat = modes.add_parser("latency", help="offline: one batch end to end, latency percentiles")
    add_model_arg(lat, "Hugging Face model folder or GGUF file")
    _common(lat, seed=False)
    lat.add_argument("--batch-size", type=int, default=8, help="requests in the one batch")
    lat.add_argument("--num-iters", type=int, default=10, help="timed runs of the batch")
    lat.add_argument("--num-iters-warmup", type=int, default=2, help="untimed runs first")
    add_engine_args(lat)
    lat.set_defaults(handler=run_latency, num_prompts=None)
    srv = modes.add_parser("serve", help="load generator against a running server")
    srv.add_argument("--url", default="http://127.0.0.1:8000", help="the server's base URL")
    srv.add_argument("--api-key", help="bearer key (default: $PAGEDLLM_API_KEY)")
    srv.add_argument("--model", help="served model name (default: the server's first)")
    srv.add_argument(
        "--endpoint", choices=["completions", "chat"], default="completions", help="API route"
    )
    srv.add_argument(
        "--request-rate",
        type=float,
        default=float("inf"),
        help="requests per second, Poisson arrivals (default inf: all at once)",
    )
    srv.add_argument("--max-concurrency", type=int, help="requests in flight at most")
    srv.add_argument(
        "--compare-all-at-once",
        action="store_true",
        help="then send the same requests all at once and print TTFT/TPOT of both runs and the "
        "ratio (whether decodes keep their pace while prompts arrive)",
    )
    srv.add_argument(
        "--no-ignore-eos",
        action="store_true",
        help="let answers end at EOS (default: exactly the output length)",
    )
    _common(srv)
    srv.set_defaults(handler=run_serve)


def _write_json(path: str | None, report: dict[str, Any]) -> None:
    if path:
        with open(path, "w") as f:
            json.dump(report, f, indent=2)


def _offline_requests(args: argparse.Namespace, engine: Any, n: int) -> list[Any]:
    from pagedllm.entrypoints.bench import datasets

    if args.dataset == "sharegpt":
        if not args.dataset_path:
            raise ValueError("--dataset-path: required with --dataset sharegpt")
        tok = engine.tokenizer
        return datasets.sharegpt_requests(
            args.dataset_path,
            n,
            args.seed or 0,
            lambda s: len(tok.encode(s)),
            max_model_len=engine.config.scheduler.max_model_len,
        )
    return datasets.random_token_requests(
        n, args.input_len, args.output_len, int(engine.vocab_size), args.seed or 0
    )


def _engine(args: argparse.Namespace) -> Any:
    from pagedllm import Engine
    from pagedllm.entrypoints.cli_args import engine_kwargs, model_from_args

    model = model_from_args(args, f"bench {args.bench_mode}")
    return Engine(model, args.device, **engine_kwargs(args))


def run_throughput(args: argparse.Namespace) -> int:
    from pagedllm.entrypoints.bench import offline

    engine = _engine(args)
    try:
        report = offline.throughput(
            engine, _offline_requests(args, engine, args.num_prompts), progress=not args.no_progress
        )
    finally:
        engine.shutdown()
    print_table(
        "Throughput Benchmark Result",
        [
            ("Requests", report["num_requests"]),
            ("Elapsed (s)", report["elapsed_s"]),
            ("Requests/s", report["requests_per_s"]),
            ("Total tokens/s", report["tokens_per_s"]),
            ("Output tokens/s", report["output_tokens_per_s"]),
        ],
        sys.stdout,
    )
    _write_json(args.output_json, report)
    return 0


def run_latency(args: argparse.Namespace) -> int:
    from pagedllm.entrypoints.bench import offline

    engine = _engine(args)
    try:
        requests = _offline_requests(args, engine, args.batch_size)
        report = offline.latency(
            engine,
            requests,
            num_iters=args.num_iters,
            warmup=args.num_iters_warmup,
            progress=not args.no_progress,
        )
    finally:
        engine.shutdown()
    rows: list[tuple[str, Any]] = [
        ("Batch size", report["batch_size"]),
        ("Iterations", report["num_iters"]),
        ("Avg latency (s)", report["avg_latency_s"]),
    ]
    rows += [(f"{k} latency (s)", v) for k, v in report["percentiles_s"].items()]
    print_table("Latency Benchmark Result", rows, sys.stdout)
    _write_json(args.output_json, report)
    return 0


def run_serve(args: argparse.Namespace) -> int:
    import httpx

    from pagedllm.config import env_api_key
    from pagedllm.entrypoints.bench import datasets, serve
    from pagedllm.entrypoints.bench.sse_client import run as run_async

    key = args.api_key or env_api_key()
    url = args.url.rstrip("/")
    if args.dataset == "sharegpt":
        if not args.dataset_path:
            raise ValueError("--dataset-path: required with --dataset sharegpt")
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        with httpx.Client(base_url=url, headers=headers, timeout=60) as client:
            info = client.get("/v1/models").json()["data"][0]

            def count(text: str) -> int:
                r = client.post("/tokenize", json={"prompt": text})
                return int(r.json()["count"]) if r.status_code == 200 else len(text.split())

            requests = datasets.sharegpt_requests(
                args.dataset_path,
                args.num_prompts,
                args.seed,
                count,
                max_model_len=info.get("max_model_len"),
            )
    else:
        requests = datasets.random_requests(
            args.num_prompts, args.input_len, args.output_len, args.seed
        )

    def one_run(rate: float) -> dict[str, Any]:
        report = run_async(
            serve.run(
                url,
                requests,
                model=args.model,
                api_key=key,
                chat=args.endpoint == "chat",
                request_rate=rate,
                max_concurrency=args.max_concurrency,
                ignore_eos=not args.no_ignore_eos,
                seed=args.seed,
                progress=not args.no_progress,
            )
        )
        serve.print_report(report, sys.stdout)
        return report

    report = one_run(args.request_rate)
    if args.compare_all_at_once:
        burst = one_run(float("inf"))
        report = serve.compare(report, burst)
        serve.print_comparison(report, sys.stdout)
        failed = report["arrivals"]["failed"] + report["all_at_once"]["failed"]
    else:
        failed = report["failed"]
    _write_json(args.output_json, report)
    return 0 if failed == 0 else 1

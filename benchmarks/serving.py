"""Serving benchmark: a fixed set of streaming requests at a chosen concurrency; JSON out.

    # against a running server
    python benchmarks/serving.py --base-url http://127.0.0.1:8000 --num-requests 64 \\
        --concurrency 8 --input-len 64 --output-len 128
    # start `pagedllm serve MODEL ...` for the run (extra serve flags after --)
    python benchmarks/serving.py --launch ./my-llama -- --device cuda --max-num-seqs 64
    # CI: a tiny random model on the CPU, a few requests, exit 1 on any failure
    python benchmarks/serving.py --smoke
    # served vs offline side by side: Engine in this process, then the server, same requests
    python benchmarks/serving.py --launch ./my-llama --compare-offline --concurrency 1,16,64
    # the same on throughput.py's random-weight 56M Llama, built for the run
    python benchmarks/serving.py --model-size 56m --compare-offline --concurrency 16,64

``--compare-offline`` (with ``--launch`` or ``--smoke``) runs the same requests through the
offline ``Engine`` in this process (add_request/step, what ``Engine.generate`` runs, with at
most C requests in flight like C clients) and through HTTP, taking turns per concurrency C (the
server's engine core idles meanwhile); it reports
both, their output-throughput ratio, and TTFT at one client against offline TTFT plus one HTTP
round trip (GET /health).

Prompts are built from a fixed word list with a seeded RNG, so every run sends the same requests.
Requests ask for ``ignore_eos`` so each produces exactly ``--output-len`` tokens. Reported:
request and token throughput, time to first token (TTFT), inter-token latency (ITL: gaps between
streamed chunks), time per output token (TPOT) and end-to-end latency, as percentiles in ms.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx

from pagedllm.config import env_api_key
from pagedllm.engine.cpu_binding import bind_threads, thread_ids
from pagedllm.entrypoints.bench import serve
from pagedllm.entrypoints.bench.datasets import BenchRequest, random_text
from pagedllm.entrypoints.bench.sse_client import run as run_async
from pagedllm.entrypoints.bench.stats import summarize


def make_prompts(n: int, words: int, seed: int) -> list[str]:
    return random_text(n, words, seed)


def serve_requests(
    base_url: str,
    model: str | None,
    prompts: list[str],
    output_len: int,
    concurrency: int,
    api_key: str | None,
    server_pid: int | None,
    client_cpus: str = "server",
) -> dict[str, Any]:
    """The prompts as streaming clients (``pagedllm bench serve``'s load generator), with the
    CPU seconds the client, the server and the engine core spent on them. With
    ``client_cpus="server"`` the clients run on the CPUs of the server process (see
    :func:`client_placement`)."""
    requests = [BenchRequest(p, output_len) for p in prompts]
    with client_placement(server_pid if client_cpus == "server" else None):
        before = cpu_seconds(server_pid)
        report = run_async(
            serve.run(base_url, requests, model=model, api_key=api_key, max_concurrency=concurrency)
        )
        after = cpu_seconds(server_pid)
    for key in ("ttfts_s", "tpots_s"):
        report.pop(key, None)
    report["concurrency"] = concurrency
    report["cpu_seconds"] = {k: after[k] - before.get(k, 0.0) for k in after}
    return report


@contextlib.contextmanager
def client_placement(server_pid: int | None) -> Iterator[None]:
    """Run this process's threads on the CPUs the API server process runs on, then put them
    back. The load generator stands in for clients on other machines: on this one it should
    take its CPU from the server's share (``pagedllm serve --cpu-bind auto`` keeps a CPU for
    the engine core's main thread), not from the core's main thread, which it would slow as no
    remote client can. Without a server pid, or where the server may run anywhere, nothing
    changes."""
    if server_pid is None or not hasattr(os, "sched_setaffinity"):
        yield
        return
    try:
        target = os.sched_getaffinity(server_pid)
    except OSError:
        target = set()
    before = {tid: os.sched_getaffinity(tid) for tid in thread_ids()}
    if not target or all(mask == target for mask in before.values()):
        yield
        return
    bind_threads(target)
    try:
        yield
    finally:
        for tid, mask in before.items():
            with contextlib.suppress(OSError):
                os.sched_setaffinity(tid, mask)


def cpu_seconds(server_pid: int | None) -> dict[str, float]:
    """CPU seconds so far: this process (the client), the server, and the server's children
    (the engine core and its workers); read from /proc, so empty where there is none. On a
    machine this small the three share the cores, so their sum is what the wall time pays."""
    out = {"client": time.process_time()}
    if server_pid is None or not Path(f"/proc/{server_pid}").exists():
        return out
    out["server"] = _proc_cpu(server_pid)
    out["core"] = sum(_proc_cpu(c) for c in _descendants(server_pid))
    return out


def _proc_cpu(pid: int) -> float:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


def _descendants(pid: int) -> list[int]:
    found: list[int] = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            children = [int(c) for c in (task / "children").read_text().split()]
        except OSError:
            continue
        for child in children:
            found += [child, *_descendants(child)]
    return found


def run_offline(
    engine: Any, prompts: list[str], output_len: int, concurrency: int
) -> dict[str, Any]:
    """The same requests through the in-process ``Engine``, at most ``concurrency`` in flight."""
    from pagedllm import SamplingParams

    params = SamplingParams(max_tokens=output_len, temperature=0, ignore_eos=True)
    pending = list(enumerate(prompts))
    sent: dict[str, float] = {}
    ttft: dict[str, float] = {}
    in_tokens = out_tokens = 0
    start, cpu_start = time.perf_counter(), time.process_time()
    while pending or sent:
        while pending and len(sent) < concurrency:
            i, prompt = pending.pop(0)
            rid = f"offline-{concurrency}-{i}"
            sent[rid] = time.perf_counter()
            engine.add_request(rid, prompt, params)
        for out in engine.step():
            now = time.perf_counter()
            if out.request_id not in ttft and out.outputs and out.outputs[0].token_ids:
                ttft[out.request_id] = now - sent[out.request_id]
            if out.finished:
                sent.pop(out.request_id, None)
                in_tokens += len(out.prompt_token_ids)
                out_tokens += sum(len(c.token_ids) for c in out.outputs)
    duration = time.perf_counter() - start
    return {
        "concurrency": concurrency,
        "num_requests": len(prompts),
        "duration_s": duration,
        "output_throughput": out_tokens / duration,
        "output_tokens": out_tokens,
        "total_token_throughput": (in_tokens + out_tokens) / duration,
        "ttft_ms": summarize(list(ttft.values())),
        "cpu_seconds": {"engine": time.process_time() - cpu_start},
    }


def offline_engine(model: str, extra: list[str]) -> Any:
    """The engine as `pagedllm serve MODEL EXTRA` builds it, here in this process, warmed up."""
    from pagedllm import Engine
    from pagedllm.entrypoints.cli import build_parser, engine_kwargs

    ns = build_parser().parse_args(["serve", model, *extra])
    engine = Engine(model, ns.device, **engine_kwargs(ns))
    run_offline(engine, make_prompts(2, 8, seed=99), 4, 2)
    return engine


def http_round_trip_ms(base_url: str, n: int = 20) -> float:
    with httpx.Client(base_url=base_url, timeout=10) as c:
        c.get("/health")
        times = []
        for _ in range(n):
            start = time.perf_counter()
            c.get("/health")
            times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def round_entry(served: dict[str, Any], offline: dict[str, Any] | None) -> dict[str, float]:
    """One round at one concurrency: both throughputs and their ratio (served alone: no ratio)."""
    entry = {"served": served["output_throughput"]}
    if offline:
        entry["offline"] = offline["output_throughput"]
        entry["ratio"] = served["output_throughput"] / max(offline["output_throughput"], 1e-9)
    return entry


def median_round(served: list[dict[str, Any]], offline: list[dict[str, Any]] | None) -> int:
    """The index of the round that stands for all of them: the one whose served/offline ratio
    is the median (the lower of the middle two for an even count), or whose served throughput
    is, without an offline column."""
    if offline is None:
        keys = [s["output_throughput"] for s in served]
    else:
        keys = [round_entry(s, o)["ratio"] for s, o in zip(served, offline, strict=True)]
    order = sorted(range(len(keys)), key=keys.__getitem__)
    return order[(len(order) - 1) // 2]


def compare(
    offline: dict[int, dict[str, Any]], served: dict[int, dict[str, Any]], rtt_ms: float
) -> dict[str, Any]:
    """Ratios served/offline per concurrency, and TTFT at the lowest concurrency."""
    ratios = {
        str(c): served[c]["output_throughput"] / offline[c]["output_throughput"]
        for c in offline
        if offline[c]["output_throughput"] > 0
    }
    low = min(offline)
    off_ttft = offline[low]["ttft_ms"].get("median", 0.0)
    srv_ttft = served[low]["ttft_ms"].get("median", 0.0)
    return {
        "output_throughput_ratio": ratios,
        "http_round_trip_ms": rtt_ms,
        "ttft_median_ms": {
            "concurrency": low,
            "offline": off_ttft,
            "served": srv_ttft,
            "served_minus_offline_minus_rtt": srv_ttft - off_ttft - rtt_ms,
        },
    }


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def launch(model: str, extra: list[str], port: int) -> subprocess.Popen[bytes]:
    cmd = [
        sys.executable,
        "-m",
        "pagedllm.entrypoints.cli",
        "serve",
        model,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        *extra,
    ]
    print("launching:", " ".join(cmd), file=sys.stderr)
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": f"{root}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    return subprocess.Popen(cmd, stdout=sys.stderr, stderr=sys.stderr, env=env)


def wait_healthy(base_url: str, proc: subprocess.Popen[bytes], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"the server exited with status {proc.returncode}")
        try:
            if httpx.get(base_url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    raise SystemExit(f"the server was not healthy after {timeout:.0f}s")


def stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def build_sized_model(folder: Path, size: str) -> Path:
    """throughput.py's random-weight Llama of ``size``, with the demo model's tokenizer (its
    4,096 ids are a subset of the model's vocabulary) so that text prompts can be served."""
    import shutil

    from throughput import MODELS, build_model

    from pagedllm.entrypoints.demo import DEMO_MODEL

    path = build_model(folder, MODELS[size])
    for item in DEMO_MODEL.iterdir():
        if item.name.startswith("tokenizer") or item.name == "special_tokens_map.json":
            shutil.copy(item, path / item.name)
    return path


def build_tiny_model(folder: Path) -> Path:
    """A random-weight two-layer Llama with a small byte-level BPE tokenizer (for --smoke)."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=384,
        special_tokens=["<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(make_prompts(200, 12, seed=1), trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")
    fast.save_pretrained(str(folder))
    config = LlamaConfig(
        vocab_size=len(fast),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        bos_token_id=0,
        eos_token_id=1,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(str(folder))
    return folder


def parse_args(argv: list[str] | None) -> tuple[argparse.Namespace, list[str]]:
    argv = list(sys.argv[1:] if argv is None else argv)
    extra: list[str] = []
    if "--" in argv:
        cut = argv.index("--")
        argv, extra = argv[:cut], argv[cut + 1 :]
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    target = p.add_mutually_exclusive_group()
    target.add_argument(
        "--base-url",
        default="http://127.0.0.1:8000",
        help="a running server (default http://127.0.0.1:8000)",
    )
    target.add_argument("--launch", metavar="MODEL", help="start `pagedllm serve MODEL`")
    target.add_argument(
        "--smoke", action="store_true", help="tiny random model on the CPU, a few requests (for CI)"
    )
    target.add_argument(
        "--model-size",
        choices=("56m", "125m"),
        help="build benchmarks/throughput.py's random-weight Llama of this size (with the demo "
        "model's tokenizer) and launch it: a step long enough to be a real model's",
    )
    p.add_argument("--model", help="model name to request (default: the server's first)")
    p.add_argument(
        "--api-key", default=env_api_key(), help="bearer key (default: $PAGEDLLM_API_KEY)"
    )
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument(
        "--concurrency",
        default="8",
        help="concurrent clients; a comma list (1,16,64) runs each in turn",
    )
    p.add_argument(
        "--compare-offline",
        action="store_true",
        help="also run the same requests through the offline Engine (needs --launch "
        "or --smoke) and report the ratios",
    )
    p.add_argument(
        "--server-args",
        default="",
        help="extra `pagedllm serve` flags for the server only, not the offline engine "
        "(e.g. '--cpu-threads 1')",
    )
    p.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="repeat the offline/served turns this many times; each concurrency is reported "
        "by its median round (a shared host's speed drifts between minutes), every round "
        "listed under 'rounds'",
    )
    p.add_argument(
        "--client-cpus",
        choices=("server", "any"),
        default="server",
        help="server: the streaming clients run on the launched server's CPUs (standing in for "
        "remote clients, they take the front end's share, not the engine core's main thread's); "
        "any: wherever the kernel puts them",
    )
    p.add_argument("--input-len", type=int, default=64, help="words per prompt")
    p.add_argument("--output-len", type=int, default=128, help="tokens per response")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--startup-timeout", type=float, default=600)
    args = p.parse_args(argv)
    if args.smoke:
        args.num_requests, args.concurrency = 8, "1,4"
        args.input_len, args.output_len = 16, 16
        args.compare_offline = True
    args.concurrency = [int(c) for c in str(args.concurrency).split(",")]
    if args.rounds < 1:
        p.error("--rounds: must be at least 1")
    if args.compare_offline and not (args.launch or args.smoke or args.model_size):
        p.error(
            "--compare-offline needs --launch MODEL, --model-size or --smoke "
            "(the engine is built here)"
        )
    return args, extra


def prompt_sets(args: argparse.Namespace) -> dict[int, list[str]]:
    """Per concurrency, the requests: all of them, but at most 8 for one client at a time."""
    prompts = make_prompts(args.num_requests, args.input_len, args.seed)
    return {c: prompts[: min(len(prompts), 8)] if c == 1 else prompts for c in args.concurrency}


def main(argv: list[str] | None = None) -> int:
    args, extra = parse_args(argv)
    prompts = prompt_sets(args)
    proc, engine = None, None
    offline: dict[int, dict[str, Any]] | None = None
    with tempfile.TemporaryDirectory() as tmp:
        base_url = args.base_url
        if args.smoke or args.launch or args.model_size:
            model = args.launch
            if args.model_size:
                model = str(
                    build_sized_model(Path(tmp) / f"llama-{args.model_size}", args.model_size)
                )
            if args.smoke:
                model = str(build_tiny_model(Path(tmp) / "tiny-llama"))
                extra = [
                    "--device",
                    "cpu",
                    "--dtype",
                    "float32",
                    "--num-kv-blocks",
                    "128",
                    "--block-size",
                    "16",
                    "--max-model-len",
                    "256",
                    *extra,
                ]
            if args.compare_offline:
                engine = offline_engine(model, extra)
            port = free_port()
            base_url = f"http://127.0.0.1:{port}"
            proc = launch(model, [*extra, *args.server_args.split()], port)
        try:
            if proc is not None:
                wait_healthy(base_url, proc, args.startup_timeout)
            # Offline and served take turns per concurrency, so a machine whose load drifts
            # (a shared CI box) tilts both columns alike rather than one.
            served_runs: dict[int, list[dict[str, Any]]] = {c: [] for c in prompts}
            offline_runs: dict[int, list[dict[str, Any]]] = {c: [] for c in prompts}
            for _ in range(args.rounds):
                for c, ps in prompts.items():
                    if engine is not None:
                        offline_runs[c].append(run_offline(engine, ps, args.output_len, c))
                    served_runs[c].append(
                        serve_requests(
                            base_url,
                            args.model,
                            ps,
                            args.output_len,
                            c,
                            args.api_key,
                            proc.pid if proc is not None else None,
                            args.client_cpus,
                        )
                    )
            rtt = http_round_trip_ms(base_url) if engine is not None else 0.0
        finally:
            if proc is not None:
                stop(proc)
            if engine is not None:
                engine.shutdown()
    # Each concurrency is reported by one whole round, the one with the median ratio (or the
    # median served throughput without an offline column): its throughputs, TTFTs and ratio
    # belong together, which medians taken field by field would not.
    pick = {
        c: median_round(served_runs[c], offline_runs[c] if engine is not None else None)
        for c in prompts
    }
    served = {c: served_runs[c][i] for c, i in pick.items()}
    offline = {c: offline_runs[c][i] for c, i in pick.items()} if engine is not None else None
    if offline is not None:
        report: dict[str, Any] = {
            "served": {str(c): r for c, r in served.items()},
            "offline": {str(c): r for c, r in offline.items()},
            **compare(offline, served, rtt),
        }
        if args.rounds > 1:
            report["rounds"] = {
                str(c): [
                    round_entry(s_run, o_run)
                    for s_run, o_run in zip(served_runs[c], offline_runs[c], strict=True)
                ]
                for c in prompts
            }
            report["median_round"] = {str(c): i for c, i in pick.items()}
    elif len(served) == 1:
        report = next(iter(served.values()))
    else:
        report = {"served": {str(c): r for c, r in served.items()}}
    print(json.dumps(report, indent=2))
    failed = sum(r["failed"] for runs in served_runs.values() for r in runs)
    if args.smoke:
        want = {c: len(ps) * args.output_len for c, ps in prompts.items()}
        bad = (
            failed
            or any(r["output_tokens"] != want[c] for c in want for r in served_runs[c])
            or any(r["output_tokens"] != want[c] for c in want for r in offline_runs[c])
        )
        if bad or (proc is not None and proc.returncode != 0):
            print("smoke test FAILED", file=sys.stderr)
            return 1
    return 0 if failed == 0 else 1


if __name__ == "__main__":
    sys.exit(main())

"""Decode attention on an NVIDIA GPU: our Triton split-K kernel against the PyTorch alternatives.

For each context length, on the same random paged cache (blocks scattered by a permutation, as
after a while of serving), it times one decode step of the whole batch:

* ``triton``: :func:`paged_decode_attention` (reads K/V through the block tables);
* ``torch_gathered``: gather the blocks into contiguous K/V with one indexing op, then SDPA
  (what a paged cache costs without a paged kernel);
* ``sdpa_contiguous``: ``scaled_dot_product_attention`` on K/V that are already contiguous (no
  paging at all: the bar to reach).

Every iteration first overwrites a buffer larger than L2, so K/V come from HBM (``--no-flush`` to
keep L2 warm). Each implementation is timed as one CUDA-graph replay (``ms``: the kernels' own
time) and as launched (``ms_eager``: Python's launch cost included, what the engine pays today;
on the first H200 runs two runs' eager Triton times differed 3.5x while PyTorch's agreed).
Bandwidth = KV + query + output bytes per second, against the theoretical peak
from the device's memory clock and bus width (or ``--peak-gbps``). Prints one JSON object.

    python benchmarks/attention_gpu.py            # batch 32, context 512/2048, d=128, 8q/2kv, fp16
    python benchmarks/attention_gpu.py --smoke    # tiny shapes; on CPU under Triton's interpreter
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--contexts", type=int, nargs="+", default=[512, 2048])
    p.add_argument("--head-size", type=int, default=128)
    p.add_argument("--num-heads", type=int, default=8)
    p.add_argument("--num-kv-heads", type=int, default=2)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--dtype", default="float16", choices=["float16", "bfloat16", "float32"])
    p.add_argument("--partition-size", type=int, default=None, help="default: sized per device")
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--peak-gbps", type=float, default=None, help="override the peak bandwidth")
    p.add_argument("--no-flush", action="store_true", help="do not flush L2 between iterations")
    p.add_argument("--smoke", action="store_true", help="tiny shapes; CPU runs use the interpreter")
    p.add_argument("--output", default=None, help="also write the JSON here")
    return p.parse_args(argv)


def peak_bytes_per_s(props: object) -> float | None:
    """DDR peak: 2 transfers per clock x bus width; None when torch does not expose them."""
    clock_khz = getattr(props, "memory_clock_rate", 0)
    bus_bits = getattr(props, "memory_bus_width", 0)
    if not clock_khz or not bus_bits:
        return None
    return 2.0 * clock_khz * 1e3 * bus_bits / 8


def timer(
    device: torch.device, flush: torch.Tensor | None
) -> Callable[..., dict[str, float | None]]:
    """Median seconds of ``fn`` over ``iters`` calls (CUDA events on the GPU), launched as it is
    (``eager``: what the engine pays today, Python launch overhead included) and, on a GPU, as
    one CUDA-graph replay (``graph``: the kernels' own time; None where capture fails)."""

    def measure(fn: Callable[[], object], iters: int, warmup: int = 3) -> float:
        for _ in range(warmup):
            fn()
        times = []
        for _ in range(iters):
            if flush is not None:
                flush.zero_()
            if device.type == "cuda":
                start = torch.cuda.Event(enable_timing=True)
                end = torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end) / 1e3)
            else:
                t0 = time.perf_counter()
                fn()
                times.append(time.perf_counter() - t0)
        return statistics.median(times)

    def run(fn: Callable[[], object], iters: int) -> dict[str, float | None]:
        eager = measure(fn, iters)
        replay = graphed(fn) if device.type == "cuda" else None
        return {"eager": eager, "graph": measure(replay, iters) if replay else None}

    return run


def graphed(fn: Callable[[], object]) -> Callable[[], object] | None:
    """``fn`` captured in a CUDA graph (its replay launches every kernel at once), or None."""
    try:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm up off the capture (Triton compiles, allocator)
            for _ in range(3):
                fn()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
    except Exception as exc:  # a benchmark: whatever the capture refuses, time it eagerly
        sys.stderr.write(f"CUDA graph capture failed ({exc}); eager timing only\n")
        return None
    return graph.replay


def decode_case(
    args: argparse.Namespace, ctx: int, device: torch.device, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Query [b, h, d], a scattered paged cache in the Triton layout, block tables, seq lens."""
    b, kvh, d, bs = args.batch, args.num_kv_heads, args.head_size, args.block_size
    per_seq = -(-ctx // bs)
    num_blocks = b * per_seq
    gen = torch.Generator().manual_seed(0)
    tables = torch.randperm(num_blocks, generator=gen).view(b, per_seq).to(torch.int32)
    cache = torch.randn((2, num_blocks, kvh, bs, d), generator=gen).to(dtype)
    query = torch.randn((b, args.num_heads, d), generator=gen).to(dtype)
    seq_lens = torch.full((b,), ctx, dtype=torch.int32)
    return query.to(device), cache.to(device), tables.to(device), seq_lens.to(device)


def run_context(
    args: argparse.Namespace,
    ctx: int,
    device: torch.device,
    dtype: torch.dtype,
    timed: Callable[..., float],
    peak: float | None,
) -> list[dict]:
    """Time the three implementations at one context length; check they agree."""
    from pagedllm.backends.gpu.triton_ops import decode_partition_size, paged_decode_attention

    query, cache, tables, seq_lens = decode_case(args, ctx, device, dtype)
    b, h, d = query.shape
    kvh, scale = args.num_kv_heads, d**-0.5
    partition = args.partition_size or decode_partition_size(ctx, b, kvh, device)
    q4 = query.unsqueeze(2)  # [b, h, 1, d]

    def triton_fn() -> torch.Tensor:
        return paged_decode_attention(
            query, cache, tables, seq_lens, ctx, scale, partition_size=partition
        )

    def gathered() -> torch.Tensor:  # [2, b, blocks, kvh, bs, d] -> [b, kvh, ctx, d]
        kv = cache[:, tables.long()].permute(0, 1, 3, 2, 4, 5).reshape(2, b, kvh, -1, d)
        k, v = kv[0, :, :, :ctx], kv[1, :, :, :ctx]
        return F.scaled_dot_product_attention(q4, k, v, scale=scale, enable_gqa=True)[:, :, 0]

    kv = cache[:, tables.long()].permute(0, 1, 3, 2, 4, 5).reshape(2, b, kvh, -1, d)
    k_c, v_c = kv[0, :, :, :ctx].contiguous(), kv[1, :, :, :ctx].contiguous()

    def contiguous() -> torch.Tensor:
        return F.scaled_dot_product_attention(q4, k_c, v_c, scale=scale, enable_gqa=True)[:, :, 0]

    elem = cache.element_size()
    moved = 2 * b * ctx * kvh * d * elem + 2 * b * h * d * elem  # K+V read, q read, out written
    ref = triton_fn().float()
    rows = []
    for name, fn in (
        ("triton", triton_fn),
        ("torch_gathered", gathered),
        ("sdpa_contiguous", contiguous),
    ):
        times = timed(fn, args.iters)
        secs = times["graph"] or times["eager"]
        bw = moved / secs
        rows.append(
            {
                "context": ctx,
                "impl": name,
                "partition_size": partition if name == "triton" else None,
                "timing": "cuda_graph" if times["graph"] else "eager",
                "ms": round(secs * 1e3, 4),
                "ms_eager": round(times["eager"] * 1e3, 4),
                "gbytes_per_s": round(bw / 1e9, 2),
                "frac_of_peak": round(bw / peak, 3) if peak else None,
                "max_abs_diff_vs_triton": float((fn().float() - ref).abs().max()),
            }
        )
    return rows


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    on_cuda = torch.cuda.is_available()
    if args.smoke:
        args.batch, args.contexts, args.iters = 2, [48], 1
        args.head_size, args.num_heads, args.num_kv_heads, args.partition_size = 64, 4, 2, 32
        if not on_cuda:
            # Only a script may do this: the kernels must be decorated after the variable is set.
            os.environ["TRITON_INTERPRET"] = "1"
            args.dtype = "float32"
    elif not on_cuda:
        sys.stderr.write("no CUDA device: run on a GPU, or pass --smoke (interpreter on CPU)\n")
        return 2
    device = torch.device("cuda" if on_cuda else "cpu")
    dtype = getattr(torch, args.dtype)
    props = torch.cuda.get_device_properties(device) if on_cuda else None
    peak = args.peak_gbps * 1e9 if args.peak_gbps else (peak_bytes_per_s(props) if props else None)
    flush = None
    if on_cuda and not args.no_flush:  # 4x L2 (or 256 MiB) of bytes to overwrite
        l2 = getattr(props, "L2_cache_size", 0) or (64 << 20)
        flush = torch.empty(max(4 * l2, 256 << 20), dtype=torch.uint8, device=device)
    timed = timer(device, flush)
    results = [
        r for ctx in args.contexts for r in run_context(args, ctx, device, dtype, timed, peak)
    ]
    report = {
        "device": props.name if props else "cpu (triton interpreter)",
        "dtype": args.dtype,
        "batch": args.batch,
        "num_heads": args.num_heads,
        "num_kv_heads": args.num_kv_heads,
        "head_size": args.head_size,
        "block_size": args.block_size,
        "l2_flushed": flush is not None,
        "peak_gbytes_per_s": round(peak / 1e9, 1) if peak else None,
        "results": results,
    }
    text = json.dumps(report, indent=2)
    sys.stdout.write(text + "\n")
    if args.output:
        with open(args.output, "w") as fh:
            fh.write(text + "\n")
    worst = max(r["max_abs_diff_vs_triton"] for r in results)
    tol = 1e-3 if dtype == torch.float32 else 2e-2
    if worst > tol:
        sys.stderr.write(f"implementations disagree: max abs diff {worst:.3e} > {tol}\n")
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Decode attention on the CPU: the C++ paged kernel against the PyTorch alternatives.

For each context length it times, on the same random paged cache (blocks scattered by a random
permutation, as after a while of serving):

* ``cpp``: :class:`CppPagedAttention` (the C++ kernel reading K/V through block tables);
* ``torch_gathered``: :class:`TorchPagedAttention`'s decode path (gather blocks, batched einsum);
* ``reference``: the per-sequence oracle (only when cheap: ``--with-reference``);
* ``sdpa_gqa`` / ``sdpa_expanded``: ``scaled_dot_product_attention`` on contiguous K/V, with
  ``enable_gqa=True`` and with K/V pre-expanded to all query heads (what it reads is not paged).

It also measures the machine's memory bandwidth in the same run (a large ``copy_``, read + write
bytes per second, and a read-only ``sum``) and reports the kernel's KV bytes read per second
against both. ``--kv-cache-dtype`` repeats every case with the cache stored in each given dtype
(float32, bfloat16, float16, fp8_e4m3, fp8_e5m2; the query stays in ``--dtype``) and reports the
cpp decode time relative to the float32 cache. ``--soft-cap`` also times the kernel with Gemma
2's attention soft cap (``soft_cap_time_ratio``: its cost). The JSON names the processor, the
ISA build and its vector path, and the cache dtype of every case. Prints one JSON object.

    python benchmarks/attention_cpu.py            # batch 32, context 512 and 2048, d=128, 8q/2kv
    python benchmarks/attention_cpu.py --kv-cache-dtype float32 bfloat16 fp8_e4m3 --contexts 4096
    python benchmarks/attention_cpu.py --soft-cap 50 --head-size 256  # Gemma 2's cap, its cost
    python benchmarks/attention_cpu.py --smoke    # tiny shapes, a few seconds (CI)
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from pagedllm.backends.base import (
    KV_CACHE_DTYPES,
    AttentionMetadata,
    build_attention_metadata,
    from_cache_dtype,
    to_cache_dtype,
)
from pagedllm.backends.cpu._ops import cpu_model_name
from pagedllm.backends.cpu.attention import TorchPagedAttention
from pagedllm.backends.cpu.kernel_attention import CppPagedAttention
from pagedllm.backends.reference import ReferenceAttention


def bench(fn: Callable[[], object], reps: int, warmup: int = 2) -> float:
    """Median seconds per call."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def memory_bandwidth(num_bytes: int, reps: int) -> tuple[float, float]:
    """(copy, read) bytes per second: ``dst.copy_(src)`` counting read + write, and ``sum()``.

    Buffers are allocated (and faulted in) once: a ``clone`` would mostly time page faults.
    """
    src = torch.ones(num_bytes // 4)
    dst = torch.empty_like(src)
    copy = 2 * num_bytes / bench(lambda: dst.copy_(src), reps)
    read = num_bytes / bench(src.sum, reps)
    return copy, read


def decode_case(
    *, batch: int, ctx: int, heads: int, kv_heads: int, head_size: int, block_size: int
) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
    """A decode batch of ``batch`` sequences of ``ctx`` tokens over a scattered paged cache."""
    blocks_per_seq = (ctx + block_size - 1) // block_size
    num_blocks = batch * blocks_per_seq
    perm = torch.randperm(num_blocks).tolist()
    tables = [perm[i * blocks_per_seq : (i + 1) * blocks_per_seq] for i in range(batch)]
    slots = [t[(ctx - 1) // block_size] * block_size + (ctx - 1) % block_size for t in tables]
    meta = build_attention_metadata(
        num_prefills=0,
        seq_lens=[ctx] * batch,
        query_lens=[1] * batch,
        slot_mapping=slots,
        block_tables=tables,
        block_size=block_size,
        device=torch.device("cpu"),
    )
    # [2, num_blocks, kv_heads, block_size, head_size]: the C++ kernel's layout.
    cache = torch.randn(2, num_blocks, kv_heads, block_size, head_size)
    query = torch.randn(batch, heads, head_size)
    return query, cache, meta


def run_case(
    *,
    batch: int,
    ctx: int,
    heads: int,
    kv_heads: int,
    head_size: int,
    block_size: int,
    reps: int,
    with_reference: bool,
    copy_bw: float,
    read_bw: float,
    kv_cache_dtype: str = "float32",
    dtype: torch.dtype = torch.float32,
    soft_cap: float | None = None,
) -> dict[str, object]:
    query, cache, meta = decode_case(
        batch=batch,
        ctx=ctx,
        heads=heads,
        kv_heads=kv_heads,
        head_size=head_size,
        block_size=block_size,
    )
    scale = head_size**-0.5
    cache = to_cache_dtype(cache, KV_CACHE_DTYPES[kv_cache_dtype])
    query = query.to(dtype)
    cpp, gathered = CppPagedAttention(), TorchPagedAttention()
    ref_cache = cache  # one layout for every kernel and the reference
    out = cpp.forward(query, cache, meta, scale)
    expect = gathered.forward(query, ref_cache, meta, scale)
    max_diff = (out.float() - expect.float()).abs().max().item()

    # Contiguous K/V for SDPA: [batch, kv_heads, ctx, d], one query token per sequence.
    idx = meta.block_tables.long()
    wide = from_cache_dtype(cache).to(dtype)  # SDPA reads K/V in the compute dtype
    k = wide[0][idx].permute(0, 2, 1, 3, 4).reshape(batch, kv_heads, -1, head_size)[:, :, :ctx]
    v = wide[1][idx].permute(0, 2, 1, 3, 4).reshape(batch, kv_heads, -1, head_size)[:, :, :ctx]
    k, v = k.contiguous(), v.contiguous()
    q4 = query.unsqueeze(2)  # [batch, heads, 1, d]
    group = heads // kv_heads
    k_exp = k.repeat_interleave(group, dim=1)
    v_exp = v.repeat_interleave(group, dim=1)

    times = {
        "cpp": bench(lambda: cpp.forward(query, cache, meta, scale), reps),
        "torch_gathered": bench(lambda: gathered.forward(query, ref_cache, meta, scale), reps),
        "sdpa_gqa": bench(
            lambda: F.scaled_dot_product_attention(q4, k, v, scale=scale, enable_gqa=True), reps
        ),
        "sdpa_expanded": bench(
            lambda: F.scaled_dot_product_attention(q4, k_exp, v_exp, scale=scale), reps
        ),
    }
    capped: dict[str, object] = {}
    if soft_cap is not None:  # Gemma 2's cap: the same kernel, tanh on every score first
        cap = {"logits_soft_cap": soft_cap}
        times["cpp_soft_cap"] = bench(lambda: cpp.forward(query, cache, meta, scale, **cap), reps)
        got = cpp.forward(query, cache, meta, scale, **cap).float()
        want = gathered.forward(query, ref_cache, meta, scale, **cap).float()
        capped = {
            "soft_cap": soft_cap,
            "soft_cap_max_abs_diff_vs_torch": (got - want).abs().max().item(),
            "soft_cap_time_ratio": round(times["cpp_soft_cap"] / times["cpp"], 3),
        }
    if with_reference:
        ref = ReferenceAttention()
        times["reference"] = bench(lambda: ref.forward(query, ref_cache, meta, scale), 2, 1)
    kv_bytes = 2 * batch * ctx * kv_heads * head_size * cache.element_size()
    best_sdpa = min(times["sdpa_gqa"], times["sdpa_expanded"])
    return {
        "batch": batch,
        "context": ctx,
        "heads": heads,
        "kv_heads": kv_heads,
        "head_size": head_size,
        "block_size": block_size,
        "kv_cache_dtype": kv_cache_dtype,
        "dtype": str(dtype).removeprefix("torch."),
        "max_abs_diff_vs_torch": max_diff,
        "time_ms": {name: round(t * 1e3, 3) for name, t in times.items()},
        "speedup_vs_torch_gathered": round(times["torch_gathered"] / times["cpp"], 2),
        "speedup_vs_best_sdpa": round(best_sdpa / times["cpp"], 2),
        "kv_bytes": kv_bytes,
        "cpp_kv_read_gbps": round(kv_bytes / times["cpp"] / 1e9, 2),
        "cpp_kv_read_vs_copy_bw": round(kv_bytes / times["cpp"] / copy_bw, 2),
        "cpp_kv_read_vs_read_bw": round(kv_bytes / times["cpp"] / read_bw, 2),
        **capped,
    }


def _ratios(cases: list[dict[str, object]]) -> dict[str, float]:
    """cpp decode time of each (context, cache dtype) over the float32 cache's, when timed."""
    base = {
        c["context"]: c["time_ms"]["cpp"]  # type: ignore[index]
        for c in cases
        if c["kv_cache_dtype"] == "float32"
    }
    return {
        f"{c['context']}/{c['kv_cache_dtype']}": round(
            c["time_ms"]["cpp"] / base[c["context"]],  # type: ignore[index]
            3,
        )
        for c in cases
        if c["context"] in base and c["kv_cache_dtype"] != "float32"
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--smoke", action="store_true", help="tiny shapes, quick (CI)")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--contexts", type=int, nargs="+", default=[512, 2048])
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--head-size", type=int, default=128)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--with-reference", action="store_true", help="also time the oracle")
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads")
    parser.add_argument(
        "--kv-cache-dtype",
        nargs="+",
        default=["float32"],
        choices=[n for n in KV_CACHE_DTYPES if n != "fp8"],
        help="cache dtypes to time (default float32)",
    )
    parser.add_argument(
        "--dtype", default="float32", choices=["float32", "bfloat16", "float16"], help="query"
    )
    parser.add_argument(
        "--soft-cap",
        type=float,
        default=None,
        help="also time the kernel with this attention soft cap (Gemma 2: 50)",
    )
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    if args.smoke:
        args.batch, args.contexts, args.head_size, args.reps = 2, [40], 64, 3
        args.with_reference = True
        args.kv_cache_dtype = ["float32", "bfloat16", "fp8_e4m3"]
        args.soft_cap = 50.0
    copy_bw, read_bw = memory_bandwidth(
        16 << 20 if args.smoke else 512 << 20, 3 if args.smoke else 5
    )
    cases = [
        run_case(
            batch=args.batch,
            ctx=ctx,
            heads=args.heads,
            kv_heads=args.kv_heads,
            head_size=args.head_size,
            block_size=args.block_size,
            reps=args.reps,
            with_reference=args.with_reference,
            copy_bw=copy_bw,
            read_bw=read_bw,
            kv_cache_dtype=kv_dtype,
            dtype=getattr(torch, args.dtype),
            soft_cap=args.soft_cap,
        )
        for ctx in args.contexts
        for kv_dtype in args.kv_cache_dtype
    ]
    cpp = CppPagedAttention()
    report = {
        "threads": torch.get_num_threads(),
        "processor": cpu_model_name(),
        "isa": cpp.isa,
        "vector_path": cpp.vector_path,
        "kv_cache_dtypes": args.kv_cache_dtype,
        "cpp_time_vs_float32_cache": _ratios(cases),
        "copy_bandwidth_gbps": round(copy_bw / 1e9, 2),
        "read_bandwidth_gbps": round(read_bw / 1e9, 2),
        "cases": cases,
    }
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()

"""Linear layers on the CPU: float32 oneDNN-packed vs bf16 F.linear vs our 16/8-bit GEMMs.

Shapes of a 1B Llama-shaped model (K=2048; N = 2560 fused qkv, 16384 fused gate_up, 2048 o_proj,
32000 LM head) at decode-ish batches (M = 1, 16, 64) and a prefill-ish one (M = 512). For each
shape, side by side in one run:

* ``f32_onednn``: the float32 path the CPU backend uses today (oneDNN-packed weights);
* ``bf16_torch``: ``F.linear`` on bf16 weights and activations (what bf16 gets without us);
* ``bf16_onednn``: oneDNN's packed bf16 weights, where the processor has bf16 arithmetic;
* ``bf16_cpp`` / ``fp16_cpp`` / ``int8_cpp``: our GEMM (``csrc/gemm.cpp``) on 2- or 1-byte
  weights, bf16 activations;
* ``w8a8_cpp``: our integer GEMM (``csrc/gemm_i8.cpp``): the same int8 weights, the bf16
  activations rounded to int8 per row inside the call, integer dot products;
* ``int8_split_cpp``: weight-only int8 on the same integer GEMM, the bf16 activations split into
  two int8 planes (near-16-bit precision; what int8 layers use where there is AMX-INT8 or VNNI),
  except that without AMX-INT8 bf16 batches of ``int8_dp_min_rows()`` rows or more convert the
  weights to bf16 once per K-block instead; ``int8_planes_cpp``: the planes at every batch;
* ``linear_path``: what ``CpuBackend.prepare_model`` would pick for a bf16 weight on this CPU.

Reports milliseconds per call (best of several), ratios to float32 and to bf16 F.linear, and for
M=1 the weight bytes streamed per second (weights are read once per call; activations are
negligible). A weight smaller than the last-level cache (o_proj in bf16/int8) is timed from the
cache, so its GB/s exceeds the memory's; in a whole model every layer comes from memory.

    python benchmarks/linear_cpu.py            # the 1B shapes above
    python benchmarks/linear_cpu.py --smoke    # small shapes, a few seconds (CI)
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from pagedllm.backends.cpu._ops import cpu_model_name, resolve_isa
from pagedllm.backends.cpu.packed_linear import (
    gemm_ops,
    make_16bit_linear,
    make_cpp_linear,
    make_int8_linear,
    make_int8_split_linear,
    make_packed_linear,
    make_w8a8_linear,
)
from pagedllm.layers.quantization import quantize_per_channel

SHAPES_1B = {"qkv": 2560, "gate_up": 16384, "o_proj": 2048, "lm_head": 32000}
HIDDEN_1B = 2048


def bench(fn: Callable[[], object], budget_s: float) -> float:
    """Fastest call within about ``budget_s`` (at least 3 timed calls).

    The minimum, not the median: on a shared machine other processes only ever add time.
    """
    fn()
    times: list[float] = []
    start = time.perf_counter()
    while len(times) < 3 or (time.perf_counter() - start < budget_s and len(times) < 50):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def _planes_only(
    q: torch.Tensor, scale: torch.Tensor
) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """int8_split_cpp with every batch on the two planes (``dp_min_rows=0``): what big bf16
    batches ran before they converted the weights per K-block."""
    ops = gemm_ops()
    if ops is None:
        return None
    packed = ops.pack_w8a8(q)
    n, scale32 = q.shape[0], scale.float().contiguous()
    return lambda x: ops.int8_split_gemm(x, packed, n, scale32, dp_min_rows=0)


def run_shape(n: int, k: int, batches: list[int], budget_s: float) -> list[dict[str, object]]:
    torch.manual_seed(0)
    w32 = torch.randn(n, k) * 0.02
    w16 = w32.bfloat16()
    q, scale = quantize_per_channel(w32)
    paths = {
        "f32_onednn": (make_packed_linear(w32, None), torch.float32, 4),
        "bf16_torch": (lambda x: F.linear(x, w16), torch.bfloat16, 2),
        # Only where the processor computes bf16 (oneDNN refuses to pack it elsewhere).
        "bf16_onednn": (make_packed_linear(w16, None), torch.bfloat16, 2),
        "bf16_cpp": (make_cpp_linear(w16, None, None), torch.bfloat16, 2),
        "fp16_cpp": (make_cpp_linear(w32.half(), None, None), torch.bfloat16, 2),
        "int8_cpp": (make_cpp_linear(q, scale, None), torch.bfloat16, 1),
        "w8a8_cpp": (make_w8a8_linear(q, scale, None), torch.bfloat16, 1),
        "int8_split_cpp": (make_int8_split_linear(q, scale, None), torch.bfloat16, 1),
        "int8_planes_cpp": (_planes_only(q, scale), torch.bfloat16, 1),
    }
    rows = []
    for m in batches:
        x = torch.randn(m, k)
        row: dict[str, object] = {"n": n, "k": k, "m": m}
        for name, (fn, dtype, nbytes) in paths.items():
            if fn is None:
                continue
            xi = x.to(dtype)
            seconds = bench(lambda fn=fn, xi=xi: fn(xi), budget_s)
            row[f"{name}_ms"] = round(seconds * 1e3, 3)
            if m == 1:
                row[f"{name}_weight_GBps"] = round(n * k * nbytes / seconds / 1e9, 2)
        for name in (
            "bf16_cpp",
            "fp16_cpp",
            "int8_cpp",
            "w8a8_cpp",
            "int8_split_cpp",
            "bf16_torch",
            "bf16_onednn",
        ):
            if f"{name}_ms" in row and "f32_onednn_ms" in row:
                row[f"{name}_vs_f32"] = round(row["f32_onednn_ms"] / row[f"{name}_ms"], 2)
        if "int8_cpp_ms" in row:
            row["int8_vs_bf16_cpp"] = round(row["bf16_cpp_ms"] / row["int8_cpp_ms"], 2)
            row["bf16_cpp_vs_bf16_torch"] = round(row["bf16_torch_ms"] / row["bf16_cpp_ms"], 2)
        if "w8a8_cpp_ms" in row:
            row["w8a8_vs_bf16_cpp"] = round(row["bf16_cpp_ms"] / row["w8a8_cpp_ms"], 2)
            row["w8a8_vs_int8_cpp"] = round(row["int8_cpp_ms"] / row["w8a8_cpp_ms"], 2)
        if "int8_split_cpp_ms" in row:
            row["int8_split_vs_int8_cpp"] = round(row["int8_cpp_ms"] / row["int8_split_cpp_ms"], 2)
            best_bf16 = min(row.get("bf16_onednn_ms", float("inf")), row["bf16_cpp_ms"])
            row["int8_split_vs_best_bf16"] = round(best_bf16 / row["int8_split_cpp_ms"], 2)
        rows.append(row)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--smoke", action="store_true", help="small shapes, a few seconds (CI)")
    parser.add_argument("--threads", type=int, default=None, help="intra-op threads")
    parser.add_argument("--budget", type=float, default=1.0, help="seconds per measurement")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.smoke:
        shapes, k, batches, budget = {"qkv": 96, "lm_head": 500}, 128, [1, 16], 0.05
    else:
        shapes, k, batches, budget = SHAPES_1B, HIDDEN_1B, [1, 16, 64, 512], args.budget
    ops = gemm_ops()
    result = {
        "benchmark": "linear_cpu",
        "processor": cpu_model_name(),
        "isa": resolve_isa(),
        "gemm_isa": ops.built_isa() if ops is not None else None,
        "w8a8_isa": ops.w8a8_isa() if ops is not None else None,
        "linear_path_bf16": make_16bit_linear(torch.randn(32, 32).bfloat16(), None)[1],
        "linear_path_int8": make_int8_linear(
            torch.zeros(16, 64, dtype=torch.int8), torch.ones(16), None
        )[1],
        "threads": torch.get_num_threads(),
        "shapes": {name: run_shape(n, k, batches, budget) for name, n in shapes.items()},
    }
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()

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
* ``int4_cpp`` / ``q4_0_cpp`` / ``q4_k_cpp`` / ``q8_0_cpp`` / ``q6_k_cpp``: our group-wise GEMM
  (``csrc/gemm_q4.cpp``) on the same weight quantised in groups of 32 as each source stores it
  (int4 made at load: fp16 scale and offset, 5 bits a weight; Q4_0: 4.5; Q4_K: d and dmin per 8
  groups, 4.625; Q8_0: 8.5; Q6_K: q - 32 as int8, d per 8 groups times int8 sc per 16 k,
  8.625; ``q6_k6``: Q6_K's q at 6 bits, 6.625, where the build reads them, the float path
  only), with the path each batch takes by default (the integer dot path
  for bf16 batches of up to 8 rows where there is VNNI); ``int4_float_cpp``: the float path at
  every batch;
* ``linear_path``: what ``CpuBackend.prepare_model`` would pick for a bf16 weight on this CPU.

The ``decode`` section times 1-8 rows with every call streaming its weights from memory (each
path cycles through copies of its weights, ``--stream-mb`` in all: by default twice the
last-level cache Linux reports, at least 256 MiB): bf16, the int8 path the backend picks, and
the group-wise formats, with ``read_GBps`` (``read_bytes`` over the same int4 copies: every
byte loaded once on all threads) and each path's weight bytes per second at one row as a share
of it.

Reports milliseconds per call (best of several), ratios to float32 and to bf16 F.linear, and for
M=1 the weight bytes streamed per second (weights are read once per call; activations are
negligible). A weight smaller than the last-level cache (o_proj in bf16/int8) is timed from the
cache, so its GB/s exceeds the memory's; in a whole model every layer comes from memory.

    python benchmarks/linear_cpu.py            # the 1B shapes above
    python benchmarks/linear_cpu.py --smoke    # small shapes, a few seconds (CI)
    python benchmarks/linear_cpu.py --head 128256  # only the decode section, one LM head
    python benchmarks/linear_cpu.py --dot-rows  # the group-wise dot path vs the float path
    python benchmarks/linear_cpu.py --dot-rows --shapes smol_qkv,smol_head --formats q4_1,q8_0

``--dot-rows`` times, for the 1B layer shapes as the model packs them (``DOT_SHAPES``: the
fused q/k/v and gate/up included) and each group-wise format, the dot path (x rounded to int8
per group) against the float path on the same packed weights and against oneDNN's bf16 GEMM,
at 1 to 512 rows of bf16 x, the contenders taking turns in one process (best of several): what
``groupwise_linear.DOT_ROWS`` is measured by. Each contender cycles through copies of its
weights as the decode section does (``--stream-mb 0``: one copy, timed from the cache).

``--rows-kernels`` times, for the demo model's layer shapes (``DEMO_SHAPES``, or ``--shapes``
of either table) and each group-wise format, 1 to 4 rows of bf16 x (or ``--rows``) under the
default kernel against the float one (``rows_kernel="fma"``: float32 FMAs on q for few rows, the
dequantised scratch past them) on the same packed weights, taking turns in one process: on AVX2
builds without AVX-512 the default rounds x to int16 per group and runs ``vpmaddwd``, in
registers for few rows (``groupwise_int16_rows``) and on register tiles over widened weights
past them (``groupwise_int16_tiles_from``); ``<fmt>_default_vs_float`` > 1 where it is faster.

    python benchmarks/linear_cpu.py --rows-kernels --shapes qkv,gate_up,down \
        --rows 5,8,16,64,512 --formats q4_0,q4_k,q8_0 --stream-mb 0

The group-wise weights come from small quantisers here (``_q4_0``, ``_q4_k``, ``_q8_0``: the
formats, not ggml's search for the best scales), which is all the timing needs.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F

from pagedllm.backends.cpu._ops import cpu_model_name, resolve_isa
from pagedllm.backends.cpu.dense_gemm import (
    gemm_ops,
    make_16bit_linear,
    make_cpp_linear,
    make_int8_linear,
    make_int8_split_linear,
    make_packed_linear,
    make_w8a8_linear,
)
from pagedllm.backends.cpu.groupwise_linear import make_groupwise_gemm, path_name
from pagedllm.backends.cpu.groupwise_pack import PackedGroupwise, pack_groupwise
from pagedllm.layers.quantization import quantize_per_channel
from pagedllm.layers.quantization.groupwise import pack_nibbles, quantize_int4

SHAPES_1B = {"qkv": 2560, "gate_up": 16384, "o_proj": 2048, "lm_head": 32000}
HIDDEN_1B = 2048
# (N, K) of a 1B Llama's layers: q/o, k/v, gate/up, down, and the fused q/k/v and gate/up.
DOT_SHAPES = {
    "o_proj": (2048, 2048),
    "k_proj": (512, 2048),
    "up_proj": (8192, 2048),
    "down_proj": (2048, 8192),
    "qkv": (3072, 2048),
    "gate_up": (16384, 2048),
}
# (N, K) of the demo model's (SmolLM2-135M: Q4_1 layers, a Q8_0 tied head) as it packs them.
DEMO_SHAPES = {
    "smol_qkv": (960, 576),
    "smol_o": (576, 576),
    "smol_gate_up": (3072, 576),
    "smol_down": (576, 1536),
    "smol_head": (49152, 576),
}
DOT_ROWS = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512]


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


def _fp16(t: torch.Tensor) -> torch.Tensor:
    return t.half().float()


def _groups(w: torch.Tensor) -> torch.Tensor:
    return w.float().reshape(w.shape[0], -1, 32)  # [N, G, 32]


def _q4_0(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Symmetric 4-bit: fp16 d per group, q = round(w / d) + 8, offset -8 d (Q4_0's format)."""
    g = _groups(w)
    d = _fp16(g.abs().amax(dim=-1).clamp_min(1e-8) / 7.5)  # [N, G]
    q = (torch.round(g / d[..., None]) + 8).clamp(0, 15).reshape(w.shape)
    return pack_nibbles(q), d, -8 * d


def _q4_1(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """4-bit with fp16 d and fp16 offset m (the group's minimum) per group: Q4_1's format."""
    g = _groups(w)
    low = _fp16(g.amin(dim=-1))
    d = _fp16(((g.amax(dim=-1) - low) / 15).clamp_min(1e-8))
    q = torch.round((g - low[..., None]) / d[..., None]).clamp(0, 15).reshape(w.shape)
    return pack_nibbles(q), d, low


def _q4_k(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Q4_K's format: per 8 groups fp16 d and dmin, per group 6-bit sc and m; scale = d * sc,
    offset = -dmin * m (Q4_K's own search for the scales is left out)."""
    g = _groups(w)
    n, groups = g.shape[:2]
    low = g.amin(dim=-1).clamp_max(0)  # [N, G]: Q4_K's offsets are <= 0
    step = ((g.amax(dim=-1) - low) / 15).clamp_min(1e-8)
    factored = []
    for values in (step, -low):
        blocks = values.reshape(n, groups // 8, 8)
        unit = _fp16(blocks.amax(dim=-1, keepdim=True).clamp_min(1e-8) / 63)
        units = torch.round(blocks / unit).clamp(0, 63)
        factored.append((unit * units).reshape(n, groups))
    scale, offset = factored[0].clamp_min(1e-8), -factored[1]
    q = torch.round((g - offset[..., None]) / scale[..., None]).clamp(0, 15).reshape(w.shape)
    return pack_nibbles(q), scale, offset


def _q8_0(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
    g = _groups(w)
    d = _fp16(g.abs().amax(dim=-1).clamp_min(1e-8) / 127)
    q = torch.round(g / d[..., None]).clamp(-127, 127).to(torch.int8).reshape(w.shape)
    return q, d, None


def _q6_k(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None, torch.Tensor]:
    """Q6_K's format: q in -32..31 per 16 k scaled by d * sc (fp16 d per 256 k, int8 sc)."""
    n = w.shape[0]
    g = w.float().reshape(n, -1, 16)  # [N, K/16, 16]
    step = g.abs().amax(dim=-1).clamp_min(1e-8) / 31  # [N, K/16]
    d = _fp16(step.reshape(n, -1, 16).amax(dim=-1) / 127).clamp_min(2**-24)  # [N, K/256]
    sc = torch.round(step / d.repeat_interleave(16, dim=1)).clamp(1, 127)
    scale = d.repeat_interleave(16, dim=1) * sc
    q = torch.round(g / scale[..., None]).clamp(-32, 31).to(torch.int8).reshape(w.shape)
    return q, scale, None, d


def groupwise_weights(w32: torch.Tensor) -> dict[str, PackedGroupwise]:
    """``w32 [N, K]`` packed as each group-wise source stores it."""
    ops = gemm_ops()
    made = {"int4": quantize_int4(w32), "q4_0": _q4_0(w32), "q8_0": _q8_0(w32)}
    made["q4_1"] = _q4_1(w32)
    if w32.shape[1] % 256 == 0:  # Q4_K's and Q6_K's super-blocks
        made["q4_k"] = _q4_k(w32)
        made["q6_k"] = _q6_k(w32)
    packed = {name: pack_groupwise(ops, *tensors) for name, tensors in made.items()}
    if "q6_k" in made and ops.groupwise_six_bits():
        packed["q6_k6"] = pack_groupwise(ops, *made["q6_k"], six=True)
    return packed


def _groupwise_paths(w32: torch.Tensor) -> dict[str, tuple[object, torch.dtype, float]]:
    if gemm_ops() is None:
        return {}
    paths: dict[str, tuple[object, torch.dtype, float]] = {}
    for name, pw in groupwise_weights(w32).items():
        gemm = make_groupwise_gemm(gemm_ops(), pw, None)
        paths[f"{name}_cpp"] = (gemm, torch.bfloat16, pw.bits_per_weight / 8)
        if name == "int4":
            float_only = (lambda x, gemm=gemm: gemm(x, dot=False), torch.bfloat16)
            paths["int4_float_cpp"] = (*float_only, pw.bits_per_weight / 8)
    return paths


def _int8_default() -> str:
    """The int8 column the backend's own choice for int8 weight-only layers runs."""
    path = make_int8_linear(torch.zeros(16, 64, dtype=torch.int8), torch.ones(16), None).path
    return "int8_split_cpp" if path.startswith("cpp-int8-split") else "int8_cpp"


def _groupwise_ratios(row: dict[str, object]) -> None:
    int8 = row.get(f"{_int8_default()}_ms")
    best_bf16 = min(row.get("bf16_onednn_ms", math.inf), row.get("bf16_cpp_ms", math.inf))
    for name in ("int4", "int4_float", "q4_0", "q4_k", "q8_0"):
        ms = row.get(f"{name}_cpp_ms")
        if ms is None:
            continue
        if int8 is not None:
            row[f"{name}_vs_int8"] = round(int8 / ms, 2)
        if best_bf16 < math.inf:
            row[f"{name}_vs_best_bf16"] = round(best_bf16 / ms, 2)


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
        **_groupwise_paths(w32),
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
        _groupwise_ratios(row)
        rows.append(row)
    return rows


def _cycling(fns: list[Callable[[torch.Tensor], object]]) -> Callable[[torch.Tensor], object]:
    """One call after another through ``fns``: each on weights not read since a cycle ago."""
    state = {"i": 0}

    def call(x: torch.Tensor) -> object:
        state["i"] += 1
        return fns[state["i"] % len(fns)](x)

    return call


def _copies(nbytes: float, stream_bytes: float) -> int:
    return max(1, math.ceil(stream_bytes / nbytes))


def last_level_cache_bytes() -> int:
    """The largest CPU cache Linux reports for cpu0 (0 where it reports none). Hosts here have
    had 32 MiB and 480 MiB: a fixed stream size that evicts one keeps the other's weights in
    cache (one-row kernels then read 2x faster than in a model)."""
    best = 0
    for index in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*"):
        try:
            size = (index / "size").read_text().strip()
        except OSError:
            continue
        units = {"K": 2**10, "M": 2**20, "G": 2**30}
        if size and size[-1] in units and size[:-1].isdigit():
            best = max(best, int(size[:-1]) * units[size[-1]])
        elif size.isdigit():
            best = max(best, int(size))
    return best


def default_stream_mb() -> float:
    """Weight copies a streamed path cycles, in MiB: twice the last-level cache, at least 256."""
    return max(256.0, 2 * last_level_cache_bytes() / 2**20)


def _interleaved(fns: dict[str, Callable[[], object]], budget_s: float) -> dict[str, float]:
    """Each function's fastest call, the functions taking turns (a few calls each, over
    several rounds) so that all of them meet the same memory traffic from other processes."""
    best = {name: math.inf for name in fns}
    rounds = 5
    for _ in range(rounds):
        for name, fn in fns.items():
            best[name] = min(best[name], bench(fn, budget_s / rounds))
    return best


def decode_from_memory(
    n: int, k: int, batches: list[int], budget_s: float, stream_bytes: float
) -> dict[str, object]:
    """Decode rows with each path's weights streamed from memory (see the module docstring)."""
    ops = gemm_ops()
    torch.manual_seed(1)
    w32 = torch.randn(n, k) * 0.02
    q, scale = quantize_per_channel(w32)
    w16 = w32.bfloat16()
    # name -> (make one copy: (linear, its packed tensor or None), bytes per weight)
    makers: dict[str, tuple[Callable[[], tuple[object, torch.Tensor | None]], float]] = {
        "bf16": (lambda: (make_16bit_linear(w16.clone(), None).fn, None), 2.0),
        "int8": (lambda: (make_int8_linear(q.clone(), scale, None).fn, None), 1.0),
    }
    for name, pw in groupwise_weights(w32).items():

        def copy(pw: PackedGroupwise = pw) -> tuple[object, torch.Tensor]:
            clone = dataclasses.replace(pw, packed=pw.packed.clone())
            return make_groupwise_gemm(ops, clone, None), clone.packed

        makers[name] = (copy, pw.bits_per_weight / 8)
    calls: dict[str, Callable[[torch.Tensor], object]] = {}
    read = None
    for name, (make, per_weight) in makers.items():
        made = [make() for _ in range(_copies(n * k * per_weight, stream_bytes))]
        if all(fn is not None for fn, _ in made):
            calls[name] = _cycling([fn for fn, _ in made])
        if name == "int4":  # the read bandwidth, over these very copies
            read = _cycling([lambda x, t=t: ops.read_bytes(t) for _, t in made])
            read_bytes = made[0][1].numel()
    rows: list[dict[str, object]] = []
    read_gbps = None
    for m in batches:
        x = torch.randn(m, k).bfloat16()
        fns = {name: lambda call=call, x=x: call(x) for name, call in calls.items()}
        if m == 1 and read is not None:
            fns["read"] = lambda: read(None)
        best = _interleaved(fns, budget_s * len(fns))
        if "read" in best:
            read_gbps = round(read_bytes / best.pop("read") / 1e9, 2)
        row: dict[str, object] = {"m": m}
        for name, seconds in best.items():
            row[f"{name}_ms"] = round(seconds * 1e3, 3)
            if m == 1:
                gbps = n * k * makers[name][1] / seconds / 1e9
                row[f"{name}_weight_GBps"] = round(gbps, 2)
                if read_gbps:
                    row[f"{name}_read_share"] = round(gbps / read_gbps, 2)
        for name in ("int4", "q4_0", "q4_k", "q8_0", "q6_k", "q6_k6"):
            if f"{name}_ms" in row and "bf16_ms" in row:
                row[f"{name}_vs_bf16"] = round(row["bf16_ms"] / row[f"{name}_ms"], 2)
            if f"{name}_ms" in row and "int8_ms" in row:
                row[f"{name}_vs_int8"] = round(row["int8_ms"] / row[f"{name}_ms"], 2)
        rows.append(row)
    return {
        "n": n,
        "k": k,
        "stream_MB": round(stream_bytes / 2**20),
        "read_GBps": read_gbps,
        "rows": rows,
    }


def _panel_copies(
    packed: dict[str, PackedGroupwise], stream_bytes: float
) -> dict[str, list[PackedGroupwise]]:
    """Per format, the layer and enough copies of its panels to stream ``stream_bytes``."""
    return {
        fmt: [pw]
        + [
            dataclasses.replace(pw, packed=pw.packed.clone())
            for _ in range(_copies(pw.packed.numel(), stream_bytes) - 1)
        ]
        for fmt, pw in packed.items()
    }


def _vector_path(ops: object, pw: PackedGroupwise, x: torch.Tensor) -> torch.Tensor:
    """The float path on vdpbf16ps where it would take AMX tiles."""
    fmt = (pw.bits, pw.half_scales, pw.with_offset, pw.factored)
    return ops.groupwise_gemm(x, pw.packed, pw.n, *fmt, None, False, pw.levels, False)  # type: ignore[attr-defined]


def dot_vs_float(
    shapes: dict[str, tuple[int, int]],
    batches: list[int],
    budget_s: float,
    formats: list[str],
    stream_bytes: float = 0.0,
) -> dict[str, list[dict[str, object]]]:
    """Per shape and row count: each format's dot and float path and bf16 oneDNN, interleaved;
    ``<fmt>_dot_vs_float`` > 1 where the dot path is faster. Where bf16 batches take AMX tiles
    (``groupwise_amx_rows``), also the float path kept on vdpbf16ps (``<fmt>_vector``), and
    ``<fmt>_float_vs_vector`` > 1 where the tiles are faster. Each path cycles through copies
    of its weights, ``stream_bytes`` in all (0: one copy, timed from the cache)."""
    ops = gemm_ops()
    tiles_from = ops.groupwise_amx_rows()
    out: dict[str, list[dict[str, object]]] = {}
    for name, (n, k) in shapes.items():
        torch.manual_seed(0)
        w32 = torch.randn(n, k) * 0.02
        w16 = w32.bfloat16()
        dense = make_packed_linear(w16, None)
        if dense is not None:
            more = _copies(n * k * 2, stream_bytes) - 1
            dense = _cycling([dense] + [make_packed_linear(w16.clone(), None) for _ in range(more)])
        packed = {
            fmt: pw
            for fmt, pw in groupwise_weights(w32).items()
            if fmt in formats and pw.bits != 6  # six-bit layers have no dot path
        }
        copies = _panel_copies(packed, stream_bytes)
        gemms = {
            fmt: [make_groupwise_gemm(ops, pw, None) for pw in made] for fmt, made in copies.items()
        }
        rows = []
        for m in batches:
            x = torch.randn(m, k).bfloat16()
            fns: dict[str, Callable[[], object]] = {}
            if dense is not None:
                fns["bf16_onednn"] = lambda dense=dense, x=x: dense(x)
            for fmt, made in gemms.items():
                dot = _cycling([partial(gemm, dot=True) for gemm in made])
                flt = _cycling([partial(gemm, dot=False) for gemm in made])
                fns[f"{fmt}_dot"] = partial(dot, x)
                fns[f"{fmt}_float"] = partial(flt, x)
                if tiles_from and m >= tiles_from:
                    vector = _cycling([partial(_vector_path, ops, pw) for pw in copies[fmt]])
                    fns[f"{fmt}_vector"] = partial(vector, x)
            best = _interleaved(fns, budget_s * len(fns))
            row: dict[str, object] = {"m": m}
            for key, seconds in best.items():
                row[f"{key}_ms"] = round(seconds * 1e3, 3)
            for fmt in gemms:
                dot, flt = best[f"{fmt}_dot"], best[f"{fmt}_float"]
                row[f"{fmt}_dot_vs_float"] = round(flt / dot, 2)
                if "bf16_onednn" in best:
                    row[f"{fmt}_dot_vs_bf16"] = round(best["bf16_onednn"] / dot, 2)
                    row[f"{fmt}_float_vs_bf16"] = round(best["bf16_onednn"] / flt, 2)
                row[f"{fmt}_dot_GMACps"] = round(m * n * k / dot / 1e9, 1)
                nbytes = packed[fmt].packed.numel()  # weight bytes each call streams
                row[f"{fmt}_float_GBps"] = round(nbytes / flt / 1e9, 2)
                row[f"{fmt}_dot_GBps"] = round(nbytes / dot / 1e9, 2)
                if f"{fmt}_vector" in best:
                    row[f"{fmt}_float_vs_vector"] = round(best[f"{fmt}_vector"] / flt, 2)
            rows.append(row)
        out[name] = rows
    return out


def rows_kernels(
    shapes: dict[str, tuple[int, int]],
    batches: list[int],
    budget_s: float,
    formats: list[str],
    stream_bytes: float = 0.0,
) -> dict[str, list[dict[str, object]]]:
    """Per shape and row count: each format's few bf16 rows under the default kernel and under
    the float one (``rows_kernel="fma"``), interleaved, each cycling through copies of its
    weights (``stream_bytes`` in all; 0: one copy, timed from the cache)."""
    ops = gemm_ops()
    out: dict[str, list[dict[str, object]]] = {}
    for name, (n, k) in shapes.items():
        torch.manual_seed(0)
        packed = {
            fmt: pw
            for fmt, pw in groupwise_weights(torch.randn(n, k) * 0.02).items()
            if fmt in formats
        }
        copies = _panel_copies(packed, stream_bytes)
        rows = []
        for m in batches:
            x = torch.randn(m, k).bfloat16()
            fns: dict[str, Callable[[], object]] = {}
            for fmt, made in copies.items():
                for label, kernel in (("default", "split"), ("float", "fma")):
                    calls = [
                        lambda x, pw=pw, kernel=kernel: pw.gemm(ops, x, None, False, kernel)
                        for pw in made
                    ]
                    fns[f"{fmt}_{label}"] = partial(_cycling(calls), x)
            best = _interleaved(fns, budget_s * len(fns))
            row: dict[str, object] = {"m": m}
            for key, seconds in best.items():
                row[f"{key}_us"] = round(seconds * 1e6, 1)
            for fmt in copies:
                default, flt = best[f"{fmt}_default"], best[f"{fmt}_float"]
                row[f"{fmt}_default_vs_float"] = round(flt / default, 2)
                row[f"{fmt}_default_GBps"] = round(packed[fmt].packed.numel() / default / 1e9, 2)
            rows.append(row)
        out[name] = rows
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--smoke", action="store_true", help="small shapes, a few seconds (CI)")
    parser.add_argument("--threads", type=int, default=None, help="intra-op threads")
    parser.add_argument("--budget", type=float, default=1.0, help="seconds per measurement")
    parser.add_argument(
        "--stream-mb",
        type=float,
        default=None,
        help="weight copies each streamed path cycles (default: 2x the last-level cache)",
    )
    parser.add_argument("--head", type=int, default=None, help="only decode, an LM head of N")
    parser.add_argument(
        "--dot-rows", action="store_true", help="only the dot path vs the float path, 1-512 rows"
    )
    parser.add_argument(
        "--shapes", default=None, help="--dot-rows: comma-separated DOT_SHAPES / DEMO_SHAPES"
    )
    parser.add_argument("--rows", default=None, help="--dot-rows: comma-separated row counts")
    parser.add_argument(
        "--formats", default="q4_0,q4_k,q8_0,q6_k", help="--dot-rows: group-wise formats (q4_1 too)"
    )
    parser.add_argument(
        "--rows-kernels",
        action="store_true",
        help="only bf16 rows (1-4, or --rows): the default kernel vs the float one (DEMO_SHAPES)",
    )
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    stream_mb = args.stream_mb if args.stream_mb is not None else default_stream_mb()
    if args.rows_kernels:
        names = args.shapes.split(",") if args.shapes else list(DEMO_SHAPES)
        known = {**DOT_SHAPES, **DEMO_SHAPES}
        ops = gemm_ops()
        result = {
            "benchmark": "linear_cpu_rows_kernels",
            "processor": cpu_model_name(),
            "isa": resolve_isa(),
            "gemm_isa": ops.built_isa(),
            "int16_rows": ops.groupwise_int16_rows(),
            "int16_tiles_from": ops.groupwise_int16_tiles_from(),
            "path_q4_1": path_name(ops, "int4", four_bit=True),
            "path_q8_0": path_name(ops, "q8_0"),
            "threads": torch.get_num_threads(),
            "stream_MB": round(stream_mb),
            "shapes": rows_kernels(
                {name: known[name] for name in names},
                [int(r) for r in args.rows.split(",")] if args.rows else [1, 2, 3, 4],
                args.budget,
                args.formats.split(","),
                stream_mb * 2**20,
            ),
        }
        print(json.dumps(result, indent=1))
        return
    if args.dot_rows:
        names = args.shapes.split(",") if args.shapes else list(DOT_SHAPES)
        known = {**DOT_SHAPES, **DEMO_SHAPES}
        rows = [int(r) for r in args.rows.split(",")] if args.rows else DOT_ROWS
        result = {
            "benchmark": "linear_cpu_dot_rows",
            "processor": cpu_model_name(),
            "isa": resolve_isa(),
            "threads": torch.get_num_threads(),
            "llc_MB": round(last_level_cache_bytes() / 2**20),
            "stream_MB": round(stream_mb),
            "shapes": dot_vs_float(
                {name: known[name] for name in names},
                rows,
                args.budget,
                args.formats.split(","),
                stream_mb * 2**20,
            ),
        }
        print(json.dumps(result, indent=1))
        return
    if args.head:
        shapes, k, batches, budget = {}, HIDDEN_1B, [], args.budget
        decode_shapes, decode_rows, stream_bytes = {"lm_head": args.head}, [1, 8, 16, 64], 0.0
    elif args.smoke:
        shapes, k, batches, budget = {"qkv": 96, "lm_head": 500}, 256, [1, 16], 0.05
        decode_shapes, decode_rows, stream_bytes = {"lm_head": 500}, [1, 8], 0.0
    else:
        shapes, k, batches, budget = SHAPES_1B, HIDDEN_1B, [1, 16, 64, 512], args.budget
        decode_shapes, decode_rows, stream_bytes = shapes, [1, 2, 4, 8], stream_mb * 2**20
    ops = gemm_ops()
    result = {
        "benchmark": "linear_cpu",
        "processor": cpu_model_name(),
        "isa": resolve_isa(),
        "gemm_isa": ops.built_isa() if ops is not None else None,
        "w8a8_isa": ops.int8_dot_isa() if ops is not None else None,
        "linear_path_bf16": make_16bit_linear(torch.randn(32, 32).bfloat16(), None).path,
        "linear_path_int8": make_int8_linear(
            torch.zeros(16, 64, dtype=torch.int8), torch.ones(16), None
        ).path,
        "linear_path_int4": path_name(ops, "int4") if ops is not None else "torch-int4",
        "linear_path_q8_0": path_name(ops, "q8_0") if ops is not None else "torch-q8_0",
        "threads": torch.get_num_threads(),
        "llc_MB": round(last_level_cache_bytes() / 2**20),
        "shapes": {name: run_shape(n, k, batches, budget) for name, n in shapes.items()},
        "decode": {
            name: decode_from_memory(n, k, decode_rows, budget, stream_bytes)
            for name, n in decode_shapes.items()
        },
    }
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()

"""Compile every Triton kernel for real NVIDIA targets, with no GPU present.

The interpreter proves what the kernels compute but not that they lower to PTX: dot shapes,
loop-carried types and register pressure only show up in the compiler. ``triton.compile`` with an
explicit ``GPUTarget`` runs the whole pipeline (TTIR -> TTGIR -> LLVM -> PTX -> cubin with the
bundled ptxas) on any machine, so the CPU test suite checks GPU code generation too.

Run as ``python -m pagedllm.backends.gpu.compile_check [--arch 80 90]``; it must run without
``TRITON_INTERPRET`` (the interpreter replaces the kernels with Python functions).
"""

from __future__ import annotations

import argparse
import itertools
import sys
import time
from typing import Any

_TT_DTYPES = {"float16": "fp16", "bfloat16": "bf16", "float32": "fp32"}
_FP32_ARGS = ("qk_scale", "cap_log2e", "k_scale", "v_scale")


def _signature(kernel: Any, pointers: dict[str, str], constexprs: dict[str, Any]) -> dict[str, str]:
    """Pointer args get their element type, the scales fp32, every other runtime arg i32."""
    sig = {}
    for name in kernel.arg_names:
        if name in constexprs:
            sig[name] = "constexpr"
        elif name in pointers:
            sig[name] = "*" + pointers[name]
        elif name == "stride_c0":
            sig[name] = "i64"  # the V half of a large cache lies past 2**31 elements
        else:
            sig[name] = "fp32" if name in _FP32_ARGS else "i32"
    return sig


def _cases(dtype: str, quick: bool) -> list[tuple[Any, dict[str, str], dict[str, Any]]]:
    """(kernel, pointer element types, constexprs) for the configurations the launchers use.

    ``quick`` keeps one variant per kernel, the one with every feature on. The logits soft cap
    rides on the windowed variants (Gemma 2 has both), so ``quick`` compiles it too.
    """
    from pagedllm.backends.gpu import triton_attention_kernels as attn
    from pagedllm.backends.gpu import triton_cache_kernels as cache

    t = _TT_DTYPES[dtype]
    prec = "ieee" if dtype == "float32" else "tf32"
    cases: list[tuple[Any, dict[str, str], dict[str, Any]]] = []
    cache_ptrs = {"cache_ptr": t, "table_ptr": "i32", "seq_lens_ptr": "i32"}
    cases.append(
        (
            cache.reshape_and_cache_kernel,
            {"key_ptr": t, "value_ptr": t, "cache_ptr": t, "slot_ptr": "i64"},
            {"BLOCK_SIZE": 16, "BLOCK_H": 8, "BLOCK_D": 128, **_NO_FP8_WRITE},
        )
    )
    windows, heads, groups = ((256,), (128,), (4,)) if quick else ((0, 256), (64, 128), (1, 4))
    for window, split, head in itertools.product(
        windows, (True,) if quick else (False, True), heads
    ):
        cases.append(
            (
                attn.decode_partition_kernel,
                {
                    **cache_ptrs,
                    "q_ptr": t,
                    "out_ptr": t,
                    "part_out_ptr": "fp32",
                    "part_max_ptr": "fp32",
                    "part_sum_ptr": "fp32",
                },
                {
                    "SLIDING_WINDOW": window,
                    "SOFT_CAP": window > 0,
                    "BLOCK_SIZE": 16,
                    "TILE_N": 64,
                    "PARTITION": 512,
                    "SPLIT": split,
                    "BLOCK_G": 16,
                    "BLOCK_D": head,
                    "DOT_PRECISION": prec,
                    **_NO_FP8,
                },
            )
        )
    cases.append(
        (
            attn.decode_reduce_kernel,
            {
                "out_ptr": t,
                "seq_lens_ptr": "i32",
                "part_out_ptr": "fp32",
                "part_max_ptr": "fp32",
                "part_sum_ptr": "fp32",
            },
            {"SLIDING_WINDOW": windows[-1], "PARTITION": 512, "BLOCK_P": 8, "BLOCK_D": 128},
        )
    )
    for window, head, block_g in itertools.product(windows, heads, groups):
        cases.append(
            (
                attn.prefill_kernel,
                {**cache_ptrs, "q_ptr": t, "out_ptr": t, "query_start_ptr": "i32"},
                {
                    "SLIDING_WINDOW": window,
                    "SOFT_CAP": window > 0,
                    "BLOCK_SIZE": 16,
                    "TILE_N": 64,
                    "BLOCK_Q": 64 // block_g,
                    "BLOCK_G": block_g,
                    "BLOCK_D": head,
                    "DOT_PRECISION": prec,
                    **_NO_FP8,
                },
            )
        )
    cases.extend(_moe_cases(t, prec))
    cases.extend(_lora_cases(t, prec))
    return cases


def _lora_cases(t: str, prec: str) -> list[tuple[Any, dict[str, str], dict[str, Any]]]:
    """The LoRA segmented GEMM as shrink (gather) and expand (scatter-add), launcher tiles."""
    from pagedllm.backends.gpu import lora

    ptrs = {"x_ptr": t, "w_ptr": t, "out_ptr": t, "perm_ptr": "i64", "seg_slot_ptr": "i32"}
    ptrs["seg_start_ptr"] = "i32"
    shrink = {"GATHER": True, "SCATTER_ADD": False, "BLOCK_N": 32, "BLOCK_K": 32}
    expand = {"GATHER": False, "SCATTER_ADD": True, "BLOCK_N": 64, "BLOCK_K": 16}
    return [
        (lora._sgmv_kernel, ptrs, {**c, "BLOCK_M": 16, "DOT_PRECISION": prec})
        for c in (shrink, expand)
    ]


_NO_FP8 = {"FP8_MANTISSA": 0, "FP8_MIN_EXP": 0, "FP8_BYTES": False}
_NO_FP8_WRITE = {**_NO_FP8, "FP8_MAX": 0.0}
# Triton's fp8 element types and the write kernel's rounding constants for each.
_FP8_CASES = {"fp8e4nv": (3, -6, 448.0), "fp8e5": (2, -14, 57344.0)}


def fp8_cases(dtype: str, arch: int) -> list[tuple[Any, dict[str, str], dict[str, Any]]]:
    """The fp8-cache variants (write, split decode, prefill) for a compute ``dtype``. Before
    sm_89 (no fp8 conversion instructions) the kernels take the cache as bytes
    (``triton_ops.fp8_as_bytes``), as the launchers do on such a GPU."""
    from pagedllm.backends.gpu import triton_attention_kernels as attn
    from pagedllm.backends.gpu import triton_cache_kernels as cache

    t = _TT_DTYPES[dtype]
    prec = "ieee" if dtype == "float32" else "tf32"
    as_bytes = arch < 89
    cases: list[tuple[Any, dict[str, str], dict[str, Any]]] = []
    for c, (mantissa, min_exp, max_value) in _FP8_CASES.items():
        elem = "u8" if as_bytes else c
        cache_ptrs = {"cache_ptr": elem, "table_ptr": "i32", "seq_lens_ptr": "i32"}
        fp8 = {"FP8_MANTISSA": mantissa, "FP8_MIN_EXP": min_exp, "FP8_BYTES": as_bytes}
        write = {**fp8, "FP8_MAX": max_value}
        cases.append(
            (
                cache.reshape_and_cache_kernel,
                {"key_ptr": t, "value_ptr": t, "cache_ptr": elem, "slot_ptr": "i64"},
                {"BLOCK_SIZE": 16, "BLOCK_H": 8, "BLOCK_D": 128, **write},
            )
        )
        # The soft cap does not touch the cache path; it is compiled with the 16/32-bit caches.
        attend = {
            "SLIDING_WINDOW": 256,
            "SOFT_CAP": False,
            "BLOCK_SIZE": 16,
            "TILE_N": 64,
            "BLOCK_D": 128,
        }
        partials = {"part_out_ptr": "fp32", "part_max_ptr": "fp32", "part_sum_ptr": "fp32"}
        cases.append(
            (
                attn.decode_partition_kernel,
                {**cache_ptrs, "q_ptr": t, "out_ptr": t, **partials},
                {
                    **attend,
                    "PARTITION": 512,
                    "SPLIT": True,
                    "BLOCK_G": 16,
                    "DOT_PRECISION": prec,
                    **fp8,
                },
            )
        )
        cases.append(
            (
                attn.prefill_kernel,
                {**cache_ptrs, "q_ptr": t, "out_ptr": t, "query_start_ptr": "i32"},
                {**attend, "BLOCK_Q": 16, "BLOCK_G": 4, "DOT_PRECISION": prec, **fp8},
            )
        )
    return cases


def _moe_cases(t: str, prec: str) -> list[tuple[Any, dict[str, str], dict[str, Any]]]:
    """The fused-MoE kernels at the tile sizes the launcher uses."""
    from pagedllm.backends.gpu import fused_moe as moe

    consts = {"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 32, "DOT_PRECISION": prec}
    index = {"sorted_ptr": "i32", "block_expert_ptr": "i32"}
    return [
        (moe._moe_gate_up_kernel, {"x_ptr": t, "w_ptr": t, "out_ptr": t, **index}, consts),
        (
            moe._moe_down_kernel,
            {"h_ptr": t, "w_ptr": t, "weight_ptr": "fp32", "out_ptr": t, **index},
            consts,
        ),
    ]


def compile_all(archs: list[int], dtypes: list[str], *, quick: bool = False) -> list[str]:
    """Compile every case to cubin; return one line per kernel variant, raise on any failure."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    lines = []
    for arch, dtype in itertools.product(archs, dtypes):
        for kernel, ptrs, consts in _cases(dtype, quick) + fp8_cases(dtype, arch):
            t0 = time.perf_counter()
            src = ASTSource(
                fn=kernel, signature=_signature(kernel, ptrs, consts), constexprs=consts
            )
            compiled = triton.compile(
                src, target=GPUTarget("cuda", arch, 32), options={"num_warps": 4}
            )
            shared = getattr(compiled.metadata, "shared", 0)
            lines.append(
                f"sm_{arch} {dtype} {kernel.__name__} {consts} ok "
                f"({time.perf_counter() - t0:.1f}s, shared={shared}B)"
            )
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", type=int, nargs="+", default=[90])
    parser.add_argument(
        "--dtype", nargs="+", default=["float16", "bfloat16"], choices=sorted(_TT_DTYPES)
    )
    parser.add_argument("--quick", action="store_true", help="one variant per kernel")
    args = parser.parse_args(argv)
    for line in compile_all(args.arch, args.dtype, quick=args.quick):
        sys.stdout.write(line + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

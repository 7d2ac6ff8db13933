"""KV-cache dtypes: what the conformance matrix does not cover.

Every kind x compute dtype x cache dtype against the reference (bit-identical writes, fp8 with
scales) lives in ``test_attention_conformance.py``. Here: each ISA build of the C++ kernels with
every cache dtype, the error fp8 quantisation itself brings, the NaN fill of fresh pools, and the
one-place refusal of a cache dtype a backend cannot read.
"""

from __future__ import annotations

import shutil

import pytest
import torch

from pagedllm.backends.base import (
    FP8_DTYPES,
    KV_CACHE_DTYPES,
    AttentionBackend,
    AttentionMetadata,
    to_cache_dtype,
)
from pagedllm.backends.reference import ReferenceAttention
from tests.backends.test_cpu_kernels import make_batch

CACHE_DTYPES = (
    torch.float32,
    torch.bfloat16,
    torch.float16,
    torch.float8_e4m3fn,
    torch.float8_e5m2,
)
COMPUTE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# Reference and kernel both compute in float32 and round once to the compute dtype: at most one
# unit in the last place apart, i.e. rtol = 2 * eps (outputs are O(1), so atol covers ~0).
TOLERANCE = {
    torch.float32: dict(atol=1e-4, rtol=0.0),
    torch.bfloat16: dict(atol=1e-4, rtol=2 * 2.0**-8),
    torch.float16: dict(atol=1e-4, rtol=2 * 2.0**-11),
}
# (head_size, block_size, (num_heads, num_kv_heads), sliding_window): 20 has scalar tails,
# 80 = 64 + 16 exercises the 16-wide and 8-wide bodies, MQA and a window once.
SHAPES = (
    (20, 8, (4, 4), None),
    (64, 16, (8, 2), None),
    (80, 16, (8, 4), 9),
    (128, 32, (8, 1), None),
)


def _id(x: object) -> str:
    return str(x).removeprefix("torch.")


@pytest.fixture(scope="module")
def cpp():
    if shutil.which("c++") is None or shutil.which("ninja") is None:
        pytest.skip("no C++ toolchain (c++ and ninja) to build the CPU kernels")
    from pagedllm.backends.cpu.kernel_attention import CppPagedAttention

    return CppPagedAttention()


def fp8_scales(cache_dtype: torch.dtype) -> tuple[float, float]:
    """Scales other than 1 for fp8 (so a kernel that ignores them fails), 1 otherwise."""
    return (0.5, 2.0) if cache_dtype in FP8_DTYPES else (1.0, 1.0)


def mixed_batch(
    cache_dtype: torch.dtype,
    compute_dtype: torch.dtype,
    head_size: int,
    block_size: int,
    heads: tuple[int, int],
) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
    """Prompt chunks (one over cached context) and decodes, the cache stored in cache_dtype."""
    seq_lens = [block_size + 5, 40, 1, block_size, 3 * block_size + 1, 200]
    query_lens = [block_size + 5, 7, 1, 1, 1, 1]
    query, cache, meta = make_batch(seq_lens, query_lens, 2, block_size, heads, head_size)
    return query.to(compute_dtype), to_cache_dtype(cache, cache_dtype), meta


def check_against_reference(
    backend: AttentionBackend,
    query: torch.Tensor,
    cache: torch.Tensor,  # kernel layout [2, blocks, kv_heads, block_size, head_size]
    meta: AttentionMetadata,
    window: int | None,
    scales: tuple[float, float],
) -> None:
    scale = query.shape[-1] ** -0.5
    kw = dict(sliding_window=window, k_scale=scales[0], v_scale=scales[1])
    out = backend.forward(query, cache, meta, scale, **kw)
    ref = ReferenceAttention().forward(query, cache, meta, scale, **kw)
    assert out.dtype == query.dtype
    diff = (out.float() - ref.float()).abs().max().item()
    torch.testing.assert_close(
        out, ref, **TOLERANCE[query.dtype], msg=lambda m: f"max abs diff {diff:.3e}\n{m}"
    )


@pytest.mark.slow
@pytest.mark.parametrize("cache_dtype", CACHE_DTYPES, ids=_id)
def test_every_isa_level_matches_reference(cpp, cache_dtype) -> None:
    """Each ISA build this processor runs (forced as PAGEDLLM_CPU_ISA would), bf16 compute."""
    from pagedllm.backends.cpu._ops import supported_isas
    from pagedllm.backends.cpu.kernel_attention import CppPagedAttention

    for isa in supported_isas():
        backend = CppPagedAttention(isa=isa)
        assert backend.isa == isa
        if isa in ("avx2", "scalar"):
            assert backend.vector_path == isa
        for head_size, block_size, heads, window in SHAPES[:3]:
            query, cache, meta = mixed_batch(
                cache_dtype, torch.bfloat16, head_size, block_size, heads
            )
            check_against_reference(backend, query, cache, meta, window, fp8_scales(cache_dtype))


def test_fp8_cache_error_is_bounded(cpp) -> None:
    """Quantisation, not a bug: fp8 outputs stay near the float32-cache output.

    Outputs are convex combinations of values, each off by at most half a unit in the last place
    (2^-4 relative for e4m3's 3 mantissa bits, 2^-3 for e5m2's 2), plus what the quantised keys
    move the weights: bounded here by one unit in the last place of the largest value.
    """
    query, cache, meta = mixed_batch(torch.float32, torch.float32, 64, 16, (8, 2))
    exact = cpp.forward(query, cache, meta, 0.125)
    largest = cache.abs().max().item()
    for dtype, ulp in ((torch.float8_e4m3fn, 2.0**-3), (torch.float8_e5m2, 2.0**-2)):
        out = cpp.forward(query, to_cache_dtype(cache, dtype), meta, 0.125)
        err = (out - exact).abs().max().item()
        assert err < ulp * largest, f"{dtype}: max abs error {err:.3f} >= {ulp * largest:.3f}"


def test_cache_engine_fill_value() -> None:
    from pagedllm.backends.base import CacheEngine, CacheSpec

    spec = CacheSpec(num_layers=2, num_kv_heads=2, head_size=8, block_size=4, dtype=torch.bfloat16)
    engine = CacheEngine(
        spec,
        ReferenceAttention(),
        device=torch.device("cpu"),
        num_device_blocks=3,
        num_host_blocks=2,
        fill_value=float("nan"),
    )
    for cache in (*engine.kv_caches, *engine.host_caches):
        assert cache.dtype == torch.bfloat16 and cache.isnan().all()


# --- which backend reads which cache dtype --------------------------------------------------------


def _bare(cls: type) -> AttentionBackend:
    """An instance without running __init__ (no triton / IPEX import needed)."""
    return object.__new__(cls)


def test_kv_cache_dtype_resolution_and_refusals() -> None:
    from pagedllm.backends.cpu.attention import TorchPagedAttention
    from pagedllm.backends.cpu.kernel_attention import CppPagedAttention
    from pagedllm.backends.gpu.attention import TritonPagedAttention
    from pagedllm.backends.xpu.attention import IpexPagedAttention

    for cls in (CppPagedAttention, TorchPagedAttention, ReferenceAttention):
        b = _bare(cls)
        assert b.resolve_kv_cache_dtype("auto", torch.bfloat16) == torch.bfloat16
        for name, dtype in KV_CACHE_DTYPES.items():
            assert b.resolve_kv_cache_dtype(name, torch.bfloat16) == dtype
        assert b.resolve_kv_cache_dtype("fp8", torch.float32) == torch.float8_e4m3fn
    for cls in (TritonPagedAttention, IpexPagedAttention):
        b = _bare(cls)
        assert b.resolve_kv_cache_dtype("auto", torch.float16) == torch.float16
        assert b.resolve_kv_cache_dtype("bfloat16", torch.bfloat16) == torch.bfloat16
        # Triton reads fp8 caches with any compute dtype (tests/backends/test_triton_fp8.py).
        bads = [("bfloat16", torch.float32)]
        if cls is IpexPagedAttention:
            bads.append(("fp8_e4m3", torch.bfloat16))
        for bad, compute in bads:
            with pytest.raises(ValueError, match=r"^kv_cache_dtype: .*supports \['auto'"):
                b.resolve_kv_cache_dtype(bad, compute)


def test_engine_refuses_unknown_kv_cache_dtype(llama_path) -> None:
    from pagedllm import Engine

    with pytest.raises(ValueError, match="^kv_cache_dtype: must be one of"):
        Engine(str(llama_path), device="cpu", kv_cache_dtype="int4")

"""KV-cache dtypes on the CPU: every kernel variant against the PyTorch reference.

Variants: the ISA builds this machine runs x cache dtype (float32, bfloat16, float16, fp8 e4m3,
fp8 e5m2) x compute dtype (float32, bfloat16, float16) x head size x block size x GQA ratio, as a
covering set rather than the full product. The reference reads the very same cache (widened to
float32, fp8 times its scale), so the only differences are float32 summation order and the final
rounding of the output to the compute dtype; the tolerances below say so per compute dtype.

Also here: cache writes bit-identical to the reference's (fp8 quantisation with a scale
included), block copies and swaps for 8- and 16-bit pools, NaN in never-written slots never
reaching an output (every backend), and the one-place refusal of a cache dtype a backend cannot
read.
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
    ref = ReferenceAttention().forward(query, cache.transpose(2, 3), meta, scale, **kw)
    assert out.dtype == query.dtype
    diff = (out.float() - ref.float()).abs().max().item()
    torch.testing.assert_close(
        out, ref, **TOLERANCE[query.dtype], msg=lambda m: f"max abs diff {diff:.3e}\n{m}"
    )


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"d{s[0]}-bs{s[1]}-h{s[2][0]}kv{s[2][1]}")
@pytest.mark.parametrize("compute_dtype", COMPUTE_DTYPES, ids=_id)
@pytest.mark.parametrize("cache_dtype", CACHE_DTYPES, ids=_id)
def test_kernel_matches_reference(cpp, cache_dtype, compute_dtype, shape) -> None:
    head_size, block_size, heads, window = shape
    query, cache, meta = mixed_batch(cache_dtype, compute_dtype, head_size, block_size, heads)
    check_against_reference(cpp, query, cache, meta, window, fp8_scales(cache_dtype))


@pytest.mark.parametrize("cache_dtype", CACHE_DTYPES, ids=_id)
def test_torch_fallback_matches_reference(cache_dtype) -> None:
    from pagedllm.backends.cpu.attention import TorchPagedAttention

    query, cache, meta = mixed_batch(cache_dtype, torch.bfloat16, 64, 16, (8, 2))
    torch_layout = cache.transpose(2, 3).contiguous()  # [2, blocks, block_size, kvh, d]
    scale = 0.125
    kw = dict(k_scale=fp8_scales(cache_dtype)[0], v_scale=fp8_scales(cache_dtype)[1])
    out = TorchPagedAttention().forward(query, torch_layout, meta, scale, **kw)
    ref = ReferenceAttention().forward(query, torch_layout, meta, scale, **kw)
    # SDPA runs the no-context prompt in bfloat16 itself: a looser bound than the kernels'.
    torch.testing.assert_close(out, ref, atol=2e-2, rtol=2e-2)


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


@pytest.mark.parametrize("input_dtype", COMPUTE_DTYPES, ids=_id)
@pytest.mark.parametrize("cache_dtype", CACHE_DTYPES, ids=_id)
def test_write_kv_matches_reference_bitwise(cpp, cache_dtype, input_dtype) -> None:
    """Round-to-nearest-even narrowing, fp8 divided by its scale and saturated: same bytes."""
    gen = torch.Generator().manual_seed(1)
    key = (torch.randn(9, 2, 40, generator=gen) * 300).to(input_dtype)  # some beyond fp8 range
    value = torch.randn(9, 2, 40, generator=gen).to(input_dtype)
    slots = torch.tensor([0, 5, 17, -1, 31, 8, 9, 63, 40])
    ks, vs = fp8_scales(cache_dtype)
    ours = torch.zeros(2, 4, 2, 16, 40, dtype=cache_dtype)
    ref = ours.clone()
    cpp.write_kv(key, value, ours, slots, k_scale=ks, v_scale=vs)
    ReferenceAttention().write_kv(key, value, ref.transpose(2, 3), slots, k_scale=ks, v_scale=vs)
    assert torch.equal(ours.view(torch.uint8), ref.view(torch.uint8))
    if cache_dtype in FP8_DTYPES:
        assert ours.float().isfinite().all(), "fp8 writes must saturate, not overflow"


@pytest.mark.parametrize("cache_dtype", (torch.bfloat16, torch.float8_e4m3fn), ids=_id)
def test_copy_and_swap_blocks_any_dtype(cpp, cache_dtype) -> None:
    caches = [torch.randn(2, 10, 2, 8, 24).to(cache_dtype) for _ in range(2)]
    expect = [c.clone() for c in caches]
    pairs = torch.tensor([[0, 5], [3, 9], [3, 1]])
    cpp.copy_blocks(caches, pairs)
    AttentionBackend.copy_blocks(cpp, expect, pairs)
    for got, want in zip(caches, expect, strict=True):
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
    host = torch.zeros(2, 4, 2, 8, 24, dtype=cache_dtype)
    want_host = host.clone()
    swap = torch.tensor([[9, 0], [1, 3]])
    cpp.swap_blocks(caches[0], host, swap)
    AttentionBackend.swap_blocks(cpp, caches[0], want_host, swap)
    assert torch.equal(host.view(torch.uint8), want_host.view(torch.uint8))


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


# --- NaN in never-written slots -----------------------------------------------------------------


def nan_cache_batch(cache_dtype: torch.dtype, compute_dtype: torch.dtype):
    """A NaN-filled cache where only the slots a sequence owns (< seq_len) were written."""
    query, clean, meta = mixed_batch(cache_dtype, compute_dtype, 32, 8, (4, 2))
    dirty = torch.full_like(clean, float("nan"))
    bs = clean.shape[3]
    for table, seq_len in zip(meta.block_tables.tolist(), meta.seq_lens_list, strict=True):
        for pos in range(seq_len):
            block, off = table[pos // bs], pos % bs
            dirty[:, block, :, off] = clean[:, block, :, off]
    return query, clean, dirty, meta


@pytest.mark.parametrize("kind", ["cpp", "torch", "reference"])
@pytest.mark.parametrize(
    "cache_dtype", (torch.float32, torch.bfloat16, torch.float8_e4m3fn), ids=_id
)
def test_never_written_nan_slots_do_not_leak(cpp, kind: str, cache_dtype) -> None:
    from pagedllm.backends.cpu.attention import TorchPagedAttention

    query, clean, dirty, meta = nan_cache_batch(cache_dtype, torch.bfloat16)
    if kind == "cpp":
        backend, view = cpp, (lambda c: c)
    else:
        backend = TorchPagedAttention() if kind == "torch" else ReferenceAttention()
        view = lambda c: c.transpose(2, 3).contiguous()  # noqa: E731
    out = backend.forward(query, view(dirty), meta, 0.2, sliding_window=None)
    want = backend.forward(query, view(clean), meta, 0.2, sliding_window=None)
    assert not out.isnan().any(), f"{kind}: NaN from never-written slots reached the output"
    torch.testing.assert_close(out, want, atol=0, rtol=0)


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
        for bad, compute in (("fp8_e4m3", torch.bfloat16), ("bfloat16", torch.float32)):
            with pytest.raises(ValueError, match=r"^kv_cache_dtype: .*supports \['auto'"):
                b.resolve_kv_cache_dtype(bad, compute)


def test_engine_refuses_unknown_kv_cache_dtype(llama_path) -> None:
    from pagedllm import Engine

    with pytest.raises(ValueError, match="^kv_cache_dtype: must be one of"):
        Engine(str(llama_path), device="cpu", kv_cache_dtype="int4")

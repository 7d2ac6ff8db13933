"""fp8 KV caches through IPEX paged attention (``kv_cache_dtype="fp8_e5m2"``, bfloat16 compute).

What IPEX 2.8's CPU ops do with 8-bit caches, and so why the backend wraps them as it does, is in
the docstring of ``pagedllm/backends/xpu/attention.py``; ``test_ipex_behaviour_the_backend_
works_around`` pins those facts, so a release that changes them shows up here. Then: the bytes
``write_kv`` stores equal the reference's quantisation over the whole e5m2 range, attention over
an fp8 cache (prompt chunks over cached context, decodes, GQA/MQA, windows, scales other than 1)
matches the reference, never-written NaN slots do not leak, and misuse is refused by name. Block
copies and swaps of 8-bit caches are in ``test_ipex_kernels.py``'s cache-engine test.

The reference reads the dequantised cache (float32 values times their scale), exactly what it
computes from an fp8 cache: torch 2.8, which IPEX pins, has no CPU gather for fp8 tensors, so it
cannot index the fp8 cache itself.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import pytest
import torch

from pagedllm.backends.base import AttentionMetadata, from_cache_dtype, to_cache_dtype
from pagedllm.backends.reference import ReferenceAttention
from tests.backends.test_ipex_kernels import DEVICES, _batch, ipex_test

if TYPE_CHECKING:
    from pagedllm.backends.xpu.attention import IpexPagedAttention

E5M2 = torch.float8_e5m2
# The conformance matrix's bound for IPEX in bfloat16: the reference reads the same quantised
# values, so only IPEX's bfloat16 arithmetic (and one more rounding when v_scale != 1) differs.
# Measured over these cases on IPEX 2.8's CPU build: max |diff| 3.1e-2 where |out| ~ 3, always
# inside this bound; the same cases over a bfloat16 cache differ by up to 1.6e-2.
TOL = dict(atol=1e-2, rtol=2 * 2.0**-8)
SCALES = [(1.0, 1.0), (0.5, 2.0), (0.037, 3.3)]
# (head_size, block_size, (num_heads, num_kv_heads), sliding_window)
SHAPES = [
    (64, 16, (8, 2), None),
    (128, 32, (8, 1), None),
    (80, 8, (4, 4), 9),
    (16, 8, (4, 2), 1),
    (32, 16, (8, 4), 40),
    # Below FP8_VARLEN_MIN_HEAD_SIZE prompt chunks read a bfloat16 copy (IPEX's fp8 varlen
    # kernel crashed on this shape on an AVX-512 Xeon).
    (16, 8, (4, 2), None),
]


@pytest.fixture(scope="module")
def attn() -> IpexPagedAttention:
    from pagedllm.backends.xpu.attention import IpexPagedAttention

    return IpexPagedAttention()


def dequantised(cache: torch.Tensor, k_scale: float, v_scale: float) -> torch.Tensor:
    """The float32 cache the kernels must behave as if they read: fp8 values times the scale."""
    return torch.stack([from_cache_dtype(cache[0], k_scale), from_cache_dtype(cache[1], v_scale)])


def stored_rows(cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """The bytes at ``slots`` of a ``[num_blocks, kv_heads, block_size, d]`` cache, by token."""
    block_size = cache.shape[2]
    return cache.view(torch.uint8)[slots // block_size, :, slots % block_size]


def mixed_batch(
    attn: IpexPagedAttention, shape: tuple, scales: tuple[float, float], device: str = "cpu"
) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor]:
    head_size, block_size, (num_heads, num_kv_heads), _ = shape
    # Prompt chunks (fresh, after full blocks, after a partial block), then ragged decodes.
    seqs = [(0, 23), (block_size, 9), (block_size + 3, block_size)]
    seqs += [(0, 1), (block_size - 2, 1), (block_size - 1, 1), (block_size, 1), (299, 1)]
    return _batch(
        attn, seqs, 3, block_size=block_size, num_heads=num_heads, num_kv_heads=num_kv_heads,
        head_size=head_size, dtype=torch.bfloat16, cache_dtype=E5M2, scales=scales, device=device,
    )  # fmt: skip


@ipex_test
def test_ipex_behaviour_the_backend_works_around(attn) -> None:
    """IPEX 2.8 (CPU): no e4m3 caches, scales ignored, a non-saturating cast, bf16-only decode.

    If one of these stops holding, the backend's wrapping (module docstring) can be revisited.
    """
    ops, slot = attn._ops, torch.tensor([0])
    key = torch.tensor([[[1.0, -3.0, 1.0e5, 0.3]]])  # [1 token, 1 head, 4]
    e4m3 = torch.zeros(2, 1, 1, 4, 4, dtype=torch.float8_e4m3fn)
    for name in ("auto", "fp8", "fp8_e4m3"):
        with pytest.raises((TypeError, RuntimeError)):
            ops.reshape_and_cache(key, key, e4m3[0], e4m3[1], slot, name)
    cache = torch.zeros(2, 1, 1, 4, 4, dtype=E5M2)
    ops.reshape_and_cache(key, key, cache[0], cache[1], slot, "fp8_e5m2", 4.0, 4.0)
    # Not key / 4; and 1e5 (beyond e5m2's largest, 57344) is stored as inf, not saturated.
    assert cache[0, 0, 0, 0].float().tolist() == [1.0, -3.0, float("inf"), 0.3125]
    out = torch.empty(1, 2, 4)  # a float32 query
    with pytest.raises(RuntimeError, match="expected scalar type Float"):
        ops.single_query_cached_kv_attention(
            out, out.clone(), cache[0], cache[1], torch.zeros(2, dtype=torch.int32), 1.0,
            torch.zeros(1, 1, dtype=torch.int32), torch.ones(1, dtype=torch.int32), 4, 1, None,
        )  # fmt: skip


@ipex_test
@pytest.mark.parametrize("key_dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("k_scale", [0.5, 3.0, 0.01])
def test_write_stores_the_reference_bytes(attn, key_dtype: torch.dtype, k_scale: float) -> None:
    """Quantised as ``to_cache_dtype`` does: ``x / scale``, saturated, round to nearest even."""
    torch.manual_seed(0)
    t, h, d, block = 64, 2, 32, 8
    # Magnitudes from 1e-6 (subnormal or zero in e5m2) past the largest finite value, 57344.
    key = torch.randn(t, h, d) * torch.logspace(-6, 6, t)[:, None, None]
    key[0, 0, :5] = torch.tensor([-0.0, 0.0, 1.125, 1.375, 61440.0])  # signed zeros, ties
    key = key.to(key_dtype)
    value = torch.randn(t, h, d).to(key_dtype)
    cache = torch.zeros(2, t // block, h, block, d, dtype=E5M2)
    slots = torch.randperm(t)
    attn.write_kv(key, value, cache, slots, k_scale=k_scale, v_scale=2.0)
    want_k = to_cache_dtype(key, E5M2, k_scale).view(torch.uint8)
    want_v = to_cache_dtype(value, E5M2, 2.0).view(torch.uint8)
    assert torch.equal(stored_rows(cache[0], slots), want_k)
    assert torch.equal(stored_rows(cache[1], slots), want_v)


@ipex_test
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("scales", SCALES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_attention_over_fp8_matches_reference(
    attn, shape: tuple, scales: tuple[float, float], device: str
) -> None:
    cache, ref_cache, meta, query = mixed_batch(attn, shape, scales, device)
    assert torch.equal(cache.view(torch.uint8).cpu(), ref_cache.view(torch.uint8).cpu())
    window, scale = shape[3], shape[0] ** -0.5
    out = attn.forward(
        query, cache, meta, scale, sliding_window=window, k_scale=scales[0], v_scale=scales[1]
    )
    ref = ReferenceAttention().forward(
        query, dequantised(cache, *scales), meta, scale, sliding_window=window
    )
    assert out.dtype == torch.bfloat16
    diff = (out.float() - ref.float()).abs().max().item()
    torch.testing.assert_close(
        out.float().cpu(),
        ref.float().cpu(),
        **TOL,
        msg=lambda m: f"e5m2 {shape} scales {scales}: max abs diff {diff:.3e}\n{m}",
    )


@ipex_test
def test_never_written_fp8_slots_do_not_leak(attn) -> None:
    """NaN bytes everywhere but the slots a sequence owns (< seq_len)."""
    clean, _, meta, query = mixed_batch(attn, SHAPES[0], (0.5, 2.0))
    block_size = clean.shape[3]
    dirty = torch.full_like(clean, float("nan"))
    clean_bytes, dirty_bytes = clean.view(torch.uint8), dirty.view(torch.uint8)
    for table, seq_len in zip(meta.block_tables.tolist(), meta.seq_lens_list, strict=True):
        for pos in range(seq_len):
            b, o = table[pos // block_size], pos % block_size
            dirty_bytes[:, b, :, o] = clean_bytes[:, b, :, o]
    kw = dict(k_scale=0.5, v_scale=2.0)
    out = attn.forward(query, dirty, meta, 0.2, **kw)
    want = attn.forward(query, clean, meta, 0.2, **kw)
    assert not out.isnan().any(), "NaN from never-written fp8 slots reached the output"
    torch.testing.assert_close(out, want, atol=0, rtol=0)


@ipex_test
def test_fp8_misuse_is_refused(attn) -> None:
    cache, _, meta, query = mixed_batch(attn, SHAPES[0], (1.0, 1.0))
    with pytest.raises(ValueError, match="bfloat16 queries"):
        attn.forward(query.float(), cache, meta, 0.125)
    e4m3 = torch.zeros(cache.shape, dtype=torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        attn.forward(query, e4m3, meta, 0.125)
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        attn.write_kv(query[:, :2], query[:, :2], e4m3, meta.slot_mapping)


# ---- kv_cache_dtype names: no IPEX needed ------------------------------------------------------


def test_kv_cache_dtype_names() -> None:
    """fp8 only as e5m2 under bfloat16 compute; every refusal names the field and what works."""
    from pagedllm.backends.xpu.attention import IpexPagedAttention

    backend = object.__new__(IpexPagedAttention)  # no IPEX import needed
    assert backend.resolve_kv_cache_dtype("fp8_e5m2", torch.bfloat16) == E5M2
    assert backend.resolve_kv_cache_dtype("auto", torch.bfloat16) == torch.bfloat16
    assert backend.resolve_kv_cache_dtype("float16", torch.float16) == torch.float16
    works_bf16 = r"supports \['auto', 'bfloat16', 'fp8_e5m2'\]"
    for name in ("fp8", "fp8_e4m3"):
        with pytest.raises(ValueError, match=rf"^kv_cache_dtype: '{name}' .*{works_bf16} \(IPEX"):
            backend.resolve_kv_cache_dtype(name, torch.bfloat16)
    for compute in (torch.float32, torch.float16):
        works = rf"\['auto', '{str(compute).removeprefix('torch.')}'\]"
        with pytest.raises(ValueError, match=rf"^kv_cache_dtype: 'fp8_e5m2' .*{works} \(IPEX"):
            backend.resolve_kv_cache_dtype("fp8_e5m2", compute)
    with pytest.raises(ValueError, match=rf"^kv_cache_dtype: 'float32' .*{works_bf16}$"):
        backend.resolve_kv_cache_dtype("float32", torch.bfloat16)

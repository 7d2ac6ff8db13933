"""fp8 KV caches in the Triton kernels (under the interpreter off CUDA).

The conformance matrix (``test_attention_conformance.py``) runs e4m3 through every kind; this adds
what is particular to Triton: e5m2 too, byte-identical writes to the reference's quantisation
over the whole fp8 range (saturation, subnormals, values that round up into the next binade,
which Triton's interpreter casts wrongly and the kernel therefore rounds itself), decode split
into several partitions, never-written NaN slots, and the kv_cache_dtype names it accepts.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from pagedllm.backends.kv_layout import to_cache_dtype
from tests.backends import test_attention_conformance as conformance

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        importlib.util.find_spec("triton") is None, reason="triton is not installed"
    ),
]
FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]


@pytest.fixture(scope="module", params=[False, True], ids=["fp8-casts", "fp8-bytes"])
def kind(request):
    """Both ways the kernels handle fp8: casts (sm_89+, the interpreter) and bytes converted
    by integer arithmetic (what GPUs before sm_89 run), forced here on whatever device runs."""
    reason = conformance._skip_reason("triton")
    if reason is not None:
        pytest.skip(reason)
    kind = conformance._make("triton")
    kind.backend.fp8_bytes = request.param
    return kind


@pytest.mark.parametrize("cache_dtype", FP8, ids=str)
@pytest.mark.parametrize("k_scale", [0.5, 3.0, 0.01])
def test_write_rounds_like_the_reference(kind, cache_dtype: torch.dtype, k_scale: float) -> None:
    torch.manual_seed(0)
    t, h, d, block = 64, 2, 32, 8
    # Magnitudes from 1e-5 (subnormal in both formats) past the largest finite value.
    key = torch.randn(t, h, d) * torch.logspace(-5, 4, t)[:, None, None]
    key[0, 0, :4] = torch.tensor([-0.0, 0.0, 7.97, -7.97])  # signed zeros, a carry to 8
    value = torch.randn(t, h, d)
    cache = torch.zeros(2, t // block, h, block, d, dtype=cache_dtype, device=kind.device)
    kind.backend.write_kv(
        key.to(kind.device),
        value.to(kind.device),
        cache,
        torch.arange(t, device=kind.device),
        k_scale=k_scale,
        v_scale=2.0,
    )
    stored_k = cache[0].cpu().permute(0, 2, 1, 3).reshape(t, h, d)
    stored_v = cache[1].cpu().permute(0, 2, 1, 3).reshape(t, h, d)
    assert torch.equal(
        stored_k.view(torch.uint8), to_cache_dtype(key, cache_dtype, k_scale).view(torch.uint8)
    )
    assert torch.equal(
        stored_v.view(torch.uint8), to_cache_dtype(value, cache_dtype, 2.0).view(torch.uint8)
    )


@pytest.mark.parametrize("cache_dtype", FP8, ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_attention_over_fp8_matches_reference(kind, dtype, cache_dtype) -> None:
    """Prefill over cached context and decodes (one over three partitions), with GQA."""
    for head_size, block_size, heads, window in ((64, 16, (8, 2), None), (32, 8, (4, 1), 9)):
        seqs, num_prefills = conformance.mixed_seqs(block_size, kind)
        batch = conformance.make_batch(
            seqs,
            num_prefills,
            block_size=block_size,
            heads=heads,
            head_size=head_size,
            dtype=dtype,
            cache_dtype=cache_dtype,
            device=kind.device,
            backend=kind.backend,
        )
        conformance.write_and_compare(kind, *batch, f"fp8 {cache_dtype}", window=window)


@pytest.mark.parametrize("cache_dtype", FP8, ids=str)
def test_never_written_fp8_slots_do_not_leak(kind, cache_dtype) -> None:
    seqs, num_prefills = conformance.mixed_seqs(8, kind)
    query, key, value, _, meta = conformance.make_batch(
        seqs, num_prefills, block_size=8, heads=(4, 2), head_size=32, device=kind.device
    )
    clean = torch.zeros(2, 64, 2, 8, 32, dtype=cache_dtype, device=kind.device)
    kind.backend.write_kv(key, value, clean, meta.slot_mapping, k_scale=0.5, v_scale=2.0)
    dirty = torch.full_like(clean, float("nan"))
    for table, seq_len in zip(meta.block_tables.tolist(), meta.seq_lens_list, strict=True):
        for pos in range(seq_len):
            dirty[:, table[pos // 8], :, pos % 8] = clean[:, table[pos // 8], :, pos % 8]
    out = kind.backend.forward(query, dirty, meta, 0.2, k_scale=0.5, v_scale=2.0)
    want = kind.backend.forward(query, clean, meta, 0.2, k_scale=0.5, v_scale=2.0)
    assert not out.isnan().any()
    torch.testing.assert_close(out, want, atol=0, rtol=0)


def test_kv_cache_dtype_names() -> None:
    from pagedllm.backends.gpu.attention import TritonPagedAttention

    backend = object.__new__(TritonPagedAttention)  # no triton import needed
    for compute in (torch.float32, torch.float16, torch.bfloat16):
        assert backend.resolve_kv_cache_dtype("fp8", compute) == torch.float8_e4m3fn
        assert backend.resolve_kv_cache_dtype("fp8_e5m2", compute) == torch.float8_e5m2
    with pytest.raises(ValueError, match=r"^kv_cache_dtype: 'bfloat16' .*'fp8_e5m2'\]"):
        backend.resolve_kv_cache_dtype("bfloat16", torch.float32)

"""Every attention kind against the plain-PyTorch reference, on the one KV layout they share.

One harness for all kernel families: each kind in the registry that this environment can run
(``cpp`` with a C++ toolchain, ``torch`` always, ``triton`` where triton imports — compiled on
CUDA, else under ``TRITON_INTERPRET=1`` on CPU tensors — and ``ipex`` where
intel-extension-for-pytorch loads) writes a batch into a cache holding garbage, then attends over
it; the reference reads the very same cache. Writes must be bit-identical, outputs within the
rounding of the compute dtype (the max difference is in the message).

The kinds that need another environment are marked (``gpu``: ci/gpu.sh's Triton leg, ``xpu``:
ci/xpu.sh's IPEX leg) and skip where their runtime cannot be imported. Backend-specific cases
(launcher checks, ISA builds, fallbacks, cache engines) stay in each backend's own test file.
"""

from __future__ import annotations

import importlib.util
import os
import random
import shutil
from dataclasses import dataclass

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

ON_CUDA = torch.cuda.is_available()
if importlib.util.find_spec("triton") is not None and not ON_CUDA:
    # Must be set before triton is first imported; only this test process reads it.
    os.environ.setdefault("TRITON_INTERPRET", "1")

REF = ReferenceAttention()
GQA = ((4, 4), (8, 2), (8, 1))  # (num_heads, num_kv_heads): MHA, 4:1, MQA
HEAD_SIZES = (32, 64, 80, 128)  # 80 = 64 + 16: vector bodies of two widths
BLOCK_SIZES = (8, 16, 32)
DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _ipex_error() -> str | None:
    try:
        import intel_extension_for_pytorch  # noqa: F401
    except Exception as exc:  # IPEX also fails with NameError/RuntimeError on version mismatch
        return f"{type(exc).__name__}: {str(exc)[:200]}"
    return None


def _skip_reason(kind: str) -> str | None:
    if kind == "cpp" and (shutil.which("c++") is None or shutil.which("ninja") is None):
        return "no C++ toolchain (c++ and ninja) to build the CPU kernels"
    if kind == "triton":
        if importlib.util.find_spec("triton") is None:
            return "triton is not installed (ci/requirements-gpu.txt; run ci/gpu.sh)"
        if not ON_CUDA and os.environ.get("TRITON_INTERPRET") != "1":
            return "no CUDA device and TRITON_INTERPRET is not 1"
    if kind == "ipex":
        error = _ipex_error()
        if error is not None:
            return f"intel_extension_for_pytorch is not importable ({error}); run ci/xpu.sh"
    return None


@dataclass
class Kind:
    """One kernel family as the harness runs it."""

    name: str
    backend: AttentionBackend
    device: torch.device
    dtypes: tuple[torch.dtype, ...]
    # Triton's interpreter runs every program in Python: shorter batches, and of the
    # GQA x head size x block size grid a covering set (every pair of values meets once).
    interpreted: bool = False

    def covers(self, *indices: int) -> bool:
        return not self.interpreted or sum(indices) % 3 == 0

    def tol(self, dtype: torch.dtype) -> dict[str, float]:
        # One rounding of an O(1) output to the compute dtype (~2 ulps relative) over an absolute
        # floor; kinds that accumulate in half precision (Triton's tl.dot, IPEX, the PyTorch
        # fallback's SDPA on a fresh prompt) get a wider floor.
        if dtype == torch.float32:
            # IPEX's float32 kernels vary from run to run under load (its split of the keys over
            # threads): one output of 2.3 came 1.24e-4 off once in a full matrix run and on in
            # ten runs alone, so a relative term of 1e-4 over the floor.
            rtol = 1e-4 if self.name == "ipex" else 0.0
            return dict(atol=1e-3 if self.name == "triton" else 1e-4, rtol=rtol)
        eps = 2.0**-8 if dtype == torch.bfloat16 else 2.0**-11
        loose = self.name in ("triton", "ipex", "torch")
        return dict(atol=1e-2 if loose else 1e-4, rtol=2 * eps)


def _make(kind: str) -> Kind:
    cpu = torch.device("cpu")
    if kind == "cpp":
        from pagedllm.backends.cpu.kernel_attention import CppPagedAttention

        return Kind(kind, CppPagedAttention(), cpu, DTYPES)
    if kind == "torch":
        from pagedllm.backends.cpu.attention import TorchPagedAttention

        return Kind(kind, TorchPagedAttention(), cpu, DTYPES)
    if kind == "triton":
        from pagedllm.backends.gpu.attention import TritonPagedAttention

        # Small partitions and tiles: split-K and its reduction engage on short contexts.
        backend = TritonPagedAttention(partition_size=32, prefill_block_m=16, tile_n=16)
        if ON_CUDA:
            return Kind(kind, backend, torch.device("cuda"), DTYPES)
        return Kind(kind, backend, cpu, (torch.float32, torch.float16), interpreted=True)
    from pagedllm.backends.xpu.attention import IpexPagedAttention
    from pagedllm.backends.xpu.backend import XpuBackend

    # IPEX's ops follow their tensors: on an Intel GPU where there is one, else its CPU build.
    device = torch.device("xpu") if XpuBackend.is_available() else cpu
    return Kind(kind, IpexPagedAttention(), device, DTYPES)


KIND_MARKS = {"triton": [pytest.mark.gpu], "ipex": [pytest.mark.xpu]}


@pytest.fixture(
    scope="module",
    params=[
        pytest.param(k, marks=KIND_MARKS.get(k, []), id=k)
        for k in ("cpp", "torch", "triton", "ipex")
    ],
)
def kind(request: pytest.FixtureRequest) -> Kind:
    reason = _skip_reason(request.param)
    if reason is not None:
        pytest.skip(reason)
    return _make(request.param)


def _id(x: object) -> str:
    return str(x).removeprefix("torch.")


# --- building a batch ----------------------------------------------------------------------------


def make_batch(
    seqs: list[tuple[int, int]],  # (cached context, new tokens) per sequence
    num_prefills: int,
    *,
    block_size: int,
    heads: tuple[int, int],  # (num_heads, num_kv_heads)
    head_size: int,
    dtype: torch.dtype = torch.float32,
    cache_dtype: torch.dtype | None = None,
    device: torch.device | str = "cpu",
    seed: int = 0,
    backend: AttentionBackend = REF,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, AttentionMetadata]:
    """A cache of random garbage (context included) with blocks scattered by a permutation.

    Returns (query, key, value, cache, meta): the new tokens' keys and values not yet written;
    the cache is ``[2, blocks, kv_heads, block_size, head_size]`` in ``cache_dtype`` (default
    ``dtype``).
    """
    gen = torch.Generator().manual_seed(seed)
    need = [-(-(ctx + q) // block_size) for ctx, q in seqs]
    num_blocks = sum(need) + 3
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    tables, slots = [], []
    for (ctx, q), n in zip(seqs, need, strict=True):
        table, perm = perm[:n], perm[n:]
        tables.append(table)
        slots += [table[p // block_size] * block_size + p % block_size for p in range(ctx, ctx + q)]
    device = torch.device(device)
    meta = backend.build_metadata(
        num_prefills=num_prefills,
        seq_lens=[c + q for c, q in seqs],
        query_lens=[q for _, q in seqs],
        slot_mapping=slots,
        block_tables=tables,
        block_size=block_size,
        device=device,
    )
    shape = REF.kv_cache_shape(num_blocks, block_size, heads[1], head_size)
    cache = to_cache_dtype(torch.randn(shape, generator=gen), cache_dtype or dtype).to(device)
    t = meta.num_tokens

    def rand(h: int) -> torch.Tensor:
        return torch.randn((t, h, head_size), generator=gen).to(dtype=dtype, device=device)

    return rand(heads[0]), rand(heads[1]), rand(heads[1]), cache, meta


def _scale_kw(cache: torch.Tensor) -> dict[str, float]:
    """Scales other than 1 for fp8 (a kernel that ignores them fails); none otherwise."""
    return dict(k_scale=0.5, v_scale=2.0) if cache.dtype in FP8_DTYPES else {}


def write_and_compare(
    kind: Kind,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cache: torch.Tensor,
    meta: AttentionMetadata,
    what: str,
    *,
    window: int | None = None,
    query_scale: float = 1.0,
    soft_cap: float | None = None,
) -> None:
    """Write through the kind and the reference (same bytes), then attend over the same cache."""
    kw = _scale_kw(cache)
    ref_cache = cache.clone()
    kind.backend.write_kv(key, value, cache, meta.slot_mapping, **kw)
    REF.write_kv(key, value, ref_cache, meta.slot_mapping, **kw)
    assert torch.equal(cache.cpu().view(torch.uint8), ref_cache.cpu().view(torch.uint8)), (
        f"{kind.name} {what}: cache after write_kv differs from the reference's"
    )
    scale = query.shape[-1] ** -0.5 * query_scale
    if soft_cap is not None:
        kw["logits_soft_cap"] = soft_cap
    out = kind.backend.forward(query, cache, meta, scale, sliding_window=window, **kw)
    ref = REF.forward(query, cache, meta, scale, sliding_window=window, **kw)
    assert out.shape == query.shape and out.dtype == query.dtype
    diff = (out.float() - ref.float()).abs().max().item()
    torch.testing.assert_close(
        out.float().cpu(),
        ref.float().cpu(),
        **kind.tol(query.dtype),
        msg=lambda m: f"{kind.name} {what} window={window}: max abs diff {diff:.3e}\n{m}",
    )


def mixed_seqs(block_size: int, kind: Kind) -> tuple[list[tuple[int, int]], int]:
    """Prompt chunks (fresh, after full blocks, after a partial block), then ragged decodes."""
    if kind.interpreted:
        prefills = [(0, 12), (block_size + 3, 5)]
        decodes = [(block_size - 1, 1), (block_size, 1), (70, 1)]  # 70: three partitions
        return prefills + decodes, len(prefills)
    prefills = [(0, 23), (block_size, 9), (block_size + 3, block_size)]
    decodes = [(0, 1), (block_size - 2, 1), (block_size - 1, 1), (block_size, 1), (299, 1)]
    return prefills + decodes, len(prefills)


# --- the matrix ----------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=_id)
@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize("head_size", HEAD_SIZES)
@pytest.mark.parametrize("heads", GQA, ids=lambda h: f"h{h[0]}kv{h[1]}")
def test_mixed_batch_matches_reference(
    kind: Kind, heads: tuple[int, int], head_size: int, block_size: int, dtype: torch.dtype
) -> None:
    if dtype not in kind.dtypes:
        pytest.skip(f"{kind.name} does not compute in {_id(dtype)} on {kind.device}")
    grid = (GQA.index(heads), HEAD_SIZES.index(head_size), BLOCK_SIZES.index(block_size))
    if not kind.covers(*grid, DTYPES.index(dtype)):
        pytest.skip("interpreted: this combination is outside the covering set")
    seqs, num_prefills = mixed_seqs(block_size, kind)
    batch = make_batch(
        seqs,
        num_prefills,
        block_size=block_size,
        heads=heads,
        head_size=head_size,
        dtype=dtype,
        device=kind.device,
        backend=kind.backend,
    )
    write_and_compare(kind, *batch, f"d={head_size} bs={block_size} heads={heads} {_id(dtype)}")


@pytest.mark.parametrize("window", [1, 2, 5, 16, 40, 1000])
@pytest.mark.parametrize("block_size", BLOCK_SIZES)
def test_sliding_window(kind: Kind, block_size: int, window: int) -> None:
    if not kind.covers(block_size // 8 - 1, window % 3):
        pytest.skip("interpreted: this combination is outside the covering set")
    seqs, num_prefills = mixed_seqs(block_size, kind)
    batch = make_batch(
        seqs,
        num_prefills,
        block_size=block_size,
        heads=(8, 2),
        head_size=64,
        device=kind.device,
        backend=kind.backend,
    )
    write_and_compare(kind, *batch, f"bs={block_size}", window=window)


@pytest.mark.parametrize("seed", range(8))
def test_random_batches(kind: Kind, seed: int) -> None:
    """Random mixes of prompt chunks and decodes, block sizes, GQA groups and windows."""
    rng = random.Random(seed)
    block_size, kv_heads = rng.choice(BLOCK_SIZES), rng.choice([1, 2, 4])
    num_prefills, num_decodes = rng.randint(0, 3), rng.randint(0, 4)
    if num_prefills + num_decodes == 0:
        num_decodes = 1
    seqs = [
        (rng.choice([0, 0, rng.randint(1, 90)]), rng.randint(1, 40)) for _ in range(num_prefills)
    ]
    seqs += [(rng.randint(0, 120), 1) for _ in range(num_decodes)]
    if kind.interpreted and seed >= 4:
        pytest.skip("interpreted: four random batches")
    heads = (kv_heads * rng.choice([1, 3, 4]), kv_heads)
    window = rng.choice([None, None, 7, 33])
    batch = make_batch(
        seqs,
        num_prefills,
        block_size=block_size,
        heads=heads,
        head_size=rng.choice([32, 64]),
        device=kind.device,
        seed=seed,
        backend=kind.backend,
    )
    write_and_compare(kind, *batch, f"seqs={seqs} bs={block_size} heads={heads}", window=window)


def test_large_scores_stay_finite(kind: Kind) -> None:
    """The softmax must subtract the running max: logits of ~1e3 would overflow exp."""
    long = 70 if kind.interpreted else 299
    batch = make_batch(
        [(0, 40), (long, 1)], 1, block_size=16, heads=(4, 2), head_size=64, device=kind.device
    )
    write_and_compare(kind, *batch, "scores x40", query_scale=40.0)


@pytest.mark.parametrize("dtype", DTYPES, ids=_id)
@pytest.mark.parametrize(("cap", "query_scale", "window"), [(50.0, 1.0, None), (2.0, 8.0, 5)])
def test_logits_soft_cap(
    kind: Kind, dtype: torch.dtype, cap: float, query_scale: float, window: int | None
) -> None:
    """Gemma 2's soft cap, ``cap * tanh(s / cap)`` on every score: at Gemma's 50 (scores far
    below it, the cap nearly linear) and at a cap of 2 under scores of ~8 (deep in the tanh's
    saturation, where a kernel that skipped it would be far off), with and without a window."""
    if dtype not in kind.dtypes:
        pytest.skip(f"{kind.name} does not compute in {_id(dtype)} on {kind.device}")
    if not kind.covers(DTYPES.index(dtype), 0 if window is None else 1):
        pytest.skip("interpreted: this combination is outside the covering set")
    seqs, num_prefills = mixed_seqs(16, kind)
    batch = make_batch(
        seqs,
        num_prefills,
        block_size=16,
        heads=(8, 2),
        head_size=64,
        dtype=dtype,
        device=kind.device,
        backend=kind.backend,
    )
    what = f"soft cap {cap} {_id(dtype)}"
    write_and_compare(kind, *batch, what, window=window, query_scale=query_scale, soft_cap=cap)


def test_write_kv_skips_padding_slots(kind: Kind) -> None:
    """Slot -1 marks a padding token: nothing is stored for it."""
    cache = torch.zeros(2, 4, 1, 8, 64, device=kind.device)
    key = torch.ones(3, 1, 64, device=kind.device)
    kind.backend.write_kv(key, key, cache, torch.tensor([0, -1, 9], device=kind.device))
    assert cache.sum().item() == 2 * 2 * 64  # two real tokens, K and V
    assert cache[0, 1, 0, 1].eq(1).all() and cache[0, 0, 0, 0].eq(1).all()


@pytest.mark.parametrize("cache_dtype", list(dict.fromkeys(KV_CACHE_DTYPES.values())), ids=_id)
@pytest.mark.parametrize("dtype", DTYPES, ids=_id)
def test_kv_cache_dtypes(kind: Kind, dtype: torch.dtype, cache_dtype: torch.dtype) -> None:
    """Every (compute, cache) dtype pair the kind accepts; fp8 with scales other than 1."""
    if dtype not in kind.dtypes:
        pytest.skip(f"{kind.name} does not compute in {_id(dtype)} on {kind.device}")
    name = next(n for n, d in KV_CACHE_DTYPES.items() if d == cache_dtype)
    try:
        kind.backend.resolve_kv_cache_dtype(name, dtype)
    except ValueError:
        pytest.skip(f"{kind.name} refuses kv_cache_dtype={name} with {_id(dtype)} (by name)")
    for head_size, block_size, heads, window in ((64, 16, (8, 2), None), (80, 8, (8, 4), 9)):
        seqs, num_prefills = mixed_seqs(block_size, kind)
        batch = make_batch(
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
        write_and_compare(kind, *batch, f"cache {name} compute {_id(dtype)}", window=window)


def test_never_written_nan_slots_do_not_leak(kind: Kind) -> None:
    """A NaN-filled cache where only the slots a sequence owns (< seq_len) were written."""
    seqs, num_prefills = mixed_seqs(8, kind)
    query, key, value, clean, meta = make_batch(
        seqs, num_prefills, block_size=8, heads=(4, 2), head_size=32, device=kind.device
    )
    kind.backend.write_kv(key, value, clean, meta.slot_mapping)
    dirty = torch.full_like(clean, float("nan"))
    for table, seq_len in zip(meta.block_tables.tolist(), meta.seq_lens_list, strict=True):
        for pos in range(seq_len):
            dirty[:, table[pos // 8], :, pos % 8] = clean[:, table[pos // 8], :, pos % 8]
    out = kind.backend.forward(query, dirty, meta, 0.2)
    want = kind.backend.forward(query, clean, meta, 0.2)
    assert not out.isnan().any(), f"{kind.name}: NaN from never-written slots reached the output"
    torch.testing.assert_close(out, want, atol=0, rtol=0)


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16), ids=_id)
def test_copy_and_swap_blocks(kind: Kind, dtype: torch.dtype) -> None:
    """The kind's block moves equal the generic ones (whole blocks, K and V)."""
    dev = kind.device
    shape = kind.backend.kv_cache_shape(10, 8, 2, 32)
    caches = [torch.randn(shape).to(dtype=dtype, device=dev) for _ in range(3)]
    expect = [c.clone() for c in caches]
    pairs = torch.tensor([[0, 5], [3, 9], [3, 1], [7, 7]], device=dev)
    kind.backend.copy_blocks(caches, pairs)
    AttentionBackend.copy_blocks(kind.backend, expect, pairs)
    for got, want in zip(caches, expect, strict=True):
        assert torch.equal(got, want)
    host = torch.zeros(kind.backend.kv_cache_shape(4, 8, 2, 32), dtype=dtype)
    want_host = host.clone()
    swap = torch.tensor([[9, 0], [1, 3]])
    kind.backend.swap_blocks(caches[0], host, swap)
    AttentionBackend.swap_blocks(kind.backend, caches[0], want_host, swap)
    assert torch.equal(host, want_host)
    back = torch.tensor([[0, 2], [3, 6]])
    want_dev = caches[1].clone()
    kind.backend.swap_blocks(host, caches[1], back)
    AttentionBackend.swap_blocks(kind.backend, host, want_dev, back)
    assert torch.equal(caches[1], want_dev)

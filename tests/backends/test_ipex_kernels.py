"""What is particular to IPEX paged attention (``attention_backend="ipex"``) and the XPU device.

The kernel-against-reference matrix is ``test_attention_conformance.py`` (kind "ipex"); here the
cache engine moving IPEX caches, IPEX's input checks, and the XpuBackend glue.

IPEX's ops run on CPU tensors with its CPU build, so these tests need no Intel GPU; where an XPU
is present they also run there. They need intel_extension_for_pytorch, which pins torch to its
own minor version: run them with the dedicated environment (``bash ci/xpu.sh``, or
``.venvs/xpu/bin/python -m pytest tests/backends/test_ipex_kernels.py``). Under the main .venv the
kernel tests skip; the XpuBackend tests at the end need no IPEX and run everywhere.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING

import pytest
import torch

from pagedllm.backends.base import (
    FP8_DTYPES,
    AttentionBackend,
    AttentionMetadata,
    CacheEngine,
    CacheSpec,
)
from pagedllm.backends.reference import ReferenceAttention
from pagedllm.backends.xpu.backend import XpuBackend

if TYPE_CHECKING:
    from pagedllm.backends.xpu.attention import IpexPagedAttention


def _ipex_import_error() -> str | None:
    try:
        import intel_extension_for_pytorch  # noqa: F401
    except Exception as exc:  # IPEX also fails with NameError/RuntimeError on version mismatch
        return f"{type(exc).__name__}: {str(exc)[:200]}"
    return None


IPEX_ERROR = _ipex_import_error()
requires_ipex = pytest.mark.skipif(
    IPEX_ERROR is not None,
    reason=f"intel_extension_for_pytorch is not importable ({IPEX_ERROR}); "
    "pip install intel-extension-for-pytorch, or run `bash ci/xpu.sh`",
)


def ipex_test(fn: Callable[..., None]) -> Callable[..., None]:
    """Marks a kernel test: ``xpu`` (the IPEX CI leg) and skipped where IPEX cannot load."""
    return pytest.mark.xpu(requires_ipex(fn))


DEVICES = ["cpu"] + (["xpu"] if XpuBackend.is_available() else [])
# (atol, rtol). Half precision: the output itself is rounded to the dtype, so allow ~2 ulps
# relative (bf16 has 8 significant bits, fp16 11) on top of a small absolute floor.
TOL = {torch.float32: (1e-4, 0.0), torch.bfloat16: (1e-2, 1.6e-2), torch.float16: (1e-3, 2e-3)}
SCALE = 0.125


@pytest.fixture(scope="module")
def attn() -> IpexPagedAttention:
    from pagedllm.backends.xpu.attention import IpexPagedAttention

    return IpexPagedAttention()


def fp8_kwargs(cache_dtype: torch.dtype, scales: tuple[float, float]) -> dict[str, float]:
    """The scale keywords the attention layer passes: only for fp8 caches."""
    if cache_dtype not in FP8_DTYPES:
        return {}
    return {"k_scale": scales[0], "v_scale": scales[1]}


def _check(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    diff = (actual.float().cpu() - expected.float().cpu()).abs().max().item()
    atol, rtol = TOL[actual.dtype]
    torch.testing.assert_close(
        actual.float().cpu(),
        expected.float().cpu(),
        atol=atol,
        rtol=rtol,
        msg=f"{what}: max abs diff {diff:.3e} (atol {atol:g}, rtol {rtol:g})",
    )


def _batch(
    attn: IpexPagedAttention,
    seqs: list[tuple[int, int]],  # (cached context, new tokens) per sequence
    num_prefills: int,
    *,
    block_size: int,
    num_heads: int,
    num_kv_heads: int,
    head_size: int,
    dtype: torch.dtype = torch.float32,
    cache_dtype: torch.dtype | None = None,
    scales: tuple[float, float] = (1.0, 1.0),
    device: str = "cpu",
    seed: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor]:
    """Random blocks assigned at random, garbage in unused slots, every token written.

    Context and new tokens are all written through ``attn.write_kv`` into the IPEX cache and
    through the reference's ``write_kv`` into a reference-layout cache holding the same garbage;
    the cache holds ``cache_dtype`` (default ``dtype``), fp8 with ``scales`` (k_scale, v_scale).
    Returns (IPEX cache, reference cache, metadata, query).
    """
    gen = torch.Generator().manual_seed(seed)
    need = [-(-(ctx + q) // block_size) for ctx, q in seqs]
    num_blocks = sum(need) + 3
    free = torch.randperm(num_blocks, generator=gen).tolist()
    tables, slots_all, slots_new = [], [], []
    for (ctx, q), n in zip(seqs, need, strict=True):
        table = [free.pop() for _ in range(n)]
        tables.append(table)
        pos_slots = [table[p // block_size] * block_size + p % block_size for p in range(ctx + q)]
        slots_all += pos_slots
        slots_new += pos_slots[ctx:]
    meta = attn.build_metadata(
        num_prefills=num_prefills,
        seq_lens=[c + q for c, q in seqs],
        query_lens=[q for _, q in seqs],
        slot_mapping=slots_new,
        block_tables=tables,
        block_size=block_size,
        device=torch.device(device),
    )
    shape = attn.kv_cache_shape(num_blocks, block_size, num_kv_heads, head_size)
    cache_dtype = cache_dtype or dtype
    cache = torch.randn(shape, generator=gen).to(dtype=cache_dtype, device=device)
    ref_cache = cache.clone()  # the reference reads the same layout
    n_all = len(slots_all)
    key = torch.randn((n_all, num_kv_heads, head_size), generator=gen).to(dtype=dtype)
    value = torch.randn((n_all, num_kv_heads, head_size), generator=gen).to(dtype=dtype)
    slots = torch.tensor(slots_all, dtype=torch.int64).to(device)
    kw = fp8_kwargs(cache_dtype, scales)
    attn.write_kv(key.to(device), value.to(device), cache, slots, **kw)
    ReferenceAttention().write_kv(key.to(device), value.to(device), ref_cache, slots, **kw)
    query = torch.randn((meta.num_tokens, num_heads, head_size), generator=gen)
    return cache, ref_cache, meta, query.to(dtype=dtype, device=device)


# (compute dtype, cache dtype): a 16/32-bit cache, and fp8 e5m2 (moved as bytes: torch 2.8 has
# no CPU gather for fp8 tensors).
CACHE_MOVES = [(torch.float32, torch.float32), (torch.bfloat16, torch.float8_e5m2)]


@ipex_test
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(("dtype", "cache_dtype"), CACHE_MOVES, ids=str)
def test_copy_and_swap_through_cache_engine(
    attn, device: str, dtype: torch.dtype, cache_dtype: torch.dtype
) -> None:
    """CacheEngine.copy / swap_out / swap_in move whole blocks; attention reads them back."""
    bs, kvh, d = 16, 2, 64
    seqs = [(0, 1), (40, 1)]
    spec = CacheSpec(num_layers=2, num_kv_heads=kvh, head_size=d, block_size=bs, dtype=cache_dtype)
    engine = CacheEngine(
        spec, attn, device=torch.device(device), num_device_blocks=8, num_host_blocks=4
    )
    kw = fp8_kwargs(cache_dtype, (0.5, 2.0))
    cache, _, meta, query = _batch(
        attn, seqs, 0, block_size=bs, num_heads=4, num_kv_heads=kvh, head_size=d,
        dtype=dtype, cache_dtype=cache_dtype, scales=(0.5, 2.0), device=device,
    )  # fmt: skip
    assert cache.shape[1] <= 8
    for layer in engine.kv_caches:
        layer.zero_()
        layer[:, : cache.shape[1]] = cache
    expected = attn.forward(query, engine.kv_caches[0], meta, SCALE, **kw)
    table = meta.block_tables[1, :3].tolist()  # the 41-token sequence's blocks

    # Copy-on-write: blocks onto fresh ones; the remapped table must give the same attention.
    fresh = [b for b in range(8) if b not in meta.block_tables.flatten().tolist()][:3]
    engine.copy(list(zip(table, fresh, strict=True)))
    for layer in engine.kv_caches:
        as_bytes = layer.view(torch.uint8)
        assert torch.equal(as_bytes[:, fresh], as_bytes[:, table])
    meta.block_tables[1, :3] = torch.tensor(fresh, dtype=torch.int32)
    _check(attn.forward(query, engine.kv_caches[1], meta, SCALE, **kw), expected, "after copy")

    # Swap out to host, wipe the device blocks, swap back in to the original block ids.
    engine.swap_out(list(zip(fresh, [3, 0, 2], strict=True)))
    for layer in engine.kv_caches:  # all-ones bytes are NaN in every dtype
        layer.view(torch.uint8)[:, fresh + table] = 0xFF  # only the host copies survive
    engine.swap_in(list(zip([3, 0, 2], table, strict=True)))
    meta.block_tables[1, :3] = torch.tensor(table, dtype=torch.int32)
    _check(attn.forward(query, engine.kv_caches[0], meta, SCALE, **kw), expected, "after swap")


@ipex_test
def test_rejects_bad_inputs(attn) -> None:
    cache, _, meta, query = _batch(
        attn, [(3, 1)], 0, block_size=16, num_heads=4, num_kv_heads=2, head_size=64
    )
    with pytest.raises(ValueError, match="KV cache must be"):
        attn.forward(query, cache[0], meta, SCALE)
    with pytest.raises(ValueError, match="head_size"):
        attn.forward(query[..., :32], cache, meta, SCALE)
    with pytest.raises(ValueError, match="dtype"):
        attn.forward(query.double(), cache, meta, SCALE)
    with pytest.raises(ValueError, match="multiple"):
        attn.forward(query[:, :3], cache, meta, SCALE)
    with pytest.raises(ValueError, match="sliding_window"):
        attn.forward(query, cache, meta, SCALE, sliding_window=0)
    # IPEX reads only -1 as "no cap" (0 or -2 give other numbers): refused before the op.
    for cap in (0.0, -1.0, -50.0, float("nan")):
        with pytest.raises(ValueError, match="logits_soft_cap"):
            attn.forward(query, cache, meta, SCALE, logits_soft_cap=cap)


# (compute dtype, cache dtype) for the soft cap: each compute dtype, and e5m2 with scales other
# than 1 (k_scale is folded into the ops' scale, so it must land inside the tanh).
SOFT_CAP_DTYPES = [
    (torch.float32, torch.float32),
    (torch.bfloat16, torch.bfloat16),
    (torch.float16, torch.float16),
    (torch.bfloat16, torch.float8_e5m2),
]


@ipex_test
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("window", [1, 5, None])
@pytest.mark.parametrize(("dtype", "cache_dtype"), SOFT_CAP_DTYPES, ids=str)
def test_logits_soft_cap_against_reference(
    attn, device: str, window: int | None, dtype: torch.dtype, cache_dtype: torch.dtype
) -> None:
    """A cap of 2 under scores of ~8 (deep in the tanh's saturation) on a mixed batch: with
    ``sliding_window == 1`` (computed in PyTorch, not by IPEX; the conformance test's windows
    are None and 5), with a window of 5 (decodes then go through the varlen op: IPEX's decode op
    refuses a window with a cap) and without; fp8 caches too, which the conformance test's
    soft-cap case does not reach, with ``k_scale``/``v_scale`` of 0.5/2."""
    seqs = [(0, 12), (16, 5), (19, 16), (2, 1), (15, 1), (40, 1)]  # 3 prompt chunks, 3 decodes
    scales = (0.5, 2.0)
    cache, ref_cache, meta, query = _batch(
        attn, seqs, 3, block_size=16, num_heads=8, num_kv_heads=2, head_size=64,
        dtype=dtype, cache_dtype=cache_dtype, scales=scales, device=device,
    )  # fmt: skip
    kw = {"sliding_window": window, "logits_soft_cap": 2.0, **fp8_kwargs(cache_dtype, scales)}
    scale = 8 * 64**-0.5
    out = attn.forward(query, cache, meta, scale, **kw)
    expected = ReferenceAttention().forward(query, ref_cache, meta, scale, **kw)
    assert out.shape == query.shape and out.dtype == query.dtype
    _check(out, expected, f"soft cap 2, window {window}, {dtype} over {cache_dtype}")
    if window != 1:  # the cap must have changed something: scores are far beyond it
        uncapped = ReferenceAttention().forward(
            query, ref_cache, meta, scale, **{**kw, "logits_soft_cap": None}
        )
        assert (uncapped.float() - expected.float()).abs().max().item() > 0.5


# ---- XpuBackend glue: no IPEX, no Intel GPU needed -------------------------------------------


def test_modules_import_without_ipex() -> None:
    """Importing the backend and its attention module must not import IPEX."""
    code = (
        "import sys, pagedllm, pagedllm.backends.xpu.backend, pagedllm.backends.xpu.attention\n"
        "assert 'intel_extension_for_pytorch' not in sys.modules, 'IPEX imported eagerly'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_missing_ipex_error_says_what_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    from pagedllm.backends.xpu import backend as xpu_backend
    from pagedllm.backends.xpu.attention import IpexPagedAttention

    monkeypatch.setitem(sys.modules, "intel_extension_for_pytorch", None)  # import -> ImportError
    with pytest.raises(ImportError, match="pip install intel-extension-for-pytorch"):
        IpexPagedAttention()
    with pytest.raises(ImportError, match="pip install intel-extension-for-pytorch"):
        XpuBackend().attention("ipex")
    monkeypatch.setattr(xpu_backend, "triton_supports_xpu", lambda: False)
    with pytest.raises(ImportError, match="pip install intel-extension-for-pytorch"):
        XpuBackend().attention("auto")
    with pytest.raises(ValueError, match="does not run on device 'xpu'"):
        XpuBackend().attention("cpp")
    assert XpuBackend().attention("reference").name == "reference"


def test_auto_falls_back_to_triton_when_it_has_the_intel_backend(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from pagedllm.backends import kernels
    from pagedllm.backends.xpu import backend as xpu_backend

    made: list[str] = []
    monkeypatch.setitem(sys.modules, "intel_extension_for_pytorch", None)
    monkeypatch.setattr(xpu_backend, "triton_supports_xpu", lambda: True)
    real = kernels.load

    def fake(row: kernels.Kernel) -> type[AttentionBackend]:
        made.append(row.impl)
        return real(kernels.entry("attention", "reference")) if row.impl == "triton" else real(row)

    monkeypatch.setattr(kernels, "load", fake)
    assert XpuBackend.kernel_order["attention"] == ("ipex", "triton")
    XpuBackend().attention("auto")
    assert made == ["ipex", "triton"]


def test_is_available_never_raises(monkeypatch: pytest.MonkeyPatch) -> None:
    def boom() -> bool:
        raise RuntimeError("driver exploded")

    monkeypatch.setattr(torch.xpu, "is_available", boom)
    assert XpuBackend.is_available() is False
    monkeypatch.delattr(torch, "xpu")
    assert XpuBackend.is_available() is False


def test_device_dtype_and_dist_backend(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch.distributed as dist

    b = XpuBackend()
    assert b.device(1) == torch.device("xpu", 1)
    assert b.default_dtype(torch.float32) is torch.bfloat16
    assert b.default_dtype(torch.float16) is torch.float16
    monkeypatch.setattr(dist, "is_xccl_available", lambda: True, raising=False)
    assert b.dist_backend() == "xccl"
    monkeypatch.setattr(dist, "is_xccl_available", lambda: False, raising=False)
    assert b.dist_backend() == "ccl"


def test_memory_queries_use_torch_xpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """Free/total memory and peak profiling read torch.xpu's allocator (faked here)."""
    state = {"allocated": 100, "peak": 100}

    class Props:
        total_memory = 64 << 30

    def run_fn() -> None:
        state["peak"] = 900  # the dummy forward peaks at 900 bytes, ends back at 100

    def noop(*args: object) -> None:
        return None

    monkeypatch.setattr(torch.xpu, "mem_get_info", lambda d=None: (10 << 30, 64 << 30))
    monkeypatch.setattr(torch.xpu, "get_device_properties", lambda d=None: Props())
    monkeypatch.setattr(torch.xpu, "synchronize", noop)
    monkeypatch.setattr(
        torch.xpu, "reset_peak_memory_stats", lambda d=None: state.update(peak=state["allocated"])
    )
    monkeypatch.setattr(torch.xpu, "memory_allocated", lambda d=None: state["allocated"])
    monkeypatch.setattr(torch.xpu, "max_memory_allocated", lambda d=None: state["peak"])
    b = XpuBackend()
    assert b.free_memory_bytes(0) == 10 << 30
    assert b.total_memory_bytes(0) == 64 << 30
    assert b.profile_peak_bytes(run_fn, 0) == 800

    def unsupported(d: object = None) -> tuple[int, int]:
        raise RuntimeError("mem_get_info needs ZES_ENABLE_SYSMAN=1")

    monkeypatch.setattr(torch.xpu, "mem_get_info", unsupported)
    monkeypatch.setattr(torch.xpu, "memory_reserved", lambda d=None: 4 << 30)
    assert b.free_memory_bytes(0) == 60 << 30

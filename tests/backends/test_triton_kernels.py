"""Triton paged-attention kernels vs the plain-PyTorch reference.

On a CUDA machine the kernels run compiled, in float32, float16 and bfloat16. Elsewhere they run
under Triton's interpreter on CPU tensors (float32 and float16): TRITON_INTERPRET must be set
before triton is first imported, which is why this module sets it at import time. A separate test
compiles every kernel to sm_80/sm_90 cubins in a subprocess, so GPU code generation is checked
even without a GPU.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest
import torch

from pagedllm.backends.base import AttentionMetadata, CacheSpec, build_attention_metadata
from pagedllm.backends.reference import ReferenceAttention

ON_CUDA = torch.cuda.is_available()
if not ON_CUDA:
    os.environ["TRITON_INTERPRET"] = "1"
HAVE_TRITON = importlib.util.find_spec("triton") is not None
DEVICE = torch.device("cuda" if ON_CUDA else "cpu")

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not HAVE_TRITON, reason="triton is not installed (ci/requirements-gpu.txt)"),
]

DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if ON_CUDA else [])
ATOL = {torch.float32: 1e-3, torch.float16: 1e-2, torch.bfloat16: 3e-2}


@pytest.fixture(scope="module")
def ops():
    from pagedllm.backends.gpu import triton_ops

    if not ON_CUDA and type(triton_ops._prefill_kernel).__name__ != "InterpretedFunction":
        pytest.skip("triton_ops was imported before TRITON_INTERPRET=1 was set")
    return triton_ops


def _check(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    diff = (actual.float() - expected.float()).abs().max().item()
    atol = ATOL[actual.dtype]
    torch.testing.assert_close(
        actual.float(),
        expected.float(),
        atol=atol,
        rtol=0,
        msg=f"{what}: max abs diff {diff:.3e} > {atol:g}",
    )


def _paged_batch(
    seqs: list[tuple[int, int]],  # (cached context, new tokens) per sequence
    num_prefills: int,
    *,
    block_size: int,
    num_heads: int,
    num_kv_heads: int,
    head_size: int,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
) -> tuple[torch.Tensor, AttentionMetadata, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A random cache (garbage in every unused slot) and a batch; blocks assigned at random.

    Returns (cache in the Triton layout, metadata, query, key, value) with the new tokens'
    keys/values not yet written.
    """
    gen = torch.Generator().manual_seed(seed)
    need = [-(-(ctx + q) // block_size) for ctx, q in seqs]
    num_blocks = sum(need) + 3
    free = torch.randperm(num_blocks, generator=gen).tolist()
    tables, slots = [], []
    for (ctx, q), n in zip(seqs, need, strict=True):
        table = [free.pop() for _ in range(n)]
        tables.append(table)
        slots += [table[p // block_size] * block_size + p % block_size for p in range(ctx, ctx + q)]
    meta = build_attention_metadata(
        num_prefills=num_prefills,
        seq_lens=[c + q for c, q in seqs],
        query_lens=[q for _, q in seqs],
        slot_mapping=slots,
        block_tables=tables,
        block_size=block_size,
        device=DEVICE,
    )
    shape = (2, num_blocks, num_kv_heads, block_size, head_size)
    cache = torch.randn(shape, generator=gen).to(dtype=dtype, device=DEVICE)
    t = meta.num_tokens
    query = torch.randn((t, num_heads, head_size), generator=gen).to(dtype=dtype, device=DEVICE)
    key = torch.randn((t, num_kv_heads, head_size), generator=gen).to(dtype=dtype, device=DEVICE)
    value = torch.randn((t, num_kv_heads, head_size), generator=gen).to(dtype=dtype, device=DEVICE)
    return cache, meta, query, key, value


def _reference(
    query: torch.Tensor, cache: torch.Tensor, meta: AttentionMetadata, window: int | None
) -> torch.Tensor:
    """The oracle on the same cache seen in its layout [2, blocks, block_size, kv_heads, d]."""
    ref_cache = cache.transpose(2, 3).contiguous().float()
    return ReferenceAttention().forward(
        query.float(), ref_cache, meta, 0.125, sliding_window=window
    )


@pytest.mark.parametrize("head_size", [64, 128])
@pytest.mark.parametrize("block_size", [16, 32])
def test_reshape_and_cache(ops, head_size: int, block_size: int) -> None:
    cache, meta, _, key, value = _paged_batch(
        [(5, 9), (0, 20)],
        2,
        block_size=block_size,
        num_heads=4,
        num_kv_heads=2,
        head_size=head_size,
    )
    slots = meta.slot_mapping.clone()
    slots[3] = -1  # a padding token: must not be written
    expected = cache.transpose(2, 3).clone()
    keep = slots >= 0
    ReferenceAttention().write_kv(key[keep], value[keep], expected, slots[keep])
    ops.reshape_and_cache(key, value, cache, slots)
    diff = (cache.transpose(2, 3) - expected).abs().max().item()
    torch.testing.assert_close(
        cache.transpose(2, 3),
        expected,
        atol=0,
        rtol=0,
        msg=f"cache after write: max abs diff {diff:.3e}",
    )


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("head_size", [64, 128])
@pytest.mark.parametrize("block_size", [16, 32])
def test_decode_split_k_gqa(ops, dtype: torch.dtype, head_size: int, block_size: int) -> None:
    """Ragged contexts, 4 query heads per KV head, 70 tokens over 32-token partitions."""
    seqs = [(0, 1), (16, 1), (69, 1), (32, 1)]
    cache, meta, query, key, value = _paged_batch(
        seqs,
        0,
        block_size=block_size,
        num_heads=8,
        num_kv_heads=2,
        head_size=head_size,
        dtype=dtype,
    )
    ops.reshape_and_cache(key, value, cache, meta.slot_mapping)
    partition = 32
    assert meta.max_seq_len > 2 * partition  # split-K and its reduction are engaged
    out = ops.paged_decode_attention(
        query,
        cache,
        meta.block_tables,
        meta.seq_lens,
        meta.max_seq_len,
        0.125,
        partition_size=partition,
    )
    _check(out, _reference(query, cache, meta, None), f"decode {dtype} d={head_size}")


@pytest.mark.parametrize("window", [None, 20, 40])
def test_decode_sliding_window_and_single_partition(ops, window: int | None) -> None:
    """Windows starting inside / before partitions; plus the one-partition (no reduce) path."""
    seqs = [(69, 1), (49, 1), (4, 1)]
    cache, meta, query, key, value = _paged_batch(
        seqs,
        0,
        block_size=16,
        num_heads=4,
        num_kv_heads=4,
        head_size=64,
    )
    ops.reshape_and_cache(key, value, cache, meta.slot_mapping)
    expected = _reference(query, cache, meta, window)
    for partition in (32, 512):
        out = ops.paged_decode_attention(
            query,
            cache,
            meta.block_tables,
            meta.seq_lens,
            meta.max_seq_len,
            0.125,
            sliding_window=window,
            partition_size=partition,
        )
        _check(out, expected, f"decode window={window} partition={partition}")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("head_size", [64, 128])
@pytest.mark.parametrize("block_size", [16, 32])
def test_prefill_with_cached_context(
    ops, dtype: torch.dtype, head_size: int, block_size: int
) -> None:
    """Fresh prompt, prompt after a cached prefix, chunk after a partial block; GQA 4:1."""
    seqs = [(0, 23), (37, 9), (16, 16)]
    cache, meta, query, key, value = _paged_batch(
        seqs,
        3,
        block_size=block_size,
        num_heads=4,
        num_kv_heads=1,
        head_size=head_size,
        dtype=dtype,
    )
    ops.reshape_and_cache(key, value, cache, meta.slot_mapping)
    out = ops.prefill_attention(
        query,
        cache,
        meta.block_tables,
        meta.seq_lens,
        meta.query_start_loc,
        meta.max_query_len,
        0.125,
        block_m=16,
        tile_n=16,
    )
    _check(out, _reference(query, cache, meta, None), f"prefill {dtype} d={head_size}")


@pytest.mark.parametrize("window", [None, 7])
@pytest.mark.parametrize("shape", [(4, 2, 64), (3, 3, 80)], ids=["gqa", "mha-d80"])
def test_mixed_batch_through_backend(window: int | None, shape: tuple[int, int, int]) -> None:
    """TritonPagedAttention.write_kv + forward on 2 prefills followed by 3 decodes."""
    from pagedllm.backends.gpu.attention import TritonPagedAttention

    heads, kv_heads, head_size = shape
    attn = TritonPagedAttention(partition_size=32, prefill_block_m=16, tile_n=16)
    seqs = [(10, 12), (0, 5), (40, 1), (0, 1), (20, 1)]
    cache, meta, query, key, value = _paged_batch(
        seqs,
        2,
        block_size=16,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_size=head_size,
    )
    assert cache.shape == attn.kv_cache_shape(cache.shape[1], 16, kv_heads, head_size)
    attn.write_kv(key, value, cache, meta.slot_mapping)
    out = attn.forward(query, cache, meta, 0.125, sliding_window=window)
    _check(out, _reference(query, cache, meta, window), f"mixed batch window={window}")


@pytest.mark.parametrize("seed", range(6))
def test_random_batches(seed: int) -> None:
    """Random mixes of prompt chunks and decodes, block sizes 8-32, groups 1-8, windows."""
    from pagedllm.backends.gpu.attention import TritonPagedAttention

    rng = torch.Generator().manual_seed(seed)

    def pick(options: list) -> object:
        return options[int(torch.randint(len(options), (1,), generator=rng))]

    block_size, group, kv_heads = pick([8, 16, 32]), pick([1, 2, 4, 8]), pick([1, 2])
    window = pick([None, None, 5, 33])
    num_prefills, num_decodes = pick([0, 1, 2]), pick([0, 1, 3])
    num_prefills = num_prefills or (0 if num_decodes else 1)
    prefills = [
        (
            int(torch.randint(0, 50, (1,), generator=rng)),
            int(torch.randint(1, 30, (1,), generator=rng)),
        )
        for _ in range(num_prefills)
    ]
    decodes = [(int(torch.randint(0, 90, (1,), generator=rng)), 1) for _ in range(num_decodes)]
    cache, meta, query, key, value = _paged_batch(
        prefills + decodes,
        num_prefills,
        block_size=block_size,
        num_heads=group * kv_heads,
        num_kv_heads=kv_heads,
        head_size=32,
        seed=seed,
    )
    attn = TritonPagedAttention(partition_size=32, prefill_block_m=16, tile_n=16)
    attn.write_kv(key, value, cache, meta.slot_mapping)
    out = attn.forward(query, cache, meta, 0.125, sliding_window=window)
    _check(
        out,
        _reference(query, cache, meta, window),
        f"seqs={prefills + decodes} bs={block_size} group={group} window={window}",
    )


def test_launchers_reject_bad_inputs(ops) -> None:
    cache, meta, query, key, value = _paged_batch(
        [(3, 1)],
        0,
        block_size=16,
        num_heads=4,
        num_kv_heads=2,
        head_size=64,
    )
    args = (meta.block_tables, meta.seq_lens, meta.max_seq_len, 0.125)
    with pytest.raises(ValueError, match="kv_cache must be"):
        ops.paged_decode_attention(query, cache[0], *args)
    with pytest.raises(ValueError, match="dtype"):
        ops.paged_decode_attention(query.half(), cache, *args)
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        ops.paged_decode_attention(query[:, :3], cache, *args)
    with pytest.raises(ValueError, match="stride"):
        ops.paged_decode_attention(query.transpose(1, 2).contiguous().transpose(1, 2), cache, *args)
    with pytest.raises(ValueError, match="partition_size"):
        ops.paged_decode_attention(query, cache, *args, partition_size=24)
    with pytest.raises(ValueError, match="slot_mapping"):
        ops.reshape_and_cache(key, value, cache, meta.slot_mapping.float())
    with pytest.raises(ValueError, match="query_start_loc"):
        ops.prefill_attention(
            query, cache, meta.block_tables, meta.seq_lens, meta.query_start_loc[:1], 1, 0.125
        )
    with pytest.raises(ValueError, match="sliding_window"):
        ops.paged_decode_attention(query, cache, *args, sliding_window=0)


def test_cache_engine_swap_and_copy() -> None:
    """CudaCacheEngine (side stream on CUDA, inline on CPU) moves whole blocks, K and V."""
    from pagedllm.backends.gpu.attention import TritonPagedAttention
    from pagedllm.backends.gpu.cache_engine import CudaCacheEngine

    spec = CacheSpec(num_layers=2, num_kv_heads=2, head_size=8, block_size=4, dtype=torch.float32)
    engine = CudaCacheEngine(
        spec, TritonPagedAttention(), device=DEVICE, num_device_blocks=6, num_host_blocks=3
    )
    for i, cache in enumerate(engine.kv_caches):
        cache.copy_(torch.randn(cache.shape, generator=torch.Generator().manual_seed(i)))
    before = [c.clone() for c in engine.kv_caches]
    engine.swap_out([(1, 0), (4, 2)])
    engine.copy([(1, 5)])
    for cache in engine.kv_caches:
        cache[:, 1].zero_()
        cache[:, 4].zero_()
    engine.swap_in([(0, 4), (2, 1)])
    engine.synchronize()
    for after, orig in zip(engine.kv_caches, before, strict=True):
        expected = orig.clone()
        expected[:, 5] = orig[:, 1]
        expected[:, 4] = orig[:, 1]
        expected[:, 1] = orig[:, 4]
        diff = (after - expected).abs().max().item()
        torch.testing.assert_close(
            after, expected, atol=0, rtol=0, msg=f"blocks after swap/copy: max abs diff {diff:.3e}"
        )
    if ON_CUDA:
        assert engine.host_caches[0].is_pinned()


def test_cuda_backend_surface() -> None:
    from pagedllm.backends.gpu.attention import TritonPagedAttention
    from pagedllm.backends.gpu.backend import CudaBackend
    from pagedllm.backends.reference import ReferenceAttention as Ref

    assert CudaBackend.is_available() is ON_CUDA
    backend = CudaBackend()
    assert backend.dist_backend() == "nccl"
    assert backend.device(1) == torch.device("cuda", 1)
    assert isinstance(backend.attention(), TritonPagedAttention)
    assert isinstance(backend.attention("reference"), Ref)
    with pytest.raises(ValueError, match="attention_backend"):
        backend.attention("cpp")
    assert backend.default_dtype(torch.float16) == torch.float16
    assert backend.default_dtype(torch.bfloat16) == torch.bfloat16
    assert backend.default_dtype(torch.float32) in (torch.bfloat16, torch.float16)


def test_decode_partition_size_fills_the_gpu(ops, monkeypatch: pytest.MonkeyPatch) -> None:
    """Few (seq, KV head) pairs with long contexts get more, smaller partitions."""
    assert ops.decode_partition_size(4096, 1, 1, torch.device("cpu")) == 512
    props = type("Props", (), {"multi_processor_count": 132})()
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda dev=None: props)
    gpu = torch.device("cuda", 0)
    assert ops.decode_partition_size(512, 32, 2, gpu) == 128  # 64 pairs x 5 parts >= 264
    assert ops.decode_partition_size(2048, 32, 2, gpu) == 512
    assert ops.decode_partition_size(100, 256, 8, gpu) == 128  # busy already: one partition
    assert ops.decode_partition_size(40, 256, 8, gpu) == 64  # the floor
    assert ops.decode_partition_size(32768, 1, 1, gpu) == 128  # one pair: 256 programs
    assert ops.decode_partition_size(8192, 64, 2, gpu) == 512  # the ceiling


def test_cuda_kv_budget_accounts_for_everything_in_use(monkeypatch: pytest.MonkeyPatch) -> None:
    """Budget = total x util - held before (weights, context) - activation peak - non-torch.

    The CUDA allocator is faked so the arithmetic is checked on any machine.
    """
    from pagedllm.backends.gpu.backend import CudaBackend

    gib = 1 << 30
    state = {"free": 80 * gib, "alloc": 18 * gib, "peak": 18 * gib, "reserved": 19 * gib}

    def profile() -> None:  # 5 GiB of activations, 6 GiB more reserved, 1 GiB outside torch
        state["peak"] = state["alloc"] + 5 * gib
        state["reserved"] += 6 * gib
        state["free"] -= 7 * gib

    cuda = torch.cuda
    monkeypatch.setattr(cuda, "mem_get_info", lambda dev=None: (state["free"], 100 * gib))
    monkeypatch.setattr(cuda, "memory_allocated", lambda dev=None: state["alloc"])
    monkeypatch.setattr(cuda, "max_memory_allocated", lambda dev=None: state["peak"])
    monkeypatch.setattr(cuda, "memory_reserved", lambda dev=None: state["reserved"])
    monkeypatch.setattr(cuda, "reset_peak_memory_stats", lambda dev=None: None)
    monkeypatch.setattr(cuda, "synchronize", lambda dev=None: None)
    monkeypatch.setattr(cuda, "empty_cache", lambda: None)
    budget = CudaBackend().kv_cache_budget_bytes(
        profile=profile, gpu_memory_utilization=0.9, cpu_kv_cache_bytes=0
    )
    assert budget == 90 * gib - 20 * gib - 5 * gib - 1 * gib, budget / gib


def _run_python(code: str, **env: str) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    return subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env={**clean, **env},
        timeout=600,
        check=False,
    )


def test_import_without_triton() -> None:
    """With triton unimportable, pagedllm and the CUDA backend probe still work."""
    code = (
        "import sys; sys.modules['triton'] = None\n"
        "import pagedllm\n"
        "from pagedllm.backends.gpu.backend import CudaBackend\n"
        "from pagedllm.backends.registry import resolve_device\n"
        "assert CudaBackend.is_available() is False\n"
        "assert resolve_device('auto') != 'cuda'\n"
        "from pagedllm.backends.gpu.attention import TritonPagedAttention\n"
        "try:\n    TritonPagedAttention()\nexcept ImportError as e:\n    print('IMPORT', e)\n"
    )
    res = _run_python(code)
    assert res.returncode == 0, res.stderr
    assert "IMPORT attention_backend='triton' needs the triton package" in res.stdout


def test_cpu_tensors_without_interpreter_fail_clearly() -> None:
    code = (
        "import torch\n"
        "from pagedllm.backends.gpu.triton_ops import reshape_and_cache\n"
        "k = torch.zeros(1, 1, 16)\n"
        "try:\n"
        "    reshape_and_cache(k, k, torch.zeros(2, 1, 1, 16, 16), torch.zeros(1).long())\n"
        "except RuntimeError as e:\n"
        "    print('ERR', e)\n"
    )
    res = _run_python(code)
    assert res.returncode == 0, res.stderr
    assert "ERR Triton kernels got cpu tensors" in res.stdout, res.stdout


def test_kernels_compile_for_nvidia_targets(tmp_path) -> None:
    """The interpreter proves the math; this proves the kernels lower to sm_80/sm_90 cubins."""
    if importlib.util.find_spec("triton.backends.nvidia") is None:
        pytest.skip("this triton build has no NVIDIA backend")
    code = (
        "from pagedllm.backends.gpu.compile_check import compile_all\n"
        "print('\\n'.join(compile_all([90], ['float16'], quick=True)))\n"
        "print('\\n'.join(compile_all([80], ['bfloat16', 'float32'], quick=True)))\n"
    )
    # A fresh cache dir: compile for real instead of reusing an earlier run's cubins.
    res = _run_python(code, TRITON_DEFAULT_FP_FUSION="1", TRITON_CACHE_DIR=str(tmp_path))
    assert res.returncode == 0, res.stderr[-4000:]
    assert res.stdout.count(" ok ") == 18, res.stdout  # 4 attention + 2 fused-MoE kernels, x3

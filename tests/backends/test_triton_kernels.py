"""What is particular to the Triton kernels: the launchers (their checks, the slot -1 skip, the
split-K partition choice and the one-partition path), the CUDA cache engine and device, imports
without triton, and compilation to sm_80/sm_90 cubins in a subprocess (no GPU needed).

The kernel-against-reference matrix is ``test_attention_conformance.py`` (kind "triton"). On a
CUDA machine the kernels run compiled; elsewhere under Triton's interpreter on CPU tensors:
TRITON_INTERPRET must be set before triton is first imported, which is why `triton_env`
(imported before anything that loads triton) sets it.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest
import torch

from pagedllm.backends.base import AttentionMetadata, CacheSpec
from pagedllm.backends.reference import ReferenceAttention
from tests.backends import test_attention_conformance as conformance
from tests.backends.triton_env import DEVICE, ON_CUDA, TRITON_MARKS

pytestmark = TRITON_MARKS

DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if ON_CUDA else [])
ATOL = {torch.float32: 1e-3, torch.float16: 1e-2, torch.bfloat16: 3e-2}


@pytest.fixture(scope="module")
def ops():
    from pagedllm.backends.gpu import triton_ops

    if not ON_CUDA and not triton_ops.interpreted():
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
    """(cache, metadata, query, key, value): the conformance module's batch, on DEVICE."""
    query, key, value, cache, meta = conformance.make_batch(
        seqs,
        num_prefills,
        block_size=block_size,
        heads=(num_heads, num_kv_heads),
        head_size=head_size,
        dtype=dtype,
        device=DEVICE,
        seed=seed,
    )
    return cache, meta, query, key, value


def _reference(
    query: torch.Tensor, cache: torch.Tensor, meta: AttentionMetadata, window: int | None
) -> torch.Tensor:
    """The oracle on the same cache (one layout everywhere), in float32."""
    return ReferenceAttention().forward(
        query.float(), cache.float(), meta, 0.125, sliding_window=window
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
    expected = cache.clone()
    keep = slots >= 0
    ReferenceAttention().write_kv(key[keep], value[keep], expected, slots[keep])
    ops.reshape_and_cache(key, value, cache, slots)
    diff = (cache - expected).abs().max().item()
    torch.testing.assert_close(
        cache,
        expected,
        atol=0,
        rtol=0,
        msg=f"cache after write: max abs diff {diff:.3e}",
    )


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


@pytest.mark.parametrize("cap", [0.0, -50.0, float("nan")])
def test_launchers_reject_bad_soft_cap(ops, cap: float) -> None:
    """A cap that is not positive is refused by name before anything launches."""
    cache, meta, query, _, _ = _paged_batch(
        [(3, 1)], 1, block_size=16, num_heads=2, num_kv_heads=1, head_size=16
    )
    with pytest.raises(ValueError, match="logits_soft_cap"):
        ops.paged_decode_attention(
            query,
            cache,
            meta.block_tables,
            meta.seq_lens,
            meta.max_seq_len,
            0.25,
            logits_soft_cap=cap,
        )
    with pytest.raises(ValueError, match="logits_soft_cap"):
        ops.prefill_attention(
            query,
            cache,
            meta.block_tables,
            meta.seq_lens,
            meta.query_start_loc,
            1,
            0.25,
            logits_soft_cap=cap,
        )


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


def test_engine_refuses_compiled_triton_on_the_cpu(llama_path) -> None:
    """Without the interpreter, naming the Triton kernels for device="cpu" is refused when the
    engine is built (a ValueError naming the field), not at the first step (which would end every
    request; seen on a CUDA machine, where the interpreter is off)."""
    code = (
        "from pagedllm import Engine\n"
        "try:\n"
        f"    Engine({str(llama_path)!r}, device='cpu', attention_backend='triton')\n"
        "except ValueError as e:\n"
        "    print('ERR', e)\n"
    )
    res = _run_python(code)
    assert res.returncode == 0, res.stderr[-4000:]
    assert "ERR attention_backend: 'triton' on device 'cpu' runs only under" in res.stdout, (
        res.stdout
    )


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
    # 4 attention + 2 fused-MoE + 2 LoRA (shrink, expand) kernels, x3; fp8 caches: write,
    # decode, prefill for e4m3 and e5m2 on sm_90 (fp8 casts) and on sm_80 (bytes, x2 dtypes).
    assert res.stdout.count(" ok ") == 24 + 6 + 2 * 6, res.stdout

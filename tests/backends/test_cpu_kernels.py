"""The C++ CPU kernels: what is particular to them (strided inputs, index checks, the fallback
for other dtypes, the ISA builds and their cache) and the engine running them end to end.

The kernel-against-reference matrix (GQA x head size x block size x dtype, windows, random
batches, cache dtypes, block moves) is ``test_attention_conformance.py``, shared by every kind.
The extension builds once per session (module fixture); later sessions only import it.
"""

from __future__ import annotations

import re
import shutil
from collections import Counter
from pathlib import Path

import pytest
import torch

from pagedllm.backends.base import AttentionMetadata
from pagedllm.backends.reference import ReferenceAttention
from tests.backends import test_attention_conformance as conformance

ATOL = 1e-4


@pytest.fixture(scope="module")
def cpp():
    if shutil.which("c++") is None or shutil.which("ninja") is None:
        pytest.skip("no C++ toolchain (c++ and ninja) to build the CPU kernels")
    from pagedllm.backends.cpu.kernel_attention import CppPagedAttention

    return CppPagedAttention()


def make_batch(
    seq_lens: list[int],
    query_lens: list[int],
    num_prefills: int,
    block_size: int,
    heads: tuple[int, int],  # (num_heads, num_kv_heads)
    head_size: int,
    seed: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
    """Random float32 query and cache (every slot garbage), blocks scattered by a permutation."""
    seqs = [(s - q, q) for s, q in zip(seq_lens, query_lens, strict=True)]
    query, _, _, cache, meta = conformance.make_batch(
        seqs, num_prefills, block_size=block_size, heads=heads, head_size=head_size, seed=seed
    )
    return query, cache, meta


def check_forward(
    cpp,
    query: torch.Tensor,
    cache: torch.Tensor,
    meta: AttentionMetadata,
    sliding_window: int | None = None,
) -> None:
    scale = query.shape[-1] ** -0.5
    out = cpp.forward(query, cache, meta, scale, sliding_window=sliding_window)
    ref = ReferenceAttention().forward(query, cache, meta, scale, sliding_window=sliding_window)
    diff = (out - ref).abs().max().item()
    torch.testing.assert_close(
        out, ref, atol=ATOL, rtol=0, msg=lambda m: f"max abs diff {diff:.3e}\n{m}"
    )


def test_strided_query_and_kv(cpp) -> None:
    """q/k/v are column slices of one fused projection in the model: non-contiguous rows."""
    query, cache, meta = make_batch([20, 33], [20, 1], 1, 8, (4, 2), 32)
    qkv = torch.randn(query.shape[0], 8, 32)  # [tokens, 4 q + 2 k + 2 v heads, d]
    qkv[:, :4] = query
    q, k, v = qkv[:, :4], qkv[:, 4:6], qkv[:, 6:]
    assert not q.is_contiguous()
    ref_cache = cache.clone()
    cpp.write_kv(k, v, cache, meta.slot_mapping)
    ReferenceAttention().write_kv(k, v, ref_cache, meta.slot_mapping)
    assert torch.equal(cache, ref_cache)
    check_forward(cpp, q, cache, meta)


def test_out_of_range_indices_raise(cpp) -> None:
    query, cache, meta = make_batch([20], [1], 0, 8, (2, 1), 16)
    meta.block_tables[0, 1] = cache.shape[1]  # one past the last block
    with pytest.raises(RuntimeError, match="outside"):
        cpp.forward(query, cache, meta, 0.25)
    with pytest.raises(RuntimeError, match="outside the cache"):
        cpp.write_kv(query[:, :1], query[:, :1], cache, torch.tensor([cache.shape[1] * 8]))


def test_other_dtypes_fall_back_to_torch(cpp) -> None:
    query, cache, meta = make_batch([30, 9], [30, 1], 1, 8, (4, 2), 32)
    query, cache = query.double(), cache.double()
    key, value = torch.randn(31, 2, 32).double(), torch.randn(31, 2, 32).double()
    ref_cache = cache.clone()
    cpp.write_kv(key, value, cache, meta.slot_mapping)
    ReferenceAttention().write_kv(key, value, ref_cache, meta.slot_mapping)
    assert torch.equal(cache, ref_cache)
    check_forward(cpp, query, cache, meta, sliding_window=5)


def test_cache_shape_and_backend_selection(cpp) -> None:
    from pagedllm.backends.cpu.backend import CpuBackend
    from pagedllm.backends.cpu.kernel_attention import CppPagedAttention

    assert cpp.kv_cache_shape(7, 16, 2, 64) == (2, 7, 2, 16, 64)
    assert isinstance(CpuBackend().attention("auto"), CppPagedAttention)
    assert isinstance(CpuBackend().attention("cpp"), CppPagedAttention)


def test_build_is_cached_and_flags_are_portable(cpp, monkeypatch) -> None:
    from pagedllm.backends.cpu import _ops

    assert _ops.load_kernels(isa=cpp.isa) is cpp._ops  # memoised: no second build or import
    flags = _ops.compile_flags(cpp.isa)
    assert "-march=native" not in flags and "-fopenmp" in flags
    assert ("-mavx2" in flags) == cpp.uses_avx2
    assert cpp.isa in _ops.supported_isas() and _ops.supported_isas()[-1] == "scalar"
    sources = ("attention.cpp",)
    assert _ops.build_key(sources, (), flags) != _ops.build_key(
        sources, (), _ops.compile_flags("scalar")
    )
    monkeypatch.setenv("PAGEDLLM_CPU_ISA", "no-such-isa")
    with pytest.raises(ValueError, match="PAGEDLLM_CPU_ISA"):
        _ops.resolve_isa()
    monkeypatch.delenv("PAGEDLLM_CPU_ISA")
    monkeypatch.setattr(_ops.shutil, "which", lambda name: None)
    with pytest.raises(RuntimeError, match="c\\+\\+"):
        _ops._check_toolchain()


def _included(names: tuple[str, ...], csrc: Path) -> set[str]:
    """Every local header ``names`` include, directly or through each other."""
    seen: set[str] = set()
    todo = list(names)
    while todo:
        text = (csrc / todo.pop()).read_text()
        for header in re.findall(r'^#include "([^"]+)"', text, flags=re.M):
            if header not in seen:
                seen.add(header)
                todo.append(header)
    return seen


def test_every_included_header_is_in_the_build_key() -> None:
    """A header left out of an extension's list does not rebuild it when edited: the cached
    build would run the old code."""
    from pagedllm.backends.cpu import _ops

    csrc = Path(_ops.__file__).with_name("csrc")
    for _, sources, headers in _ops.EXTENSIONS:
        assert _included(sources, csrc) <= set(headers), sorted(
            _included(sources, csrc) - set(headers)
        )


@pytest.mark.slow
def test_scalar_build_matches_reference(cpp) -> None:
    """The path a CPU without AVX2 runs: built once per machine without -mavx2/-mfma."""
    from pagedllm.backends.cpu.kernel_attention import CppPagedAttention

    scalar = CppPagedAttention(isa="scalar")
    assert not scalar.uses_avx2
    for head_size, window in ((20, None), (64, 7)):
        query, cache, meta = make_batch([40, 19, 1, 300], [40, 3, 1, 1], 2, 16, (8, 2), head_size)
        check_forward(scalar, query, cache, meta, sliding_window=window)


# --- end to end: the engine with attention_backend="cpp" vs transformers -----------------------

E2E_NEW = 6
E2E_CASES = {
    "llama-bs16": ("llama", dict(block_size=16)),  # GQA 2:1, head size 16
    "qwen2-bs8": ("qwen2", dict(block_size=8)),  # MHA, head size 32
    "mistral-bs32": ("mistral", dict(block_size=32)),  # GQA 4:1, head size 8
    # Prompt chunks over cached context and shared-prefix blocks reused from the cache.
    "llama-prefix-chunked": (
        "llama",
        dict(
            block_size=8,
            enable_prefix_caching=True,
            enable_chunked_prefill=True,
            max_num_batched_tokens=32,
        ),
    ),
    # Too few blocks for the batch: sequences are swapped to host and back (swap_blocks).
    "llama-swap": ("llama", dict(block_size=8, num_kv_blocks=14, preemption_mode="swap")),
}


def count_calls(monkeypatch, cls: type, name: str) -> Counter[str]:
    """Count calls of ``cls.name`` (still doing the work) to prove the engine took that path."""
    calls: Counter[str] = Counter()
    original = getattr(cls, name)

    def wrapper(self, *args: object) -> object:
        calls[name] += 1
        return original(self, *args)

    monkeypatch.setattr(cls, name, wrapper)
    return calls


@pytest.mark.parametrize("case", list(E2E_CASES))
def test_engine_matches_transformers(cpp, tiny_models, case: str, monkeypatch) -> None:
    from transformers import AutoTokenizer

    from pagedllm import Engine, SamplingParams
    from pagedllm.backends.cpu.kernel_attention import CppPagedAttention
    from tests.conftest import PROMPTS
    from tests.hf_reference import assert_greedy_match, hf_greedy

    calls = count_calls(monkeypatch, CppPagedAttention, "swap_blocks")
    model, kwargs = E2E_CASES[case]
    path = tiny_models[model]
    tok = AutoTokenizer.from_pretrained(str(path))
    prompts = [*PROMPTS, PROMPTS[-1] + " and again"]  # the last two share a long prefix
    ids = [tok.encode(p) for p in prompts]
    engine = Engine(
        str(path),
        device="cpu",
        dtype="float32",
        attention_backend="cpp",
        **{"num_kv_blocks": 64, **kwargs},
    )
    assert isinstance(engine.executor.worker.attention, CppPagedAttention)
    params = SamplingParams(temperature=0.0, max_tokens=E2E_NEW)
    outs = engine.generate([{"prompt_token_ids": i} for i in ids], params, use_tqdm=False)
    for i, (out, ref) in enumerate(zip(outs, hf_greedy(path, ids, E2E_NEW), strict=True)):
        assert_greedy_match(out.outputs[0].token_ids, ref, f"cpp {case} prompt {i}")
    stats = engine.get_stats()
    assert stats["num_free_device_blocks"] == stats["num_device_blocks"], stats
    if "swap" in case:
        assert stats["num_preemptions_swap"] > 0 and calls["swap_blocks"] > 0, (stats, calls)
    if kwargs.get("enable_prefix_caching"):
        assert stats["prefix_cache_hits"] > 0, stats


def test_engine_beam_search_matches_transformers(cpp, llama_path, monkeypatch) -> None:
    """Beams fork and share blocks, so copy-on-write (copy_blocks) runs inside the engine."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from pagedllm import Engine, SamplingParams
    from pagedllm.backends.cpu.kernel_attention import CppPagedAttention
    from tests.conftest import PROMPTS

    calls = count_calls(monkeypatch, CppPagedAttention, "copy_blocks")

    engine = Engine(
        str(llama_path), device="cpu", dtype="float32", attention_backend="cpp", block_size=8
    )
    params = SamplingParams(n=2, best_of=3, use_beam_search=True, temperature=0.0, max_tokens=10)
    outs = engine.generate(PROMPTS[:2], params, use_tqdm=False)
    tok = AutoTokenizer.from_pretrained(str(llama_path))
    model = AutoModelForCausalLM.from_pretrained(str(llama_path), dtype=torch.float32).eval()
    for prompt, out in zip(PROMPTS[:2], outs, strict=True):
        ids = tok.encode(prompt)
        ref = model.generate(
            torch.tensor([ids]),
            num_beams=3,
            num_return_sequences=2,
            max_new_tokens=10,
            do_sample=False,
            pad_token_id=2,
        )
        expected = [[t for t in r[len(ids) :].tolist() if t != 2] for r in ref]
        assert [c.token_ids for c in out.outputs] == expected, prompt
    assert calls["copy_blocks"] > 0, "no copy-on-write happened"


@pytest.mark.parametrize("window", [None, 100, 200])
@pytest.mark.parametrize("block_size", [8, 16, 32])
@pytest.mark.parametrize("head_size", [64, 96])
def test_bf16_cache_spans_and_windows_match_reference(
    cpp, head_size: int, block_size: int, window: int | None
) -> None:
    """bf16 queries over a bf16 cache: in avx512bf16 builds the scores come from vdpbf16ps on the
    panel as stored and the values are widened in registers. Contexts cross several of the
    128-key softmax spans, prompt chunks start mid-span, windows end inside spans."""
    seqs = [(0, 150), (130, 40), (257, 1), (700, 1), (127, 1), (128, 1), (129, 3)]
    kind = conformance.Kind("cpp", cpp, torch.device("cpu"), conformance.DTYPES)
    batch = conformance.make_batch(
        seqs, 2, block_size=block_size, heads=(8, 2), head_size=head_size, dtype=torch.bfloat16
    )
    conformance.write_and_compare(
        kind, *batch, f"bf16 d={head_size} bs={block_size}", window=window
    )

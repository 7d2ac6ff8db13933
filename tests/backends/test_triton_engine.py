"""End to end: the engine with ``attention_backend="triton"`` generates transformers' greedy tokens.

Without CUDA the kernels run on CPU tensors under Triton's interpreter (TRITON_INTERPRET is set
here, before triton is first imported). The decode partition is shrunk so split-K and its
reduction run inside the engine too; chunked prefill and prefix caching drive the prefill kernel
over cached context.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

from pagedllm import Engine, SamplingParams
from tests.conftest import PROMPTS
from tests.hf_reference import assert_greedy_match, hf_greedy

# Compiled kernels need CUDA tensors; interpreted ones run on CPU tensors.
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        importlib.util.find_spec("triton") is None,
        reason="triton is not installed (ci/requirements-gpu.txt)",
    ),
]

MAX_NEW = 6
PARTITION = 32  # context tokens per decode program: the longest prompts span two partitions
# Two prompts that share a long prefix, so prefix caching has full blocks to reuse.
SHARED = PROMPTS[-1]
EXTRA = [SHARED + " and again", SHARED + " once more"]


@pytest.fixture(scope="module")
def prompt_ids(llama_path: Path) -> list[list[int]]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(llama_path))
    return [tok.encode(p) for p in PROMPTS + EXTRA]


@pytest.mark.parametrize(
    "engine_kwargs",
    [
        dict(block_size=16),
        dict(
            block_size=8,
            enable_prefix_caching=True,
            enable_chunked_prefill=True,
            max_num_batched_tokens=32,
        ),
    ],
    ids=["plain", "prefix-cache-chunked"],
)
def test_triton_engine_matches_transformers(
    llama_path: Path,
    prompt_ids: list[list[int]],
    engine_kwargs: dict,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from pagedllm.backends.gpu.attention import TritonPagedAttention

    monkeypatch.setattr(TritonPagedAttention, "default_partition_size", PARTITION)
    assert max(len(i) for i in prompt_ids) + MAX_NEW > PARTITION  # split-K engaged
    engine = Engine(
        str(llama_path),
        device=DEVICE,
        attention_backend="triton",
        dtype="float32",
        num_kv_blocks=96,
        max_model_len=128,
        max_num_seqs=8,
        **{"max_num_batched_tokens": 128, **engine_kwargs},
    )
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW)
    outs = engine.generate([{"prompt_token_ids": i} for i in prompt_ids], params, use_tqdm=False)
    refs = hf_greedy(llama_path, prompt_ids, MAX_NEW)
    for i, (out, ref) in enumerate(zip(outs, refs, strict=True)):
        assert_greedy_match(out.outputs[0].token_ids, ref, f"triton engine prompt {i}")
    stats = engine.get_stats()
    assert stats["num_free_device_blocks"] == stats["num_device_blocks"], stats
    if engine_kwargs.get("enable_prefix_caching"):
        assert stats["prefix_cache_hits"] > 0, stats


def test_kv_cache_dtype_accepted_or_refused(llama_path: Path) -> None:
    """The cache may hold the compute dtype (named or "auto") or fp8; another 16-bit type is
    refused at construction, naming what works."""
    engine = Engine(
        str(llama_path),
        device=DEVICE,
        dtype="float16",
        kv_cache_dtype="float16",
        attention_backend="triton",
        num_kv_blocks=32,
        max_model_len=64,
        max_num_seqs=2,
        max_num_batched_tokens=64,
    )
    assert engine.executor.worker.cache_engine.kv_caches[0].dtype == torch.float16
    out = engine.generate(
        PROMPTS[:1], SamplingParams(temperature=0.0, max_tokens=2), use_tqdm=False
    )
    assert len(out[0].outputs[0].token_ids) == 2
    fp8 = Engine(
        str(llama_path),
        device=DEVICE,
        dtype="float16",
        kv_cache_dtype="fp8_e5m2",
        attention_backend="triton",
        num_kv_blocks=8,
        max_model_len=64,
    )
    assert fp8.executor.worker.cache_engine.kv_caches[0].dtype == torch.float8_e5m2
    with pytest.raises(ValueError, match=r"^kv_cache_dtype: .*supports \['auto', 'float16', 'fp8"):
        Engine(
            str(llama_path),
            device=DEVICE,
            dtype="float16",
            kv_cache_dtype="bfloat16",
            attention_backend="triton",
        )

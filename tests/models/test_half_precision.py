"""bfloat16 and float16 end to end: greedy tokens equal transformers' in the same dtype.

Both engines round the same float32 checkpoint to the same 16-bit weights; after that their
kernels round differently (GEMM blocking, attention in float32 vs transformers' sdpa), so the
final logits may differ by a few units in the last place (ulps) of the 16-bit type. A greedy
divergence is therefore accepted only where transformers' own top-two logit gap at that step is
at most ``TIE_ULPS`` ulps of the top logit in that dtype (2^-7 relative per ulp in bfloat16,
2^-10 in float16), and our token is one of those two; the rest of that sequence is not compared.
So that near-ties cannot excuse everything, at least ``MIN_COMPARED`` of all generated tokens
must have been compared equal. A NaN log-probability fails the test: it was the bug of 16-bit KV
caches reading never-written slots (after an earlier engine in the process freed memory, or after
swapping), fixed in the attention kernels and guarded here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from pagedllm import Engine, SamplingParams
from tests.conftest import PROMPTS

MAX_NEW = 16
DTYPES = ["bfloat16", "float16"]
TIE_ULPS = 4
MIN_COMPARED = 0.6
# First-step log-probabilities of the chosen token: both sides take log_softmax in float32 of
# 16-bit logits that may differ by a few ulps (about 0.016 per ulp at logits near 2 in bf16).
FIRST_LOGPROB_ATOL = {"bfloat16": 0.1, "float16": 0.02}


@dataclass
class HalfRef:
    token_ids: list[int]
    logits: list[torch.Tensor]  # per step: [vocab], the model-dtype logits widened to float32


def hf_greedy_logits(path: Path, prompts: list[list[int]], dtype: str) -> list[HalfRef]:
    """transformers' greedy tokens and raw logits, the model loaded in ``dtype``."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=getattr(torch, dtype)).eval()
    refs = []
    with torch.no_grad():
        for ids in prompts:
            out = model.generate(
                torch.tensor([ids]),
                max_new_tokens=MAX_NEW,
                do_sample=False,
                output_logits=True,
                return_dict_in_generate=True,
                pad_token_id=model.config.pad_token_id,
            )
            refs.append(
                HalfRef(out.sequences[0, len(ids) :].tolist(), [x[0].float() for x in out.logits])
            )
    return refs


def ulp(value: float, dtype: torch.dtype) -> float:
    """The spacing of ``dtype``'s representable numbers at ``value``."""
    finfo = torch.finfo(dtype)
    magnitude = max(abs(value), finfo.tiny)
    return finfo.eps * 2.0 ** math.floor(math.log2(magnitude))


def compared_prefix(ours: list[int], ref: HalfRef, dtype: torch.dtype, label: str) -> int:
    """How many leading tokens equal transformers'; a divergence must be a near-tie."""
    n = min(len(ours), len(ref.token_ids))
    for i in range(n):
        if ours[i] == ref.token_ids[i]:
            continue
        vals, idx = ref.logits[i].topk(2)
        gap = float(vals[0] - vals[1])
        bound = TIE_ULPS * ulp(float(vals[0]), dtype)
        assert gap <= bound and ours[i] in idx.tolist(), (
            f"{label}: token {i} differs (ours {ours[i]}, transformers {ref.token_ids[i]}); "
            f"transformers' top-2 logits {vals.tolist()} are {gap:.3g} apart, more than "
            f"{TIE_ULPS} ulps ({bound:.3g}) of {dtype}\n ours={ours}\n  ref={ref.token_ids}"
        )
        return i
    assert len(ours) == len(ref.token_ids), (
        f"{label}: lengths differ: ours {len(ours)} vs transformers {len(ref.token_ids)}"
    )
    return n


def check_outputs(outs: list[Any], refs: list[HalfRef], dtype: str, label: str) -> None:
    assert not nan_in(outs), f"{label}: NaN log-probabilities (a never-written KV slot was read)"
    torch_dtype = getattr(torch, dtype)
    compared = total = 0
    for i, (out, ref) in enumerate(zip(outs, refs, strict=True)):
        comp = out.outputs[0]
        compared += compared_prefix(comp.token_ids, ref, torch_dtype, f"{label} prompt {i}")
        total += len(ref.token_ids)
        first = ref.logits[0].log_softmax(-1)
        for token, lp in comp.logprobs[0].items():
            diff = abs(lp - float(first[token]))
            assert diff <= FIRST_LOGPROB_ATOL[dtype], (
                f"{label} prompt {i}: first-step logprob of {token} differs by {diff:.3g}"
            )
    assert compared >= MIN_COMPARED * total, (
        f"{label}: only {compared} of {total} tokens compared before near-ties; "
        "too few for the check to mean anything"
    )


def nan_in(outs: list[Any]) -> bool:
    return any(math.isnan(o.outputs[0].cumulative_logprob) for o in outs)


# -- fixtures ------------------------------------------------------------------------------------
# Families of test_more_families.py also run in half precision (Gemma 2: the soft caps in bf16;
# Gemma 3: its per-head norms).
HALF_FAMILIES = ("gemma", "gemma2", "gemma3", "gpt2", "phi3")


@pytest.fixture(scope="module")
def extra_families(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from tests.models.test_more_families import build_family

    root = tmp_path_factory.mktemp("half_families")
    return {name: build_family(root / name, name) for name in HALF_FAMILIES}


@pytest.fixture(scope="module")
def half_refs(tiny_models: dict[str, Path], extra_families: dict[str, Path]) -> Any:
    """(model, dtype) -> (prompt ids, transformers references), built on first use."""
    from transformers import AutoTokenizer

    paths = {**tiny_models, **extra_families}
    cache: dict[tuple[str, str], tuple[list[list[int]], list[HalfRef]]] = {}

    def get(model: str, dtype: str) -> tuple[Path, list[list[int]], list[HalfRef]]:
        if (model, dtype) not in cache:
            tok = AutoTokenizer.from_pretrained(str(paths[model]))
            ids = [tok.encode(p) for p in PROMPTS]
            cache[model, dtype] = (ids, hf_greedy_logits(paths[model], ids, dtype))
        return (paths[model], *cache[model, dtype])

    return get


def run(path: Path, ids: list[list[int]], dtype: str, **kwargs: Any) -> tuple[Engine, list]:
    kwargs.setdefault("num_kv_blocks", 256)
    engine = Engine(str(path), device="cpu", dtype=dtype, **kwargs)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, logprobs=3)
    outs = engine.generate([{"prompt_token_ids": i} for i in ids], params, use_tqdm=False)
    return engine, outs


def assert_weights_in(engine: Engine, dtype: str) -> None:
    model = engine.executor.worker.runner.model  # type: ignore[attr-defined]
    wrong = {n: p.dtype for n, p in model.named_parameters() if p.dtype != getattr(torch, dtype)}
    assert not wrong, f"parameters not in {dtype}: {wrong}"


# -- the helper itself must be able to fail --------------------------------------------------------
def test_tie_rule_rejects_a_real_divergence_and_accepts_a_near_tie() -> None:
    logits = torch.zeros(8)
    logits[3], logits[5] = 2.0, 1.5  # 0.5 apart: 32 bf16 ulps at 2.0
    ref = HalfRef([3, 3], [logits, logits])
    with pytest.raises(AssertionError, match="more than 4 ulps"):
        compared_prefix([5, 3], ref, torch.bfloat16, "real")
    tie = logits.clone()
    tie[5] = 2.0 - 2 * ulp(2.0, torch.bfloat16)
    assert compared_prefix([3, 5], HalfRef([3, 3], [logits, tie]), torch.bfloat16, "tie") == 1
    with pytest.raises(AssertionError, match="more than"):  # a tie, but not with our token
        compared_prefix([3, 7], HalfRef([3, 3], [logits, tie]), torch.bfloat16, "other")
    with pytest.raises(AssertionError, match="lengths differ"):
        compared_prefix([3], ref, torch.bfloat16, "short")
    assert ulp(2.0, torch.bfloat16) == 2.0**-6 and ulp(1.5, torch.float16) == 2.0**-10


# -- greedy equality -----------------------------------------------------------------------------
# Every block size and attention kind on llama (GQA); the others see each of them once.
GREEDY_CASES = [
    ("llama", 8, "cpp"),
    ("llama", 16, "cpp"),
    ("llama", 8, "torch"),
    ("llama", 16, "torch"),
    ("qwen2", 8, "cpp"),
    ("qwen2", 16, "torch"),
    ("mistral", 16, "cpp"),
    ("mistral", 8, "torch"),
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("model", "block_size", "attention"), GREEDY_CASES)
def test_greedy_matches_transformers_in_dtype(
    half_refs: Any, model: str, dtype: str, block_size: int, attention: str
) -> None:
    path, ids, refs = half_refs(model, dtype)
    engine, outs = run(path, ids, dtype, block_size=block_size, attention_backend=attention)
    assert_weights_in(engine, dtype)
    check_outputs(outs, refs, dtype, f"{model}/{dtype}/bs{block_size}/{attention}")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("model", HALF_FAMILIES)
def test_other_families_match_transformers_in_dtype(half_refs: Any, model: str, dtype: str) -> None:
    from tests.models.test_more_families import FAMILIES

    path, ids, refs = half_refs(model, dtype)
    engine, outs = run(path, ids, dtype, block_size=FAMILIES[model][2])
    assert_weights_in(engine, dtype)
    check_outputs(outs, refs, dtype, f"{model}/{dtype}")


@pytest.mark.parametrize("attention", ["cpp", "torch"])
@pytest.mark.parametrize("mode", ["recompute", "swap"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_preemption_under_a_tight_cache(
    half_refs: Any, dtype: str, mode: str, attention: str
) -> None:
    path, ids, refs = half_refs("llama", dtype)
    # 9 prompts of up to ~30 tokens plus 16 new ones cannot all fit in 14 blocks of 8 tokens.
    engine, outs = run(
        path,
        ids,
        dtype,
        block_size=8,
        num_kv_blocks=14,
        preemption_mode=mode,
        attention_backend=attention,
    )
    stats = engine.get_stats()
    assert stats[f"num_preemptions_{mode}"] > 0, f"no {mode} preemption happened: {stats}"
    check_outputs(outs, refs, dtype, f"preempt-{mode}/{dtype}/{attention}")
    bm = engine.block_manager
    assert bm.get_num_free_device_blocks() == bm.num_device_blocks
    assert bm.get_num_free_host_blocks() == bm.num_host_blocks


@pytest.mark.parametrize("dtype", DTYPES)
def test_prefix_caching_and_chunked_prefill(half_refs: Any, dtype: str) -> None:
    path, ids, refs = half_refs("qwen2", dtype)
    engine = Engine(
        str(path),
        device="cpu",
        dtype=dtype,
        block_size=8,
        num_kv_blocks=256,
        enable_prefix_caching=True,
        enable_chunked_prefill=True,
        max_num_batched_tokens=24,
    )
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, logprobs=3)
    for attempt in ("cold", "cached"):  # the second pass reads the first's cached blocks
        outs = engine.generate([{"prompt_token_ids": i} for i in ids], params, use_tqdm=False)
        check_outputs(outs, refs, dtype, f"prefix+chunked/{dtype}/{attempt}")
    stats = engine.get_stats()
    assert stats["prefix_cache_hits"] > 0 and stats["chunked_prefill_steps"] > 0, stats


@pytest.fixture(scope="module")
def bf16_llama(tiny_models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny llama saved in bfloat16: the same weights transformers uses in bfloat16."""
    from transformers import AutoModelForCausalLM

    folder = tmp_path_factory.mktemp("bf16_llama")
    model = AutoModelForCausalLM.from_pretrained(str(tiny_models["llama"]), dtype=torch.bfloat16)
    model.save_pretrained(str(folder))
    return folder


def test_tensor_parallel_reads_bf16_slices(half_refs: Any, bf16_llama: Path) -> None:
    """Two ranks read their slices of a bfloat16 checkpoint lazily and decode as transformers."""
    _, ids, refs = half_refs("llama", "bfloat16")
    engine = Engine(
        str(bf16_llama),
        device="cpu",
        dtype="bfloat16",
        tensor_parallel_size=2,
        block_size=8,
        num_kv_blocks=96,
        skip_tokenizer_init=True,
    )
    try:
        params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, logprobs=3)
        outs = engine.generate([{"prompt_token_ids": i} for i in ids], params, use_tqdm=False)
    finally:
        engine.shutdown()
    check_outputs(outs, refs, "bfloat16", "tp2/bfloat16")

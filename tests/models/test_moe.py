"""Mixture-of-experts families end to end against transformers on tiny random-weight models.

Mixtral (8 experts, top-2), Qwen2-MoE (6 experts, top-4, shared expert), Qwen3-MoE (8 experts,
top-4 renormalised, a dense first layer) and OLMoE (8 experts, top-2, whole-projection q/k norms,
clip_qkv) run through the engine with a cache too small for the batch (so sequences are
preempted) and prefix caching on (the second pass reads the first's cached blocks): greedy tokens
must equal transformers' and first-step log-probabilities agree within 1e-4. Then bfloat16 (near-tie
tolerant, as tests/models/test_half_precision.py), int8 experts, and config fields we do not
implement, which must fail at load naming the field.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from pagedllm import Engine, SamplingParams
from tests.conftest import PROMPTS, load_on_reference
from tests.hf_reference import assert_first_logprobs_close, assert_greedy_match, hf_greedy
from tests.models.moe_models import MOE_FAMILIES, build_moe

MAX_NEW = 12
FAMILY_NAMES = list(MOE_FAMILIES)


@pytest.fixture(scope="session")
def moe_paths(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("moe")
    return {name: build_moe(root / name, name) for name in MOE_FAMILIES}


@pytest.fixture(scope="session")
def moe_refs(moe_paths: dict[str, Path]) -> Any:
    """name -> (prompt ids, transformers' float32 greedy references), built on first use."""
    from transformers import AutoTokenizer

    cache: dict[str, Any] = {}

    def get(name: str) -> tuple[list[list[int]], list[Any]]:
        if name not in cache:
            tok = AutoTokenizer.from_pretrained(str(moe_paths[name]))
            ids = [tok.encode(p) for p in PROMPTS]
            cache[name] = (ids, hf_greedy(moe_paths[name], ids, MAX_NEW))
        return cache[name]

    return get


def generate(engine: Engine, ids: list[list[int]]) -> list[Any]:
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, logprobs=5)
    return engine.generate([{"prompt_token_ids": i} for i in ids], params, use_tqdm=False)


def check_against(outs: list[Any], refs: list[Any], label: str) -> None:
    for i, (out, ref) in enumerate(zip(outs, refs, strict=True)):
        comp = out.outputs[0]
        assert_greedy_match(comp.token_ids, ref, f"{label} prompt {i}")
        assert_first_logprobs_close(comp.logprobs[0], ref, f"{label} prompt {i}")


@pytest.mark.parametrize(
    ("name", "mode"),
    [
        ("mixtral", "recompute"),
        ("qwen2_moe", "swap"),
        ("qwen3_moe", "recompute"),
        ("olmoe", "swap"),
    ],
)
def test_family_matches_transformers_with_preemption_and_prefix_caching(
    moe_paths: dict[str, Path], moe_refs: Any, name: str, mode: str
) -> None:
    ids, refs = moe_refs(name)
    # 9 prompts of up to ~30 tokens plus 12 new ones cannot all fit in 14 blocks of 8 tokens.
    engine = Engine(
        str(moe_paths[name]),
        device="cpu",
        dtype="float32",
        block_size=8,
        num_kv_blocks=14,
        preemption_mode=mode,
        enable_prefix_caching=True,
    )
    assert "FusedMoE=" in engine.executor.worker.linear_path()  # type: ignore[attr-defined]
    for attempt in ("cold", "cached"):
        check_against(generate(engine, ids), refs, f"{name}/{mode}/{attempt}")
    stats = engine.get_stats()
    assert stats[f"num_preemptions_{mode}"] > 0, f"no {mode} preemption happened: {stats}"
    assert stats["prefix_cache_hits"] > 0, stats
    bm = engine.block_manager
    assert bm.get_num_free_device_blocks() == bm.num_device_blocks


@pytest.mark.parametrize("name", FAMILY_NAMES)
def test_plain_pytorch_expert_path_matches_too(
    moe_paths: dict[str, Path], moe_refs: Any, name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The generic path (XPU's, and any backend without a fused kernel): no packed GEMMs."""
    from pagedllm.backends.cpu import backend as cpu_backend

    monkeypatch.setattr(cpu_backend.CpuBackend, "prepare_model", lambda self, model, **_: None)
    ids, refs = moe_refs(name)
    engine = Engine(
        str(moe_paths[name]), device="cpu", dtype="float32", block_size=16, num_kv_blocks=64
    )
    check_against(generate(engine, ids), refs, f"{name}/torch-path")


# -- bfloat16 ------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", FAMILY_NAMES)
def test_bfloat16_matches_transformers_in_bfloat16(
    moe_paths: dict[str, Path], moe_refs: Any, name: str
) -> None:
    from tests.models.test_half_precision import check_outputs, hf_greedy_logits, run

    ids, _ = moe_refs(name)
    refs = hf_greedy_logits(moe_paths[name], ids, "bfloat16")
    engine, outs = run(moe_paths[name], ids, "bfloat16", block_size=8)
    model = engine.executor.worker.runner.model  # type: ignore[attr-defined]
    wrong = {n: p.dtype for n, p in model.named_parameters() if p.dtype != torch.bfloat16}
    assert not wrong, f"parameters not in bfloat16: {wrong}"
    check_outputs(outs, refs, "bfloat16", f"{name}/bfloat16")


# -- int8 experts --------------------------------------------------------------------------------
_QUANTISED = (
    "q_proj",
    "k_proj",
    "v_proj",
    "o_proj",
    "gate_proj",
    "up_proj",
    "down_proj",
    ".w1.",
    ".w2.",
    ".w3.",
)


def dequantized_copy(src: Path, dst: Path) -> Path:
    """The checkpoint with every weight int8 quantises replaced by its int8 round trip."""
    from safetensors.torch import load_file, save_file

    from pagedllm.layers.quantization import quantize_per_channel

    shutil.copytree(src, dst)
    tensors = load_file(str(src / "model.safetensors"))
    for name, t in tensors.items():
        if t.dim() == 2 and any(k in name for k in _QUANTISED) and "shared_expert_gate" not in name:
            q, scale = quantize_per_channel(t)
            tensors[name] = (q.float() * scale[:, None]).to(t.dtype)
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


@pytest.mark.parametrize("name", ["mixtral", "qwen2_moe"])
def test_int8_experts_equal_transformers_on_the_dequantized_weights(
    moe_paths: dict[str, Path], moe_refs: Any, name: str, tmp_path: Path
) -> None:
    from pagedllm.layers.fused_moe import FusedMoE

    ids, _ = moe_refs(name)
    refs = hf_greedy(dequantized_copy(moe_paths[name], tmp_path / name), ids, MAX_NEW)
    engine = Engine(
        str(moe_paths[name]),
        device="cpu",
        dtype="float32",
        quantization="int8",
        block_size=8,
        num_kv_blocks=96,
    )
    model = engine.executor.worker.runner.model  # type: ignore[attr-defined]
    experts = [m for m in model.modules() if isinstance(m, FusedMoE)]
    assert experts and all(m.is_int8 for m in experts)
    assert "cpp-int8" in engine.executor.worker.linear_path()  # type: ignore[attr-defined]
    check_against(generate(engine, ids), refs, f"{name}/int8")


def test_int8_experts_quantised_by_the_backend_kernel(moe_paths: dict[str, Path]) -> None:
    """Expert stacks go through the dense layers' quantiser (the CPU's C++ one), with the
    PyTorch definition's result exactly."""
    from pagedllm.backends.cpu.backend import CpuBackend
    from pagedllm.layers.fused_moe import FusedMoE

    kernel = CpuBackend().kernel("int8_quantize").value
    if kernel is None:
        pytest.skip("the C++ GEMM extension did not build here")
    path = moe_paths["mixtral"]
    shapes: list[tuple[int, ...]] = []

    def counting(weight: torch.Tensor, absmax: torch.Tensor | None) -> Any:
        shapes.append(tuple(weight.shape))
        return kernel(weight, absmax)

    def load(quantizer: Any) -> list[FusedMoE]:
        model = load_on_reference(path, torch.bfloat16, quantization="int8", quantizer=quantizer)
        return [m for m in model.modules() if isinstance(m, FusedMoE)]

    fast, plain = load(counting), load(None)
    assert fast and all(m.is_int8 for m in fast)
    stacks = {(m.w13_weight.shape[0] * m.w13_weight.shape[1], m.w13_weight.shape[2]) for m in fast}
    assert stacks <= set(shapes)  # the expert stacks, reshaped [E * N, K], went through it
    for a, b in zip(fast, plain, strict=True):
        for name in ("w13_weight", "w2_weight"):
            assert torch.equal(getattr(a, name), getattr(b, name))
            assert torch.equal(a.scales(name), b.scales(name))


# -- configs we do not implement -----------------------------------------------------------------
BAD_CONFIGS = [
    ("mixtral", {"scoring_func": "sigmoid"}, "scoring_func"),
    ("mixtral", {"num_experts_per_tok": 9}, "num_experts_per_tok"),
    ("mixtral", {"hidden_act": "gelu"}, "hidden_act"),
    ("qwen3_moe", {"topk_method": "group_limited_greedy"}, "topk_method"),
    ("qwen3_moe", {"decoder_sparse_step": 0}, "decoder_sparse_step"),
    ("qwen2_moe", {"shared_expert_intermediate_size": 0}, "shared_expert_intermediate_size"),
    ("qwen2_moe", {"routed_scaling_factor": 2.5}, "routed_scaling_factor"),
    ("olmoe", {"num_experts_per_tok": 0}, "num_experts_per_tok"),
]


@pytest.mark.parametrize(("name", "change", "field"), BAD_CONFIGS)
def test_unsupported_config_fails_at_load_naming_the_field(
    moe_paths: dict[str, Path], tmp_path: Path, name: str, change: dict[str, Any], field: str
) -> None:
    folder = tmp_path / name
    shutil.copytree(moe_paths[name], folder)
    config = json.loads((folder / "config.json").read_text())
    config.update(change)
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=rf"^{field}: "):
        Engine(str(folder), device="cpu", dtype="float32", num_kv_blocks=16)


def test_expert_parallel_needs_divisible_experts(moe_paths: dict[str, Path]) -> None:
    """Qwen2-MoE's 6 experts cannot be placed on 4 ranks (checked before workers start)."""
    from pagedllm.layers.fused_moe import FusedMoE
    from pagedllm.layers.parallel import TPContext

    with pytest.raises(ValueError, match="^tensor_parallel_size: num_experts"):
        FusedMoE(
            num_experts=6,
            hidden_size=8,
            intermediate_size=8,
            tp=TPContext(rank=0, size=4, expert_parallel=True),
        )


@pytest.mark.parametrize(
    ("name", "change"),
    [
        ("qwen2_moe", {"decoder_sparse_step": 2, "num_hidden_layers": 4}),
        ("qwen3_moe", {"mlp_only_layers": [1, 2], "num_hidden_layers": 4}),
        ("qwen3_moe", {"decoder_sparse_step": 3, "mlp_only_layers": [5], "num_hidden_layers": 6}),
    ],
)
def test_sparse_layers_are_where_transformers_puts_them(name: str, change: dict[str, Any]) -> None:
    from transformers import AutoModelForCausalLM

    from pagedllm.backends.reference import ReferenceAttention
    from pagedllm.layers.fused_moe import SparseMoeBlock
    from pagedllm.models.registry import resolve_model_class
    from tests.models.moe_models import make_moe_config

    config = make_moe_config(name, 64, **change)
    with torch.device("meta"):
        theirs = AutoModelForCausalLM.from_config(config)
        ours = resolve_model_class(config.architectures or [type(theirs).__name__])(
            config, attn_backend=ReferenceAttention()
        )
    want = [hasattr(layer.mlp, "experts") for layer in theirs.model.layers]
    got = [isinstance(layer.mlp, SparseMoeBlock) for layer in ours.layers]
    assert got == want and any(want) and not all(want), (got, want)

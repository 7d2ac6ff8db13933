"""GGUF files of mixture-of-experts models (Qwen2-MoE, Qwen3-MoE, Mixtral, OLMoE): llama.cpp's
stacked expert tensors, its router and shared-expert names, and quantised experts kept quantised
on the CPU.

Files are written in the test from tiny random MoE models (``gguf_files.write_gguf`` stacks the
experts as llama.cpp's converter does, Mixtral as a "llama" file). References: the Hugging Face
model a float32 file was written from; for a quantised file, transformers loading the same file
(dequantised by ggml's ``gguf`` package) with the source's config, since transformers' GGUF
reader leaves the expert sizes out (it would build 1,408-wide experts for any Qwen2-MoE file),
and for the families that reader lacks (Mixtral, OLMoE) transformers running the source model
with every weight replaced by the file's, dequantised by the same package.
"""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import torch

from pagedllm import Engine
from pagedllm.backends.cpu import dense_gemm, groupwise_linear
from pagedllm.layers.fused_moe import FusedMoE
from tests.hf_reference import assert_greedy_match, hf_greedy
from tests.models.gguf_files import (
    dequantised_source,
    hf_gguf_greedy,
    llama_cpp_vs_source,
    write_gguf,
)
from tests.models.moe_models import build_moe
from tests.models.test_gguf import (
    GREEDY,
    MAX_NEW,
    PROMPTS,
    assert_refused_in_one_line,
    engine_greedy,
    record_groupwise_calls,
)

# name -> (types by GGUF tensor kind, type of every other 2-D tensor, source model, the
# group-wise formats the expert stacks keep: (w13, w2), None where dequantised)
RECIPES: dict[str, tuple[dict[str, str], str, str, tuple[str | None, str | None]]] = {
    # 4-bit experts with 8-bit down projections, a shared expert, an 8-bit table.
    "qwen2_moe-q4_0": (
        {"ffn_down_exps": "Q8_0", "ffn_gate_inp": "F32", "token_embd": "Q8_0"},
        "Q4_0",
        "qwen2_moe",
        ("int4", "q8_0"),
    ),
    "qwen3_moe-q8_0": ({"ffn_gate_inp": "F32"}, "Q8_0", "qwen3_moe", ("q8_0", "q8_0")),
    # Gate and up of two types of one format (Q4_0, Q4_1: int4): one stack, decoded apart.
    "qwen2_moe-q4_0+q4_1-up": (
        {"ffn_up_exps": "Q4_1", "ffn_gate_inp": "F32"},
        "Q4_0",
        "qwen2_moe",
        ("int4", "int4"),
    ),
    # Gate and up in different formats: that stack is dequantised, down stays 4-bit.
    "qwen3_moe-q4_1+q8_0-up": (
        {"ffn_up_exps": "Q8_0", "ffn_gate_inp": "F32"},
        "Q4_1",
        "qwen3_moe",
        (None, "int4"),
    ),
    # llama.cpp's Q4_K_M mix for experts (Q4_K gate/up, Q6_K down), in super-blocks of 256.
    "qwen3_moe-q4_k_m": (
        {"ffn_down_exps": "Q6_K", "attn_v": "Q6_K", "token_embd": "Q6_K", "ffn_gate_inp": "F32"},
        "Q4_K",
        "qwen3_moe-wide",
        ("int4", "q6_k"),
    ),
    # Mixtral (a "llama" file: q/k rows interleaved) in the same Q4_K_M mix.
    "mixtral-q4_k_m": (
        {"ffn_down_exps": "Q6_K", "attn_v": "Q6_K", "token_embd": "Q6_K", "ffn_gate_inp": "F32"},
        "Q4_K",
        "mixtral-wide",
        ("int4", "q6_k"),
    ),
    # OLMoE: 4-bit experts, 8-bit down projections.
    "olmoe-q4_0": (
        {"ffn_down_exps": "Q8_0", "ffn_gate_inp": "F32"},
        "Q4_0",
        "olmoe",
        ("int4", "q8_0"),
    ),
}
WIDE = dict(hidden_size=256, intermediate_size=256, moe_intermediate_size=256, head_dim=64)
# The families transformers' GGUF reader lacks (a Mixtral file is read as a dense llama).
NOT_READ_BY_TRANSFORMERS = ("mixtral", "olmoe")


@pytest.fixture(scope="module")
def moe_sources(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("gguf-moe-sources")
    return {
        "qwen2_moe": build_moe(root / "qwen2_moe", "qwen2_moe"),
        # A dense first layer (``mlp_only_layers``): transformers' GGUF reader drops its MLP,
        # so this one is checked against the model it was written from only.
        "qwen3_moe-dense0": build_moe(root / "qwen3_moe-dense0", "qwen3_moe"),
        "qwen3_moe": build_moe(root / "qwen3_moe", "qwen3_moe", mlp_only_layers=[]),
        "qwen3_moe-wide": build_moe(
            root / "qwen3_moe-wide", "qwen3_moe", mlp_only_layers=[], **WIDE
        ),
        "mixtral": build_moe(root / "mixtral", "mixtral"),
        "mixtral-wide": build_moe(
            root / "mixtral-wide", "mixtral", hidden_size=256, intermediate_size=256
        ),
        # clip_qkv (3.0) as the key llama.cpp's converter writes; experts 64 wide for Q8_0.
        "olmoe": build_moe(root / "olmoe", "olmoe", intermediate_size=64),
    }


@pytest.fixture(scope="module")
def moe_files(moe_sources: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> dict:
    root = tmp_path_factory.mktemp("gguf-moe")
    return {
        name: write_gguf(moe_sources[src], root / f"{name}.gguf", recipe=recipe, default=default)
        for name, (recipe, default, src, _) in RECIPES.items()
    }


def _experts(engine: Engine) -> list[FusedMoE]:
    model = engine.executor.worker.runner.model  # type: ignore[attr-defined]
    return [m for m in model.modules() if isinstance(m, FusedMoE)]


@pytest.mark.parametrize("family", ["qwen2_moe", "qwen3_moe-dense0", "mixtral", "olmoe"])
def test_float_moe_file_matches_the_model_it_was_written_from(
    moe_sources: dict[str, Path], tmp_path: Path, family: str
) -> None:
    """Stacked experts split back per expert, the router, the shared expert and its gate (a
    vector in the file), a dense layer between sparse ones: every mapping against the original
    transformers model."""
    path = write_gguf(moe_sources[family], tmp_path / f"{family}.gguf")
    ref = hf_greedy(moe_sources[family], PROMPTS, MAX_NEW)
    for i, (ours, r) in enumerate(zip(engine_greedy(path), ref, strict=True)):
        assert_greedy_match(ours, r, f"{family} prompt {i}")


@pytest.mark.parametrize("recipe", list(RECIPES))
def test_quantised_experts_match_transformers_on_the_same_file(
    moe_files: dict, moe_sources: dict[str, Path], recipe: str
) -> None:
    path = moe_files[recipe]
    source = moe_sources[RECIPES[recipe][2]]
    if source.name.split("-")[0] in NOT_READ_BY_TRANSFORMERS:
        folder = dequantised_source(path, source, path.with_suffix(".dequantised"))
        ref = hf_greedy(folder, PROMPTS, MAX_NEW)
    else:
        ref = hf_gguf_greedy(path, PROMPTS, MAX_NEW, config_from=source)
    for i, (ours, r) in enumerate(zip(engine_greedy(path), ref, strict=True)):
        assert_greedy_match(ours, r, f"{recipe} prompt {i}")


@pytest.mark.parametrize("recipe", list(RECIPES))
def test_expert_stacks_stay_quantised_on_the_cpu(moe_files: dict, recipe: str) -> None:
    """Each stack in one native format stays in it, on the C++ group-wise GEMM, one packed GEMM
    per expert, the experts' panels side by side in one buffer per stack, and each such stack's
    experts of a step in one grouped call; the stacks themselves are released once packed."""
    w13, w2 = RECIPES[recipe][3]
    engine = Engine(str(moe_files[recipe]), device="cpu", block_size=8, num_kv_blocks=16)
    layers = _experts(engine)
    assert layers
    for layer in layers:
        want = {k: v for k, v in (("w13_weight", w13), ("w2_weight", w2)) if v is not None}
        assert layer.groupwise == want
        for fmt in want.values():
            assert f"cpp-{fmt}-" in layer.path, layer.path
        if w13 is None:  # the dequantised stack: the dense float GEMM
            assert "onednn" in layer.path or "bfloat16" in layer.path, layer.path
        assert "grouped" in layer.path, layer.path
        kernels = layer.expert_kernels
        for which, name in enumerate(("w13_weight", "w2_weight")):
            if name not in want:
                assert layer.fast_moe.keywords["grouped"][which] is None
                continue
            panels = [pair[which].groupwise.packed for pair in kernels]
            for a, b in itertools.pairwise(panels):  # one buffer: each expert's after the last's
                assert b.data_ptr() == a.data_ptr() + a.numel(), f"{name}: not side by side"
        assert layer.w13_weight.numel() == 0 and layer.w2_weight.numel() == 0
    outs = engine.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == MAX_NEW for o in outs)
    manager = engine.block_manager
    assert manager.get_num_free_device_blocks() == manager.num_device_blocks


def test_a_grouped_gemm_that_disagrees_at_load_leaves_each_expert_its_own_call(
    moe_files: dict, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The grouped call is checked at load against the experts' own GEMMs bit for bit: one
    that differs (here float32 outputs one unit in the last place off) is not used, and the
    experts keep one call each."""
    ops = dense_gemm.gemm_ops()
    if ops is None:
        pytest.skip("no C++ GEMM here")
    grouped = ops.groupwise_gemm_grouped

    def one_ulp_off(*args):
        y = grouped(*args)
        return torch.nextafter(y.float(), torch.tensor(float("inf"))).to(y.dtype)

    monkeypatch.setattr(ops, "groupwise_gemm_grouped", one_ulp_off)
    with caplog.at_level("WARNING"):
        engine = Engine(
            str(moe_files["qwen2_moe-q4_0"]), device="cpu", block_size=8, num_kv_blocks=16
        )
    assert "grouped expert GEMM differs" in caplog.text
    for layer in _experts(engine):
        assert "grouped" not in layer.path and layer.fast_moe.keywords["grouped"] == (None, None)
    outs = engine.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == MAX_NEW for o in outs)


@pytest.mark.parametrize("int8_activations", [False, True])
def test_int8_activations_reach_the_expert_gemms(
    moe_files: dict, monkeypatch: pytest.MonkeyPatch, int8_activations: bool
) -> None:
    """``int8_activations`` sends the experts' bf16 rows to the dot path as it does the dense
    layers' (a step's experts each see a few rows: the float path's conversion of every weight
    is what their time goes to); without it no call takes it. Each call of the C++ GEMM is
    recorded with its columns, rows and path."""
    calls = record_groupwise_calls(monkeypatch)
    engine = Engine(
        str(moe_files["qwen2_moe-q4_0"]),
        device="cpu",
        block_size=8,
        num_kv_blocks=64,
        int8_activations=int8_activations,
    )
    if engine.executor.worker.dtype != torch.bfloat16:  # type: ignore[attr-defined]
        pytest.skip("this processor computes a bf16 checkpoint in float32")
    layers = _experts(engine)
    assert all(("+dot" in layer.path) is int8_activations for layer in layers), layers[0].path
    calls.clear()  # the checks at load
    outs = engine.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == MAX_NEW for o in outs)
    # Calls of 64 columns: the experts' gate/up (2 x 32) and down, o_proj, the shared expert's
    # down; the 4-bit ones dot, the 8-bit ones too unless the int16 tiles run (takes_dot). The
    # LM head never dots.
    ops = dense_gemm.gemm_ops()
    name = {4: "int4", 8: "q8_0", 6: "q6_k"}
    experts = [c for c in calls if c[0] == 64]
    assert experts and any(c[3] == 4 for c in experts)
    for c in experts:
        want = int8_activations and groupwise_linear.takes_dot(ops, name[c[3]], dot=True)
        assert c[2] is want, c
    assert not any(c[2] for c in calls if c[0] == engine.vocab_size)
    bm = engine.block_manager
    assert bm.get_num_free_device_blocks() == bm.num_device_blocks


def test_quantised_experts_on_the_pytorch_path(moe_files: dict) -> None:
    """Without the C++ GEMM (a device that runs the formats in PyTorch), group-wise experts
    compute what the same experts dequantised at load compute."""
    from tests.conftest import load_on_reference

    path = moe_files["qwen2_moe-q4_0"]
    dense = load_on_reference(path, torch.float32, native_formats=frozenset())
    kept = load_on_reference(path, torch.float32, native_formats=frozenset({"int4", "q8_0"}))
    want, got = dense.layers[1].mlp.experts, kept.layers[1].mlp.experts
    assert want.groupwise == {} and got.groupwise == {"w13_weight": "int4", "w2_weight": "q8_0"}
    assert got.w13_weight.dtype == torch.uint8 and got.w2_weight.dtype == torch.int8
    torch.manual_seed(0)
    x = torch.randn(5, 64)
    ids = torch.tensor([[0, 1, 2, 3], [5, 4, 3, 2], [1, 3, 5, 0], [2, 2, 1, 0], [4, 0, 1, 5]])
    weights = torch.rand(5, 4)
    torch.testing.assert_close(got(x, weights, ids), want(x, weights, ids), rtol=1e-5, atol=1e-5)
    for name in ("w13_weight", "w2_weight"):
        for e in range(got.num_local_experts):
            torch.testing.assert_close(
                got.dequantized_expert(name, e), getattr(want, name)[e], rtol=0, atol=0
            )


def test_prefix_caching_chunked_prefill_and_preemption_over_moe_experts(moe_files: dict) -> None:
    path = moe_files["qwen2_moe-q4_0"]
    shared = [list(range(20, 60)) + p for p in PROMPTS]
    base = engine_greedy(path, shared)
    engine = Engine(
        str(path),
        device="cpu",
        dtype="float32",
        block_size=8,
        num_kv_blocks=14,
        enable_prefix_caching=True,
        enable_chunked_prefill=True,
        max_num_batched_tokens=16,
    )
    outs = engine.generate([{"prompt_token_ids": p} for p in shared], GREEDY, use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in outs] == base
    stats = engine.get_stats()
    assert stats["num_preemptions_total"] > 0 and stats["chunked_prefill_steps"] > 0, stats
    assert stats["prefix_cache_hits"] > 0, stats
    manager = engine.block_manager
    assert manager.get_num_free_device_blocks() == manager.num_device_blocks


def test_bad_moe_files_fail_at_start_with_one_line(
    moe_sources: dict[str, Path], tmp_path: Path
) -> None:
    source, mixtral = moe_sources["qwen3_moe"], moe_sources["mixtral"]
    no_count = write_gguf(source, tmp_path / "no-count.gguf", drop_keys=("qwen3moe.expert_count",))
    experts_in_qwen3 = write_gguf(source, tmp_path / "qwen3-experts.gguf", arch="qwen3")
    miscounted = write_gguf(source, tmp_path / "count.gguf", metadata={"qwen3moe.expert_count": 6})
    # A llama file with experts is Mixtral: its count, and experts as wide as its MLP.
    mixtral_no_count = write_gguf(
        mixtral, tmp_path / "mixtral-no-count.gguf", drop_keys=("llama.expert_count",)
    )
    mixtral_width = write_gguf(
        mixtral, tmp_path / "mixtral-width.gguf", metadata={"llama.feed_forward_length": 64}
    )
    split = write_gguf(mixtral, tmp_path / "mixtral-split.gguf", split_experts=True)
    cases = [
        (no_count, "qwen3moe.expert_count"),
        (miscounted, "stacks 8 experts where qwen3moe.expert_count says 6"),
        (experts_in_qwen3, "has no place in a qwen3"),
        (mixtral_no_count, "llama.expert_count"),
        (mixtral_width, "ffn_gate_exps.weight has shape .* llama.feed_forward_length 64 and"),
        (split, "one expert of an early-2024 file"),
    ]
    assert_refused_in_one_line(cases)


# llama.cpp runs no dense layers in these files, and ignores OLMoE's clamp_kqv: its source here
# has no clip_qkv (nor has the released OLMoE).
@pytest.mark.parametrize("family", ["qwen2_moe", "qwen3_moe", "mixtral", "olmoe-unclipped"])
def test_llama_cpp_reads_our_moe_files_as_transformers_reads_their_models(
    moe_sources: dict[str, Path], tmp_path: Path, family: str
) -> None:
    """The writer's MoE conventions (stacks ``[E, N, K]`` in expert order, the router, the
    shared expert and its vector gate, the expert-size keys, Mixtral as a "llama" file with
    interleaved q/k rows, OLMoE's without) are what llama.cpp itself reads: its float32 logits
    on the written file equal transformers' on the source model. Where llama-cpp-python is
    installed (the benchmarks' environment; CI's clean one skips it)."""
    pytest.importorskip("llama_cpp")
    if family == "olmoe-unclipped":
        source = build_moe(tmp_path / family, "olmoe", clip_qkv=None)
    else:
        source = moe_sources[family]
    path = write_gguf(source, tmp_path / f"{family}.gguf")
    diff = llama_cpp_vs_source(source, path)
    assert diff < 1e-4, f"{family}: llama.cpp's logits differ from transformers' by {diff:.2e}"


@pytest.mark.parametrize("expert_parallel", [False, True])
def test_whole_stacks_load_as_expert_by_expert_on_a_rank(expert_parallel: bool) -> None:
    """A GGUF file's group-wise stacks arrive whole (``[E, 2I, ...]``, ``[E, H, ...]``); where
    a rank keeps a slice (tensor or expert parallelism) the loader cuts it as it cuts experts
    arriving one by one."""
    from pagedllm.layers.parallel import TPContext

    tp = TPContext(rank=1, size=2, expert_parallel=expert_parallel)

    def layer() -> FusedMoE:
        moe = FusedMoE(num_experts=4, hidden_size=64, intermediate_size=64, tp=tp)
        moe.use_groupwise("w13_weight", "int4")
        moe.use_groupwise("w2_weight", "q8_0")
        return moe

    whole, one_by_one = layer(), layer()
    torch.manual_seed(0)
    stacks = {
        "w13_weight": torch.randint(0, 255, (4, 128, 32), dtype=torch.uint8),
        "w13_weight_scale": torch.randn(4, 128, 2),
        "w13_weight_offset": torch.randn(4, 128, 2),
        "w2_weight": torch.randint(-127, 127, (4, 64, 64), dtype=torch.int8),
        "w2_weight_scale": torch.randn(4, 64, 2),
    }
    for name, stack in stacks.items():
        param = getattr(whole, name)
        param.weight_loader(param, stack)
        param = getattr(one_by_one, name)
        for e in range(4):
            if name.startswith("w2"):
                param.weight_loader(param, stack[e], (e, None))
            else:
                param.weight_loader(param, stack[e, :64], (e, 0))
                param.weight_loader(param, stack[e, 64:], (e, 1))
        assert torch.equal(getattr(whole, name), getattr(one_by_one, name)), name
    # What this rank keeps: experts 2-3 whole, or every expert's second half of I.
    w13 = whole.w13_weight
    if expert_parallel:
        assert torch.equal(w13, stacks["w13_weight"][2:])
    else:
        assert torch.equal(w13[:, :32], stacks["w13_weight"][:, 32:64])
        assert torch.equal(whole.w2_weight, stacks["w2_weight"][:, :, 32:])

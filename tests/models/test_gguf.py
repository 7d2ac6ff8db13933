"""GGUF files: greedy tokens equal transformers on the same file, for every tensor type we read.

Files are written in the test from tiny random models (``gguf_files.write_gguf``, with ggml's
own ``gguf`` package). The reference is transformers loading the same GGUF (it dequantises with
``gguf`` too), or, for families transformers cannot read from GGUF or reads differently (Gemma,
Phi-3's partial rotary), the Hugging Face model the float32 file was written from.
"""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from pagedllm import Engine, SamplingParams
from pagedllm.models.checkpoint import CheckpointError
from tests.conftest import build_model
from tests.hf_reference import assert_greedy_match, hf_greedy
from tests.models.gguf_files import hf_gguf_greedy, llama_cpp_vs_source, write_gguf
from tests.models.test_more_families import GGUF_GEMMA2, GGUF_GEMMA3, build_family

MAX_NEW = 10
PROMPTS = [[5, 17, 99, 3, 44, 12, 7], [7, 8, 9], list(range(20, 60)), [300, 12, 150, 151, 152]]
GREEDY = SamplingParams(max_tokens=MAX_NEW, temperature=0.0)

# name -> (types by GGUF tensor kind, type of every other 2-D tensor, source model)
RECIPES: dict[str, tuple[dict[str, str], str, str]] = {
    "f32": ({}, "F32", "llama"),
    "f16": ({}, "F16", "llama"),
    "bf16": ({}, "BF16", "llama"),
    "q8_0": ({}, "Q8_0", "llama"),
    "q4_0": ({}, "Q4_0", "llama"),
    "q4_1+q8_0": ({"ffn_down": "Q8_0", "token_embd": "Q8_0"}, "Q4_1", "llama"),
    "q5_0+q5_1": ({"attn_v": "Q5_0", "ffn_down": "Q5_1", "token_embd": "F16"}, "Q4_0", "llama"),
    # K-quants come in super-blocks of 256 columns: a wider model.
    "q4_k_m": ({"attn_v": "Q6_K", "ffn_down": "Q5_K", "token_embd": "Q6_K"}, "Q4_K", "wide"),
    # llama.cpp's Q4_K_M mix as our kernels see it: q/k Q4_K with a Q6_K v, gate Q4_K with a
    # Q8_0 up (fused layers of several formats, each part kept in its own), Q6_K down.
    "q4_k+q6_k+q8_0": (
        {"attn_v": "Q6_K", "ffn_up": "Q8_0", "ffn_down": "Q6_K", "token_embd": "Q6_K"},
        "Q4_K",
        "wide",
    ),
    # Every layer Q6_K (fused q/k/v and gate/up whole), the tied head too.
    "q6_k": ({}, "Q6_K", "wide"),
    # An untied Q6_K head (as every llama.cpp quantisation writes it) over a Q6_K embedding.
    "mistral-q6_k-head": ({"output": "Q6_K", "token_embd": "Q6_K"}, "Q8_0", "mistral-wide"),
    "qwen2-q4_0": ({"token_embd": "Q8_0"}, "Q4_0", "qwen2"),
    # The types kept as 8-bit groups (IQ4_XS, IQ4_NL, Q5_0: q8_0) and as q6_k (Q3_K), exactly:
    # fused q/k/v and gate/up of two such types each, a Q3_K down, an IQ4_XS tied table.
    "iq4_xs+iq4_nl+q5_0+q3_k": (
        {"attn_v": "IQ4_NL", "ffn_up": "Q5_0", "ffn_down": "Q3_K", "attn_output": "Q3_K"},
        "IQ4_XS",
        "wide",
    ),
    # A part no format holds (a Q5_1 v, a Q2_K up), dequantised alone (dense) beside
    # quantised neighbours.
    "iq4_xs+dense": ({"attn_v": "Q5_1", "ffn_up": "Q2_K"}, "IQ4_XS", "wide"),
    # llama.cpp's Q5_K_M mix: Q5_K, with Q6_K v and down (and a Q6_K table).
    "q5_k_m": ({"attn_v": "Q6_K", "ffn_down": "Q6_K", "token_embd": "Q6_K"}, "Q5_K", "wide"),
    # Every type that is dequantised at load (ggml's own dequantisation) in one file; an untied
    # head.
    "low-bit": (
        {
            "attn_q": "IQ3_S",
            "attn_k": "IQ3_XXS",
            "attn_v": "IQ2_S",
            "attn_output": "IQ2_XS",
            "ffn_gate": "IQ2_XXS",
            "ffn_up": "IQ1_S",
            "ffn_down": "IQ1_M",
            "token_embd": "TQ2_0",
            "output": "TQ1_0",
        },
        "Q2_K",
        "mistral-wide",
    ),
    "mxfp4+q5_1": ({"ffn_down": "Q5_1", "token_embd": "F16"}, "MXFP4", "wide"),
    # An untied head: output.weight kept as Q4_1, the embedding as Q8_0.
    "mistral-q8_0": ({"output": "Q4_1"}, "Q8_0", "mistral"),
}


@pytest.fixture(scope="module")
def sources(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("gguf-sources")
    wide = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4)
    return {
        "llama": build_model(root / "llama", "llama"),
        "wide": build_model(root / "wide", "llama", **wide),
        "mistral-wide": build_model(root / "mistral-wide", "mistral", **wide),
        "qwen2": build_model(root / "qwen2", "qwen2"),
        "mistral": build_model(root / "mistral", "mistral"),
        **{name: build_family(root / name, name) for name in ("phi3", "gemma", "qwen3")},
        "gemma2": build_family(root / "gemma2", "gemma2", **GGUF_GEMMA2),
        "gemma3": build_family(root / "gemma3", "gemma3", **GGUF_GEMMA3),
    }


@pytest.fixture(scope="module")
def gguf_files(sources: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> dict:
    root = tmp_path_factory.mktemp("gguf")
    return {
        name: write_gguf(sources[src], root / f"{name}.gguf", recipe=recipe, default=default)
        for name, (recipe, default, src) in RECIPES.items()
    }


def engine_greedy(path: Path, prompts: list[list[int]] = PROMPTS, **kw: object) -> list[list[int]]:
    kw.setdefault("dtype", "float32")  # the reference's; a quantised file's default is bf16
    engine = Engine(str(path), device="cpu", block_size=8, num_kv_blocks=64, **kw)
    outs = engine.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    assert (
        engine.block_manager.get_num_free_device_blocks() == engine.block_manager.num_device_blocks
    )
    return [list(o.outputs[0].token_ids) for o in outs]


@pytest.mark.parametrize("recipe", list(RECIPES))
def test_greedy_matches_transformers_on_the_same_file(gguf_files: dict, recipe: str) -> None:
    path = gguf_files[recipe]
    ref = hf_gguf_greedy(path, PROMPTS, MAX_NEW)
    for i, (ours, r) in enumerate(zip(engine_greedy(path), ref, strict=True)):
        assert_greedy_match(ours, r, f"{recipe} prompt {i}")


# bf16 rounding of every activation: ties are as wide as in the half-precision engine tests,
# bounds included: logits between 8 and 16 are bf16 multiples of 2**-4 = BF16_TIE, so a gap of
# exactly one such step is the narrowest a near-tie there can show.
BF16_TIE = 8 * 2.0**-7


@pytest.mark.parametrize(
    "recipe", ["q4_k_m", "q4_1+q8_0", "iq4_xs+iq4_nl+q5_0+q3_k", "iq4_xs+dense", "q5_k_m"]
)
def test_quantised_files_default_to_bf16_and_match_transformers_in_bf16(
    gguf_files: dict, recipe: str
) -> None:
    path = gguf_files[recipe]
    engine = Engine(str(path), device="cpu", block_size=8, num_kv_blocks=64)
    if engine.executor.worker.dtype != torch.bfloat16:  # type: ignore[attr-defined]
        pytest.skip("this processor computes a bf16 checkpoint in float32")
    outs = engine.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
    ref = hf_gguf_greedy(path, PROMPTS, MAX_NEW, dtype=torch.bfloat16)
    for i, (o, r) in enumerate(zip(outs, ref, strict=True)):
        assert_within_bf16_ties(list(o.outputs[0].token_ids), r, f"{recipe} bf16 {i}")


def assert_within_bf16_ties(ours: list[int], ref, label: str) -> None:
    """Token-for-token equality up to the first step where ours is one of transformers' tied
    best: bf16 logits are coarse enough that three or more tokens tie exactly (a top-2 margin of
    0 whose third token is ours), so the rule is "within ``BF16_TIE`` of transformers' best"."""
    for i, (a, b) in enumerate(zip(ours, ref.token_ids, strict=False)):
        if a == b:
            continue
        lp = ref.step_logprobs[i]
        gap = float(lp.max() - lp[a])
        assert gap <= BF16_TIE, f"{label}: token {i} is {gap:.3f} below transformers' best"
        return
    assert len(ours) == len(ref.token_ids), label


@pytest.mark.parametrize(
    "family", ["llama", "mistral", "qwen2", "qwen3", "phi3", "gemma", "gemma2", "gemma3"]
)
def test_llama_cpp_reads_our_test_files_as_transformers_reads_their_models(
    sources: dict[str, Path], tmp_path: Path, family: str
) -> None:
    """The test writer's conventions (names, the q/k interleave, ``1 + w`` norms, Gemma 2's
    keys) are what llama.cpp itself reads: its float32 logits on the written file equal
    transformers' on the model it was written from. Where llama-cpp-python is installed (the
    benchmarks' environment; CI's clean environment skips it). ggml's GELU reads an fp16
    table, hence the Gemma families' wider bound; Gemma 2 without its caps is 0.18 away."""
    pytest.importorskip("llama_cpp")
    path = write_gguf(sources[family], tmp_path / f"{family}.gguf")
    bound = 5e-3 if family.startswith("gemma") else 1e-4
    diff = llama_cpp_vs_source(sources[family], path)
    assert diff < bound, f"{family}: llama.cpp's logits differ from transformers' by {diff:.2e}"


# llama.cpp's file types whose tensors we hold otherwise than as before: kept as 8-bit groups
# (IQ4_XS, IQ4_NL, Q5_0) or q6_k (Q3_K), or dequantised (Q2_K, IQ3_S, TQ2_0).
LLAMA_CPP_FTYPES = ("IQ4_XS", "IQ4_NL", "Q3_K_M", "Q5_0", "Q2_K", "IQ3_M", "TQ2_0")


@pytest.mark.parametrize("ftype", LLAMA_CPP_FTYPES)
def test_files_quantised_by_llama_cpp_read_as_llama_cpp_reads_them(
    sources: dict[str, Path], tmp_path: Path, ftype: str
) -> None:
    """Blocks written by llama.cpp's own quantiser (not our test writer's random bytes) mean to
    ggml's dequantisation in the ``gguf`` package (which we and transformers read them by) what
    they mean to llama.cpp: its logits on the quantised file are within its int8 activations'
    rounding of transformers' on the same file (0.10-0.21 for Q4_0, Q4_K_M, Q6_K files of this
    model), far inside what the quantisation itself moved them from the F16 file's (0.9-6.6).
    A misread block moves them by as much as the quantisation does."""
    import ctypes

    llama_cpp = pytest.importorskip("llama_cpp")
    from transformers import AutoModelForCausalLM

    from pagedllm.models.gguf.loading import open_gguf

    f16 = write_gguf(sources["wide"], tmp_path / "f16.gguf", default="F16")
    path = tmp_path / f"{ftype}.gguf"
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{ftype}")
    params.nthread = 2
    assert not llama_cpp.llama_model_quantize(
        str(f16).encode(), str(path).encode(), ctypes.byref(params)
    )
    types = {t.type_name for t in open_gguf(path).tensors.values()}
    assert types & {"IQ4_XS", "IQ4_NL", "Q3_K", "Q5_0", "Q2_K", "IQ3_S", "TQ2_0"}, types
    ids = [5, 9, 17, 33, 65, 7, 11, 13, 3, 21, 40, 41, 42, 43, 44, 45, 46, 47, 48, 49]

    def transformers_logits(file: Path) -> np.ndarray:
        model = AutoModelForCausalLM.from_pretrained(
            str(file.parent), gguf_file=file.name, dtype=torch.float32
        ).eval()
        with torch.no_grad():
            return model(torch.tensor([ids])).logits[0].numpy()

    want = transformers_logits(path)
    moved = float(np.abs(want - transformers_logits(f16)).max())
    llm = llama_cpp.Llama(
        str(path), n_ctx=64, logits_all=True, verbose=False, n_threads=2, type_k=0, type_v=0
    )
    llm.eval(ids)
    diff = float(np.abs(np.asarray(llm.scores[: len(ids)]) - want).max())
    assert diff < 0.3 and diff < 0.25 * moved, (ftype, sorted(types), diff, moved)
    # And our engine reads llama.cpp's blocks as transformers does: the same greedy tokens.
    ref = hf_gguf_greedy(path, PROMPTS[:2], MAX_NEW)
    for i, (ours, r) in enumerate(zip(engine_greedy(path, PROMPTS[:2]), ref, strict=True)):
        assert_greedy_match(ours, r, f"{ftype} prompt {i}")


@pytest.mark.parametrize(
    "family", ["mistral", "qwen2", "qwen3", "phi3", "gemma", "gemma2", "gemma3"]
)
def test_float_file_matches_the_model_it_was_written_from(
    sources: dict[str, Path], tmp_path: Path, family: str
) -> None:
    """Names, the q/k interleave, Phi-3's fused tensors and partial rotary, Gemma's ``1 + w``
    norms: every mapping is exercised against the original transformers model."""
    path = write_gguf(sources[family], tmp_path / f"{family}.gguf")
    ref = hf_greedy(sources[family], PROMPTS, MAX_NEW)
    for i, (ours, r) in enumerate(zip(engine_greedy(path), ref, strict=True)):
        assert_greedy_match(ours, r, f"{family} prompt {i}")


def test_quantised_layers_stay_quantised(gguf_files: dict) -> None:
    engine = Engine(str(gguf_files["q4_1+q8_0"]), device="cpu", block_size=8, num_kv_blocks=16)
    model = engine.executor.worker.runner.model  # type: ignore[attr-defined]
    layer = model.layers[0]
    assert layer.self_attn.qkv_proj.quant_method.name == "int4"
    assert layer.self_attn.qkv_proj.weight.dtype == torch.uint8
    assert layer.mlp.down_proj.quant_method.name == "q8_0"
    assert layer.mlp.down_proj.weight.dtype == torch.int8 or layer.mlp.down_proj.fast_linear
    assert model.embed_tokens.quant_method.name == "q8_0"  # the tied head too
    assert model.embed_tokens.weight.dtype == torch.int8
    untied = Engine(str(gguf_files["mistral-q8_0"]), device="cpu", num_kv_blocks=16)
    head = untied.executor.worker.runner.model.lm_head  # type: ignore[attr-defined]
    assert head.quant_method.name == "int4"
    mixed = Engine(str(gguf_files["q5_0+q5_1"]), device="cpu", block_size=8, num_kv_blocks=16)
    layer = mixed.executor.worker.runner.model.layers[0]  # type: ignore[attr-defined]
    # Q4_0 q/k with a Q5_0 v (8-bit groups): each part in its own format.
    assert layer.self_attn.qkv_proj.quant_method.name == "mixed"
    assert layer.mlp.down_proj.quant_method is None  # Q5_1: dequantised


def test_q5_k_layers_stay_quantised(gguf_files: dict) -> None:
    """Q5_K layers stay q5_k on the CPU (q in 0..31 as int8 with a scale and an offset per 32,
    on the group-wise GEMM): a Q5_K_M file's q/k/gate/up, a Q4_K_M file's down."""
    engine = Engine(str(gguf_files["q5_k_m"]), device="cpu", block_size=8, num_kv_blocks=16)
    model = engine.executor.worker.runner.model  # type: ignore[attr-defined]
    layer = model.layers[0]
    assert layer.self_attn.qkv_proj.quant_method.formats == ("q5_k", "q5_k", "q6_k")
    assert layer.mlp.gate_up_proj.quant_method.name == "q5_k"
    assert layer.mlp.down_proj.quant_method.name == "q6_k"
    paths = dict(p.split("=") for p in model.linear_path.split(", "))
    assert paths["ColumnParallelLinear"].startswith("cpp-q5_k-"), paths
    assert paths["QKVParallelLinear"].startswith("cpp-mixed(q5_k,q5_k,q6_k)-"), paths
    k_m = Engine(str(gguf_files["q4_k_m"]), device="cpu", block_size=8, num_kv_blocks=16)
    down = k_m.executor.worker.runner.model.layers[0].mlp.down_proj  # type: ignore[attr-defined]
    assert down.quant_method.name == "q5_k"


def test_iq4_q5_0_and_q3_k_stay_quantised(gguf_files: dict) -> None:
    """IQ4_XS, IQ4_NL and Q5_0 layers stay quantised as 8-bit groups, Q3_K ones as q6_k (its
    q at 6 bits where the build reads them), the IQ4_XS tied table too; Q2_K and the IQ2/IQ3
    types are dequantised."""
    engine = Engine(
        str(gguf_files["iq4_xs+iq4_nl+q5_0+q3_k"]), device="cpu", block_size=8, num_kv_blocks=16
    )
    model = engine.executor.worker.runner.model  # type: ignore[attr-defined]
    layer = model.layers[0]
    assert layer.self_attn.qkv_proj.quant_method.name == "q8_0"  # IQ4_XS q/k, IQ4_NL v
    assert layer.mlp.gate_up_proj.quant_method.name == "q8_0"  # IQ4_XS gate, Q5_0 up
    assert layer.mlp.down_proj.quant_method.name == "q6_k"  # Q3_K
    assert layer.self_attn.o_proj.quant_method.name == "q6_k"
    assert model.embed_tokens.quant_method.name == "q8_0"
    path = engine.executor.collective_rpc("linear_path")[0]
    assert "torch" not in path, path  # every layer on the C++ GEMM
    low = Engine(str(gguf_files["low-bit"]), device="cpu", block_size=8, num_kv_blocks=16)
    model = low.executor.worker.runner.model  # type: ignore[attr-defined]
    assert model.layers[0].self_attn.qkv_proj.quant_method is None
    assert model.lm_head.quant_method is None


def test_q6_k_layers_stay_quantised(gguf_files: dict) -> None:
    """Q6_K layers, tables and heads stay Q6_K on the CPU (the C++ GEMM), a Q6_K part of a fused
    layer among Q4_K ones too."""
    engine = Engine(str(gguf_files["q6_k"]), device="cpu", block_size=8, num_kv_blocks=16)
    model = engine.executor.worker.runner.model  # type: ignore[attr-defined]
    for layer in (model.layers[0].self_attn.qkv_proj, model.layers[1].mlp.gate_up_proj):
        assert layer.quant_method.name == "q6_k" and layer.fast_linear is not None
    assert model.embed_tokens.quant_method.name == "q6_k"  # the tied head too
    assert model.embed_tokens.weight.dtype == torch.int8
    paths = model.linear_path.split(", ")  # kind=path, the head's included
    assert len(paths) == 4 and all("=cpp-q6_k-" in p for p in paths), paths
    mixed = Engine(str(gguf_files["q4_k_m"]), device="cpu", block_size=8, num_kv_blocks=16)
    m = mixed.executor.worker.runner.model  # type: ignore[attr-defined]
    qkv = m.layers[0].self_attn.qkv_proj  # Q4_K q, k with a Q6_K v
    assert qkv.quant_method.formats == ("int4", "int4", "q6_k") and qkv.fast_linear is not None
    assert m.layers[0].self_attn.o_proj.quant_method.name == "int4"
    assert m.embed_tokens.quant_method.name == "q6_k"
    untied = Engine(str(gguf_files["mistral-q6_k-head"]), device="cpu", num_kv_blocks=16)
    u = untied.executor.worker.runner.model  # type: ignore[attr-defined]
    assert u.lm_head.quant_method.name == "q6_k" and u.lm_head.weight.numel() == 0  # packed
    assert u.embed_tokens.quant_method.name == "q6_k"


def _packed_part_by_part(
    path: Path, qkv_formats: tuple[str, ...], gate_up_formats: tuple[str, ...]
) -> dict[str, str]:
    """Every layer's fused q/k/v and gate/up hold these formats per part, two runs of parts a
    layer (one per format), each packed with no unpacked copy left; returns the linear paths."""
    engine = Engine(str(path), device="cpu", num_kv_blocks=16)
    model = engine.executor.worker.runner.model  # type: ignore[attr-defined]
    for layer in model.layers:
        qkv, gate_up = layer.self_attn.qkv_proj, layer.mlp.gate_up_proj
        assert qkv.quant_method.formats == qkv_formats
        assert gate_up.quant_method.formats == gate_up_formats
        assert len(qkv.parts) == 2  # q and k (one format) in one GEMM, v in another
        for fused in (qkv, gate_up):
            assert fused.fast_linear is not None
            assert all(p.weight.numel() == 0 for p in fused.parts)  # packed copies only
    return dict(p.split("=") for p in model.linear_path.split(", "))


def test_fused_layers_of_several_formats_keep_each_part_in_its_own(gguf_files: dict) -> None:
    """Q4_K q/k with a Q6_K v, Q4_K gate with a Q8_0 up: each fused layer runs one packed GEMM
    per part on the CPU (no part dequantised to the compute dtype: it would stream 3-4x the
    bytes), with transformers' tokens (the greedy tests above)."""
    paths = _packed_part_by_part(
        gguf_files["q4_k+q6_k+q8_0"], ("int4", "int4", "q6_k"), ("int4", "q8_0")
    )
    assert paths["QKVParallelLinear"].startswith("cpp-mixed(int4,int4,q6_k)-"), paths
    assert paths["ColumnParallelLinear"].startswith("cpp-mixed(int4,q8_0)-"), paths
    assert not any("float" in p for p in paths.values()), paths


def test_fused_layers_of_several_formats_on_the_pytorch_path(gguf_files: dict) -> None:
    """Without the C++ GEMM (another device that runs the formats in PyTorch), a fused layer of
    several formats computes what the same layer dequantised at load computes."""
    from tests.conftest import load_on_reference

    path = gguf_files["q4_k+q6_k+q8_0"]
    dense = load_on_reference(path, torch.float32, native_formats=frozenset())
    kept = load_on_reference(
        path, torch.float32, native_formats=frozenset({"int4", "q6_k", "q8_0"})
    )
    x = torch.randn(3, 256)
    for name in ("self_attn.qkv_proj", "mlp.gate_up_proj"):
        want, got = dense.layers[1].get_submodule(name), kept.layers[1].get_submodule(name)
        assert want.quant_method is None and got.quant_method.name == "mixed"
        torch.testing.assert_close(got(x), want(x), rtol=1e-5, atol=1e-5)
    # One of the formats not run here: that part is dequantised alone (a dense run).
    partly = load_on_reference(path, torch.float32, native_formats=frozenset({"int4", "q8_0"}))
    qkv = partly.layers[1].self_attn.qkv_proj
    assert qkv.quant_method.formats == ("int4", "int4", "dense")
    assert qkv.parts[1].weight.dtype == torch.float32
    torch.testing.assert_close(qkv(x), dense.layers[1].self_attn.qkv_proj(x), rtol=1e-5, atol=1e-5)
    assert partly.layers[1].mlp.gate_up_proj.quant_method.formats == ("int4", "q8_0")
    # None run here: dequantised whole, as before.
    none = load_on_reference(path, torch.float32, native_formats=frozenset({"q8_0"}))
    assert none.layers[1].self_attn.qkv_proj.quant_method is None


def test_a_part_in_no_native_format_is_dequantised_alone(gguf_files: dict) -> None:
    """IQ4_XS q/k with a Q5_1 v, IQ4_XS gate with a Q2_K up: the Q5_1 and Q2_K parts become
    dense runs in the compute dtype on the CPU's dense GEMM, q/k and gate stay 8-bit groups
    (packed at 4 bits), with transformers' tokens (the greedy tests above)."""
    paths = _packed_part_by_part(
        gguf_files["iq4_xs+dense"], ("q8_0", "q8_0", "dense"), ("q8_0", "dense")
    )
    # The IQ4_XS runs packed back to 4 bits (their levels' indices) on the float path.
    assert paths["QKVParallelLinear"].startswith("cpp-mixed(iq4,iq4,dense)-"), paths
    assert paths["ColumnParallelLinear"].startswith("cpp-mixed(iq4,dense)-"), paths


def record_groupwise_calls(
    monkeypatch: pytest.MonkeyPatch,
) -> list[tuple[int, int, bool, int]]:
    """(columns, rows, dot path, bits) of every later call of the C++ group-wise GEMM (patched
    before an engine binds it), a grouped call's once per group; skips where this build has no
    dot path."""
    from pagedllm.backends.cpu import dense_gemm, groupwise_linear

    ops = dense_gemm.gemm_ops()
    if ops is None or not groupwise_linear.dot_rows(ops, torch.bfloat16):
        pytest.skip("no dot path on this build")
    calls: list[tuple[int, int, bool, int]] = []
    kernel, grouped = ops.groupwise_gemm, ops.groupwise_gemm_grouped

    def recorded(x, packed, n, bits, half, with_offset, factored, bias, dot, levels=False):
        calls.append((n, x.shape[0], dot, bits))  # the layers bind the kernel with these
        return kernel(x, packed, n, bits, half, with_offset, factored, bias, dot, levels)

    def recorded_grouped(x, packed, starts, n, bits, half, with_offset, factored, dot, levels):
        calls.extend((n, hi - lo, dot, bits) for lo, hi in itertools.pairwise(starts))
        return grouped(x, packed, starts, n, bits, half, with_offset, factored, dot, levels)

    monkeypatch.setattr(ops, "groupwise_gemm", recorded)
    monkeypatch.setattr(ops, "groupwise_gemm_grouped", recorded_grouped)
    return calls


def assert_refused_in_one_line(cases: list[tuple[Path, str]]) -> None:
    """Each file fails at start with one line naming the file and matching its message."""
    for path, message in cases:
        with pytest.raises(CheckpointError, match=message) as info:
            Engine(str(path), device="cpu", block_size=8, num_kv_blocks=16)
        text = str(info.value)
        assert str(path) in text and "\n" not in text, text


def test_int8_activations_round_prefill_rows_but_never_the_head(
    gguf_files: dict, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With ``int8_activations`` every bf16 batch of the group-wise layers takes the dot path,
    a 120-row prefill step included (as llama.cpp rounds its prompts), and the LM head never
    does: each call of the C++ GEMM is recorded with its columns, rows and path."""
    calls = record_groupwise_calls(monkeypatch)
    path = gguf_files["q4_0"]
    engine = Engine(str(path), device="cpu", block_size=8, num_kv_blocks=64, int8_activations=True)
    if engine.executor.worker.dtype != torch.bfloat16:  # type: ignore[attr-defined]
        pytest.skip("this processor computes a bf16 checkpoint in float32")
    calls.clear()  # the checks at load
    prompts = [list(range(20 + i, 60 + i)) for i in range(3)]  # one 120-row prefill step
    outs = engine.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == MAX_NEW for o in outs)
    head = [c for c in calls if c[0] == engine.vocab_size]
    layers = [c for c in calls if c[0] != engine.vocab_size]
    assert max(c[1] for c in layers) == 120, sorted({c[1] for c in layers})
    assert all(c[2] for c in layers), [c for c in layers if not c[2]][:3]
    assert head and not any(c[2] for c in head), head[:3]
    bm = engine.block_manager
    assert bm.get_num_free_device_blocks() == bm.num_device_blocks


@pytest.mark.parametrize("model", ["q4_0", "gemma2", "gemma3"])
def test_prefix_caching_chunked_prefill_and_preemption(
    gguf_files: dict, sources: dict[str, Path], tmp_path: Path, model: str
) -> None:
    """Shared prefixes cached, prompts in chunks of 16 tokens, a cache too small for the batch
    (preemption): the tokens of a plain run. The Gemma files' windows (8 tokens, every other
    layer, or five in six) are shorter than the chunks and the shared prefix."""
    if model == "q4_0":
        path = gguf_files["q4_0"]
    else:
        path = write_gguf(sources[model], tmp_path / f"{model}.gguf", default="Q8_0")
    plain = engine_greedy(path)
    shared = [list(range(20, 60)) + p for p in PROMPTS]
    base = engine_greedy(path, shared)
    engine = Engine(
        str(path),
        device="cpu",
        dtype="float32",
        block_size=8,
        num_kv_blocks=14,  # 20 held the batch without preempting (the stats now say so)
        enable_prefix_caching=True,
        enable_chunked_prefill=True,
        max_num_batched_tokens=16,
    )
    outs = engine.generate([{"prompt_token_ids": p} for p in shared], GREEDY, use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in outs] == base
    stats = engine.get_stats()
    assert stats["num_preemptions_total"] > 0 and stats["chunked_prefill_steps"] > 0, stats
    assert stats["prefix_cache_hits"] > 0, stats
    assert (
        engine.block_manager.get_num_free_device_blocks() == engine.block_manager.num_device_blocks
    )
    assert plain == engine_greedy(path)


def test_int8_groups_and_int4_groups_are_ggml_exact() -> None:
    """Our group-wise form of Q4_0 / Q4_1 / Q4_K (int4), Q8_0 / Q5_0 / IQ4_NL / IQ4_XS (8-bit
    groups), Q6_K / Q3_K (q6_k) and Q5_K (q5_k) dequantises bit for bit as ggml does
    (float32)."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, quants

    from pagedllm.backends.cpu.groupwise_pack import factor_q6_k
    from pagedllm.layers.quantization.groupwise import (
        dequantize_groups,
        dequantize_int4,
        dequantize_int8_groups,
    )
    from pagedllm.models.gguf.blocks import int4_groups, int8_groups, q5_k_groups, q6_k_groups
    from pagedllm.models.gguf.reader import GGUFTensor
    from tests.models.gguf_files import (
        READ_ONLY_TYPES,
        _random_k_blocks,
        _random_read_only_blocks,
    )

    rng = np.random.default_rng(0)
    rows, cols = 5, 512
    kinds = ("Q4_0", "Q4_1", "Q8_0", "Q5_0", "IQ4_NL", "IQ4_XS", "Q4_K", "Q6_K", "Q3_K", "Q5_K")
    for kind in kinds:
        qtype = GGMLQuantizationType[kind]
        if kind in ("Q4_K", "Q6_K", "Q5_K"):
            raw = _random_k_blocks(kind, rows, cols, rng)
        elif kind in READ_ONLY_TYPES:
            raw = _random_read_only_blocks(kind, rows, cols, rng)
        else:
            raw = quants.quantize(rng.normal(size=(rows, cols)).astype(np.float32), qtype)
        assert raw.shape[1] == cols // GGML_QUANT_SIZES[qtype][0] * GGML_QUANT_SIZES[qtype][1]
        expected = torch.from_numpy(quants.dequantize(raw, qtype))
        tensor = GGUFTensor("t", kind, (rows, cols), raw, qtype)
        if kind in ("Q8_0", "Q5_0", "IQ4_NL", "IQ4_XS"):
            q, scale = (torch.from_numpy(a) for a in int8_groups(tensor))
            got = dequantize_int8_groups(q, scale)
        elif kind in ("Q6_K", "Q3_K"):
            q, scale, d = (torch.from_numpy(a) for a in q6_k_groups(tensor))
            low, high = (-32, 31) if kind == "Q6_K" else (-4, 3)
            assert int(q.min()) >= low and int(q.max()) <= high
            assert factor_q6_k(scale, d) is not None  # scale = d * sc, sc a signed byte
            got = dequantize_int8_groups(q, scale)
        elif kind == "Q5_K":
            q, scale, offset = (torch.from_numpy(a) for a in q5_k_groups(tensor))
            assert q.dtype == torch.int8 and int(q.min()) >= 0 and int(q.max()) <= 31
            got = dequantize_groups(q, scale, offset)
        else:
            packed, scale, offset = (torch.from_numpy(a) for a in int4_groups(tensor))
            got = dequantize_int4(packed, scale, offset)
        assert torch.equal(got, expected), f"{kind}: max diff {(got - expected).abs().max()}"


def test_tokenizer_and_chat_template_come_from_the_file(
    gguf_files: dict, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from transformers import AutoTokenizer

    monkeypatch.setenv("PAGEDLLM_CACHE_DIR", str(tmp_path / "cache"))
    path = gguf_files["q4_0"]
    reference = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    texts = ["The quick brown fox", "def fibonacci(n):\n    return n", "你好 🚀"]
    for attempt in ("converted", "cached"):
        engine = Engine(str(path), device="cpu", block_size=8, num_kv_blocks=16)
        tok = engine.get_tokenizer()
        for text in texts:
            assert tok.encode(text) == reference.encode(text), (attempt, text)
        chat = tok.apply_chat_template(
            [{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False
        )
        assert chat == "<s>user\nhi</s>\n<s>assistant\n", attempt
        assert engine.eos_token_ids == frozenset({tok.convert_tokens_to_ids("</s>")})
        assert list((tmp_path / "cache" / "gguf-tokenizers").iterdir()), attempt


def test_add_bos_token_from_the_file_survives_the_tokenizer_cache(
    sources: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``tokenizer.ggml.add_bos_token`` decides whether a prompt string starts with BOS (as in
    llama.cpp; Llama 3 files say true), converted and from the cached ``tokenizer.json``."""
    monkeypatch.setenv("PAGEDLLM_CACHE_DIR", str(tmp_path / "cache"))
    for flag in (True, False):
        meta = {"tokenizer.ggml.add_bos_token": flag}
        path = write_gguf(sources["llama"], tmp_path / f"bos-{flag}.gguf", metadata=meta)
        for attempt in ("converted", "cached"):
            engine = Engine(str(path), device="cpu", block_size=8, num_kv_blocks=16)
            out = engine.generate(["hello world"], GREEDY, use_tqdm=False)[0]
            bos = engine.get_tokenizer().bos_token_id
            assert (out.prompt_token_ids[0] == bos) is flag, (flag, attempt)
            assert out.prompt_token_ids.count(bos) == int(flag), (flag, attempt)


def test_folder_with_one_gguf_loads(gguf_files: dict, tmp_path: Path) -> None:
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "model.gguf").symlink_to(gguf_files["q4_0"])
    assert engine_greedy(folder) == engine_greedy(gguf_files["q4_0"])
    (folder / "other.gguf").symlink_to(gguf_files["q8_0"])
    with pytest.raises(ValueError, match="several GGUF files"):
        Engine(str(folder), device="cpu")


def _rewrite(src: Path, dst: Path, edit: object) -> Path:
    data = bytearray(src.read_bytes())
    edit(data)  # type: ignore[operator]
    dst.write_bytes(bytes(data))
    return dst


def test_bad_files_fail_at_start_with_one_line(
    gguf_files: dict, sources: dict[str, Path], tmp_path: Path
) -> None:
    good = gguf_files["q4_0"]
    size = good.stat().st_size
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(good.read_bytes()[: size - 1000])
    bad_magic = _rewrite(good, tmp_path / "magic.gguf", lambda d: d.__setitem__(0, ord("X")))
    no_tokenizer = write_gguf(sources["llama"], tmp_path / "notok.gguf", with_tokenizer=False)
    unknown_arch = write_gguf(sources["llama"], tmp_path / "arch.gguf", arch="bloom")
    unknown_type = write_gguf(sources["wide"], tmp_path / "fp4.gguf", recipe={"attn_q": "NVFP4"})
    zero_cap = build_family(tmp_path / "gemma2-zero", "gemma2", attn_logit_softcapping=0.0)
    zero_cap = write_gguf(zero_cap, tmp_path / "cap.gguf")
    cases = [
        (truncated, "truncated"),
        (bad_magic, "not a readable GGUF file"),
        (no_tokenizer, "tokenizer.ggml.tokens is missing"),
        (unknown_arch, "general.architecture 'bloom' is not supported"),
        (unknown_type, "blk.0.attn_q.weight' has type NVFP4"),
        (zero_cap, "gemma2.attn_logit_softcapping must be > 0, got 0.0"),
    ]
    assert_refused_in_one_line(cases)
    # A tokenizer given separately makes the tokenizer-less file usable.
    engine = Engine(
        str(no_tokenizer), device="cpu", tokenizer=str(sources["llama"]), num_kv_blocks=16
    )
    assert engine.generate("The quick", SamplingParams(max_tokens=2), use_tqdm=False)


def test_lora_adapter_over_a_quantised_gguf_base_matches_peft(
    gguf_files: dict, sources: dict[str, Path], tmp_path: Path
) -> None:
    """An adapter trained for the original model, served over its Q4_0 GGUF: the reference is
    PEFT over the GGUF as transformers dequantises it (saved back as a model folder)."""
    from safetensors.torch import save_model
    from transformers import AutoModelForCausalLM

    from pagedllm.lora import LoRARequest
    from tests.lora.adapters import ATTN, MLP, make_adapter, peft_greedy

    path = gguf_files["q4_0"]
    adapter = make_adapter(sources["llama"], tmp_path / "adapter", rank=8, targets=ATTN + MLP)
    dequantised = tmp_path / "dequantised"
    dequantised.mkdir()
    model = AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    )
    # transformers will not save_pretrained a model it read from GGUF: write it by hand.
    config = model.config.to_dict()
    config.pop("quantization_config", None)
    (dequantised / "config.json").write_text(json.dumps(config))
    save_model(model, str(dequantised / "model.safetensors"))
    engine = Engine(
        str(path),
        device="cpu",
        dtype="float32",
        block_size=8,
        num_kv_blocks=64,
        enable_lora=True,
        max_lora_rank=8,
    )
    lora = LoRARequest("a", 1, str(adapter))
    outs = engine.generate(
        [{"prompt_token_ids": p} for p in PROMPTS], GREEDY, lora_request=lora, use_tqdm=False
    )
    ref = peft_greedy(dequantised, adapter, PROMPTS, MAX_NEW)
    for i, (o, r) in enumerate(zip(outs, ref, strict=True)):
        assert_greedy_match(list(o.outputs[0].token_ids), r, f"lora over q4_0 prompt {i}")
    assert [list(o.outputs[0].token_ids) for o in outs] != engine_greedy(path)


def test_devices_without_group_kernels_get_every_layer_dequantised(gguf_files: dict) -> None:
    """GPU and XPU run no group-wise GEMM (their ``kernel("linear")`` claims no format): the loader
    dequantises every layer to the compute dtype, to the same function."""
    from tests.conftest import load_on_reference

    path = gguf_files["q4_1+q8_0"]
    dense = load_on_reference(path, torch.float32, native_formats=frozenset())
    kept = load_on_reference(path, torch.float32, native_formats=frozenset({"int4", "q8_0"}))
    layers = [m for m in dense.modules() if hasattr(m, "quant_method")]
    assert layers and all(m.quant_method is None for m in layers)
    x, h = torch.randn(3, 64), torch.randn(3, 128)
    down_dense, down_kept = dense.layers[0].mlp.down_proj, kept.layers[0].mlp.down_proj
    assert down_kept.quant_method.name == "q8_0"
    torch.testing.assert_close(down_dense(h), down_kept(h), rtol=1e-5, atol=1e-5)
    qkv_dense, qkv_kept = dense.layers[1].self_attn.qkv_proj, kept.layers[1].self_attn.qkv_proj
    torch.testing.assert_close(qkv_dense(x), qkv_kept(x), rtol=1e-5, atol=1e-5)
    # Q6_K: dequantised at load without the format, kept (the PyTorch definition here) with it.
    path = gguf_files["q6_k"]
    dense = load_on_reference(path, torch.float32, native_formats=frozenset({"int4", "q8_0"}))
    kept = load_on_reference(path, torch.float32, native_formats=frozenset({"q6_k"}))
    qkv_dense, qkv_kept = dense.layers[0].self_attn.qkv_proj, kept.layers[0].self_attn.qkv_proj
    assert qkv_dense.quant_method is None and qkv_kept.quant_method.name == "q6_k"
    x = torch.randn(3, 256)
    torch.testing.assert_close(qkv_dense(x), qkv_kept(x), rtol=1e-5, atol=1e-5)


def test_rope_scaling_from_the_metadata(tmp_path: Path) -> None:
    """``llama.rope.scaling.*`` (linear) reaches the rotary tables: the file answers as the
    Hugging Face model with the same ``rope_scaling`` does, and differently from one without."""
    scaled = build_model(
        tmp_path / "scaled", "llama", rope_scaling={"rope_type": "linear", "factor": 4.0}
    )
    meta = {"llama.rope.scaling.type": "linear", "llama.rope.scaling.factor": 4.0}
    path = write_gguf(scaled, tmp_path / "scaled.gguf", metadata=meta)
    ours = engine_greedy(path)
    ref = hf_greedy(scaled, PROMPTS, MAX_NEW)
    for i, (o, r) in enumerate(zip(ours, ref, strict=True)):
        assert_greedy_match(o, r, f"linear rope prompt {i}")
    assert ours != engine_greedy(write_gguf(scaled, tmp_path / "plain.gguf"))


def test_llama3_rope_frequency_factors(tmp_path: Path) -> None:
    """Llama 3's scaling travels as a ``rope_freqs`` tensor (transformers' GGUF loading drops
    it; llama.cpp divides the frequencies by it): the file answers as the Hugging Face model
    with ``rope_type: llama3`` does."""
    rope = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    }
    scaled = build_model(tmp_path / "llama3", "llama", rope_scaling=rope)
    path = write_gguf(scaled, tmp_path / "llama3.gguf")
    ours = engine_greedy(path)
    for i, (o, r) in enumerate(zip(ours, hf_greedy(scaled, PROMPTS, MAX_NEW), strict=True)):
        assert_greedy_match(o, r, f"llama3 rope prompt {i}")
    plain = build_model(tmp_path / "plain", "llama")  # same seed and weights, plain rope
    assert ours != engine_greedy(write_gguf(plain, tmp_path / "plain.gguf"))

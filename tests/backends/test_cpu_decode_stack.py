"""The decode stack (backends/cpu/decode_stack.py, csrc/decode_stack.cpp): decode steps of a
group-wise packed Llama-shaped model through every layer in one C++ call, against the layer
loop it replaces (``PAGEDLLM_DECODE_STACK=0``, the reference).

The stack calls the kernels the layers call, in their order, so the logits of every step are
the layer loop's bit for bit (asserted exactly), and greedy tokens equal token for token: batch
1 and batch 4 of different lengths, float32 and bfloat16, Q4_0 / Q4_1 + Q8_0 / Q8_0 / Q4_K
files, Qwen2's q/k/v bias, fused layers whose parts keep their own formats (Q4_K q/k with a Q6_K
v, Q4_K gate with a Q8_0 up). Prefill steps and models it does not cover run the layer loop.
Where the ends are plain (every file here: a tied head's rows, an untied group-wise table's own
panels, or an F16 table beside an untied head) the stack runs decode steps from token ids to
logits (``fast_decode_logits``), and the model runner's decode step samples them: sampled rows
and logprobs too equal the layer loop's.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from pagedllm import Engine, SamplingParams
from pagedllm.backends.cpu import dense_gemm
from tests.conftest import build_model
from tests.models.gguf_files import write_gguf

pytestmark = pytest.mark.skipif(
    shutil.which("c++") is None or shutil.which("ninja") is None,
    reason="no C++ toolchain (c++ and ninja) to build the CPU kernels",
)

STEPS = 6
GREEDY = SamplingParams(max_tokens=STEPS, temperature=0.0, ignore_eos=True)
ONE = [[5, 17, 99, 3, 44, 12, 7]]
FOUR = [[5, 17, 99, 3, 44, 12, 7], [7, 8, 9], list(range(20, 45)), [300, 12, 150, 151, 152]]

# name -> (types by GGUF tensor kind, type of every other 2-D tensor, source model)
FILES: dict[str, tuple[dict[str, str], str, str]] = {
    "q4_0": ({}, "Q4_0", "llama"),
    "q4_1+q8_0": ({"ffn_down": "Q8_0", "token_embd": "Q8_0"}, "Q4_1", "llama"),
    "q8_0": ({}, "Q8_0", "llama"),
    "q4_k": ({}, "Q4_K", "wide"),
    "qwen2-q4_0": ({"token_embd": "Q8_0"}, "Q4_0", "qwen2"),
    # An untied Q4_0 head beside a dense (F16) embedding table: the stack's table look-up.
    "untied-f16-embd": ({"token_embd": "F16"}, "Q4_0", "untied"),
    # An untied head beside a group-wise table (as the 1B Llama-shaped files): the table's
    # rows read back from its own panels.
    "untied-q8_0-embd": ({"token_embd": "Q8_0"}, "Q4_0", "untied"),
    "untied-q4_0-embd": ({}, "Q4_0", "untied"),
    # q/k Q4_K with a Q6_K v (as a Q4_K_M file), gate Q4_K with a Q8_0 up: fused layers of two
    # formats, each part its own GEMM into its columns.
    "mixed": ({"attn_v": "Q6_K", "ffn_up": "Q8_0"}, "Q4_K", "wide"),
    # A Q6_K down projection beside Q4_K layers (as half a Q4_K_M file's layers).
    "q6_k-down": ({"ffn_down": "Q6_K"}, "Q4_K", "wide"),
    # IQ4_XS layers (q8_0 ones of the IQ4 levels, packed at 4 bits), an IQ4_NL down.
    "iq4": ({"ffn_down": "IQ4_NL"}, "IQ4_XS", "wide"),
    # A part that is not group-wise packed (F16 v), which the stack does not take.
    "mixed-dense": ({"attn_v": "F16"}, "Q4_K", "wide"),
}


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("decode-stack")
    wide = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4)
    sources = {
        "llama": build_model(root / "llama", "llama"),
        "wide": build_model(root / "wide", "llama", **wide),
        "qwen2": build_model(root / "qwen2", "qwen2"),
        "untied": build_model(root / "untied", "llama", tie_word_embeddings=False),
    }
    return {
        name: write_gguf(sources[src], root / f"{name}.gguf", recipe=recipe, default=default)
        for name, (recipe, default, src) in FILES.items()
    }


def run(
    path: Path,
    prompts: list[list[int]],
    dtype: str,
    monkeypatch: pytest.MonkeyPatch,
    *,
    stack: bool,
    params: SamplingParams = GREEDY,
    int8_activations: bool = False,
) -> tuple[list[list[int]], list[torch.Tensor], Engine]:
    """Tokens, the logits of every greedy step (as the sampler's greedy path receives them, or
    as the stack's whole decode step returns them), and the engine (blocks checked free)."""
    monkeypatch.setenv("PAGEDLLM_DECODE_STACK", "1" if stack else "0")
    engine = Engine(
        str(path),
        device="cpu",
        dtype=dtype,
        block_size=8,
        num_kv_blocks=64,
        int8_activations=int8_activations,
    )
    runner = engine.executor.worker.runner
    sampler, model = runner.sampler, runner.model
    logits: list[torch.Tensor] = []
    greedy, whole = sampler.greedy, model.fast_decode_logits

    def recorded(out: torch.Tensor):
        logits.append(out.detach().clone())
        return greedy(out)

    def recorded_whole(*args):
        done = whole(*args)
        if done is not None:
            logits.append(done[0].detach().clone())
        return done

    sampler.greedy = recorded
    if whole is not None:
        model.fast_decode_logits = recorded_whole
    outs = engine.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    manager = engine.block_manager
    assert manager.get_num_free_device_blocks() == manager.num_device_blocks
    return [list(o.outputs[0].token_ids) for o in outs], logits, engine


def count_stack_steps(engine: Engine) -> list[int]:
    """Wraps the model's ``fast_decode_logits``; the list fills with each step's sequences."""
    model = engine.executor.worker.runner.model
    fast, seen = model.fast_decode_logits, []
    assert fast is not None

    def counted(token_ids, *args):
        seen.append(len(token_ids))
        return fast(token_ids, *args)

    model.fast_decode_logits = counted
    return seen


def count_layer_steps(engine: Engine) -> list[int]:
    """Wraps the model's ``fast_decode`` (the layers alone); fills with each step's queries."""
    model = engine.executor.worker.runner.model
    fast, seen = model.fast_decode, []
    assert fast is not None

    def counted(hidden, positions, kv_caches, meta):
        seen.append(meta.max_query_len)
        return fast(hidden, positions, kv_caches, meta)

    model.fast_decode = counted
    return seen


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize(
    "name", ["q4_0", "q4_1+q8_0", "q8_0", "q4_k", "qwen2-q4_0", "mixed", "iq4"]
)
@pytest.mark.parametrize("prompts", [ONE, FOUR], ids=["batch1", "batch4"])
def test_stack_equals_the_layer_loop(
    files: dict[str, Path],
    name: str,
    dtype: str,
    prompts: list[list[int]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    ref_tokens, ref_logits, ref = run(files[name], prompts, dtype, monkeypatch, stack=False)
    assert ref.executor.worker.runner.model.fast_decode is None
    assert "decode_stack" not in ref.executor.worker.backend.layer_kernels
    tokens, logits, engine = run(files[name], prompts, dtype, monkeypatch, stack=True)
    assert "decode_stack: cpp x2 layers" in engine.executor.worker.backend.layer_kernels
    if name == "mixed":  # both fused layers of two formats, each part its own GEMM
        path = engine.executor.collective_rpc("linear_path")[0]
        assert "QKVParallelLinear=cpp-mixed(int4,int4,q6_k)-" in path, path
        assert "ColumnParallelLinear=cpp-mixed(int4,q8_0)-" in path, path
    if name == "iq4":  # the levels at 4 bits, in the stack
        path = engine.executor.collective_rpc("linear_path")[0]
        assert "QKVParallelLinear=cpp-iq4-" in path and "RowParallelLinear=cpp-iq4-" in path, path
    assert tokens == ref_tokens
    assert all(len(t) == STEPS for t in tokens)
    # Same kernels, same order: the logits of every step are equal, not merely close.
    assert len(logits) == len(ref_logits)
    for ours, theirs in zip(logits, ref_logits, strict=True):
        torch.testing.assert_close(ours, theirs, rtol=0, atol=0)


@pytest.mark.parametrize("name", ["q4_0", "q8_0", "mixed", "q6_k-down"])
def test_the_dot_flag_reaches_the_layers_whose_own_gemm_takes_it(
    files: dict[str, Path], name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Under ``int8_activations`` the step's one dot flag reaches each layer (and each part of
    a fused one) where its own GEMM takes the dot path: the 4-bit parts round x to int8, the
    8-bit ones too unless the build runs the int16 tiles (``takes_dot``: then a Q8_0 file's
    layers, a Q6_K down projection or the mixed file's Q6_K v keep the int16 kernels). The
    stack still covers every file, and its logits equal the layer loop's bit for bit."""
    prompts = FOUR
    ref_tokens, ref_logits, ref = run(
        files[name], prompts, "bfloat16", monkeypatch, stack=False, int8_activations=True
    )
    if ref.executor.worker.dtype != torch.bfloat16:  # type: ignore[attr-defined]
        pytest.skip("this processor computes a bf16 checkpoint in float32")
    tokens, logits, engine = run(
        files[name], prompts, "bfloat16", monkeypatch, stack=True, int8_activations=True
    )
    assert "decode_stack: cpp x2 layers" in engine.executor.worker.backend.layer_kernels
    path = engine.executor.collective_rpc("linear_path")[0]
    eight_bit_off = name == "q8_0" and dense_gemm.gemm_ops().groupwise_int16_tiles_from()
    assert ("+dot" in path) is not eight_bit_off, path
    assert tokens == ref_tokens
    assert len(logits) == len(ref_logits)
    for ours, theirs in zip(logits, ref_logits, strict=True):
        torch.testing.assert_close(ours, theirs, rtol=0, atol=0)


def test_only_decode_steps_take_the_stack(
    files: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PAGEDLLM_DECODE_STACK", "1")
    engine = Engine(str(files["q4_0"]), device="cpu", dtype="float32", num_kv_blocks=64)
    seen = count_stack_steps(engine)
    layers_only = count_layer_steps(engine)
    engine.generate([{"prompt_token_ids": p} for p in FOUR], GREEDY, use_tqdm=False)
    # Four prompts' prefill (one step, the layer loop), then STEPS - 1 decode-only steps of
    # the four, each from the lists to logits in the stack; forward()'s layers-only call unused.
    assert seen == [4] * (STEPS - 1)
    assert layers_only == []


@pytest.mark.parametrize(
    "name", ["q4_1+q8_0", "untied-f16-embd", "untied-q8_0-embd", "untied-q4_0-embd"]
)
def test_the_ends_join_the_stack(files: dict[str, Path], name: str, monkeypatch) -> None:
    """A tied head's rows (Q8_0 panels), an untied table's rows (its own Q8_0 or Q4_0 panels)
    or a dense table, the final norm and the head run in the stack's call; the logits every
    decode step samples equal the layer loop's."""
    ref_tokens, ref_logits, _ = run(files[name], FOUR, "bfloat16", monkeypatch, stack=False)
    tokens, logits, engine = run(files[name], FOUR, "bfloat16", monkeypatch, stack=True)
    kernels = engine.executor.worker.backend.layer_kernels
    assert "+ embedding, norm, head" in kernels, kernels
    assert engine.executor.worker.runner.model.fast_decode_logits is not None
    assert tokens == ref_tokens
    for ours, theirs in zip(logits, ref_logits, strict=True):
        torch.testing.assert_close(ours, theirs, rtol=0, atol=0)


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(max_tokens=STEPS, temperature=0.9, top_p=0.9, seed=11, logprobs=2),
        SamplingParams(max_tokens=STEPS, temperature=0.0, repetition_penalty=1.3),
    ],
    ids=["sampled-logprobs", "greedy-penalty"],
)
def test_decode_steps_that_are_not_plain_greedy(
    files: dict[str, Path], params: SamplingParams, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rows the runner's decode step hands to the full sampler: the same tokens and logprobs."""

    def generate(stack: bool) -> list[tuple[list[int], list]]:
        monkeypatch.setenv("PAGEDLLM_DECODE_STACK", "1" if stack else "0")
        engine = Engine(str(files["q4_0"]), device="cpu", dtype="float32", num_kv_blocks=64)
        seen = count_stack_steps(engine) if stack else []
        outs = engine.generate([{"prompt_token_ids": p} for p in FOUR], params, use_tqdm=False)
        assert len(seen) == (STEPS - 1 if stack else 0)
        return [(list(o.outputs[0].token_ids), o.outputs[0].logprobs) for o in outs]

    assert generate(True) == generate(False)


@pytest.mark.parametrize("name", ["mixed-dense"])
def test_a_model_it_does_not_cover_keeps_the_layer_loop(
    files: dict[str, Path], name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    tokens, _, engine = run(files[name], FOUR, "float32", monkeypatch, stack=True)
    assert engine.executor.worker.runner.model.fast_decode is None
    assert "decode_stack" not in engine.executor.worker.backend.layer_kernels
    ref_tokens, _, _ = run(files[name], FOUR, "float32", monkeypatch, stack=False)
    assert tokens == ref_tokens


def test_other_families_are_not_covered() -> None:
    """A relative that changes a layer (Qwen3's q/k norms, Gemma's norm offset and GELU, Gemma
    2's caps) offers no layers; the plain shape (Phi-3, Mistral's window) does."""
    from pagedllm.backends.reference import ReferenceAttention
    from pagedllm.models.registry import resolve_model_class
    from tests.models.test_more_families import make_config

    attn = ReferenceAttention()
    for name, (arch, covered) in _ARCH.items():
        config = make_config(name, 128)
        model = resolve_model_class([arch])(config, attn_backend=attn)
        assert (model.decode_stack_layers() is not None) == covered, name


_ARCH = {
    "phi3": ("Phi3ForCausalLM", True),
    "mistral_window": ("MistralForCausalLM", True),
    "qwen3": ("Qwen3ForCausalLM", False),
    "gemma": ("GemmaForCausalLM", False),
    "gemma2": ("Gemma2ForCausalLM", False),
}

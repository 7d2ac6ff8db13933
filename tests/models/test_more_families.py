"""OPT, GPT-2, Phi, Phi-3, Gemma 1-3, Qwen3 and sliding-window Mistral equal transformers.

Each family is a tiny random model (hidden 64, 2 layers) saved with ``save_pretrained`` and run
through the whole engine on a mixed batch of prompts; greedy tokens must equal transformers'
(``assert_greedy_match``) and first-step logprobs agree within 1e-4. Unlike the shared
``build_model``, 1-d parameters (biases, norm weights) are randomised too, so a bias loaded into
the wrong place, or a Gemma norm missing its ``1 +``, changes the tokens.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from pagedllm import Engine, SamplingParams
from pagedllm.models.checkpoint import CheckpointError
from pagedllm.models.registry import resolve_model_class, supported_architectures
from tests.conftest import PROMPTS, build_tokenizer
from tests.hf_reference import assert_first_logprobs_close, assert_greedy_match, hf_greedy

MAX_NEW = 10
WINDOW = 8

# Gemma 2 and 3's shape: GQA, a query scale apart from head_dim, 3 layers whose windowed (0, 2)
# and global (1) attention alternate.
_GEMMA_2_3: dict[str, Any] = dict(
    hidden_size=64,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    query_pre_attn_scalar=24,
    intermediate_size=128,
    num_hidden_layers=3,
    sliding_window=WINDOW,
    hidden_activation="gelu_pytorch_tanh",
)

# name -> (transformers config class name, config fields, engine block size). Head sizes vary:
# 16, 32 (OPT-350m style with project_in/out), 8 (GPT-2), 16 with 8 rotary dims (Phi),
# 16 with 12 rotary dims and GQA (Phi-3), 32 with q wider than hidden (Gemma), 16 (Qwen3).
FAMILIES: dict[str, tuple[str, dict[str, Any], int]] = {
    "opt": (
        "OPTConfig",
        dict(
            hidden_size=64,
            num_attention_heads=4,
            ffn_dim=128,
            num_hidden_layers=2,
            do_layer_norm_before=True,
            word_embed_proj_dim=64,
        ),
        16,
    ),
    "opt350m": (
        "OPTConfig",
        dict(
            hidden_size=64,
            num_attention_heads=2,
            ffn_dim=96,
            num_hidden_layers=2,
            do_layer_norm_before=False,
            word_embed_proj_dim=32,
        ),
        8,
    ),
    "gpt2": (
        "GPT2Config",
        dict(
            n_embd=64,
            n_head=8,
            n_layer=2,
            n_positions=512,
            activation_function="gelu_new",
        ),
        16,
    ),
    "phi": (
        "PhiConfig",
        dict(
            hidden_size=64,
            num_attention_heads=4,
            intermediate_size=128,
            num_hidden_layers=2,
            partial_rotary_factor=0.5,
            hidden_act="gelu_new",
        ),
        8,
    ),
    "phi3": (
        "Phi3Config",
        dict(
            hidden_size=64,
            num_attention_heads=4,
            num_key_value_heads=2,
            intermediate_size=96,
            num_hidden_layers=2,
            partial_rotary_factor=0.75,
            tie_word_embeddings=False,
        ),
        16,
    ),
    "gemma": (
        "GemmaConfig",
        dict(
            hidden_size=64,
            num_attention_heads=4,
            num_key_value_heads=1,
            head_dim=32,
            intermediate_size=128,
            num_hidden_layers=2,
            hidden_act="gelu_pytorch_tanh",
        ),
        8,
    ),
    # Gemma 2 at caps small enough to bend random weights' scores and logits (the released
    # models use 50 and 30).
    "gemma2": (
        "Gemma2Config",
        dict(**_GEMMA_2_3, attn_logit_softcapping=1.5, final_logit_softcapping=4.0),
        8,
    ),
    # Gemma 3 (text): per-head q/k norms, local and global layers rotating at different bases
    # (the global ones linearly scaled, as on the 4B and up), no soft caps.
    "gemma3": (
        "Gemma3TextConfig",
        dict(
            **_GEMMA_2_3,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"],
            rope_parameters={
                "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
                "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
            },
        ),
        8,
    ),
    "qwen3": (
        "Qwen3Config",
        dict(
            hidden_size=64,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            intermediate_size=96,
            num_hidden_layers=2,
            tie_word_embeddings=True,
        ),
        16,
    ),
    "mistral_window": (
        "MistralConfig",
        dict(
            hidden_size=64,
            num_attention_heads=4,
            num_key_value_heads=2,
            intermediate_size=128,
            num_hidden_layers=2,
            sliding_window=WINDOW,
            tie_word_embeddings=False,
        ),
        8,
    ),
}


# Gemma 2 and 3 as a GGUF file can hold them: no key carries query_pre_attn_scalar, which
# llama.cpp (and our loader) take to be head_dim, as on every released size but the 27B.
GGUF_GEMMA2 = {"query_pre_attn_scalar": FAMILIES["gemma2"][1]["head_dim"]}
# Nor any its layer pattern: llama.cpp's Gemma 3 is five local layers to one global.
GGUF_GEMMA3 = {
    "query_pre_attn_scalar": FAMILIES["gemma3"][1]["head_dim"],
    "num_hidden_layers": 6,
    "layer_types": None,
}


def make_config(name: str, vocab_size: int, **overrides: Any) -> Any:
    import transformers

    cls_name, fields, _ = FAMILIES[name]
    kwargs: dict[str, Any] = dict(
        vocab_size=vocab_size, bos_token_id=0, eos_token_id=1, pad_token_id=2
    )
    if cls_name != "GPT2Config":
        kwargs["max_position_embeddings"] = 512
    kwargs.update(fields)
    kwargs.update(overrides)
    return getattr(transformers, cls_name)(**kwargs)


def build_family(folder: Path, name: str, **overrides: Any) -> Path:
    from transformers import AutoModelForCausalLM

    folder.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(folder)
    config = make_config(name, len(tokenizer), **overrides)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.08)  # separate greedy choices, as build_model does
            else:
                p.add_(torch.randn_like(p), alpha=0.1)  # biases and norm weights count too
    model.save_pretrained(str(folder))
    return folder


@pytest.fixture(scope="module")
def family_paths(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("families")
    return {name: build_family(root / name, name) for name in FAMILIES}


def prompt_ids(path: Path) -> list[list[int]]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(path))
    return [tok.encode(p) for p in PROMPTS]


@pytest.mark.parametrize("name", list(FAMILIES))
def test_greedy_matches_transformers(family_paths: dict[str, Path], name: str) -> None:
    path = family_paths[name]
    ids = prompt_ids(path)
    refs = hf_greedy(path, ids, MAX_NEW)
    block_size = FAMILIES[name][2]
    engine = Engine(str(path), device="cpu", dtype="float32", block_size=block_size)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, logprobs=5)
    outs = engine.generate([{"prompt_token_ids": i} for i in ids], params, use_tqdm=False)
    for i, (out, ref) in enumerate(zip(outs, refs, strict=True)):
        comp = out.outputs[0]
        label = f"{name}/bs{block_size} prompt {i}"
        assert_greedy_match(comp.token_ids, ref, label)
        assert_first_logprobs_close(comp.logprobs[0], ref, label)
    bm = engine.block_manager
    assert bm.get_num_free_device_blocks() == bm.num_device_blocks


def test_sliding_window_is_live_in_reference(family_paths: dict[str, Path]) -> None:
    """The Mistral comparison means something: transformers' output depends on the window.

    With the window removed the same weights must give different logits on a prompt longer than
    the window, and eager and sdpa attention (the reference's default) must agree with it on.
    """
    from transformers import AutoModelForCausalLM

    path = family_paths["mistral_window"]
    ids = max(prompt_ids(path), key=len)
    assert len(ids) > 2 * WINDOW, f"prompt of {len(ids)} tokens does not exceed the window"
    x = torch.tensor([ids])
    logits = {}
    for impl, window in (("sdpa", WINDOW), ("eager", WINDOW), ("sdpa", None)):
        model = AutoModelForCausalLM.from_pretrained(
            str(path), dtype=torch.float32, attn_implementation=impl, sliding_window=window
        ).eval()
        with torch.no_grad():
            logits[impl, window] = model(x).logits[0]  # [seq, vocab]
    windowed, eager, full = logits["sdpa", WINDOW], logits["eager", WINDOW], logits["sdpa", None]
    diff = (windowed - eager).abs().max().item()
    assert diff < 1e-4, f"eager and sdpa differ by {diff:.2e} with a sliding window"
    inside = (windowed[:WINDOW] - full[:WINDOW]).abs().max().item()
    outside = (windowed[WINDOW:] - full[WINDOW:]).abs().max().item()
    assert inside < 1e-4, f"positions inside the window differ by {inside:.2e}"
    assert outside > 1e-2, f"window has no effect past position {WINDOW} (max diff {outside:.2e})"


@pytest.mark.parametrize("attention", ["torch", "reference"])
@pytest.mark.parametrize("name", ["gemma2", "gemma3"])
def test_gemma_2_and_3_on_the_other_cpu_attention_backends(
    family_paths: dict[str, Path], name: str, attention: str
) -> None:
    """The soft cap and the per-layer windows through the PyTorch fallback and the oracle too
    (the C++ kernel is the default in test_greedy_matches_transformers)."""
    path = family_paths[name]
    ids = prompt_ids(path)
    refs = hf_greedy(path, ids, MAX_NEW)
    engine = Engine(
        str(path), device="cpu", dtype="float32", block_size=8, attention_backend=attention
    )
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW)
    outs = engine.generate([{"prompt_token_ids": i} for i in ids], params, use_tqdm=False)
    for i, (out, ref) in enumerate(zip(outs, refs, strict=True)):
        assert_greedy_match(out.outputs[0].token_ids, ref, f"{name}/{attention} prompt {i}")


def test_gemma2_caps_and_windows_are_live_in_reference(family_paths: dict[str, Path]) -> None:
    """The Gemma 2 comparison means something: transformers' logits change when either soft cap
    or the window is taken away, so an engine that ignored one would fail the greedy match."""
    assert_changes_logits(
        family_paths["gemma2"],
        dict(attn_logit_softcapping=None),
        dict(final_logit_softcapping=None),
        dict(sliding_window=1024),
    )


def assert_changes_logits(path: Path, *changes: dict[str, Any]) -> None:
    """Each config change moves transformers' logits on the longest prompt (longer than twice
    the window) by more than 1e-2."""
    from transformers import AutoModelForCausalLM

    ids = max(prompt_ids(path), key=len)
    assert len(ids) > 2 * WINDOW, f"prompt of {len(ids)} tokens does not exceed the window"
    x = torch.tensor([ids])

    def logits(**overrides: Any) -> torch.Tensor:
        model = AutoModelForCausalLM.from_pretrained(
            str(path), dtype=torch.float32, attn_implementation="eager", **overrides
        ).eval()
        with torch.no_grad():
            return model(x).logits[0]  # [seq, vocab]

    base = logits()
    for change in changes:
        diff = (logits(**change) - base).abs().max().item()
        assert diff > 1e-2, f"{change} leaves the reference's logits as they were ({diff:.2e})"


def test_gemma3_rope_kinds_and_windows_are_live_in_reference(
    family_paths: dict[str, Path],
) -> None:
    """The Gemma 3 comparison means something: transformers' logits change when the local
    layers rotate at the global base, when the global scaling goes, or when the window does."""
    rope = FAMILIES["gemma3"][1]["rope_parameters"]
    assert_changes_logits(
        family_paths["gemma3"],
        dict(rope_parameters={**rope, "sliding_attention": rope["full_attention"]}),
        dict(rope_parameters={**rope, "full_attention": rope["sliding_attention"]}),
        dict(sliding_window=1024),
    )


def build_gemma3_multimodal(folder: Path) -> Path:
    """A tiny ``Gemma3ForConditionalGeneration`` (a SigLIP tower of one layer before the
    family's gemma3 language model), saved as the hub holds Gemma 3 4B and up."""
    import transformers

    folder.mkdir(parents=True, exist_ok=True)
    vocab = len(build_tokenizer(folder))
    text = make_config("gemma3", vocab)
    vision = transformers.SiglipVisionConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        image_size=28,
        patch_size=14,
    )
    config = transformers.Gemma3Config(
        text_config=text.to_dict(),
        vision_config=vision.to_dict(),
        mm_tokens_per_image=4,
        boi_token_index=vocab - 3,
        eoi_token_index=vocab - 2,
        image_token_index=vocab - 1,
        pad_token_id=text.pad_token_id,  # what transformers' generate reads off the top
    )
    torch.manual_seed(0)
    model = transformers.Gemma3ForConditionalGeneration(config)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.08)
            else:
                p.add_(torch.randn_like(p), alpha=0.1)
    model.save_pretrained(str(folder))
    return folder


def test_gemma3_multimodal_checkpoint_serves_its_text(tmp_path: Path) -> None:
    """Gemma 3's 4B and up ship as Gemma3ForConditionalGeneration: the engine serves its
    language model (text prompts) with transformers' own multimodal class as the reference,
    the vision tower left unread."""
    from safetensors import safe_open

    path = build_gemma3_multimodal(tmp_path / "gemma3-mm")
    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        names = list(f.keys())
    assert any(n.startswith("vision_tower.") for n in names), names[:5]
    assert any(n.startswith("language_model.model.layers.") for n in names), names[:5]
    ids = prompt_ids(path)
    refs = hf_greedy(path, ids, MAX_NEW)
    engine = Engine(str(path), device="cpu", dtype="float32", block_size=8)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW)
    outs = engine.generate([{"prompt_token_ids": i} for i in ids], params, use_tqdm=False)
    for i, (out, ref) in enumerate(zip(outs, refs, strict=True)):
        assert_greedy_match(out.outputs[0].token_ids, ref, f"gemma3 multimodal prompt {i}")


@pytest.mark.parametrize(
    "field", ["query_pre_attn_scalar", "attn_logit_softcapping", "final_logit_softcapping"]
)
def test_gemma2_config_values_out_of_range_name_their_field(
    family_paths: dict[str, Path], field: str
) -> None:
    from pagedllm.backends.reference import ReferenceAttention
    from pagedllm.models.model_loader import load_hf_config

    config = load_hf_config(str(family_paths["gemma2"]))
    setattr(config, field, -4 if field == "query_pre_attn_scalar" else -4.0)  # typed fields
    with pytest.raises(ValueError, match=f"^{field}: must be a positive number"):
        resolve_model_class(config.architectures)(config, attn_backend=ReferenceAttention())


def test_unsupported_architecture_lists_supported() -> None:
    with pytest.raises(ValueError, match="not supported") as info:
        resolve_model_class(["BloomForCausalLM"])
    message = str(info.value)
    for arch in (
        "OPTForCausalLM",
        "GPT2LMHeadModel",
        "PhiForCausalLM",
        "Phi3ForCausalLM",
        "GemmaForCausalLM",
        "Gemma2ForCausalLM",
        "Gemma3ForCausalLM",
        "Qwen3ForCausalLM",
        "LlamaForCausalLM",
    ):
        assert arch in message and arch in supported_architectures(), message


def checkpoint(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(path / "model.safetensors"))


def fresh_model(path: Path) -> torch.nn.Module:
    from pagedllm.backends.reference import ReferenceAttention
    from pagedllm.models.model_loader import load_hf_config

    config = load_hf_config(str(path))
    cls = resolve_model_class(config.architectures)
    return cls(config, attn_backend=ReferenceAttention())


@pytest.mark.parametrize("name", ["gpt2", "phi3", "opt350m"])
def test_missing_tensor_names_what_is_missing(family_paths: dict[str, Path], name: str) -> None:
    weights = checkpoint(family_paths[name])
    dropped = sorted(n for n in weights if "layers.1." in n or ".h.1." in n)[0]
    del weights[dropped]
    with pytest.raises(CheckpointError, match="lacks weights"):
        fresh_model(family_paths[name]).load_weights(weights.items())


def test_fused_phi3_tensor_of_wrong_size_is_rejected(family_paths: dict[str, Path]) -> None:
    weights = checkpoint(family_paths["phi3"])
    key = next(n for n in weights if n.endswith("qkv_proj.weight"))
    weights[key] = weights[key][:-16]
    with pytest.raises(CheckpointError, match="qkv_proj"):
        fresh_model(family_paths["phi3"]).load_weights(weights.items())


def legacy_layout(name: str, weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Older hub layouts: GPT-2 without "transformer." and with its causal-mask buffers, OPT as
    saved from ``OPTModel`` ("decoder." prefix) with an explicit copy of the tied head."""
    if name == "gpt2":
        out = {k.removeprefix("transformer."): v for k, v in weights.items()}
        for i in range(2):
            out[f"h.{i}.attn.bias"] = torch.tril(torch.ones(1, 1, 512, 512))
            out[f"h.{i}.attn.masked_bias"] = torch.tensor(-1e4)
        return out
    out = {k.removeprefix("model."): v for k, v in weights.items()}
    out["lm_head.weight"] = out["decoder.embed_tokens.weight"].clone()
    return out


@pytest.mark.parametrize("name", ["gpt2", "opt"])
def test_legacy_checkpoint_layouts_load_the_same(family_paths: dict[str, Path], name: str) -> None:
    weights = checkpoint(family_paths[name])
    current, legacy = fresh_model(family_paths[name]), fresh_model(family_paths[name])
    current.load_weights(weights.items())
    legacy.load_weights(legacy_layout(name, weights).items())
    ours, theirs = current.state_dict(), legacy.state_dict()
    assert ours.keys() == theirs.keys()
    for key, value in ours.items():
        diff = (value - theirs[key]).abs().max().item()
        assert diff == 0.0, f"{name} {key}: legacy layout differs by {diff:.2e}"

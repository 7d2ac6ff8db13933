"""Tiny random-weight mixture-of-experts checkpoints for the MoE tests (and the benchmark's smoke).

Every family gets several experts; top-2 and top-4 routing, with and without a shared expert,
dense layers between sparse ones (``decoder_sparse_step`` / ``mlp_only_layers``) and both
``norm_topk_prob`` settings appear across the set. Weights are widened to N(0, 0.08) like the
other tiny models, and the routers to N(0, 0.3) so that routing decisions are not near-ties.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from tests.conftest import build_tokenizer

# name -> (transformers config class, fields, engine block size)
MOE_FAMILIES: dict[str, tuple[str, dict[str, Any], int]] = {
    # 8 experts, top-2, always renormalised, GQA 4:2
    "mixtral": (
        "MixtralConfig",
        dict(
            hidden_size=64,
            intermediate_size=96,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            num_local_experts=8,
            num_experts_per_tok=2,
            tie_word_embeddings=False,
        ),
        8,
    ),
    # 6 experts, top-4 not renormalised, shared expert, q/k/v bias
    "qwen2_moe": (
        "Qwen2MoeConfig",
        dict(
            hidden_size=64,
            intermediate_size=128,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=96,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            num_experts=6,
            num_experts_per_tok=4,
            norm_topk_prob=False,
            tie_word_embeddings=False,
        ),
        16,
    ),
    # 8 experts, top-4 renormalised, a dense first layer (mlp_only_layers), q/k norms per head
    "qwen3_moe": (
        "Qwen3MoeConfig",
        dict(
            hidden_size=64,
            intermediate_size=96,
            moe_intermediate_size=32,
            num_hidden_layers=3,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            num_experts=8,
            num_experts_per_tok=4,
            norm_topk_prob=True,
            mlp_only_layers=[0],
            tie_word_embeddings=True,
        ),
        8,
    ),
    # 8 experts, top-2 not renormalised, whole-projection q/k norms, clip_qkv
    "olmoe": (
        "OlmoeConfig",
        dict(
            hidden_size=64,
            intermediate_size=48,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=4,
            num_experts=8,
            num_experts_per_tok=2,
            norm_topk_prob=False,
            clip_qkv=3.0,
            tie_word_embeddings=False,
        ),
        16,
    ),
}


def make_moe_config(name: str, vocab_size: int, **overrides: Any) -> Any:
    import transformers

    cls_name, fields, _ = MOE_FAMILIES[name]
    kwargs: dict[str, Any] = dict(
        vocab_size=vocab_size,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=2,
        max_position_embeddings=512,
    )
    kwargs.update(fields)
    kwargs.update(overrides)
    return getattr(transformers, cls_name)(**kwargs)


def build_moe(
    folder: Path, name: str, dtype: torch.dtype = torch.float32, **overrides: Any
) -> Path:
    from transformers import AutoModelForCausalLM

    folder.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(folder)
    config = make_moe_config(name, len(tokenizer), **overrides)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if "norm" in pname:
                p.uniform_(0.8, 1.2)  # a norm loaded into the wrong place changes the tokens
            elif pname.endswith("gate.weight") and "proj" not in pname:
                p.normal_(0.0, 0.3)  # routers: decisive choices
            elif p.dim() > 1 or "bias" in pname:
                p.normal_(0.0, 0.08)
    model.to(dtype).save_pretrained(str(folder))
    return folder

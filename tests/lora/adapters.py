"""Random PEFT LoRA adapters over the tiny test models, made with peft itself and saved."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

ATTN = ["q_proj", "k_proj", "v_proj", "o_proj"]
MLP = ["gate_proj", "up_proj", "down_proj"]


def make_adapter(
    base: Path,
    folder: Path,
    *,
    rank: int,
    targets: list[str],
    alpha: float | None = None,
    use_rslora: bool = False,
    seed: int = 1,
    std: float = 0.1,
) -> Path:
    """``get_peft_model`` on the base with random A and B (PEFT starts B at zero), saved."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32)
    cfg = LoraConfig(
        r=rank,
        lora_alpha=alpha if alpha is not None else 2 * rank,
        target_modules=targets,
        use_rslora=use_rslora,
        lora_dropout=0.0,
    )
    peft_model = get_peft_model(model, cfg)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_A" in name or "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * std)
    peft_model.save_pretrained(str(folder))
    return folder


def peft_greedy(base: Path, adapter: Path | None, prompts: list[list[int]], n: int) -> list[Any]:
    """transformers (+ PEFT when ``adapter``) greedy outputs, as tests/hf_reference.HFGreedy."""
    from transformers import AutoModelForCausalLM

    from tests.hf_reference import HFGreedy

    model: Any = AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32)
    if adapter is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, str(adapter))
    model.eval()
    results = []
    with torch.no_grad():
        for ids in prompts:
            out = model.generate(
                input_ids=torch.tensor([ids]),
                max_new_tokens=n,
                do_sample=False,
                output_scores=True,
                return_dict_in_generate=True,
                pad_token_id=2,
            )
            gen = out.sequences[0, len(ids) :].tolist()
            lps = [torch.log_softmax(s[0].float(), dim=-1) for s in out.scores]
            results.append(HFGreedy(gen, lps))
    return results

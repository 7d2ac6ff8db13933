"""Greedy reference outputs from Hugging Face transformers, and the rule for comparing to them.

Random weights give flat logits, so two engines can legitimately pick different tokens where the
top two logits nearly tie. As vLLM's ``check_logprobs_close`` does, a divergence is accepted only
where transformers' own top-two margin at that step is below ``TIE_MARGIN``, and the engine's
token is one of those two; everything after an accepted divergence is not compared.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

TIE_MARGIN = 1e-4


@dataclass
class HFGreedy:
    token_ids: list[int]
    step_logprobs: list[torch.Tensor]  # [vocab] log_softmax of each step's logits


def hf_greedy(
    model_path: Path,
    prompts: list[list[int]],
    max_new_tokens: int,
    *,
    device: str = "cpu",
    dtype: str = "float32",
    gguf_file: str | None = None,
    config_from: Path | None = None,
) -> list[HFGreedy]:
    """transformers' greedy outputs; ``gguf_file``: the model is that file in ``model_path``
    (transformers dequantises it with ggml's ``gguf`` package); ``config_from``: a model folder
    whose config to use instead of the one transformers reads from the file (its GGUF reader
    leaves out the MoE families' expert sizes)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    extra: dict[str, object] = {} if gguf_file is None else {"gguf_file": gguf_file}
    if config_from is not None:
        extra["config"] = AutoConfig.from_pretrained(str(config_from))
    model = AutoModelForCausalLM.from_pretrained(
        str(model_path), dtype=getattr(torch, dtype), **extra
    )
    model = model.to(device).eval()
    results = []
    with torch.no_grad():
        for ids in prompts:
            out = model.generate(
                torch.tensor([ids], device=device),
                max_new_tokens=max_new_tokens,
                do_sample=False,
                output_scores=True,
                return_dict_in_generate=True,
                pad_token_id=model.config.pad_token_id,
            )
            gen = out.sequences[0, len(ids) :].tolist()
            lps = [torch.log_softmax(s[0].float(), dim=-1).cpu() for s in out.scores]
            results.append(HFGreedy(gen, lps))
    return results


def assert_greedy_match(
    ours: list[int], ref: HFGreedy, label: str, tie_margin: float = TIE_MARGIN
) -> None:
    """Token-for-token equality, except at a genuine near-tie in the reference."""
    n = min(len(ours), len(ref.token_ids))
    for i in range(n):
        if ours[i] == ref.token_ids[i]:
            continue
        top2 = ref.step_logprobs[i].topk(2)
        margin = float(top2.values[0] - top2.values[1])
        assert margin < tie_margin and ours[i] in top2.indices.tolist(), (
            f"{label}: token {i} differs (ours {ours[i]}, transformers {ref.token_ids[i]}), "
            f"top-2 margin {margin:.2e} is not a tie\n ours={ours}\n  ref={ref.token_ids}"
        )
        return
    assert len(ours) == len(ref.token_ids), (
        f"{label}: lengths differ: ours {len(ours)} vs transformers {len(ref.token_ids)}\n"
        f" ours={ours}\n  ref={ref.token_ids}"
    )


def assert_first_logprobs_close(
    ours: dict[int, float], ref: HFGreedy, label: str, atol: float = 1e-4
) -> None:
    diffs = {t: abs(v - float(ref.step_logprobs[0][t])) for t, v in ours.items()}
    worst = max(diffs.values())
    assert worst <= atol, f"{label}: first-step logprobs differ by {worst:.2e} (> {atol})"

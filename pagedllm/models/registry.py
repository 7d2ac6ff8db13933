"""Architecture name (``architectures`` in config.json) -> model class, imported lazily."""

from __future__ import annotations

from torch import nn

from pagedllm.lazy import load_object

_MODELS: dict[str, str] = {
    "LlamaForCausalLM": "pagedllm.models.llama:LlamaForCausalLM",
    "MistralForCausalLM": "pagedllm.models.llama:LlamaForCausalLM",
    "Qwen2ForCausalLM": "pagedllm.models.llama:LlamaForCausalLM",
    "Qwen3ForCausalLM": "pagedllm.models.qwen3:Qwen3ForCausalLM",
    "OPTForCausalLM": "pagedllm.models.opt:OPTForCausalLM",
    "GPT2LMHeadModel": "pagedllm.models.gpt2:GPT2LMHeadModel",
    "PhiForCausalLM": "pagedllm.models.phi:PhiForCausalLM",
    "Phi3ForCausalLM": "pagedllm.models.phi:Phi3ForCausalLM",
    "GemmaForCausalLM": "pagedllm.models.gemma:GemmaForCausalLM",
    "Gemma2ForCausalLM": "pagedllm.models.gemma2:Gemma2ForCausalLM",
    "Gemma3ForCausalLM": "pagedllm.models.gemma3:Gemma3ForCausalLM",
    "MixtralForCausalLM": "pagedllm.models.mixtral:MixtralForCausalLM",
    "Qwen2MoeForCausalLM": "pagedllm.models.qwen_moe:Qwen2MoeForCausalLM",
    "Qwen3MoeForCausalLM": "pagedllm.models.qwen_moe:Qwen3MoeForCausalLM",
    "OlmoeForCausalLM": "pagedllm.models.olmoe:OlmoeForCausalLM",
    # Pooling models (models/pooling.py): encoders as embedders and as cross-encoders.
    "BertModel": "pagedllm.models.bert:BertModel",
    "RobertaModel": "pagedllm.models.bert:RobertaModel",
    "XLMRobertaModel": "pagedllm.models.bert:RobertaModel",
    "BertForSequenceClassification": "pagedllm.models.bert:BertForSequenceClassification",
    "RobertaForSequenceClassification": "pagedllm.models.bert:RobertaForSequenceClassification",
    "XLMRobertaForSequenceClassification": (
        "pagedllm.models.bert:RobertaForSequenceClassification"
    ),
}


def supported_architectures() -> list[str]:
    return sorted(_MODELS)


def resolve_model_class(architectures: list[str] | None) -> type[nn.Module]:
    for arch in architectures or []:
        if arch in _MODELS:
            return load_object(_MODELS[arch])
    raise ValueError(
        f"architectures: {architectures} not supported; pagedllm runs "
        f"{', '.join(supported_architectures())} (remote code is never executed)"
    )

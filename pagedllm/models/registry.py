"""Architecture name (``architectures`` in config.json) -> model class, imported lazily; and the
task a checkpoint serves (generate, embed, classify)."""

from __future__ import annotations

from pathlib import Path

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
    # Bare decoders (no head): only embedders.
    "LlamaModel": "pagedllm.models.decoder_embedder:LlamaEmbeddingModel",
    "MistralModel": "pagedllm.models.decoder_embedder:LlamaEmbeddingModel",
    "Qwen2Model": "pagedllm.models.decoder_embedder:LlamaEmbeddingModel",
    "Qwen3Model": "pagedllm.models.decoder_embedder:Qwen3EmbeddingModel",
}
# Generative families that also run as embedders (``task="embed"``, or a sentence-transformers
# folder): Qwen3-Embedding's config says Qwen3ForCausalLM.
_EMBEDDERS: dict[str, str] = {
    "LlamaForCausalLM": "pagedllm.models.decoder_embedder:LlamaEmbeddingModel",
    "MistralForCausalLM": "pagedllm.models.decoder_embedder:LlamaEmbeddingModel",
    "Qwen2ForCausalLM": "pagedllm.models.decoder_embedder:LlamaEmbeddingModel",
    "Qwen3ForCausalLM": "pagedllm.models.decoder_embedder:Qwen3EmbeddingModel",
}
TASKS = ("generate", "embed", "classify")


def supported_architectures() -> list[str]:
    return sorted(_MODELS)


def resolve_model_class(
    architectures: list[str] | None, task: str | None = None
) -> type[nn.Module]:
    """The class of the first architecture we run; ``task`` (None: the class's own) picks an
    embedder over a generative family, and refuses a class that does not serve it."""
    if task is not None and task not in TASKS:
        raise ValueError(f"task: {task!r} is not one of {list(TASKS)}")
    for arch in architectures or []:
        if task == "embed" and arch in _EMBEDDERS:
            return load_object(_EMBEDDERS[arch])
        if arch in _MODELS:
            cls = load_object(_MODELS[arch])
            serves = getattr(cls, "task", "generate")
            if task is not None and task != serves:
                raise ValueError(f"task: {arch} serves {serves!r}, not {task!r}")
            return cls
    raise ValueError(
        f"architectures: {architectures} not supported; pagedllm runs "
        f"{', '.join(supported_architectures())} (remote code is never executed)"
    )


def model_task(architectures: list[str] | None, folder: str | Path | None = None) -> str:
    """The task a checkpoint serves when the user names none: its class's, else "embed" for a
    sentence-transformers folder (``modules.json``) over a family that embeds, else generate."""
    cls = resolve_model_class(architectures)
    task = getattr(cls, "task", "generate")
    if task != "generate" or folder is None or not (Path(folder) / "modules.json").is_file():
        return task
    return "embed" if any(a in _EMBEDDERS for a in architectures or []) else task

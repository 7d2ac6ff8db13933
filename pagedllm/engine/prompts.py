"""What a prompt is to the engine: the tokenizer that reads it, its token ids, and its EOS ids.

Shared by the one engine (``llm_engine.py``), the replicated one (``dp_engine.py``) and the
core-process client, which loads the same tokenizer on the server's side.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from pagedllm.core.sampling_params import SamplingParams
from pagedllm.engine.lora_registry import per_prompt_loras
from pagedllm.models.gguf.reader import gguf_path_of

logger = logging.getLogger(__name__)

PromptType = str | dict[str, Any] | list[int]


def load_tokenizer(path: str) -> Any:
    """The tokenizer of a model folder, or the one a GGUF file carries: pagedllm's own class
    (``tokenization/tokenizer.py``, no transformers import) where the folder's
    ``tokenizer.json`` and ``tokenizer_config.json`` are plain enough for it, else
    transformers' ``AutoTokenizer``; the log says which and why."""
    gguf_path = gguf_path_of(path)
    if gguf_path is not None:
        # Not through models.gguf.loading, which imports torch: a server's front process
        # loads this tokenizer too, and needs no torch.
        from pagedllm.models.gguf.reader import open_gguf
        from pagedllm.models.gguf.tokenizer import load_gguf_tokenizer

        return load_gguf_tokenizer(open_gguf(gguf_path))
    from pagedllm.tokenization.loading import NotPlain, load_plain_tokenizer

    try:
        tokenizer = load_plain_tokenizer(path)
    except NotPlain as why:
        logger.info("tokenizer: transformers' AutoTokenizer (%s)", why)
    else:
        logger.info("tokenizer: pagedllm's over the tokenizers library")
        return tokenizer
    from transformers import AutoTokenizer  # its auto mappings alone cost ~0.6 s

    try:
        return AutoTokenizer.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError) as exc:
        raise ValueError(f"tokenizer: cannot load a tokenizer from {path!r} ({exc})") from exc


def eos_ids_of(model: str, hf_config: Any, tokenizer: Any) -> set[int]:
    """EOS ids as transformers' generate sees them: generation_config first, then config."""
    ids: Any = None
    if (Path(model) / "generation_config.json").exists():
        from transformers import GenerationConfig

        ids = GenerationConfig.from_pretrained(model, local_files_only=True).eos_token_id
    if ids is None:
        ids = getattr(hf_config, "eos_token_id", None)
    if ids is None and tokenizer is not None:
        ids = tokenizer.eos_token_id
    if ids is None:
        return set()
    return {int(i) for i in ids} if isinstance(ids, (list, tuple)) else {int(ids)}


def batch_inputs(
    prompts: Any, sampling_params: Any, lora_request: Any
) -> tuple[list[Any], list[SamplingParams | None], list[Any]]:
    """``generate``'s arguments as one list each: a single prompt (text, a dict, or token ids)
    becomes a batch of one; one ``SamplingParams`` (or None: the model's defaults, which
    ``add_request`` fills in) and one adapter apply to all."""
    if isinstance(prompts, (str, dict)) or (
        isinstance(prompts, list) and prompts and isinstance(prompts[0], int)
    ):
        prompts = [prompts]
    prompts = list(prompts)
    if isinstance(sampling_params, list):
        if len(sampling_params) != len(prompts):
            raise ValueError("sampling_params: the list must be as long as prompts")
        params_list = sampling_params
    else:
        params_list = [sampling_params] * len(prompts)
    return prompts, params_list, per_prompt_loras(lora_request, len(prompts))


def tokenize_prompt(
    prompt: PromptType, tokenizer: Any, vocab_size: int
) -> tuple[str | None, list[int]]:
    """A prompt's text (None when given as ids) and token ids; a ValueError naming the field."""
    if tokenizer is None and not (
        isinstance(prompt, list) or (isinstance(prompt, dict) and "prompt_token_ids" in prompt)
    ):
        raise ValueError("prompt: token ids are required when skip_tokenizer_init is set")
    if isinstance(prompt, str):
        text, ids = prompt, tokenizer.encode(prompt)
    elif isinstance(prompt, dict) and "prompt_token_ids" in prompt:
        text, ids = prompt.get("prompt"), prompt["prompt_token_ids"]
    elif isinstance(prompt, dict) and isinstance(prompt.get("prompt"), str):
        text = prompt["prompt"]
        ids = tokenizer.encode(text)
    elif isinstance(prompt, list):
        text, ids = None, prompt
    else:
        raise ValueError("prompt: must be a string or {'prompt_token_ids': [...]}")
    if not isinstance(ids, list) or not all(
        isinstance(t, int) and not isinstance(t, bool) for t in ids
    ):
        raise ValueError("prompt_token_ids: must be a list of integers")
    if not ids:
        raise ValueError("prompt: must not be empty")
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(
            f"prompt_token_ids: token id {bad[0]} is outside the vocabulary [0, {vocab_size})"
        )
    return text, list(ids)

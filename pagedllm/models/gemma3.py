"""Google's Gemma 3, text only (``Gemma3ForCausalLM``: the 1B, and the language model of GGUF
files of every size): Gemma 2's layer (four norms, ``query_pre_attn_scalar``) with three
changes, all read from the config:

- q and k are normalised per head before the rotation, as Qwen3 does, by RMSNorms that scale
  by ``1 + weight`` like every Gemma norm;
- five local (``sliding_window``) layers to one global (``layer_types``), and the two kinds
  rotate at different bases: ``rope_parameters`` is keyed by layer type (local 10,000; global
  1,000,000, linearly scaled on the 4B and up), one table per kind;
- no soft caps (``attn_logit_softcapping`` and ``final_logit_softcapping`` are null on the
  released models; honoured where a config sets them).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch

from pagedllm.models.gemma2 import Gemma2Attention, Gemma2ForCausalLM
from pagedllm.models.qwen3 import Qwen3Attention


class Gemma3Attention(Qwen3Attention, Gemma2Attention):
    """Qwen3's q/k norms and forward over Gemma 2's scale and cap."""

    qk_norm_offset = 1.0


class Gemma3ForCausalLM(Gemma2ForCausalLM):
    """Also serves the text of ``Gemma3ForConditionalGeneration`` checkpoints (see
    ``model_loader.TEXT_PARTS``): their language model's tensors, renamed."""

    attention_cls = Gemma3Attention
    rope_per_layer_type = True

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return super().load_weights(language_model_weights(weights))


# A multimodal checkpoint's names (as the hub holds them, and transformers 5 saves them) of its
# language model's tensors, and the parts a text-only engine never reads.
_LANGUAGE_MODEL = {"language_model.model.": "model.", "language_model.lm_head.": "lm_head."}
_VISION = ("vision_tower.", "multi_modal_projector.")


def language_model_weights(
    weights: Iterable[tuple[str, torch.Tensor]],
) -> Iterator[tuple[str, torch.Tensor]]:
    """The tensors of a text checkpoint as they are; of a multimodal one, its language model's
    under the text model's names, the vision tower and projector dropped."""
    for name, tensor in weights:
        if name.startswith(_VISION):
            continue
        for prefix, text_prefix in _LANGUAGE_MODEL.items():
            if name.startswith(prefix):
                name = text_prefix + name[len(prefix) :]
                break
        yield name, tensor

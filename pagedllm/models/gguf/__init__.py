"""GGUF files (llama.cpp's format) as models: config, tokenizer and weights from one file.

``Engine("model.gguf")`` or a folder holding one ``.gguf`` (and no ``config.json``) loads
through here; see :mod:`.reader`, :mod:`.config`, :mod:`.weights` and :mod:`.tokenizer`.
"""

from __future__ import annotations

from pagedllm.models.gguf.reader import GGUFFile, gguf_path_of

__all__ = ["GGUFFile", "gguf_path_of"]

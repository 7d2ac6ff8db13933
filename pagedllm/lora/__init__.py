"""Multi-LoRA serving: adapters over one base model, mixed in one batch.

``LoRARequest`` (pure Python) names an adapter; ``adapter`` reads and checks PEFT folders;
``manager`` keeps adapters in a host LRU and device slots and builds each step's token mapping;
``ops`` holds the batched shrink/expand in PyTorch (CPU and XPU); the GPU backend brings a Triton
one. The layers that apply them are in ``pagedllm/layers/lora.py``.
"""

from pagedllm.lora.request import LoRARequest, parse_lora_module

__all__ = ["LoRARequest", "parse_lora_module"]

"""pagedllm: a high-throughput LLM inference and serving engine with a paged KV cache.

Heavy modules (torch, transformers, backends) load on first use, so ``import pagedllm`` is cheap
and works on any machine.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from pagedllm.config import prefer_huge_pages
from pagedllm.core.sampling_params import SamplingParams
from pagedllm.lora.request import LoRARequest
from pagedllm.outputs import CompletionOutput, RequestOutput

__version__ = "0.1.0"

prefer_huge_pages()  # before torch's first allocation in this process (see its docstring)

__all__ = [
    "AsyncEngine",
    "CompletionOutput",
    "Engine",
    "LLMEngine",
    "LoRARequest",
    "RequestOutput",
    "SamplingParams",
    "__version__",
]

if TYPE_CHECKING:
    from pagedllm.engine.async_engine import AsyncEngine
    from pagedllm.engine.factory import Engine
    from pagedllm.engine.llm_engine import LLMEngine


def __getattr__(name: str) -> Any:
    if name == "Engine":
        from pagedllm.engine.factory import Engine

        return Engine
    if name == "LLMEngine":
        from pagedllm.engine.llm_engine import LLMEngine

        return LLMEngine
    if name == "AsyncEngine":
        from pagedllm.engine.async_engine import AsyncEngine

        return AsyncEngine
    raise AttributeError(f"module 'pagedllm' has no attribute {name!r}")

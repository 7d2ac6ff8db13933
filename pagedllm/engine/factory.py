"""``pagedllm.Engine``: the front door that picks the one engine or the replicated one.

A factory rather than a class whose ``__new__`` returns another class: the caller gets either an
:class:`LLMEngine` or a :class:`DataParallelEngine`, both named in the return type, and neither
module needs to know the other (the one engine imported the replicated one to return it, which
closed an import cycle through the replicas' clients back to itself).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from pagedllm.engine.llm_engine import LLMEngine

if TYPE_CHECKING:  # imported when asked for: replicas need the engine-core channel (zmq,
    # msgspec), which an in-process engine does not (the xpu leg's environment lacks them)
    from pagedllm.engine.dp_engine import DataParallelEngine


# Named as the class it stood for, so that callers need not change.
def Engine(model: str, device: str = "auto", **engine_args: Any) -> LLMEngine | DataParallelEngine:
    """``Engine(model, device="auto", **engine_args)``: ``LLMEngine``'s arguments (see it).

    ``data_parallel_size`` N > 1 gives a :class:`DataParallelEngine` over N replicas; any other
    value is the one engine's to validate.
    """
    replicas = engine_args.get("data_parallel_size")
    if isinstance(replicas, int) and replicas > 1:
        from pagedllm.engine.dp_engine import DataParallelEngine

        return DataParallelEngine(model, device, **engine_args)
    return LLMEngine(model, device, **engine_args)

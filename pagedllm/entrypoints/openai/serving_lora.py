"""LoRA adapters over HTTP: ``/v1/models`` entries, and vLLM's load/unload routes.

The served adapters live in ``ModelInfo.adapters`` (name -> LoRARequest), which the completion
and chat handlers read to turn a request's ``model`` into its adapter. Loading reads the folder
on a thread of the server (the engine keeps stepping), then the engine checks it against the
model and packs it (``Engine.add_lora``) before the name is served, so a bad folder is a 400
naming the adapter and nothing changes. Runtime updates are refused (403) unless the server
was started with ``--enable-lora-runtime-updates``.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from typing import Any

from fastapi import APIRouter, Request
from pydantic import BaseModel

from pagedllm.entrypoints.openai.errors import APIError
from pagedllm.entrypoints.openai.running import engine_errors
from pagedllm.entrypoints.openai.serving_base import ModelInfo
from pagedllm.lora.request import LoRARequest

logger = logging.getLogger(__name__)


class LoadLoRARequest(BaseModel):
    lora_name: str
    lora_path: str


class UnloadLoRARequest(BaseModel):
    lora_name: str
    lora_int_id: int | None = None


def _engine_add_lora(request: LoRARequest, weights: Any, engine: Any) -> None:
    engine.add_lora(request, weights)


def _engine_remove_lora(lora_id: int, engine: Any) -> bool:
    return bool(engine.remove_lora(lora_id))


def adapter_entries(model: ModelInfo) -> list[dict[str, Any]]:
    """``/v1/models`` entries of the adapters: ``parent`` is the base model's served name."""
    return [
        {
            "id": name,
            "object": "model",
            "created": model.created,
            "owned_by": "pagedllm",
            "root": req.lora_path,
            "parent": model.name,
            "max_model_len": model.max_model_len,
            "sampling_defaults": dict(model.sampling_defaults),
        }
        for name, req in model.adapters.items()
    ]


async def load_adapter(engine: Any, model: ModelInfo, name: str, path: str) -> LoRARequest:
    """Read, check and serve an adapter under ``name`` (APIError 400 naming it when bad)."""
    if not name or name in model.names or name in model.adapters:
        raise APIError(
            f"lora {name!r}: the name is already served", param="lora_name", code="lora_exists"
        )
    next_id = max((r.lora_int_id for r in model.adapters.values()), default=0) + 1
    try:
        request = LoRARequest(name, next_id, path)
        # Read off the event loop and off the engine's thread: steps go on meanwhile, and the
        # engine only packs the tensors (its max_lora_rank is checked there).
        from pagedllm.lora.adapter import read_adapter  # torch: not among the server's imports

        weights = await asyncio.to_thread(read_adapter, name, path, max_rank=1 << 30)
        with engine_errors():
            await engine.call(functools.partial(_engine_add_lora, request, weights))
    except ValueError as exc:
        raise APIError(str(exc), param="lora_path", code="invalid_lora") from None
    model.adapters[name] = request
    logger.info("serving LoRA adapter %r (id %d) from %s", name, next_id, path)
    return request


def add_lora_routes(
    router: APIRouter, engine: Any, model: ModelInfo, *, runtime_updates: bool, body: Any
) -> None:
    """``POST /v1/load_lora_adapter`` and ``/v1/unload_lora_adapter`` (vLLM's shapes)."""

    def check_allowed() -> None:
        if not runtime_updates:
            raise APIError(
                "LoRA adapters cannot be loaded or unloaded at run time: start the server "
                "with --enable-lora-runtime-updates",
                status=403,
                type="permission_error",
                code="lora_runtime_updates_disabled",
            )

    @router.post("/load_lora_adapter")
    async def load_lora_adapter(request: Request) -> dict[str, Any]:
        check_allowed()
        req = await body(request, LoadLoRARequest)
        lora = await load_adapter(engine, model, req.lora_name, req.lora_path)
        return {"status": "ok", "lora_name": lora.lora_name, "lora_int_id": lora.lora_int_id}

    @router.post("/unload_lora_adapter")
    async def unload_lora_adapter(request: Request) -> dict[str, Any]:
        check_allowed()
        req = await body(request, UnloadLoRARequest)
        lora = model.adapters.get(req.lora_name)
        if lora is None:
            raise APIError(
                f"lora {req.lora_name!r}: no such adapter is served "
                f"(served: {sorted(model.adapters)})",
                status=404,
                param="lora_name",
                code="lora_not_found",
            )
        del model.adapters[req.lora_name]  # new requests stop finding it now
        with engine_errors():
            await engine.call(functools.partial(_engine_remove_lora, lora.lora_int_id))
        logger.info("unloaded LoRA adapter %r", req.lora_name)
        return {"status": "ok", "lora_name": req.lora_name}

"""The engine's side of multi-LoRA: which adapters exist, checked once before any request runs.

Adapters are read, checked and packed by every worker (``add_lora``) when first named, so a bad
folder, a rank above ``max_lora_rank`` or an adapter for another base model is a ValueError at
``add_request`` (naming the adapter) and never fails a step; steps only copy packed host
tensors into device slots.
"""

from __future__ import annotations

import hashlib
from typing import Any

from pagedllm.config import LoRAConfig
from pagedllm.lora.request import LoRARequest


class LoRARegistry:
    def __init__(self, config: LoRAConfig | None, executor: Any) -> None:
        self.config = config
        self.executor = executor
        self.known: dict[int, LoRARequest] = {}

    def ensure(self, request: LoRARequest | None) -> None:
        """Check a request's adapter, reading it on first use."""
        if request is None:
            return
        if not isinstance(request, LoRARequest):
            raise ValueError("lora_request: must be a LoRARequest")
        known = self.known.get(request.lora_int_id)
        if known == request:
            return
        self.add(request)

    def add(self, request: LoRARequest, weights: Any = None) -> None:
        """Every worker reads (or, given ``weights`` read elsewhere, only packs) the adapter."""
        if not isinstance(request, LoRARequest):
            raise ValueError("lora_request: must be a LoRARequest")
        if self.config is None:
            raise ValueError(
                f"lora {request.lora_name!r}: LoRA is not enabled (start with enable_lora=True)"
            )
        known = self.known.get(request.lora_int_id)
        if known is not None and known != request:
            raise ValueError(
                f"lora {request.lora_name!r}: id {request.lora_int_id} already names "
                f"{known.lora_name!r} ({known.lora_path})"
            )
        for other in self.known.values():
            if other.lora_name == request.lora_name and other != request:
                raise ValueError(
                    f"lora {request.lora_name!r}: the name is already loaded with id "
                    f"{other.lora_int_id} from {other.lora_path}"
                )
        errors = [e for e in self.executor.collective_rpc("add_lora", request, weights) if e]
        if errors:
            self.executor.collective_rpc("remove_lora", request.lora_int_id)
            raise ValueError(errors[0])
        self.known[request.lora_int_id] = request

    def remove(self, lora_id: int) -> bool:
        """Forget an adapter. Requests still running under it go on: a worker that meets it
        again reads it again from its folder."""
        if self.known.pop(lora_id, None) is None:
            return False
        self.executor.collective_rpc("remove_lora", lora_id)
        return True

    def list(self) -> list[LoRARequest]:
        return [self.known[i] for i in sorted(self.known)]


def lora_cache_root(request: LoRARequest | None, salt: bytes = b"") -> int | None:
    """The prefix cache's root key for a request's first block (None: the base model).

    ``salt`` is random per engine: an adapter's id and folder may hold other weights after a
    restart, so its blocks in the disk tier are never read by a later run.
    """
    if request is None:
        return None
    name = repr(("lora", request.lora_int_id, request.lora_path)).encode()
    return int.from_bytes(hashlib.blake2b(salt + name, digest_size=16).digest(), "little")


def per_prompt_loras(
    lora_request: LoRARequest | list[LoRARequest | None] | None, num_prompts: int
) -> list[LoRARequest | None]:
    if isinstance(lora_request, list):
        if len(lora_request) != num_prompts:
            raise ValueError("lora_request: the list must be as long as prompts")
        return list(lora_request)
    return [lora_request] * num_prompts

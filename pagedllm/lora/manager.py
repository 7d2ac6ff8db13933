"""Adapters on one worker: a host LRU (``max_cpu_loras``) behind an LRU of device slots.

``add`` reads, checks and packs an adapter into this rank's per-layer slot contents (host
memory); ``activate`` gives every adapter of a step a device slot, evicting the least recently
used adapter that the step does not need; ``set_step`` builds the step's token mapping. The
scheduler never lets a step need more than ``max_loras`` adapters.
"""

from __future__ import annotations

import dataclasses
import logging
from collections import OrderedDict
from typing import Any

import torch
from torch import nn

from pagedllm.core.interfaces import SchedulerOutput
from pagedllm.layers.lora import LoRAContext, LoRAKernel, LoRALinear, LoRAPart, wrap_linear_layers
from pagedllm.lora.adapter import AdapterWeights, read_adapter, resolve_target
from pagedllm.lora.ops import build_mapping
from pagedllm.lora.request import LoRARequest

logger = logging.getLogger(__name__)

# Per wrapped layer path: this rank's (A [slices*R, in], B [out, slices*R]) slot contents.
PackedAdapter = dict[str, tuple[torch.Tensor, torch.Tensor]]


class LoRAManager:
    def __init__(
        self,
        model: nn.Module,
        *,
        kernel: LoRAKernel,
        max_loras: int,
        max_lora_rank: int,
        max_cpu_loras: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.ctx = LoRAContext(kernel=kernel)
        self.layers: dict[str, LoRALinear] = wrap_linear_layers(
            model,
            ctx=self.ctx,
            max_loras=max_loras,
            max_rank=max_lora_rank,
            dtype=dtype,
            device=device,
        )
        self.max_lora_rank = max_lora_rank
        self.max_cpu_loras = max_cpu_loras
        self.device = device
        self.requests: dict[int, LoRARequest] = {}
        self.host: OrderedDict[int, PackedAdapter] = OrderedDict()  # id -> packed, LRU first
        self.slot_of: OrderedDict[int, int] = OrderedDict()  # id -> device slot, LRU first
        self.free_slots = list(range(max_loras))

    # -- host ----------------------------------------------------------------------------------
    def add(self, request: LoRARequest, weights: AdapterWeights | None = None) -> None:
        """Read, check and keep an adapter in host memory (ValueError naming it if bad).

        ``weights``: the adapter already read (off the engine's thread, by the server), so
        only the packing happens here.
        """
        known = self.requests.get(request.lora_int_id)
        if known is not None and known != request:
            raise ValueError(
                f"lora {request.lora_name!r}: id {request.lora_int_id} already names "
                f"{known.lora_name!r} ({known.lora_path})"
            )
        if request.lora_int_id in self.host:
            self.host.move_to_end(request.lora_int_id)
            return
        packed = self._pack(request, weights)
        self.requests[request.lora_int_id] = request
        self.host[request.lora_int_id] = packed
        while len(self.host) > self.max_cpu_loras:
            evicted, _ = self.host.popitem(last=False)
            logger.info("LoRA %d dropped from host memory (LRU)", evicted)

    def _pack(self, request: LoRARequest, weights: AdapterWeights | None) -> PackedAdapter:
        name = request.lora_name
        if weights is None:
            weights = read_adapter(name, request.lora_path, max_rank=self.max_lora_rank)
        elif weights.rank > self.max_lora_rank:
            raise ValueError(
                f"lora {name!r}: rank {weights.rank} exceeds max_lora_rank ({self.max_lora_rank})"
            )
        by_layer: dict[str, dict[int, LoRAPart]] = {}
        for module, (a, b, scale) in weights.modules.items():
            target = resolve_target(module, self.layers)
            if target is None:
                raise ValueError(
                    f"lora {name!r}: module {module!r} is not a linear layer of this model "
                    "(only attention and MLP projections take adapters)"
                )
            path, index = target
            layer = self.layers[path]
            slices = by_layer.setdefault(path, {})
            if index is not None:
                slices[index] = (a, b, scale)
                continue
            # The adapter covers the whole (possibly fused) layer: split B by the parts.
            rows = 0
            for i, size in enumerate(layer.full_sizes):
                slices[i] = (a, b[rows : rows + size], scale)
                rows += size
            if b.shape[0] != rows:
                raise ValueError(
                    f"lora {name!r}: module {module!r} has lora_B with {b.shape[0]} rows, "
                    f"the model's layer has {rows} (an adapter for another base model?)"
                )
        packed: PackedAdapter = {}
        for path, slices in by_layer.items():
            try:
                packed[path] = self.layers[path].pack(slices)
            except ValueError as exc:
                raise ValueError(
                    f"lora {name!r}: layer {path!r}: {exc} (an adapter for another base model?)"
                ) from exc
        return packed

    def remove(self, lora_id: int) -> bool:
        """Forget an adapter (host and device); False if it was not known."""
        known = self.requests.pop(lora_id, None) is not None
        self.host.pop(lora_id, None)
        slot = self.slot_of.pop(lora_id, None)
        if slot is not None:
            for layer in self.layers.values():
                layer.clear_slot(slot)
            self.free_slots.append(slot)
        return known

    def list_ids(self) -> list[int]:
        return sorted(self.requests)

    # -- device slots --------------------------------------------------------------------------
    def activate(self, requests: dict[int, Any]) -> dict[int, int]:
        """A device slot for each adapter id of the step (loading evicted ones again)."""
        for lora_id in requests:
            if lora_id in self.slot_of:
                self.slot_of.move_to_end(lora_id)
        for lora_id, request in requests.items():
            if lora_id not in self.slot_of:
                self._load_slot(lora_id, request, keep=set(requests))
        return {i: self.slot_of[i] for i in requests}

    def _load_slot(self, lora_id: int, request: Any, keep: set[int]) -> None:
        if lora_id not in self.host:
            self.add(request)  # dropped from host memory (or first seen on this rank)
        self.host.move_to_end(lora_id)
        if not self.free_slots:
            victim = next((i for i in self.slot_of if i not in keep), None)
            if victim is None:
                raise RuntimeError("lora: a step needs more adapters than max_loras slots")
            self.free_slots.append(self.slot_of.pop(victim))
        slot = self.free_slots.pop(0)
        packed = self.host[lora_id]
        for path, layer in self.layers.items():
            if path in packed:
                layer.load_slot(slot, *packed[path])
            else:
                layer.clear_slot(slot)
        self.slot_of[lora_id] = slot
        logger.debug("LoRA %d loaded into slot %d", lora_id, slot)

    def prepare_step(self, sched_out: SchedulerOutput) -> SchedulerOutput:
        """Slots for the step's adapters, the step ordered by slot, and its mapping.

        Prefills stay first (the attention metadata wants them there): base prefills, then
        prefills by ascending slot; then decodes by ascending slot, then base decodes. So the
        adapter tokens form one run of the batch in slot order. Outputs are keyed by sequence
        id, so the order is the runner's own business.
        """
        seqs = sched_out.seqs
        ids = {s.lora_request.lora_int_id: s.lora_request for s in seqs if s.lora_request}
        if not ids:
            self.ctx.mapping = None
            return sched_out
        slots = self.activate(ids)

        def slot(s: Any) -> int:
            return -1 if s.lora_request is None else slots[s.lora_request.lora_int_id]

        n = sched_out.num_prefill_seqs
        prefills = sorted(seqs[:n], key=slot)
        decodes = sorted(seqs[n:], key=lambda s: slot(s) if s.lora_request else 1 << 30)
        ordered = prefills + decodes
        self.ctx.mapping = build_mapping(
            [slot(s) for s in ordered], [len(s.token_ids) for s in ordered], self.device
        )
        return dataclasses.replace(sched_out, seqs=ordered)

    def clear_step(self) -> None:
        self.ctx.mapping = None

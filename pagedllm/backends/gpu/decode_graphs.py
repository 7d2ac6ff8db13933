"""CUDA graphs for decode steps: the layer loop captured once per batch bucket, then replayed.

A decode step of a small batch on a GPU is bound by the host: every layer launches a dozen
kernels, each a Python call, and the GPU waits for them. Captured as a CUDA graph, the whole
stack of layers is one launch (vLLM's approach). The ``decode_stack / cuda_graph`` row's
installer puts :meth:`DecodeGraphs.step` into the model's ``fast_decode`` slot, the seam the
CPU's C++ decode stack fills, so the runner and worker know nothing of graphs.

A step of ``n`` sequences is padded to a bucket (``graph_inputs``); the first step at each
(bucket, context capacity, KV cache) warms the layers up and captures them, every later one
copies its inputs into the static buffers and replays. Captured at first use rather than at
start: nothing outside the installer has to know about them, at the price of one warm-up and
capture (tens of milliseconds) the first time a bucket is met. Every graph shares one memory
pool: only one runs at a time, and each one's outputs stay held, so no graph reuses them.

What it takes (``not_covered`` says why not, in the log): the whole model on one CUDA device
(no pipeline stage, no tensor parallelism: collectives are not captured here), no LoRA wrapper
(its per-step slot mapping is not a static input), no mixture-of-experts layer (its routing
reads counts back to the host), and the Triton attention kernels, whose use
of the metadata (grids from ``max_seq_len``, everything else read on the device) is the one
known to be capture-safe. An op that reads a tensor back to the host fails the capture; the
runner then logs why and runs every later step eagerly. ``enforce_eager`` turns it off.

The capture mechanism is a parameter (:class:`CudaGraphCapture`; :func:`eager_capture` runs the
same padded steps eagerly), so the padding is tested on the CPU under Triton's interpreter.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from pagedllm.backends.gpu.graph_inputs import (
    BATCH_BUCKETS,
    MAX_CAPACITY,
    MIN_CAPACITY,
    PaddedStep,
    StaticDecodeInputs,
    bucket_of,
    capacity_of,
)
from pagedllm.backends.kv_layout import AttentionMetadata

logger = logging.getLogger(__name__)

Outputs = tuple[torch.Tensor, torch.Tensor | None]  # the last layer's (hidden, residual)
StepFn = Callable[[], Outputs]
Capture = Callable[[StepFn], StepFn]  # a step on the static buffers -> its replay
LayersFn = Callable[
    [torch.Tensor, torch.Tensor, None, list[torch.Tensor], AttentionMetadata], Outputs
]
WARMUP_RUNS = 2  # Triton compiles, cuBLAS picks its kernels: none of that may happen in capture


def eager_capture(fn: StepFn) -> StepFn:
    """No capture: each "replay" runs the step again on the static buffers (CPU tests)."""
    return fn


class CudaGraphCapture:
    """Warm a step up on a side stream, capture it into a ``torch.cuda.CUDAGraph`` (one memory
    pool for every graph), and hand back its replay."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.pool = torch.cuda.graph_pool_handle()
        self.graphs: list[Any] = []  # held for their memory; counted in tests

    def __call__(self, fn: StepFn) -> StepFn:
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for _ in range(WARMUP_RUNS):
                fn()
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            out = fn()
        self.graphs.append(graph)

        def replay() -> Outputs:
            graph.replay()
            return out

        return replay


class DecodeGraphs:
    """The ``fast_decode`` of a model: decode steps padded to buckets and replayed."""

    def __init__(
        self,
        layers: LayersFn,
        capture: Capture,
        *,
        batch_buckets: Sequence[int] = BATCH_BUCKETS,
        min_capacity: int = MIN_CAPACITY,
        max_capacity: int = MAX_CAPACITY,
    ) -> None:
        self.layers = layers
        self.capture = capture
        self.batch_buckets = tuple(sorted(batch_buckets))
        self.min_capacity = min_capacity
        self.max_capacity = max_capacity
        self.inputs: StaticDecodeInputs | None = None
        # (bucket, capacity, first cache's address) -> its replay
        self.replays: dict[tuple[int, int, int], StepFn] = {}
        self.steps: dict[tuple[int, int], int] = {}  # (bucket, capacity) -> steps replayed
        self.broken: str | None = None  # why capture failed: every later step runs eagerly

    def _buffers(self, hidden: torch.Tensor, block_size: int) -> StaticDecodeInputs:
        if self.inputs is None or not self.inputs.fits(hidden, block_size):
            self.inputs = StaticDecodeInputs(
                self.batch_buckets[-1], self.max_capacity, block_size, hidden
            )
            self.replays.clear()  # they read the buffers that were replaced
        return self.inputs

    def step(
        self,
        hidden: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        meta: AttentionMetadata,
    ) -> Outputs | None:
        """The last layer's (hidden, residual) for the step's ``n`` rows; None where the step
        is not one a graph serves (the layer loop runs it)."""
        n = hidden.shape[0]
        if self.broken is not None or not kv_caches or meta.num_prefills or n == 0:
            return None
        batch = bucket_of(n, self.batch_buckets)
        capacity = capacity_of(meta.max_seq_len, self.min_capacity, self.max_capacity)
        if batch is None or capacity is None or meta.num_decode_tokens != n:
            return None
        inputs = self._buffers(hidden, meta.block_size)
        padded = inputs.view(batch, capacity)
        inputs.load(padded, hidden, positions, meta)
        key = (batch, capacity, kv_caches[0].data_ptr())
        replay = self.replays.get(key)
        if replay is None:
            replay = self._capture(padded, kv_caches, key)
            if replay is None:
                return None
            inputs.load(padded, hidden, positions, meta)  # warm-up may have changed them
        out_hidden, out_residual = replay()
        self.steps[key[:2]] = self.steps.get(key[:2], 0) + 1
        return out_hidden[:n], None if out_residual is None else out_residual[:n]

    def _capture(
        self, padded: PaddedStep, kv_caches: list[torch.Tensor], key: tuple[int, int, int]
    ) -> StepFn | None:
        layers = self.layers

        def run() -> Outputs:
            return layers(padded.positions, padded.hidden, None, kv_caches, padded.meta)

        try:
            replay = self.capture(run)
        except RuntimeError as exc:  # a host read-back (or any launch) refused while capturing
            self.broken = f"capture failed at batch {key[0]}, context {key[1]}: {exc}"
            logger.warning("decode: CUDA graphs not used from here on: %s", self.broken)
            return None
        self.replays[key] = replay
        logger.debug("decode: captured batch %d, context up to %d tokens", key[0], key[1])
        return replay


def not_covered(model: nn.Module) -> str | None:
    """Why the model's decode steps cannot be captured, or None."""
    from pagedllm.layers.attention import Attention
    from pagedllm.layers.fused_moe.layer import FusedMoE
    from pagedllm.layers.lora import LoRALinear

    if not hasattr(model, "fast_decode") or not hasattr(model, "run_layers"):
        return f"{type(model).__name__} is not a decoder with a layer loop"
    if getattr(model, "pp", None) is not None and model.pp.size > 1:
        return "pipeline parallelism (a stage hands on activations)"
    if getattr(model, "tp", None) is not None and model.tp.size > 1:
        return "tensor parallelism (collectives are not captured)"
    modules = list(model.modules())
    if any(isinstance(m, LoRALinear) for m in modules):
        return "LoRA adapters (their per-step slot mapping is not a static input)"
    if any(isinstance(m, FusedMoE) for m in modules):
        # torch.bincount on CUDA reads its maximum back to size its output; the PyTorch path
        # reads the expert offsets: either would fail the capture.
        return "mixture-of-experts layers (their routing reads expert counts back to the host)"
    names = {m.backend.name for m in modules if isinstance(m, Attention)}
    if names != {"triton"}:
        return f"attention backend {sorted(names)} (only the Triton kernels are capture-safe)"
    param = next(model.parameters(), None)
    if param is None or param.device.type != "cuda":
        where = "no parameters" if param is None else f"parameters on {param.device.type}"
        return f"{where}, not a CUDA device"
    return None


def _span(buckets: Sequence[int]) -> str:
    return f"{buckets[0]}..{buckets[-1]} ({len(buckets)})"


def install_cuda_graphs(model: nn.Module, *, int8_activations: bool = False) -> str:
    """The registry's installer (op ``decode_stack``, impl ``cuda_graph``): fills
    ``model.fast_decode`` where the model's decode steps can be captured; returns e.g.
    ``"decode_stack: cuda_graph batches 1..256 (35)"`` ("" for none, the reason logged)."""
    del int8_activations  # the layers' own kernels decided
    reason = not_covered(model)
    if reason is not None:
        logger.info("decode: CUDA graphs not used: %s", reason)
        return ""
    device = next(model.parameters()).device
    runner = DecodeGraphs(model.run_layers, CudaGraphCapture(device))
    model.fast_decode = runner.step
    logger.info(
        "decode: CUDA graphs, buckets %s, contexts up to %d tokens (captured at first use)",
        list(runner.batch_buckets),
        runner.max_capacity,
    )
    return f"decode_stack: cuda_graph batches {_span(runner.batch_buckets)}"

"""What a one-sequence decode step on the CPU backend does besides its kernels.

At one sequence the C++ kernels of a small model's layer take a few microseconds each, and
every ATen call around them (a view, a dtype conversion that changes nothing, a small tensor
made from a list) costs about a microsecond of dispatch plus its Python: a decode step of
SmolLM2-135M spent nearly as long in such glue as in its kernels. These tests count the ATen
calls of a decode step, inside the decoder layers and around them, so that the glue does not
grow back unnoticed.
"""

from __future__ import annotations

import shutil
from collections import Counter

import pytest
from torch.utils._python_dispatch import TorchDispatchMode

# Per decoder layer: the outputs of the norms, the attention and the activation kernels, the
# four projections (oneDNN's op here), and the fused QKV output's per-head views (a reshape
# and one split). It was 27 before the q/k/v views and the metadata's dtypes were settled.
MAX_CALLS_PER_LAYER = 14
# Per step, outside the layers: input ids and positions, the metadata (one int32 tensor and
# its views, the slot mapping), the embedding, the final norm, the LM head and the sampler's
# row parameters. It was 50.
MAX_CALLS_PER_STEP = 28


class CountCalls(TorchDispatchMode):
    """ATen calls, counted apart inside a decoder layer and outside."""

    def __init__(self) -> None:
        super().__init__()
        self.depth = 0  # > 0 inside a decoder layer
        self.layer: Counter[str] = Counter()
        self.step: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        (self.layer if self.depth else self.step)[str(func.overloadpacket)] += 1
        return func(*args, **(kwargs or {}))


@pytest.fixture(scope="module")
def engine(llama_path):
    if shutil.which("c++") is None or shutil.which("ninja") is None:
        pytest.skip("no C++ toolchain (c++ and ninja) to build the CPU kernels")
    from pagedllm import Engine, SamplingParams

    engine = Engine(str(llama_path), device="cpu", dtype="float32", num_kv_blocks=32)
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    engine.add_request("r", {"prompt_token_ids": [5, 6, 7, 8, 9]}, params)
    for _ in range(3):  # the prompt, then decodes
        engine.step()
    return engine


def test_decode_step_makes_few_aten_calls(engine) -> None:
    from pagedllm.models.llama import LlamaDecoderLayer

    model = engine.executor.worker.runner.model
    layers = [m for m in model.modules() if isinstance(m, LlamaDecoderLayer)]
    assert model.layer_kernels != "none", "the C++ layer kernels are what this counts around"
    mode = CountCalls()

    def enter(*_args: object) -> None:
        mode.depth += 1

    def leave(*_args: object) -> None:
        mode.depth -= 1

    handles = [m.register_forward_pre_hook(enter) for m in layers]
    handles += [m.register_forward_hook(leave) for m in layers]
    try:
        with mode:
            engine.step()
    finally:
        for h in handles:
            h.remove()
    per_layer = sum(mode.layer.values()) / len(layers)
    outside = sum(mode.step.values())
    assert per_layer <= MAX_CALLS_PER_LAYER, f"{per_layer} ATen calls a layer: {mode.layer}"
    assert outside <= MAX_CALLS_PER_STEP, f"{outside} ATen calls outside the layers: {mode.step}"

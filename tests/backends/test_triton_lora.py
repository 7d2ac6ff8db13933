"""The Triton LoRA shrink/expand vs a per-token PyTorch loop (and the PyTorch path).

Off CUDA they run under Triton's interpreter on CPU tensors (small shapes); TRITON_INTERPRET must
be set before triton is first imported, which is why `triton_env` (imported before
anything that loads triton) sets it.
"""

from __future__ import annotations

import pytest
import torch

from pagedllm.lora.ops import TorchLoRAOps, build_mapping
from tests.backends.triton_env import DEVICE, TRITON_MARKS
from tests.lora.test_ops import CASES, make_case

pytestmark = TRITON_MARKS

ATOL = {torch.float32: 1e-4, torch.float16: 2e-2}


@pytest.fixture(scope="module")
def ops():
    from pagedllm.backends.gpu.lora import TritonLoRAOps

    return TritonLoRAOps()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("case", sorted(CASES))
def test_shrink_expand_equals_per_token_loop(ops, case: str, dtype: torch.dtype) -> None:
    x, y, a, b, want = make_case(case, dtype)
    mapping = build_mapping(*CASES[case], DEVICE)
    assert mapping is not None
    for kernel in (ops, TorchLoRAOps()):
        got = y.to(DEVICE).clone()
        s = kernel.shrink(x.to(DEVICE), a.to(DEVICE), mapping)
        kernel.expand(got, s, b.to(DEVICE), mapping)
        diff = (got.float().cpu() - want).abs().max().item()
        assert diff <= ATOL[dtype], f"{kernel.name} {case} {dtype}: max diff {diff:.2e}"

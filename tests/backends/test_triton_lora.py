"""The Triton LoRA shrink/expand vs a per-token PyTorch loop (and the PyTorch path).

Off CUDA they run under Triton's interpreter on CPU tensors (small shapes); TRITON_INTERPRET must
be set before triton is first imported, which is why this module sets it at import time.
"""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

from pagedllm.lora.ops import TorchLoRAOps, build_mapping

ON_CUDA = torch.cuda.is_available()
if not ON_CUDA:
    os.environ["TRITON_INTERPRET"] = "1"
HAVE_TRITON = importlib.util.find_spec("triton") is not None
DEVICE = torch.device("cuda" if ON_CUDA else "cpu")

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not HAVE_TRITON, reason="triton is not installed (ci/requirements-gpu.txt)"),
]

SLOTS, K_IN, N_OUT, RANK = 4, 40, 72, 24  # ranks and widths that are not block multiples
ATOL = {torch.float32: 1e-4, torch.float16: 2e-2}


def reference(
    x: torch.Tensor, y: torch.Tensor, a: torch.Tensor, b: torch.Tensor, token_slot: list[int]
) -> torch.Tensor:
    """Token by token, in float32: ``y_t + (x_t A_s^T) B_s^T`` for tokens with a slot."""
    out = y.float().clone()
    for t, s in enumerate(token_slot):
        if s >= 0:
            out[t] += (x[t].float() @ a[s].float().t()) @ b[s].float().t()
    return out


CASES = {
    "mixed": ([-1, 2, 0, -1, 2, 3], [3, 1, 5, 2, 1, 20]),
    "one_slot_all": ([1, 1], [7, 1]),
    "decode_only": ([0, 1, 2, 3, 0, 1, -1, 2], [1] * 8),
}


@pytest.fixture(scope="module")
def ops():
    from pagedllm.backends.gpu.lora import TritonLoRAOps

    return TritonLoRAOps()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("case", sorted(CASES))
def test_shrink_expand_equals_per_token_loop(ops, case: str, dtype: torch.dtype) -> None:
    seq_slots, seq_lens = CASES[case]
    g = torch.Generator().manual_seed(5)
    n = sum(seq_lens)
    x = torch.randn(n, K_IN, generator=g).to(dtype)
    y = torch.randn(n, N_OUT, generator=g).to(dtype)
    a = (torch.randn(SLOTS, RANK, K_IN, generator=g) * 0.3).to(dtype)
    b = (torch.randn(SLOTS, N_OUT, RANK, generator=g) * 0.3).to(dtype)
    token_slot = [s for s, n_ in zip(seq_slots, seq_lens, strict=True) for _ in range(n_)]
    want = reference(x, y, a, b, token_slot)
    mapping = build_mapping(seq_slots, seq_lens, DEVICE)
    assert mapping is not None
    for kernel in (ops, TorchLoRAOps()):
        got = y.to(DEVICE).clone()
        s = kernel.shrink(x.to(DEVICE), a.to(DEVICE), mapping)
        kernel.expand(got, s, b.to(DEVICE), mapping)
        diff = (got.float().cpu() - want).abs().max().item()
        assert diff <= ATOL[dtype], f"{kernel.name} {case} {dtype}: max diff {diff:.2e}"


def test_no_adapter_tokens_is_no_mapping() -> None:
    assert build_mapping([-1, -1], [3, 1], DEVICE) is None

"""The PyTorch LoRA shrink/expand (segmented and padded-bmm paths) vs a per-token loop."""

from __future__ import annotations

import pytest
import torch

from pagedllm.lora.ops import TorchLoRAOps, build_mapping

SLOTS, K_IN, N_OUT, RANK = 4, 40, 72, 24
ATOL = {torch.float32: 1e-4, torch.float16: 2e-2, torch.bfloat16: 5e-2}
# name -> (slot of each sequence (-1: base), tokens of each sequence)
CASES = {
    "mixed_prefill": ([-1, 2, 0, -1, 2, 3], [3, 1, 5, 2, 1, 20]),
    "one_slot_all": ([1, 1], [7, 1]),
    "decode_all_slots": ([0, 1, 2, 3, 0, 1, -1, 2], [1] * 8),
    "decode_sparse_slots": ([3, 1, -1, 3, 1], [1] * 5),
    "decode_no_base": ([0, 2, 0, 2, 1], [1] * 5),
    # as the runner orders a step: one run of adapter tokens, slot by slot
    "sorted_decode": ([-1, 0, 0, 2, 2], [1] * 5),
    "sorted_slots_0_1": ([0, 0, 1, 1, -1], [1] * 5),
    "sorted_prefill_skewed": ([-1, 1, 2, 2, 3], [2, 30, 1, 2, 4]),
}


def reference(
    x: torch.Tensor, y: torch.Tensor, a: torch.Tensor, b: torch.Tensor, token_slot: list[int]
) -> torch.Tensor:
    """Token by token, in float32: ``y_t + (x_t A_s^T) B_s^T`` for tokens with a slot."""
    out = y.float().clone()
    for t, s in enumerate(token_slot):
        if s >= 0:
            out[t] += (x[t].float() @ a[s].float().t()) @ b[s].float().t()
    return out


def make_case(case: str, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    seq_slots, seq_lens = CASES[case]
    g = torch.Generator().manual_seed(5)
    n = sum(seq_lens)
    x = torch.randn(n, K_IN, generator=g).to(dtype)
    y = torch.randn(n, N_OUT, generator=g).to(dtype)
    a = (torch.randn(SLOTS, RANK, K_IN, generator=g) * 0.3).to(dtype)
    b = (torch.randn(SLOTS, N_OUT, RANK, generator=g) * 0.3).to(dtype)
    token_slot = [s for s, k in zip(seq_slots, seq_lens, strict=True) for _ in range(k)]
    return x, y, a, b, reference(x, y, a, b, token_slot)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("fused", [False, True], ids=["shrink_expand", "one_call"])
def test_torch_ops_equal_per_token_loop(case: str, dtype: torch.dtype, fused: bool) -> None:
    x, y, a, b, want = make_case(case, dtype)
    mapping = build_mapping(*CASES[case], torch.device("cpu"))
    assert mapping is not None
    ops = TorchLoRAOps()
    got = y.clone()
    if fused:
        ops(got, x, a, b, mapping)
    else:
        ops.expand(got, ops.shrink(x, a, mapping), b, mapping)
    diff = (got.float() - want).abs().max().item()
    tol = ATOL[dtype] * max(1.0, want.abs().max().item())  # 16-bit: relative to the magnitude
    assert diff <= tol, f"{case} {dtype} fused={fused}: max diff {diff:.2e} > {tol:.2e}"


def test_padded_path_is_chosen_for_balanced_decodes() -> None:
    balanced = build_mapping(*CASES["decode_all_slots"], torch.device("cpu"))
    skewed = build_mapping(*CASES["mixed_prefill"], torch.device("cpu"))
    assert balanced is not None and balanced.pad_gather is not None
    assert skewed is not None and skewed.pad_gather is None


def test_sorted_steps_need_no_gather() -> None:
    m = build_mapping(*CASES["sorted_decode"], torch.device("cpu"))
    assert m is not None and m.token_range == (1, 5) and m.equal_len == 2
    m = build_mapping(*CASES["sorted_prefill_skewed"], torch.device("cpu"))
    assert m is not None and m.token_range == (2, 39) and m.pad_gather is None
    m = build_mapping(*CASES["sorted_slots_0_1"], torch.device("cpu"))
    assert m is not None and m.slot_index is None  # slot weights are views


def test_no_adapter_tokens_is_no_mapping() -> None:
    assert build_mapping([-1, -1], [3, 1], torch.device("cpu")) is None

"""The C++ row-wise layer kernels (RMSNorm + residual, SiLU-and-mul, rotary) at every ISA level
this processor runs, against the layers' own PyTorch definitions (``forward_native``).

The rotary embedding and the residual sum round exactly where PyTorch does, so they must agree
bit for bit. RMSNorm's sum of squares and SiLU's exp run in another order / polynomial than
ATen's, so float32 outputs agree to a few ulps and 16-bit outputs bit for bit except where that
last float32 bit lands on a rounding boundary (bounded below). The engine-level check is
``test_cpu_kernels.test_engine_matches_transformers``, which runs with these kernels installed.
"""

from __future__ import annotations

import types

import pytest
import torch

from pagedllm.backends.cpu.layer_kernels import (
    act_kernel,
    install_layer_kernels,
    norm_kernel,
    rotary_kernel,
)
from pagedllm.layers.activation import GeluAndMul, SiluAndMul
from pagedllm.layers.norm import RMSNorm
from pagedllm.layers.rotary import RotaryEmbedding

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# 16-bit outputs that may differ from the definition by one unit in the last place (a float32
# statistic one ulp off, rounding the other way): at most this fraction of elements.
MAX_ULP_FLIPS = 1e-3


def assert_close_to_definition(out: torch.Tensor, ref: torch.Tensor) -> None:
    assert out.shape == ref.shape and out.dtype == ref.dtype
    if out.dtype == torch.float32:
        torch.testing.assert_close(out, ref, rtol=4e-6, atol=1e-6)
        return
    flips = out != ref
    assert flips.float().mean().item() <= MAX_ULP_FLIPS, f"{int(flips.sum())} elements differ"
    # Where they differ, by one step of the dtype's grid at that magnitude.
    ulp = torch.finfo(out.dtype).eps * ref.float().abs().clamp_min(1e-30)
    assert ((out.float() - ref.float()).abs() <= 2 * ulp + 1e-30).all()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("offset", [0.0, 1.0])
@pytest.mark.parametrize("width", [2048, 301, 7])
def test_rms_norm_matches_definition(ops, dtype: torch.dtype, offset: float, width: int) -> None:
    torch.manual_seed(width)
    norm = RMSNorm(width, 1e-5, offset=offset).to(dtype)
    norm.weight.data.normal_()
    fast = norm_kernel(ops, norm)
    wide = torch.randn(37, width + 5, dtype=dtype) * 3
    x = wide[:, 3 : 3 + width]  # rows with a stride wider than the row
    residual = torch.randn(37, width, dtype=dtype)
    out, h = fast(x, residual)
    ref_out, ref_h = norm.forward_native(x, residual)
    assert torch.equal(h, ref_h)  # the residual sum rounds exactly as PyTorch's add
    assert_close_to_definition(out, ref_out)
    out, same = fast(x)
    assert same is x
    assert_close_to_definition(out, norm.forward_native(x)[0])


def test_rms_norm_of_one_row_and_many_threads(ops) -> None:
    norm = RMSNorm(512).to(torch.bfloat16)
    norm.weight.data.uniform_(0.5, 1.5)
    fast = norm_kernel(ops, norm)
    for rows in (1, 600):  # one row on the calling thread; many split over the workers
        x = torch.randn(rows, 512, dtype=torch.bfloat16)
        assert_close_to_definition(fast(x)[0], norm.forward_native(x)[0])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("width", [8192, 1003])
def test_silu_and_mul_matches_definition(ops, dtype: torch.dtype, width: int) -> None:
    torch.manual_seed(width)
    act = SiluAndMul()
    fast = act_kernel(ops, act)
    x = torch.randn(21, 2 * width, dtype=dtype) * 4
    # exp(-g) overflowing, zeros of both signs, tiny and ordinary values.
    edge = torch.tensor([-100.0, -89.0, -60.0, 0.0, -0.0, 90.0, 1e-3, -1e-3, 3.0])
    x[0, : edge.numel()] = edge.to(dtype)
    out = fast(x)
    ref = act.forward_native(x)
    assert_close_to_definition(out, ref)
    assert torch.equal(out[0, :2], ref[0, :2])  # signed zeros where exp(-g) overflows to inf


@pytest.mark.parametrize("dtype", DTYPES)
def test_gelu_tanh_and_mul_matches_definition(ops, dtype: torch.dtype) -> None:
    """Within two ulps, but for where PyTorch's 1 + tanh(z) cancels (gate below about -3): its
    float32 absolute accuracy there, 6e-8 of 0.5 |gate|, times |up| (the kernel evaluates the
    same function as gate / (1 + exp(-2z)), which does not cancel)."""
    torch.manual_seed(1)
    act = GeluAndMul("tanh")
    fast = act_kernel(ops, act)
    width = 1003
    x = torch.randn(21, 2 * width, dtype=dtype) * 4
    x[0, :5] = torch.tensor([-100.0, -30.0, 0.0, 5.0, 30.0]).to(dtype)
    out, ref = fast(x).float(), act.forward_native(x).float()
    gate, up = x[:, :width].float().abs(), x[:, width:].float().abs()
    tiny = torch.finfo(dtype).smallest_normal * torch.finfo(dtype).eps  # one subnormal step
    bound = 2 * torch.finfo(dtype).eps * ref.abs() + 1e-7 * gate * up + 2 * tiny
    assert ((out - ref).abs() <= bound).all()
    big = gate < 2  # away from the cancellation: the last-bit rule of the other kernels
    assert_close_to_definition(fast(x)[big].view(-1, 1), act.forward_native(x)[big].view(-1, 1))


def test_gelu_without_tanh_is_left_to_the_definition() -> None:
    from pagedllm.backends.cpu.layer_kernels import install_layer_kernels as install

    model = torch.nn.Sequential(GeluAndMul("none"), GeluAndMul("tanh"))
    assert "gelu_tanh_and_mul x1" in install(model)
    assert model[0].fast_act is None and model[1].fast_act is not None


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("head_size", "rotary_dim"), [(64, 64), (80, 32), (128, 128), (40, 40)])
def test_rotary_is_bit_exact_in_place(
    ops, dtype: torch.dtype, head_size: int, rotary_dim: int
) -> None:
    torch.manual_seed(head_size)
    config = types.SimpleNamespace(rope_theta=10000.0, max_position_embeddings=4096)
    rotary = RotaryEmbedding(config, head_size, rotary_dim, 4096)
    fast = rotary_kernel(ops, rotary)
    tokens, heads, kv_heads = 29, 8, 2
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_size, dtype=dtype)
    q = qkv[:, : heads * head_size].view(tokens, heads, head_size)
    k = qkv[:, heads * head_size : (heads + kv_heads) * head_size].view(tokens, kv_heads, -1)
    v_before = qkv[:, (heads + kv_heads) * head_size :].clone()
    positions = torch.randint(0, 4096, (tokens,))
    ref_q, ref_k = rotary.forward_native(positions, q, k)  # new tensors: q, k untouched
    out_q, out_k = fast(positions, q, k)
    assert out_q.data_ptr() == q.data_ptr() and out_k.data_ptr() == k.data_ptr()
    assert torch.equal(out_q, ref_q) and torch.equal(out_k, ref_k)
    assert torch.equal(qkv[:, (heads + kv_heads) * head_size :], v_before)


def test_rotary_position_outside_the_table_raises(ops) -> None:
    config = types.SimpleNamespace(rope_theta=10000.0, max_position_embeddings=64)
    rotary = RotaryEmbedding(config, 32, 32, 64)
    q = torch.randn(2, 4, 32)
    k = torch.randn(2, 1, 32)
    with pytest.raises(RuntimeError, match="position 64 is outside the table"):
        rotary_kernel(ops, rotary)(torch.tensor([3, 64]), q, k)


def test_inputs_the_kernels_cannot_take_go_to_the_definition(ops) -> None:
    norm = RMSNorm(16).to(torch.bfloat16)
    norm.weight.data = norm.weight.data.float()  # weight dtype != activations: promotes
    x = torch.randn(3, 16, dtype=torch.bfloat16)
    out, _ = norm_kernel(ops, norm)(x)
    ref, _ = norm.forward_native(x)
    assert out.dtype == ref.dtype == torch.float32 and torch.equal(out, ref)
    # A strided 3-D view (a q-norm over heads of a fused QKV output) is not rows: definition.
    norm = RMSNorm(16)
    qkv = torch.randn(5, 3 * 4 * 16)
    heads = qkv[:, : 4 * 16].view(5, 4, 16)
    assert torch.equal(norm_kernel(ops, norm)(heads)[0], norm.forward_native(heads)[0])
    ints = torch.arange(12).view(3, 4)
    act = SiluAndMul()
    with pytest.raises(RuntimeError):  # what the definition itself does with an integer tensor
        act_kernel(ops, act)(ints)


def test_install_fills_every_slot_of_a_model(llama_path) -> None:
    from tests.conftest import load_on_reference

    model = load_on_reference(llama_path, torch.float32)
    summary = install_layer_kernels(model)
    norms = [m for m in model.modules() if isinstance(m, RMSNorm)]
    assert norms and all(m.fast_norm is not None for m in norms)
    assert all(m.fast_act is not None for m in model.modules() if isinstance(m, SiluAndMul))
    assert f"rms_norm x{len(norms)}" in summary and "rotary x" in summary

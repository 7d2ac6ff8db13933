"""The encoder_attention op against its definition and a plain PyTorch reference."""

from __future__ import annotations

import math

import pytest
import torch

from pagedllm.backends import kernels
from pagedllm.backends.cpu.backend import CpuBackend
from pagedllm.backends.encoder_attention import install_encoder_attention, padded_sdpa
from pagedllm.backends.gpu.backend import CudaBackend
from pagedllm.backends.xpu.backend import XpuBackend
from pagedllm.layers.encoder_attention import EncoderAttention

LENS = [[7], [3, 1, 12, 5], [40, 2, 33, 1, 17, 9]]


def _plain(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lens: list[int], scale: float):
    """Every token against every token of the batch in float64, other sequences masked out."""
    seq = torch.repeat_interleave(torch.arange(len(lens)), torch.tensor(lens))
    scores = torch.einsum("qhd,khd->hqk", q.double(), k.double()) * scale
    scores = scores.masked_fill(seq[None, :, None] != seq[None, None, :], -math.inf)
    return torch.einsum("hqk,khd->qhd", torch.softmax(scores, -1), v.double())


@pytest.mark.parametrize("lens", LENS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("impl", ["definition", "torch"])
def test_encoder_attention_matches_reference(lens: list[int], dtype: torch.dtype, impl: str):
    torch.manual_seed(len(lens))
    n, heads, head = sum(lens), 4, 16
    q, k, v = (torch.randn(n, heads, head).to(dtype) for _ in range(3))
    fn = EncoderAttention.forward_native if impl == "definition" else padded_sdpa
    out = fn(q, k, v, lens, head**-0.5)
    want = _plain(q, k, v, lens, head**-0.5)
    assert out.dtype == dtype and out.shape == q.shape
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    diff = (out.double() - want).abs().max().item()
    assert diff <= tol, f"{impl} {dtype} {lens}: largest difference {diff:.3g}"


@pytest.mark.parametrize("lens", LENS[1:])
def test_slices_of_one_qkv_buffer_gather_once_and_match(lens: list[int]) -> None:
    """q, k and v as a fused projection's split output (one gather of its rows) give what the
    same values as three tensors give, and the shared buffer is found."""
    from pagedllm.backends.encoder_attention import _fused_rows

    torch.manual_seed(1)
    n, heads, head = sum(lens), 4, 16
    qkv = torch.randn(n, 3 * heads * head)
    q, k, v = (t.reshape(n, heads, head) for t in qkv.split(heads * head, -1))
    assert _fused_rows(q, k, v) is not None
    apart = [t.clone() for t in (q, k, v)]
    assert _fused_rows(*apart) is None
    assert _fused_rows(k, q, v) is None  # not in q, k, v order
    torch.testing.assert_close(padded_sdpa(q, k, v, lens, 0.25), padded_sdpa(*apart, lens, 0.25))
    want = _plain(q, k, v, lens, 0.25)
    assert (padded_sdpa(q, k, v, lens, 0.25).double() - want).abs().max().item() < 1e-5


def test_padded_sdpa_checks_its_inputs() -> None:
    q = torch.zeros(5, 2, 4)
    with pytest.raises(ValueError, match="query_lens"):
        padded_sdpa(q, q, q, [2, 2], 0.5)
    with pytest.raises(ValueError, match="must be"):
        padded_sdpa(q, q[:, :1], q, [5], 0.5)


def test_every_device_selects_the_torch_kernel_and_installs_it() -> None:
    for backend in (CpuBackend, CudaBackend, XpuBackend):
        assert backend.kernel_order["encoder_attention"] == ("torch",)
        chosen = kernels.select("encoder_attention", backend.name, ("torch",))
        assert chosen.value is install_encoder_attention, chosen.explain()
    model = torch.nn.ModuleList(
        [EncoderAttention(num_heads=2, head_size=4, scale=0.5) for _ in range(3)]
    )
    assert install_encoder_attention(model) == "encoder_attention x3"
    assert all(layer.fast_encoder_attn is padded_sdpa for layer in model)
    assert install_encoder_attention(torch.nn.Linear(2, 2)) == ""

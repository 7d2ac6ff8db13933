"""The Triton fused-MoE kernels vs a plain per-token PyTorch loop.

Off CUDA they run under Triton's interpreter on CPU tensors (small shapes); TRITON_INTERPRET must
be set before triton is first imported, which is why `triton_env` (imported before
anything that loads triton) sets it. The
sm_80/sm_90 compilation of these kernels is part of ``compile_check`` (see test_triton_kernels).
"""

from __future__ import annotations

import pytest
import torch

from tests.backends.triton_env import DEVICE, ON_CUDA, TRITON_MARKS
from tests.layers.test_fused_moe import INTER, TOP_K, E, H, check, reference_moe, routing_case

pytestmark = TRITON_MARKS

DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if ON_CUDA else [])
ATOL = {torch.float32: 1e-4, torch.float16: 2e-2, torch.bfloat16: 5e-2}


@pytest.fixture(scope="module")
def fm():
    from pagedllm.backends.gpu import fused_moe

    return fused_moe


def weights_for(dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    w13 = (torch.randn(E, 2 * INTER, H, generator=g) * 0.2).to(dtype)
    w2 = (torch.randn(E, H, INTER, generator=g) * 0.2).to(dtype)
    return w13, w2


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", ["random", "some_experts_idle", "one_expert_gets_all"])
@pytest.mark.parametrize("num_tokens", [1, 13])
def test_kernel_equals_per_token_loop(fm, dtype: torch.dtype, case: str, num_tokens: int) -> None:
    w13, w2 = weights_for(dtype)
    weights, ids = routing_case(case, num_tokens)
    x = torch.randn(num_tokens, H).to(dtype)
    want = reference_moe(x, w13, w2, weights, ids)
    got = fm.fused_moe(
        x.to(DEVICE),
        w13.to(DEVICE),
        w2.to(DEVICE),
        weights.to(DEVICE),
        ids.to(DEVICE),
        block_m=16,
        block_n=32,
        block_k=16,
    )
    check(got.cpu(), want, ATOL[dtype], f"{case}/{dtype}/T={num_tokens}")


def test_expert_parallel_halves_sum_to_the_whole(fm) -> None:
    w13, w2 = weights_for(torch.float32)
    weights, ids = routing_case("random")
    x = torch.randn(13, H)
    half = E // 2
    total = sum(
        fm.fused_moe(
            x.to(DEVICE),
            w13[r * half : (r + 1) * half].contiguous().to(DEVICE),
            w2[r * half : (r + 1) * half].contiguous().to(DEVICE),
            weights.to(DEVICE),
            ids.to(DEVICE),
            expert_start=r * half,
            block_m=16,
            block_n=32,
            block_k=16,
        )
        for r in range(2)
    )
    check(total.cpu(), reference_moe(x, w13, w2, weights, ids), 1e-4, "ep")


def test_alignment_pads_each_expert_to_whole_blocks(fm) -> None:
    ids = torch.tensor([[2, 0], [0, 2], [2, 1]])
    sorted_ids, block_expert = fm.align_by_expert(ids, 3, 0, 4)
    sentinel = 6
    assert sorted_ids.tolist()[:12] == [
        1,
        2,
        sentinel,
        sentinel,
        5,
        sentinel,
        sentinel,
        sentinel,
        0,
        3,
        4,
        sentinel,
    ]
    assert block_expert.tolist()[:3] == [0, 1, 2]
    assert all(b == -1 for b in block_expert.tolist()[3:])


def test_launcher_rejects_bad_inputs(fm) -> None:
    w13, w2 = (w.to(DEVICE) for w in weights_for(torch.float32))
    x = torch.randn(4, H, device=DEVICE)
    ids = torch.zeros(4, TOP_K, dtype=torch.long, device=DEVICE)
    w = torch.ones(4, TOP_K, device=DEVICE)
    with pytest.raises(ValueError, match="dtypes differ"):
        fm.fused_moe(x.half(), w13, w2, w, ids)
    with pytest.raises(ValueError, match="shapes disagree"):
        fm.fused_moe(torch.randn(4, H + 1, device=DEVICE), w13, w2, w, ids)
    with pytest.raises(ValueError, match="topk_ids"):
        fm.fused_moe(x, w13, w2, w, ids[:3])


def test_gpu_backend_installs_the_kernel_on_moe_layers() -> None:
    """prepare_model puts the Triton path in the FusedMoE slot (and leaves int8 layers alone)."""
    from pagedllm.backends.gpu.backend import CudaBackend
    from pagedllm.layers.fused_moe import FusedMoE

    layer = FusedMoE(num_experts=E, hidden_size=H, intermediate_size=INTER)
    w13, w2 = weights_for(torch.float32)
    layer.w13_weight.data, layer.w2_weight.data = w13, w2
    quantised = FusedMoE(num_experts=E, hidden_size=H, intermediate_size=INTER)
    quantised.w13_weight.data, quantised.w2_weight.data = w13.clone(), w2.clone()
    quantised.quantize_int8()
    model = torch.nn.ModuleList([layer, quantised])
    CudaBackend.prepare_model(object.__new__(CudaBackend), model)
    assert layer.path == "triton" and quantised.path == "torch"
    weights, ids = routing_case("random")
    x = torch.randn(13, H)
    got = layer.to(DEVICE)(x.to(DEVICE), weights.to(DEVICE), ids.to(DEVICE))
    check(got.cpu(), reference_moe(x, w13, w2, weights, ids), 1e-4, "installed")


def test_engine_with_the_triton_moe_path_matches_transformers(
    tmp_path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The whole engine on the tiny Mixtral with its experts on the Triton kernels (on a GPU
    through the CUDA backend, else interpreted on CPU tensors through the CPU backend with the
    registry's Triton MoE row as its only installer), greedy tokens equal to transformers'."""
    from transformers import AutoTokenizer

    from pagedllm import Engine, SamplingParams
    from pagedllm.backends import kernels
    from pagedllm.backends.cpu.backend import CpuBackend
    from pagedllm.layers.fused_moe import FusedMoE
    from tests.conftest import PROMPTS
    from tests.hf_reference import assert_greedy_match, hf_greedy
    from tests.models.moe_models import build_moe

    path = build_moe(tmp_path / "mixtral", "mixtral")
    if not ON_CUDA:
        # The CPU's attention and sampler, the CUDA device's installers (MoE only).
        order = {**CpuBackend.kernel_order, **dict.fromkeys(kernels.INSTALLED_OPS, ())}
        monkeypatch.setattr(CpuBackend, "kernel_order", {**order, "moe": ("triton",)})
    tok = AutoTokenizer.from_pretrained(str(path))
    ids = [tok.encode(p) for p in PROMPTS[:4]]
    refs = hf_greedy(path, ids, 6)
    engine = Engine(str(path), device=DEVICE.type, dtype="float32", block_size=8, num_kv_blocks=64)
    model = engine.executor.worker.runner.model  # type: ignore[attr-defined]
    assert {m.path for m in model.modules() if isinstance(m, FusedMoE)} == {"triton"}
    params = SamplingParams(temperature=0.0, max_tokens=6)
    outs = engine.generate([{"prompt_token_ids": i} for i in ids], params, use_tqdm=False)
    for i, (out, ref) in enumerate(zip(outs, refs, strict=True)):
        assert_greedy_match(out.outputs[0].token_ids, ref, f"triton-moe prompt {i}")

"""CUDA graphs for decode steps (backends/gpu/decode_graphs.py, graph_inputs.py).

Without a GPU the padding is what is tested: decode steps padded to batch buckets and context
capacities, run on the static buffers with the capture replaced by :func:`eager_capture` (the
Triton kernels under the interpreter), must give the unpadded layer loop's logits and greedy
tokens, write no cache slot for a padded row, and leave no block behind, while sequences finish
and join between buckets. The capture itself (``torch.cuda.CUDAGraph``) runs only on CUDA:
``test_cuda_graphs_replay_the_eager_tokens``, also run by ``tools/gpu_check.sh``.
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from pagedllm import Engine, SamplingParams
from pagedllm.backends import kernels
from pagedllm.backends.gpu.decode_graphs import (
    DecodeGraphs,
    eager_capture,
    install_cuda_graphs,
    not_covered,
)
from pagedllm.backends.gpu.graph_inputs import PAD_SLOT, bucket_of, capacity_of
from pagedllm.backends.kernels import Kernel
from pagedllm.backends.kv_layout import build_attention_metadata
from tests.backends.triton_env import DEVICE, ON_CUDA, TRITON_MARKS

BUCKETS = (1, 2, 4, 8)
BLOCK = 8
PARTITION = 16  # split-K decode inside the captured step once a context passes 16 tokens
MIN_CAP, MAX_CAP = 16, 64  # three capacities met; a context past 64 runs eagerly
HERE = "tests.backends.test_decode_graphs"


def needs_triton(test: object) -> object:
    """The gpu leg's marks: the test runs the Triton kernels (interpreted without CUDA)."""
    for mark in TRITON_MARKS:
        test = mark(test)
    return test


def test_buckets_and_capacities() -> None:
    assert [bucket_of(n, BUCKETS) for n in (1, 2, 3, 4, 5, 8)] == [1, 2, 4, 4, 8, 8]
    assert bucket_of(9, BUCKETS) is None  # larger batches run eagerly
    assert [capacity_of(s, 16, 64) for s in (1, 16, 17, 33, 64)] == [16, 16, 32, 64, 64]
    assert capacity_of(65, 16, 64) is None


def engine(path: Path, **kwargs: object) -> Engine:
    return Engine(
        str(path),
        device=DEVICE.type,
        attention_backend="triton",
        dtype="float32",
        block_size=BLOCK,
        num_kv_blocks=48,
        max_model_len=96,
        max_num_batched_tokens=96,
        **kwargs,
    )


def padded_runner(model: torch.nn.Module) -> DecodeGraphs:
    runner = DecodeGraphs(
        model.run_layers,
        eager_capture,
        batch_buckets=BUCKETS,
        min_capacity=MIN_CAP,
        max_capacity=MAX_CAP,
    )
    model.fast_decode = runner.step
    return runner


def greedy(
    eng: Engine, prompts: list[list[int]], lengths: list[int]
) -> tuple[list[list[int]], list[torch.Tensor]]:
    """Greedy tokens and every step's logits; every block free afterwards."""
    model = eng.executor.worker.runner.model
    logits: list[torch.Tensor] = []
    compute = model.compute_logits

    def recorded(hidden: torch.Tensor) -> torch.Tensor:
        out = compute(hidden)
        logits.append(out.detach().cpu().clone())
        return out

    model.compute_logits = recorded
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in lengths]
    outs = eng.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    stats = eng.get_stats()
    assert stats["num_free_device_blocks"] == stats["num_device_blocks"], stats
    return [list(o.outputs[0].token_ids) for o in outs], logits


# Five sequences, at most three at a time, ending at different steps: batches of 3 (padded to
# 4), 2 and 1, sequences joining as others finish; contexts in all three capacities, the last
# one's passing 64 tokens (those steps run the layer loop).
PROMPTS = [[5, 17, 99, 3, 44, 12, 7], [7, 8, 9], [300, 12, 150], list(range(20, 45)), [9] * 58]
LENGTHS = [5, 3, 8, 6, 8]


@needs_triton
def test_padded_steps_equal_the_layer_loop(
    llama_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Split-K decode: each capacity's grid has partitions that shorter contexts leave empty
    (one partition, the default off the GPU, is test_padded_rows_write_no_slot...'s)."""
    from pagedllm.backends.gpu.attention import TritonPagedAttention

    monkeypatch.setattr(TritonPagedAttention, "default_partition_size", PARTITION)
    ref = engine(llama_path, max_num_seqs=3, enforce_eager=True)
    assert ref.executor.worker.runner.model.fast_decode is None
    ref_tokens, ref_logits = greedy(ref, PROMPTS, LENGTHS)
    ref.shutdown()

    eng = engine(llama_path, max_num_seqs=3, enforce_eager=True)
    model = eng.executor.worker.runner.model
    runner = padded_runner(model)
    declined: list[int] = []  # the longest context of each decode step left to the layer loop

    def step(hidden, positions, kv_caches, meta):
        out = runner.step(hidden, positions, kv_caches, meta)
        if out is None:
            declined.append(meta.max_seq_len)
        return out

    model.fast_decode = step
    tokens, logits = greedy(eng, PROMPTS, LENGTHS)
    assert tokens == ref_tokens
    assert len(logits) == len(ref_logits)
    for got, want in zip(logits, ref_logits, strict=True):
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    buckets = {b for b, _ in runner.steps}
    capacities = {c for _, c in runner.steps}
    assert 4 in buckets and {1, 2} <= buckets, runner.steps  # 3 rows padded to 4
    assert capacities == {16, 32, 64}, runner.steps
    assert declined and min(declined) > MAX_CAP, declined  # only those past the capacity
    assert runner.broken is None


def decode_meta(seq_lens: list[int], tables: list[list[int]]) -> tuple:
    pairs = zip(seq_lens, tables, strict=True)
    slots = [t[(s - 1) // BLOCK] * BLOCK + (s - 1) % BLOCK for s, t in pairs]
    meta = build_attention_metadata(
        num_prefills=0,
        seq_lens=seq_lens,
        query_lens=[1] * len(seq_lens),
        slot_mapping=slots,
        block_tables=tables,
        block_size=BLOCK,
        device=DEVICE,
    )
    return meta, torch.tensor([s - 1 for s in seq_lens], device=DEVICE), slots


def by_slot(cache: torch.Tensor) -> torch.Tensor:
    """[2, blocks, kv heads, block size, head] -> one row per slot (block * size + offset)."""
    return cache.permute(1, 3, 0, 2, 4).reshape(cache.shape[1] * cache.shape[3], -1)


@needs_triton
def test_padded_rows_write_no_slot_and_change_no_real_row(llama_path: Path) -> None:
    """Three rows in a bucket of four, block 0 (what a padded row reads) full of NaN: the real
    rows' outputs and cache writes equal the unpadded loop's; no other slot changes."""
    eng = engine(llama_path, max_num_seqs=4, enforce_eager=True)
    model = eng.executor.worker.runner.model
    caches = eng.executor.worker.cache_engine.kv_caches
    torch.manual_seed(0)
    for c in caches:
        c.normal_()
        c[:, 0] = float("nan")
    before = [c.clone() for c in caches]
    meta, positions, slots = decode_meta([12, 3, 20], [[1, 2], [3], [4, 5, 6]])
    hidden = torch.randn(3, model.config.hidden_size, device=DEVICE)

    want_caches = [c.clone() for c in before]
    want_hidden, want_res = model.run_layers(positions, hidden.clone(), None, want_caches, meta)
    runner = padded_runner(model)
    got = runner.step(hidden.clone(), positions, caches, meta)
    assert got is not None and runner.steps == {(4, 32): 1}
    torch.testing.assert_close(got[0], want_hidden, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(got[1], want_res, atol=1e-4, rtol=1e-4)
    assert runner.inputs is not None
    assert runner.inputs.slot_mapping[3].item() == PAD_SLOT
    written = torch.zeros(caches[0].shape[1] * BLOCK, dtype=torch.bool)
    written[slots] = True
    for c, old, want in zip(caches, before, want_caches, strict=True):
        new, old, want = by_slot(c), by_slot(old), by_slot(want)
        torch.testing.assert_close(new, want, equal_nan=True, atol=1e-4, rtol=1e-4)
        changed = ~((new == old) | (new.isnan() & old.isnan())).all(dim=1)
        assert changed.cpu().equal(written), "a slot other than the real rows' was written"


@needs_triton
def test_steps_a_graph_does_not_serve_return_none(llama_path: Path) -> None:
    eng = engine(llama_path, max_num_seqs=4, enforce_eager=True)
    model = eng.executor.worker.runner.model
    caches = eng.executor.worker.cache_engine.kv_caches
    runner = padded_runner(model)
    h = model.config.hidden_size
    meta, positions, _ = decode_meta([70], [list(range(1, 10))])  # past the largest capacity
    assert runner.step(torch.zeros(1, h, device=DEVICE), positions, caches, meta) is None
    many = [[i + 1] for i in range(9)]  # past the largest bucket
    meta, positions, _ = decode_meta([2] * 9, many)
    assert runner.step(torch.zeros(9, h, device=DEVICE), positions, caches, meta) is None
    assert runner.steps == {}


def failing_capture(fn: object) -> object:
    raise RuntimeError("operation not permitted when stream is capturing")


@needs_triton
def test_a_failed_capture_runs_every_later_step_eagerly(
    llama_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    eng = engine(llama_path, max_num_seqs=3, enforce_eager=True)
    model = eng.executor.worker.runner.model
    runner = DecodeGraphs(model.run_layers, failing_capture, batch_buckets=BUCKETS)
    model.fast_decode = runner.step
    with caplog.at_level(logging.WARNING, logger="pagedllm.backends.gpu.decode_graphs"):
        tokens, _ = greedy(eng, PROMPTS[:2], [3, 3])
    assert runner.broken and "capture failed at batch 2" in runner.broken
    assert "decode: CUDA graphs not used from here on" in caplog.text
    assert all(len(t) == 3 for t in tokens)


def test_the_installer_names_why_not(llama_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    from tests.conftest import load_on_reference

    assert not_covered(torch.nn.Linear(2, 2)) == "Linear is not a decoder with a layer loop"
    model = load_on_reference(llama_path, torch.float32)
    want = "attention backend ['reference'] (only the Triton kernels are capture-safe)"
    assert not_covered(model) == want
    for m in model.modules():
        if hasattr(m, "backend"):
            m.backend.name = "triton"  # (the reference's instance)
    assert not_covered(model) == "parameters on cpu, not a CUDA device"
    with caplog.at_level(logging.INFO, logger="pagedllm.backends.gpu.decode_graphs"):
        assert install_cuda_graphs(model) == ""
    assert "decode: CUDA graphs not used: parameters on cpu, not a CUDA device" in caplog.text
    assert model.fast_decode is None


def test_cuda_prefers_the_graph_row() -> None:
    from pagedllm.backends.gpu.backend import CudaBackend

    chosen = kernels.select("decode_stack", "cuda", CudaBackend.kernel_order["decode_stack"])
    assert chosen.kernel is not None and chosen.kernel.impl == "cuda_graph"
    assert chosen.value is install_cuda_graphs


def _stack(model: list, *, int8_activations: bool) -> str:
    model.append("decode_stack")
    return "decode_stack: fake"


def test_enforce_eager_installs_no_decode_stack(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(
        kernels, "KERNELS", (Kernel("decode_stack", "cuda_graph", f"{HERE}:_stack", ("cuda",)),)
    )
    order = {"decode_stack": ("cuda_graph",)}
    calls: list[str] = []
    assert kernels.install(calls, "cuda", order, int8_activations=False) == (
        "",
        "decode_stack: fake",
    )
    assert calls == ["decode_stack"]
    with caplog.at_level(logging.INFO, logger="pagedllm.backends.kernels"):
        done = kernels.install(calls, "cuda", order, int8_activations=False, enforce_eager=True)
    assert done == ("", "none") and calls == ["decode_stack"]
    assert "decode: layer by layer (enforce_eager)" in caplog.text


@needs_triton
@pytest.mark.skipif(not ON_CUDA, reason="CUDA graphs capture and replay only on a CUDA device")
def test_cuda_graphs_replay_the_eager_tokens(llama_path: Path) -> None:
    """On the device: the registry installs the graphs by default; greedy tokens equal the
    eager engine's (enforce_eager) while sequences finish and join; graphs were captured."""
    from pagedllm.backends.gpu.decode_graphs import CudaGraphCapture

    eager = engine(llama_path, max_num_seqs=3, enforce_eager=True)
    want, want_logits = greedy(eager, PROMPTS, LENGTHS)
    eager.shutdown()
    eng = engine(llama_path, max_num_seqs=3)
    model = eng.executor.worker.runner.model
    assert "cuda_graph" in eng.executor.worker.layer_kernels()
    runner = model.fast_decode.__self__
    assert isinstance(runner, DecodeGraphs) and isinstance(runner.capture, CudaGraphCapture)
    got, logits = greedy(eng, PROMPTS, LENGTHS)
    assert got == want
    for a, b in zip(logits, want_logits, strict=True):
        torch.testing.assert_close(a, b, atol=1e-3, rtol=1e-3)
    assert runner.broken is None
    assert runner.capture.graphs and sum(runner.steps.values()) > len(runner.capture.graphs)


def test_enforce_eager_reaches_the_installers(
    llama_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The engine argument travels through the config and the worker to ``prepare_model``."""
    with caplog.at_level(logging.INFO, logger="pagedllm.backends.kernels"):
        eng = Engine(str(llama_path), device="cpu", enforce_eager=True, num_kv_blocks=16)
    assert "decode: layer by layer (enforce_eager)" in caplog.text
    assert eng.executor.worker.runner.model.fast_decode is None
    eng.shutdown()

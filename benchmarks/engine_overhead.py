"""Engine overhead: everything around the forward pass, at 256 running sequences.

Runs the real engine (scheduler, block manager, input preparation, output processing) with a
model stand-in that returns a token for every sampled row at once, and compares the time per
step with a real decode step of the benchmark model at the same batch. Prints JSON.

``--host-step``: the host time of one decode step at one sequence of the demo file
(SmolLM2-135M Q4_1, 30 layers; issue 60's bar is 0.5 ms): each ``Engine.step()``'s wall time
against the time spent inside our C++ kernels (every call into the extensions is timed through
a wrapper module installed before the engine loads), with the decode stack on and off. Host =
step - kernels: the step loop, scheduling, input preparation, the Python between kernels,
sampling's Python side, output processing and detokenisation. Medians over the steps.
``layer_kernels`` in the JSON names what the stack covers (``+ embedding, norm, head``: decode
steps go from the scheduler's lists to logits, and greedy tokens, in one call).

    python benchmarks/engine_overhead.py
    python benchmarks/engine_overhead.py --smoke
    python benchmarks/engine_overhead.py --host-step [--smoke]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from throughput import FULL_MODEL, SMOKE_MODEL, build_model

from pagedllm import Engine, SamplingParams
from pagedllm.core.interfaces import ModelRunnerOutput, SampledToken, SchedulerOutput
from pagedllm.executors.inputs import flatten


def fill(engine: Engine, num_seqs: int, prompt_len: int, vocab: int) -> None:
    # max_tokens=None: the rest of the context window, so sequences stay running
    params = SamplingParams(temperature=0.0, max_tokens=None, ignore_eos=True)
    for i in range(num_seqs):
        ids = [(i * 31 + j * 7) % (vocab - 3) + 3 for j in range(prompt_len)]
        engine.add_request(f"r{i}", {"prompt_token_ids": ids}, params)
    while engine.scheduler.waiting:
        engine.step()


def time_steps(engine: Engine, steps: int) -> float:
    engine.step()
    start = time.perf_counter()
    for _ in range(steps):
        engine.step()
    return (time.perf_counter() - start) / steps


def fake_executor(engine: Engine):
    """Input preparation as the real runner does it, then an instant 'model'."""
    worker = engine.executor.worker  # type: ignore[attr-defined]
    runner = worker.runner
    block_size = engine.config.cache.block_size

    def execute(sched_out: SchedulerOutput) -> ModelRunnerOutput:
        batch = flatten(sched_out, block_size)
        runner.attention.build_metadata(
            num_prefills=sched_out.num_prefill_seqs,
            seq_lens=batch.seq_lens,
            query_lens=batch.query_lens,
            slot_mapping=batch.slot_mapping,
            block_tables=batch.block_tables,
            block_size=block_size,
            device=runner.device,
        )
        torch.tensor(batch.input_ids)
        torch.tensor(batch.positions)
        return ModelRunnerOutput(
            sampled={
                s.seq_id: SampledToken(s.seq_id, 5, -1.0) for s in sched_out.seqs if s.do_sample
            }
        )

    return execute


class _TimedOps:
    """An extension module whose every function call (and ``DecodeStack.run``) adds its
    duration to ``clock[0]`` and the calling thread's CPU time in it to ``clock[1]`` (ns): the
    kernels' share of a step, measured from Python. The CPU time is what a loaded machine does
    not blur: host work preempted by other processes takes longer but no more CPU."""

    def __init__(self, module: ModuleType, clock: list[int]) -> None:
        self._module, self._clock = module, clock

    def _timed(self, fn: Any) -> Any:
        clock = self._clock

        def call(*args: Any, **kwargs: Any) -> Any:
            start, cpu = time.perf_counter_ns(), time.thread_time_ns()
            try:
                return fn(*args, **kwargs)
            finally:
                clock[0] += time.perf_counter_ns() - start
                clock[1] += time.thread_time_ns() - cpu

        return call

    def __getattr__(self, name: str) -> Any:
        value = getattr(self._module, name)
        if name == "DecodeStack":
            return lambda *a, **k: _TimedStack(value(*a, **k), self._timed)
        if isinstance(value, type) or not callable(value):
            return value
        return self._timed(value)


class _TimedStack:
    """A ``DecodeStack`` whose step calls (``run``, ``run_decode``) are timed as kernels."""

    def __init__(self, stack: Any, timed: Any) -> None:
        self._stack, self.run = stack, timed(stack.run)
        if hasattr(stack, "run_decode"):
            self.run_decode = timed(stack.run_decode)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stack, name)


def _time_kernels(clock: list[int]) -> None:
    """Every later load of the C++ extensions hands out a ``_TimedOps``."""
    from pagedllm.backends.cpu import _ops, dense_gemm, kernel_attention, layer_kernels

    def wrap(load: Any) -> Any:
        return lambda *a, **k: _TimedOps(load(*a, **k), clock)

    _ops.load_kernels = wrap(_ops.load_kernels)  # type: ignore[assignment]
    kernel_attention.load_kernels = _ops.load_kernels  # type: ignore[attr-defined]
    dense_gemm.gemm_ops.cache_clear()
    layer_kernels.layer_ops.cache_clear()


def host_step(
    model: Path, *, stack: bool, steps: int, int8: bool, tokenizer: bool = True
) -> dict[str, Any]:
    """One sequence's decode steps through ``Engine.step()``: medians (ms) of the step, of its
    time in kernels, in the model runner (``execute_model``) and host = step - kernels; and host
    CPU time, the engine thread's CPU time in the step outside kernels."""
    clock = [0, 0]
    _time_kernels(clock)
    os.environ["PAGEDLLM_DECODE_STACK"] = "1" if stack else "0"
    engine = Engine(
        str(model),
        device="cpu",
        max_num_seqs=1,
        kv_cache_space=1,
        int8_activations=int8,
        skip_tokenizer_init=not tokenizer,  # the smoke model has none
    )
    runner_ns = [0]
    execute = engine.executor.execute_model

    def timed_execute(sched_out: SchedulerOutput) -> ModelRunnerOutput:
        start = time.perf_counter_ns()
        try:
            return execute(sched_out)
        finally:
            runner_ns[0] += time.perf_counter_ns() - start

    engine.executor.execute_model = timed_execute  # type: ignore[method-assign]
    params = SamplingParams(temperature=0.0, max_tokens=steps + 8, ignore_eos=True)
    engine.add_request("host", {"prompt_token_ids": list(range(10, 42))}, params)
    for _ in range(4):  # the prefill and a few warm decode steps
        engine.step()
    rows: list[tuple[int, int, int, int]] = []
    for _ in range(steps):
        clock[0] = clock[1] = runner_ns[0] = 0
        start, cpu = time.perf_counter_ns(), time.thread_time_ns()
        engine.step()
        host_cpu = time.thread_time_ns() - cpu - clock[1]
        rows.append((time.perf_counter_ns() - start, clock[0], runner_ns[0], host_cpu))
    while engine.has_unfinished_requests():
        engine.step()
    free = engine.scheduler.block_manager.get_num_free_device_blocks()  # type: ignore[attr-defined]

    def median_ms(values: list[int]) -> float:
        return statistics.median(values) / 1e6

    return {
        "path": engine.executor.collective_rpc("linear_path")[0],
        "layer_kernels": engine.executor.collective_rpc("layer_kernels")[0],
        "dtype": str(engine.executor.worker.dtype).removeprefix("torch."),  # type: ignore
        "step_ms": median_ms([r[0] for r in rows]),
        "kernels_ms": median_ms([r[1] for r in rows]),
        "host_ms": median_ms([r[0] - r[1] for r in rows]),
        "host_in_runner_ms": median_ms([r[2] - r[1] for r in rows]),
        "host_outside_runner_ms": median_ms([r[0] - r[2] for r in rows]),
        "min_host_ms": min(r[0] - r[1] for r in rows) / 1e6,
        "host_cpu_ms": median_ms([r[3] for r in rows]),
        "free_blocks_after": free,
    }


def host_main(args: argparse.Namespace) -> None:
    from pagedllm.backends.cpu._ops import cpu_model_name, resolve_isa

    if args.smoke:
        tmp = tempfile.TemporaryDirectory()
        model = build_model(Path(tmp.name) / "model", SMOKE_MODEL)
    else:
        from pagedllm.entrypoints.demo_model import fetch_demo_model

        fetched = fetch_demo_model(download=False)
        assert fetched.path is not None, "the demo file is not cached (pagedllm serve --demo)"
        model = fetched.path
    steps = 4 if args.smoke else args.steps
    result: dict[str, Any] = {
        "benchmark": "engine_overhead.host_step",
        "processor": cpu_model_name(),
        "isa": resolve_isa(),
        "model": model.name,
        "sequences": 1,
        "steps": steps,
        "int8_activations": args.int8_activations,
        "torch_threads": torch.get_num_threads(),
    }
    for stack in ("on", "off") if args.decode_stack == "both" else (args.decode_stack,):
        result[f"decode_stack_{stack}"] = host_step(
            model,
            stack=stack == "on",
            steps=steps,
            int8=args.int8_activations,
            tokenizer=not args.smoke,
        )
    result["note"] = (
        "kernels: time inside calls into the C++ extensions (the wrapper's Python frame is "
        "counted as host); host = step - kernels; host_cpu: the engine thread's CPU time in "
        "the step outside kernels (what load on the machine does not inflate)"
    )
    print(json.dumps(result, indent=2))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-seqs", type=int, default=256)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--model-dir", type=Path, default=None)
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--host-step", action="store_true", help="one sequence's host time")
    parser.add_argument("--int8-activations", action="store_true")
    parser.add_argument("--decode-stack", choices=("on", "off", "both"), default="both")
    args = parser.parse_args(argv)
    if args.host_step:
        host_main(args)
        return
    spec = SMOKE_MODEL if args.smoke else FULL_MODEL
    num_seqs = 8 if args.smoke else args.num_seqs
    steps = 3 if args.smoke else args.steps
    with tempfile.TemporaryDirectory() as tmp:
        model = build_model(args.model_dir or Path(tmp) / "model", spec)
        engine = Engine(
            str(model),
            device="cpu",
            dtype="float32",
            skip_tokenizer_init=True,
            max_num_seqs=num_seqs,
            kv_cache_space=2,
        )
        fill(engine, num_seqs, args.prompt_len, spec["vocab_size"])
        real = time_steps(engine, steps)
        engine.executor.execute_model = fake_executor(engine)  # type: ignore[method-assign]
        overhead = time_steps(engine, steps * 5)
    print(
        json.dumps(
            {
                "benchmark": "engine_overhead",
                "running_sequences": num_seqs,
                "context_tokens": args.prompt_len,
                "overhead_us_per_step": overhead * 1e6,
                "real_step_ms": real * 1e3,
                "overhead_share_of_real_step": overhead / real,
                "note": "overhead = scheduling + block tables + input tensors + output processing "
                "(no detokenization: the benchmark model has no tokenizer)",
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()

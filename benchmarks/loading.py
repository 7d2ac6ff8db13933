"""Checkpoint loading: seconds and peak memory to load a random-weight Llama in its own dtype.

Builds (once, cached in ``--folder``) the Llama-3.2-1B-shaped checkpoint in bfloat16 (2.2 GB;
``benchmarks/model_builder.py``), then in a fresh subprocess per dtype loads it with
``load_model`` and, separately timed, the backend's ``prepare_model`` (weight packing). Prints one
JSON object: checkpoint bytes, and per dtype the load seconds, packing seconds, peak RSS
(``ru_maxrss``) and its ratio to the weights' in-memory size.

    python benchmarks/loading.py                     # the 1B checkpoint: bf16, float32, int8, w8a8
    python benchmarks/loading.py --smoke             # a tiny checkpoint, for CI
    python benchmarks/loading.py --huge-pages both   # with and without huge pages, alternating
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from model_builder import LLAMA_1B, LLAMA_TINY, build_random_llama, checkpoint_bytes

_CHILD = r"""
import json, resource, sys, time, torch
from pagedllm.backends.cpu._ops import cpu_model_name
from pagedllm.backends.cpu.backend import CpuBackend
from pagedllm.models.model_loader import load_hf_config, load_model

path, dtype = sys.argv[1], getattr(torch, sys.argv[2])
quantization = sys.argv[3] or None
backend = CpuBackend()
attention = backend.attention("auto")
config = load_hf_config(path)  # imports transformers: not part of reading the weights
start, cpu_start = time.perf_counter(), time.process_time()
model = load_model(path, config, attn_backend=attention, device=torch.device("cpu"), dtype=dtype,
                   quantization=quantization, quantizer=backend.kernel("int8_quantize").value)
load_s, load_cpu_s = time.perf_counter() - start, time.process_time() - cpu_start
rss_after_load = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
start = time.perf_counter()
backend.prepare_model(model)
prepare_s = time.perf_counter() - start
print(json.dumps({
    "load_s": round(load_s, 3),
    "load_cpu_s": round(load_cpu_s, 3),  # wall time on a busy machine overstates the work
    "prepare_model_s": round(prepare_s, 3),
    "peak_rss_after_load_bytes": rss_after_load,
    "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
    "weight_bytes": weight_bytes,
    "peak_rss_over_weights": round(rss_after_load / weight_bytes, 3),
    "processor": cpu_model_name(),
    "linear_path": backend.linear_path,
    "layer_kernels": backend.layer_kernels,
}))
"""


def measure(folder: Path, run: str, huge_pages: bool = True) -> dict[str, object]:
    """One ``dtype`` or ``dtype:quantization`` run (``bfloat16:int8``) in a fresh process, with
    PyTorch's large tensors on transparent huge pages (pagedllm's default) or not."""
    dtype, _, quantization = run.partition(":")
    env = {
        **os.environ,
        "PYTHONPATH": str(Path(__file__).resolve().parents[1]),
        "THP_MEM_ALLOC_ENABLE": "1" if huge_pages else "0",
    }
    proc = subprocess.run(
        [sys.executable, "-c", _CHILD, str(folder), dtype, quantization],
        capture_output=True,
        text=True,
        env=env,
        check=False,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"loading in {run} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _total(run: dict[str, object]) -> float:
    return float(run["load_s"]) + float(run["prepare_model_s"])  # type: ignore[arg-type]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true", help="a tiny checkpoint (CI)")
    ap.add_argument("--folder", type=Path, default=None, help="where the checkpoint is cached")
    ap.add_argument(
        "--dtypes",
        default="bfloat16,float32,bfloat16:int8,bfloat16:w8a8",
        help="runs, comma-separated: a dtype, or dtype:quantization (int8 weights made at load)",
    )
    ap.add_argument(
        "--huge-pages",
        choices=("on", "off", "both"),
        default="on",
        help="PyTorch's large tensors on transparent huge pages (THP_MEM_ALLOC_ENABLE, "
        "pagedllm's default: on); both: each run twice, alternating, reported side by side",
    )
    args = ap.parse_args(argv)
    spec = LLAMA_TINY if args.smoke else LLAMA_1B
    with tempfile.TemporaryDirectory() as tmp:
        folder = args.folder or Path(tmp) / "llama-bf16"
        build_random_llama(folder, spec)
        result = {
            "model": "tiny" if args.smoke else "llama-1b-shape",
            "checkpoint_dtype": "bfloat16",
            "checkpoint_bytes": checkpoint_bytes(folder),
        }
        runs = args.dtypes.split(",")
        if args.huge_pages == "both":  # alternating, so a drifting machine tilts both alike
            pairs = {d: (measure(folder, d, True), measure(folder, d, False)) for d in runs}
            result["runs"] = {d: on for d, (on, _) in pairs.items()}
            result["runs_without_huge_pages"] = {d: off for d, (_, off) in pairs.items()}
            result["load_speedup_from_huge_pages"] = {
                d: round(_total(off) / _total(on), 2) for d, (on, off) in pairs.items()
            }
        else:
            result["runs"] = {d: measure(folder, d, args.huge_pages == "on") for d in runs}
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()

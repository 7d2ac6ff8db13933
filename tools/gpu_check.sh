#!/usr/bin/env bash
# One self-contained check on a CUDA machine (no network; torch, triton, transformers present).
# Runs, compiled on the device (never the interpreter):
#   1. the Triton kernel tests (fp32/fp16/bf16 and fp8 caches vs the PyTorch reference, fused
#      MoE, LoRA, the sm_80/sm_90 compile check), the end-to-end engine tests with
#      attention_backend="triton", and the CUDA graphs of decode steps
#      (tests/backends/test_decode_graphs.py: padded buckets vs the layer loop, compiled, and
#      torch.cuda.CUDAGraph capture/replay against enforce_eager's tokens);
#   2. the Hugging Face equality tests on device="cuda" in float16 (test_hf_equality.py is the
#      file that reads PAGEDLLM_TEST_DEVICE / PAGEDLLM_TEST_DTYPE; the rest of tests/models runs
#      on the CPU whatever the machine, and would only compile the CPU extension there);
#   3. the decode benchmark (JSON written to $OUT_DIR/attention_gpu.json);
#   4. the offline throughput benchmark, our engine vs transformers on the device (bf16, fp32;
#      JSON written to $OUT_DIR/throughput_gpu.json);
#   5. decode steps with CUDA graphs against without, at batch 1 and 32 (JSON written to
#      $OUT_DIR/decode_graphs.json);
#   6. the demo (`make demo`'s job on the embedded model, no download) with --device cuda.
# Exits non-zero if any step fails; each step has its own time limit (< 10 minutes in all).
# Needs the `gguf` package (the model tests import it): carry its wheel where it is missing.
#
#   tools/gpu_check.sh                 # uses .venv/bin/python, else python3
#   PYTHON=/path/to/python OUT_DIR=/tmp/out tools/gpu_check.sh
set -uo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-}
if [ -z "$PY" ]; then
    if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi
fi
OUT_DIR=${OUT_DIR:-${OUT:-.}}
mkdir -p "$OUT_DIR"
unset TRITON_INTERPRET
export TRITON_DEFAULT_FP_FUSION=1  # triton 3.9 warns when unset
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1

"$PY" - <<'PYEOF' || { echo "FAILED: no usable CUDA device or triton"; exit 2; }
import torch, triton
assert torch.cuda.is_available(), "torch sees no CUDA device"
p = torch.cuda.get_device_properties(0)
print(f"{p.name} (sm_{p.major}{p.minor}, {p.total_memory / 2**30:.0f} GiB), "
      f"torch {torch.__version__}, triton {triton.__version__}")
PYEOF

# Each Triton specialisation compiles for several seconds on the device: spread the kernel
# tests over the machine's cores where pytest-xdist is installed (184 tests, ~7 s each alone).
PAR=()
if "$PY" -c "import xdist" 2>/dev/null; then PAR=(-n "$(nproc)"); fi

failed=()
step() {  # step NAME SECONDS CMD...
    local name=$1 limit=$2
    shift 2
    echo "=== $name (limit ${limit}s)"
    local t0=$SECONDS
    if timeout --kill-after=10 "$limit" "$@"; then
        echo "=== $name: ok ($((SECONDS - t0))s)"
    else
        echo "=== $name: FAILED (rc=$?, $((SECONDS - t0))s)"
        failed+=("$name")
    fi
}

step "triton kernel + engine tests" 200 \
    "$PY" -m pytest -q -rfEs --tb=short -p no:cacheprovider "${PAR[@]}" -m gpu \
    tests/backends/test_attention_conformance.py tests/backends/test_triton_kernels.py \
    tests/backends/test_triton_engine.py tests/backends/test_triton_fp8.py \
    tests/backends/test_triton_fused_moe.py tests/backends/test_triton_lora.py \
    tests/backends/test_decode_graphs.py
step "HF equality on cuda/float16" 100 \
    env PAGEDLLM_TEST_DEVICE=cuda PAGEDLLM_TEST_DTYPE=float16 \
    "$PY" -m pytest -q -rfEs -p no:cacheprovider tests/models/test_hf_equality.py
step "decode benchmark" 50 \
    env PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" "$PY" benchmarks/attention_gpu.py --output "$OUT_DIR/attention_gpu.json"
step "throughput vs transformers" 150 \
    env PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" "$PY" benchmarks/throughput.py \
    --device cuda --num-requests 64 --output "$OUT_DIR/throughput_gpu.json"
step "decode with CUDA graphs vs eager" 50 \
    env PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" "$PY" benchmarks/decode_graphs.py \
    --device cuda --model-size 56m --output "$OUT_DIR/decode_graphs.json"
step "demo on cuda" 50 \
    "$PY" -m pagedllm.entrypoints.demo --no-download --device cuda --max-tokens 32

if [ ${#failed[@]} -gt 0 ]; then
    echo "gpu_check: FAILED: ${failed[*]}"
    exit 1
fi
echo "gpu_check: all steps passed"

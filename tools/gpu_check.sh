#!/usr/bin/env bash
# One self-contained check on a CUDA machine (no network; torch, triton, transformers present).
# Runs, compiled on the device (never the interpreter):
#   1. the Triton kernel tests (fp32/fp16/bf16 vs the PyTorch reference) and the end-to-end
#      engine test with attention_backend="triton";
#   2. the Hugging Face equality tests on device="cuda" in float16 (tests/models reads
#      PAGEDLLM_TEST_DEVICE / PAGEDLLM_TEST_DTYPE);
#   3. the decode benchmark (JSON written to $OUT_DIR/attention_gpu.json).
# Exits non-zero if any step fails; each step has its own time limit (< 8 minutes in all).
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

step "triton kernel + engine tests" 180 \
    "$PY" -m pytest -q -rfEs -p no:cacheprovider -m gpu \
    tests/backends/test_attention_conformance.py tests/backends/test_triton_kernels.py \
    tests/backends/test_triton_engine.py
step "HF equality on cuda/float16" 150 \
    env PAGEDLLM_TEST_DEVICE=cuda PAGEDLLM_TEST_DTYPE=float16 \
    "$PY" -m pytest -q -rfEs -p no:cacheprovider tests/models
step "decode benchmark" 90 \
    "$PY" benchmarks/attention_gpu.py --output "$OUT_DIR/attention_gpu.json"

if [ ${#failed[@]} -gt 0 ]; then
    echo "gpu_check: FAILED: ${failed[*]}"
    exit 1
fi
echo "gpu_check: all steps passed"

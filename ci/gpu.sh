#!/usr/bin/env bash
# The "gpu" leg of the CI matrix. Runs anywhere: without a CUDA device the Triton kernels run on
# CPU tensors under Triton's interpreter (TRITON_INTERPRET=1), and are also compiled to sm_80/sm_90
# cubins (no GPU needed) by tests/backends/test_triton_kernels.py. The kernel-vs-reference matrix
# is the "triton" kind of tests/backends/test_attention_conformance.py (marked gpu).
#
#   ci/gpu.sh                 # creates .venvs/gpu once (torch 2.13.0 CPU + '.[dev]' + triton)
#   VENV=.venv ci/gpu.sh      # reuse an existing environment; only triton is added if missing
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=${VENV:-.venvs/gpu}
if [ ! -x "$VENV/bin/python" ]; then
    python3 -m venv "$VENV"
    # torch is pinned (==2.13.0, the CPU build on local disk) in pyproject.toml: a bare
    # `torch` would pull a multi-GB CUDA build.
    # Editable installs write pagedllm.egg-info into the checkout: one at a time (ci/xpu.sh
    # --prepare may be installing into .venvs/xpu meanwhile).
    mkdir -p build
    flock build/.editable-install.lock \
        "$VENV/bin/pip" install -q --disable-pip-version-check -e '.[dev]'
fi
if ! "$VENV/bin/python" -c "import triton" 2>/dev/null; then
    "$VENV/bin/pip" install -q --disable-pip-version-check -r ci/requirements-gpu.txt
fi
PY="$VENV/bin/python"
"$PY" -c "import torch, triton; print(f'torch {torch.__version__}, triton {triton.__version__}')"

if ! "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    export TRITON_INTERPRET=1
    echo "no CUDA device: Triton kernels run under the interpreter"
fi

"$PY" -m pytest -q -rfEs -p no:cacheprovider --durations=15 -m gpu \
    tests/backends/test_attention_conformance.py tests/backends/test_triton_kernels.py \
    tests/backends/test_triton_engine.py tests/backends/test_triton_fused_moe.py \
    tests/backends/test_triton_lora.py tests/backends/test_triton_fp8.py \
    tests/backends/test_decode_graphs.py
"$PY" benchmarks/attention_gpu.py --smoke > /dev/null
echo "benchmark smoke run: ok"

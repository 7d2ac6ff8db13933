#!/usr/bin/env bash
# CI leg: IPEX paged attention (attention_backend="ipex") in its own virtualenv.
#
# IPEX pins torch to its own minor version (2.8), unlike the main .venv, so this leg builds
# .venvs/xpu from ci/requirements-xpu.txt and reuses it while a stamp file holds the hash of that
# file (and of the interpreter's version). It then runs the IPEX kernel tests against the
# PyTorch reference and the IPEX engine tests against transformers, on CPU tensors with IPEX's
# CPU build (and on an XPU too where one is present), and exits non-zero on any failure.
#
# Usage, from anywhere:  bash ci/xpu.sh [extra pytest args]
#                        bash ci/xpu.sh --prepare   # only the venv and our CPU kernels for its torch
# PYTHON chooses the interpreter the venv is made from (default python3; IPEX 2.8: 3.9-3.13).
#
# --prepare is what ci/matrix.sh runs in the background during the gpu leg (whose Triton
# interpreter keeps about one core busy): the venv, and our C++ CPU kernels built for torch 2.8
# (the engine tests' CPU backend would otherwise build them in the leg's first engine test, ~3
# minutes on 2 cores). The leg itself then finds both ready; it runs every test as before.
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."

PREPARE=0
if [[ "${1:-}" == "--prepare" ]]; then
    PREPARE=1
    shift
fi
# Editable installs write pagedllm.egg-info into the checkout: one at a time across the legs.
mkdir -p build
EDITABLE_LOCK=build/.editable-install.lock

PYTHON="${PYTHON:-python3}"
VENV=.venvs/xpu
REQUIREMENTS=ci/requirements-xpu.txt
STAMP="$VENV/.requirements-xpu.stamp"

want="$( { sha256sum "$REQUIREMENTS" | cut -d' ' -f1; "$PYTHON" --version; } 2>&1 )"
have="$(cat "$STAMP" 2>/dev/null || true)"

if [[ "$want" != "$have" || ! -x "$VENV/bin/python" ]]; then
    echo "ci/xpu.sh: (re)creating $VENV from $REQUIREMENTS"
    rm -rf "$VENV"
    "$PYTHON" -m venv "$VENV"
    "$VENV/bin/python" -m pip install --quiet --upgrade pip
    "$VENV/bin/python" -m pip install --quiet -r "$REQUIREMENTS"
    flock "$EDITABLE_LOCK" "$VENV/bin/python" -m pip install --quiet --no-deps -e .
    printf '%s\n' "$want" > "$STAMP"
else
    echo "ci/xpu.sh: reusing $VENV (stamp matches $REQUIREMENTS)"
fi

# The editable install points at the checkout it was made from; a moved checkout reinstalls.
if ! "$VENV/bin/python" - <<'PY'
import pathlib, sys
import pagedllm
sys.exit(pathlib.Path(pagedllm.__file__).resolve().parents[1] != pathlib.Path.cwd().resolve())
PY
then
    flock "$EDITABLE_LOCK" "$VENV/bin/python" -m pip install --quiet --no-deps -e .
fi

if (( PREPARE )); then
    # A failed build is not fatal here either: the leg then builds (or falls back) as before.
    "$VENV/bin/python" -m pagedllm.backends.cpu.build \
        || echo "ci/xpu.sh --prepare: the CPU kernels did not build; the leg tries again"
    exit 0
fi

"$VENV/bin/python" - <<'PY'
import torch
import intel_extension_for_pytorch as ipex

print(f"ci/xpu.sh: torch {torch.__version__}, intel_extension_for_pytorch {ipex.__version__}, "
      f"xpu available: {torch.xpu.is_available()}")
PY

# The "ipex" kind of the kernel conformance matrix (marked xpu), then IPEX's own tests.
"$VENV/bin/python" -m pytest tests/backends/test_attention_conformance.py -m xpu -q -rfEs "$@"
exec "$VENV/bin/python" -m pytest tests/backends/test_ipex_*.py -q -rfEs --durations=10 "$@"

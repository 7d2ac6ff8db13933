#!/usr/bin/env bash
# The "cpu" leg of the CI matrix: core, CPU backend (C++ kernels), models, engine, server,
# tensor parallelism, in the main .venv (torch 2.13.0 CPU build). Benchmarks run in --smoke mode.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
PY="$VENV/bin/python"
# The tests run every ISA level this processor supports, scalar included; `make setup` built
# only the best one. The scalar build compiles meanwhile the extras below download and install
# (mostly waiting on the network and the disk); the same build, earlier (a no-op when cached).
mkdir -p build/ci
"$PY" -m pagedllm.backends.cpu.build --isa scalar > build/ci/cpu-scalar-build.log 2>&1 &
scalar_build=$!
# Ray runs the multi-machine executor's tests on a local cluster; it leaves torch as it is.
"$PY" -c "import ray" 2>/dev/null || "$PY" -m pip install -q --disable-pip-version-check \
    -r ci/requirements-ray.txt
# The engine-core channel (pinned in pyproject.toml too), for a .venv made before it existed.
"$PY" -c "import zmq, msgspec" 2>/dev/null || "$PY" -m pip install -q --disable-pip-version-check \
    pyzmq==26.2.0 msgspec==0.19.0
# The LoRA tests' reference (pinned in pyproject.toml too), for a .venv made before it existed.
"$PY" -c "import peft" 2>/dev/null || "$PY" -m pip install -q --disable-pip-version-check \
    peft==0.21.2
# The web pages are tested in the system's headless Chromium (selenium), `pagedllm chat` in a
# pseudo-terminal (pexpect).
bash ci/install_browser.sh
"$PY" -c "import selenium, pexpect" 2>/dev/null || "$PY" -m pip install -q \
    --disable-pip-version-check -r ci/requirements-web.txt
# The whole tree stays `ruff check` clean and `ruff format`ted.
"$VENV/bin/ruff" check --quiet .
"$VENV/bin/ruff" format --check --quiet .
wait "$scalar_build" || { cat build/ci/cpu-scalar-build.log; echo "scalar build failed"; }
"$PY" -m pytest -q -p no:cacheprovider --durations=30 -m "not gpu and not xpu" tests "$@"
for bench in benchmarks/throughput.py benchmarks/attention_cpu.py benchmarks/engine_overhead.py \
             benchmarks/prefix_caching.py benchmarks/chunked_prefill.py benchmarks/serving.py \
             benchmarks/linear_cpu.py benchmarks/loading.py benchmarks/structured.py \
             benchmarks/moe.py benchmarks/speculative.py benchmarks/lora.py \
             benchmarks/gguf_bench.py benchmarks/kv_tiers.py benchmarks/router.py \
             benchmarks/pipeline.py benchmarks/startup.py benchmarks/activation_rounding.py \
             benchmarks/demo_answers.py; do
    if [ -f "$bench" ]; then
        "$PY" "$bench" --smoke > /dev/null
        echo "benchmark smoke run ok: $bench"
    fi
done

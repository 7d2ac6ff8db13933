#!/usr/bin/env bash
# The per-backend CI matrix: one leg per backend, each in its own virtual environment, each
# printing its own test summary. Fails if any leg fails; a leg's environment is reused while its
# requirements are unchanged.
#
#   ci/matrix.sh            # all legs: cpu gpu xpu
#   ci/matrix.sh cpu xpu    # some legs
set -uo pipefail
cd "$(dirname "$0")/.."
legs=("$@")
[ ${#legs[@]} -gt 0 ] || legs=(cpu gpu xpu)
mkdir -p build/ci
declare -A status
total_passed=0
total_failed=0
# When the xpu leg comes after the gpu leg, its venv and our CPU kernels for its torch are made
# in the background while the gpu leg runs (the Triton interpreter keeps about one of the two
# cores busy); the xpu leg waits for that first, then runs as it always does.
xpu_after_gpu=0
seen_gpu=0
for leg in "${legs[@]}"; do
    [ "$leg" = gpu ] && seen_gpu=1
    [ "$leg" = xpu ] && [ "$seen_gpu" = 1 ] && xpu_after_gpu=1
done
prepare_pid=""
for leg in "${legs[@]}"; do
    echo "================ leg: $leg ================"
    start=$SECONDS
    if [ "$leg" = gpu ] && [ "$xpu_after_gpu" = 1 ] && [ -z "$prepare_pid" ]; then
        bash ci/xpu.sh --prepare > build/ci/xpu-prepare.log 2>&1 &
        prepare_pid=$!
        echo "matrix: preparing the xpu leg in the background (build/ci/xpu-prepare.log)"
    fi
    if [ "$leg" = xpu ] && [ -n "$prepare_pid" ]; then
        wait "$prepare_pid" || echo "matrix: preparing the xpu leg failed; the leg sets up itself"
        prepare_pid=""
        cat build/ci/xpu-prepare.log
    fi
    log="build/ci/$leg.log"
    bash "ci/$leg.sh" 2>&1 | tee "$log"
    rc=${PIPESTATUS[0]}
    status[$leg]="rc=$rc, $((SECONDS - start))s"
    summary=$(grep -E "[0-9]+ (passed|failed)" "$log" | tail -n 1)
    p=$(echo "$summary" | grep -oE "[0-9]+ passed" | grep -oE "[0-9]+" || echo 0)
    f=$(echo "$summary" | grep -oE "[0-9]+ failed" | grep -oE "[0-9]+" || echo 0)
    total_passed=$((total_passed + ${p:-0}))
    if [ "$rc" -ne 0 ] && [ "${f:-0}" -eq 0 ]; then f=1; fi
    total_failed=$((total_failed + ${f:-0}))
done
echo "================ matrix summary ================"
failed_legs=0
for leg in "${legs[@]}"; do
    echo "$leg: ${status[$leg]}"
    case "${status[$leg]}" in rc=0,*) ;; *) failed_legs=$((failed_legs + 1)) ;; esac
done
echo "matrix: $total_passed passed, $total_failed failed"
[ "$failed_legs" -eq 0 ]

#!/usr/bin/env bash
# Every check that needs an NVIDIA GPU, in one run: a GPU is lent for minutes at a time, to a
# machine with torch (CUDA), triton and transformers but without the rest of mcpd's packages
# and no network.
#
#   bench/gpu_checks.sh wheels   here, with network: the missing packages' wheels into .whl/
#                                (for the GPU machine's Python 3.12; .git/info/exclude keeps it out)
#   bench/gpu_checks.sh run [STEP...]
#                                there, from the repo root, .whl/ beside it: installs them and
#                                mcpd, then the steps (default all: tests decode_1b decode_q4_k_m
#                                handlers), each one's log in $OUT. A call runs at most 10 minutes:
#                                `run tests decode_1b decode_q4_k_m` in one, `run handlers` in another.
#
# `run` on a machine without a GPU runs the same steps, the tests skipping and the benchmarks
# printing `skipped`: a check of this script itself.
set -uo pipefail
cd "$(dirname "$0")/.."

WHEELS=(gguf==0.19.0 msgspec==0.23.0 pyzmq==27.3.0 zstandard==0.25.0)
CUDA_TESTS=(tests/test_cuda_kernels.py tests/test_int4_cuda.py tests/test_int8.py tests/test_decode_graphs.py
            tests/test_decode_step.py tests/test_host_kv.py tests/test_cuda_pool.py tests/test_models_vs_hf.py
            tests/test_daemon_cuda.py tests/test_handlers_cuda.py tests/test_int8_handlers_cuda.py)

wheels() {
    grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        --platform any -d .whl "${WHEELS[@]}"
    ls -l .whl
}

step() {   # step NAME COMMAND...: when chosen, its output to $OUT/NAME.log and here, its exit status noted
    [[ " $CHOSEN " == *" $1 "* ]] || return 0
    echo "== $1: ${*:2}"
    "${@:2}" 2>&1 | tee "$OUT/$1.log"
    echo "== $1: exit ${PIPESTATUS[0]}" | tee -a "$OUT/summary.log"
}

run() {
    CHOSEN="${*:-tests decode_1b decode_q4_k_m handlers}"
    OUT=${OUT:-$(mktemp -d)}
    export PYTHONUNBUFFERED=1
    if [ -d .whl ]; then
        python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
            || exit 1
        export PYTHONPATH=/tmp/site
    fi
    python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . || exit 1   # mcpd and mcpctl for the daemon tests
    nvidia-smi -L 2>&1 | tee "$OUT/summary.log"
    step tests python3 -m pytest -q -p no:cacheprovider "${CUDA_TESTS[@]}"
    step decode_1b python3 bench/gpu_decode.py --quick --shape 1b
    step decode_q4_k_m python3 bench/gpu_decode.py --quick --shape 1b --gguf q4_k_m
    step handlers python3 bench/handlers.py --quick --device cuda --peers ''
    echo "logs in $OUT"
}

case "${1:-}" in
    wheels) wheels ;;
    run) shift; run "$@" ;;
    *) echo "usage: $0 wheels|run" >&2; exit 2 ;;
esac

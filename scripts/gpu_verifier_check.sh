#!/usr/bin/env bash
# On the GPU machine (`device` tool, carry [".whl"] after scripts/gpu_fetch_wheels.sh):
#   bash scripts/gpu_verifier_check.sh [TEST FILES...]
# Runs the verifier service, drafter pool, STANDALONE, EAGLE, EAGLE-3, MTP, draft-loading and token-map tests
# (or the given files) with the `splitspec verifier` and `splitspec drafter` processes on the GPU (their --device auto
# picks CUDA; fp32 so greedy outputs compare with the CPU reference), scraped by the carried Prometheus
# server. The log lands in $OUT.
set -uo pipefail
OUT="${OUT:-/tmp/splitspec-gpu}"
mkdir -p "$OUT"
. scripts/gpu_env.sh || exit 1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
TESTS=("$@")
if [[ ${#TESTS[@]} -eq 0 ]]; then
    TESTS=(tests/test_verifier_service.py tests/test_drafter_pool.py tests/test_standalone.py tests/test_eagle.py
           tests/test_eagle_head.py tests/test_eagle3_head.py tests/test_mtp.py tests/test_draft_loading.py tests/test_token_map.py)
fi
python3 -P -m pytest -p no:cacheprovider -q -rs -s "${TESTS[@]}" 2>&1 | tee "$OUT/pytest_verifier_cuda.log"
exit "${PIPESTATUS[0]}"

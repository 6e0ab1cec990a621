#!/usr/bin/env bash
# On the GPU machine (`device` tool, carry [".whl"] after scripts/gpu_fetch_wheels.sh):
#   bash scripts/gpu_verifier_check.sh
# Runs the verifier service, drafter pool, STANDALONE, EAGLE and token-map tests with the `splitspec verifier` process on the GPU (its --device auto
# picks CUDA; fp32 so greedy outputs compare with the CPU reference), scraped by the carried Prometheus
# server; the drafters are CPU processes beside it. The log lands in $OUT.
set -uo pipefail
OUT="${OUT:-/tmp/splitspec-gpu}"
mkdir -p "$OUT"
. scripts/gpu_env.sh || exit 1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
python3 -P -m pytest -p no:cacheprovider -q -rs tests/test_verifier_service.py tests/test_drafter_pool.py tests/test_standalone.py tests/test_eagle.py tests/test_eagle_head.py tests/test_token_map.py 2>&1 | tee "$OUT/pytest_verifier_cuda.log"
exit "${PIPESTATUS[0]}"

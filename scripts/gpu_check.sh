#!/usr/bin/env bash
# Run on the lent GPU machine (the `device` tool), from the repo root. The GPU image has torch 2.11,
# transformers, safetensors, tokenizers, huggingface_hub and pytest, so nothing is carried.
#   1. the runtime test suite with its forwards on CUDA (references stay fp32 on CPU);
#   2. the plain-decode baseline on a Llama-3.1-8B-shaped dummy model in bf16.
# Only `splitspec` is put on the import path (scripts/import_tree.sh builds it from symlinks, with
# its mapped sub-packages), never the repo root, whose gateway/, kernels/, protos/ folders must not be
# importable as top-level packages.
# Results land in $OUT (pytest log, benchmark JSON) and are committed under benchmarks/results/.
set -uo pipefail
OUT="${OUT:-/tmp/splitspec-gpu}"
mkdir -p "$OUT"
export PYTHONPATH="$(bash scripts/import_tree.sh)" PYTHONUNBUFFERED=1 SPLITSPEC_TEST_DEVICE=cuda
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)" | tee -a "$OUT/gpu.txt"
python3 -P -m pytest -p no:cacheprovider -q \
    tests/test_model_equivalence.py tests/test_paged_attention.py tests/test_generate.py \
    tests/test_sampling.py tests/test_rope.py tests/test_loading_errors.py tests/test_hub.py \
    tests/test_tree_and_acceptance.py tests/test_ngram.py \
    2>&1 | tee "$OUT/pytest_cuda.log"
tests_rc=${PIPESTATUS[0]}
python3 -P benchmarks/decode.py --device cuda --preset llama-3.1-8b --dtype bfloat16 --batch-sizes 1,8,32 \
    --prompt-len 128 --new-tokens 64 --out "$OUT/decode_gpu.json" > /dev/null
bench_rc=$?
echo "pytest rc=$tests_rc bench rc=$bench_rc"
exit $(( tests_rc || bench_rc ))

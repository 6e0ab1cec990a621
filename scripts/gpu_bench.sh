#!/usr/bin/env bash
# The GPU benchmark, from a clean checkout on the lent GPU machine (the `device` tool), carrying .fi/
# (scripts/gpu_fetch_wheels.sh fills it):
#   bash scripts/gpu_bench.sh            # results in $OUT (default /tmp/splitspec-gpu)
# 1. plain decode (below), then the GPU equivalence tests: Triton kernels vs their torch twins, FlashInfer vs the torch backend,
#    CUDA-graph decode vs eager (tests/test_gpu_kernels.py), and the runtime suite with forwards on CUDA;
# 2. plain decode of a Llama-3.1-8B-shaped dummy model in bf16 (FlashInfer, CUDA graphs) at batch 1 and 8,
#    with step phases and the 16-node tree verification's time over a decode step's;
# 3. the same eagerly (--disable-cuda-graph), to show what the graphs are worth.
set -uo pipefail
OUT="${OUT:-/tmp/splitspec-gpu}"
mkdir -p "$OUT"
. scripts/gpu_env.sh || exit 1
export SPLITSPEC_TEST_DEVICE=cuda
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch, triton, flashinfer; print('torch', torch.__version__, 'triton', triton.__version__, 'flashinfer', flashinfer.__version__)" | tee -a "$OUT/gpu.txt"
bench=(python3 -P benchmarks/decode.py --device cuda --preset llama-3.1-8b --dtype bfloat16 --batch-sizes 1,8
       --prompt-len 128 --new-tokens 128 --phases --tree-nodes 16)
"${bench[@]}" --out "$OUT/decode_8b_graphs.json" 2>&1 | tail -5; graphs_rc=${PIPESTATUS[0]}
python3 -P -m pytest -p no:cacheprovider -q tests/test_gpu_kernels.py tests/test_model_equivalence.py \
    tests/test_paged_attention.py tests/test_rope.py 2>&1 | tee "$OUT/pytest_cuda.log"
tests_rc=${PIPESTATUS[0]}
"${bench[@]}" --disable-cuda-graph --repeats 1 --out "$OUT/decode_8b_eager.json" 2>&1 | tail -5; eager_rc=${PIPESTATUS[0]}
echo "pytest rc=$tests_rc bench rc=$graphs_rc/$eager_rc"
exit $(( tests_rc || graphs_rc || eager_rc ))

#!/usr/bin/env bash
# On the GPU machine (`device` tool, carry [".whl", ".demo-data"]): trains the demo target's EAGLE-2 and
# EAGLE-3 heads on the demo dataset (.demo-data: the token ids the demo target was trained on, prepared
# here by splitspec.train.dataset.prepare_dataset) and leaves them, with their reports, in $OUT.
#   bash scripts/gpu_train_demo_heads.sh [STEPS] [SECONDS PER HEAD]
set -uo pipefail
OUT="${OUT:-/tmp/splitspec-gpu}"
STEPS="${1:-2000}"
BUDGET="${2:-150}"
mkdir -p "$OUT"
. scripts/gpu_env.sh || exit 1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
TARGET=splitspec/demo_models/target
for KIND in eagle eagle3; do
    EXTRA=()
    [[ $KIND == eagle3 ]] && EXTRA=(--draft-vocab-size 2048 --ttt-steps 3)
    python3 -P -m splitspec train "$KIND" --model-path "$TARGET" --data .demo-data --out "$OUT/$KIND" --device cuda \
        --steps "$STEPS" --batch-size 32 --seq-len 512 --lr 1e-3 --warmup-steps 100 --eval-every 100 --eval-windows 64 \
        --save-every 100000 --time-budget-s "$BUDGET" --accept-prompts 16 --accept-new-tokens 128 --save-dtype bfloat16 \
        "${EXTRA[@]}" 2>&1 | grep -v "it/s]" | tail -20 | tee "$OUT/$KIND.log"
done

#!/usr/bin/env bash
# On the GPU machine, from the repo root: which Triton kernel faults in a draft loop's capture (scripts/dbg_draft_loop.py,
# one process each): every kernel in Triton, every one as its torch twin, then each kernel alone in Triton (the others
# twins). It found the RoPE kernel's stride-0 positions read at top-k > 1 (runtime.draft_loop._body).
#   bash scripts/dbg_draft_loop_bisect.sh [TOPK MAX_BS STEPS]   (default 2 4 3)
set -uo pipefail
. scripts/gpu_env.sh
[[ $# -eq 0 ]] && set -- 2 4 3
dims=("$@")
ops=(rms_norm add_rms_norm apply_rope rope_and_store silu_and_mul draft_topk move_kv_slots merge_own_attention)
run() { DBG_TWINS="$1" CUDA_LAUNCH_BLOCKING=1 timeout 120 python3 -P scripts/dbg_draft_loop.py "${dims[@]}" 2>&1 \
            | grep -E "RESULT|Error|error" | head -3; }
run ""
run "$(IFS=,; echo "${ops[*]}")"
for op in "${ops[@]}"; do
    others=() && for o in "${ops[@]}"; do [[ $o != "$op" ]] && others+=("$o"); done
    run "$(IFS=,; echo "${others[*]}")"
done

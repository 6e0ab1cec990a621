#!/usr/bin/env bash
# Is the demo target's slow host mode torch's intra-op thread pool (issue 31)? On a GPU nothing sets OMP_NUM_THREADS,
# so every process starts one OpenMP worker per CPU; a process pinned to one CPU starts none. The demo target's plain
# decoding in process (batch 16) with and without OMP_NUM_THREADS=1, interleaved, then served (benchmarks/served.py,
# both sides) under each.     OUT=/tmp/omp bash benchmarks/omp_threads.sh   (after scripts/gpu_env.sh)
set -u
OUT=${OUT:-/tmp/omp}; W=$(mktemp -d); mkdir -p "$OUT"
load="--batch-size ${NB_BATCH:-16} --prompt-len 128 --output-len 128 --num-prompts ${NB_PROMPTS:-96}"
flags=(--device cuda --dtype bfloat16 --no-phase-sync $load)
summary=$OUT/omp_threads.txt; : > "$summary"
row() { python3 -c "import json,sys; r=json.load(open(sys.argv[1]))['rows'][0]; print(sys.argv[2], r['output_tok_s'], r['step_ms']['total'])" "$@" >> "$summary" 2>&1; }
timeout 300 python3 -P -m splitspec bench "${flags[@]}" --out "$W/warm.json" > "$W/warm.log" 2>&1  # FlashInfer's JIT
row "$W/warm.json" "in process, warm-up run (JIT), threads unset:"
for round in 1 2 3; do
    for threads in unset 1; do
        env=(); [[ $threads == 1 ]] && env=(OMP_NUM_THREADS=1)
        env "${env[@]}" timeout 120 python3 -P -m splitspec bench "${flags[@]}" --out "$W/r${round}_$threads.json" > "$W/r${round}_$threads.log" 2>&1
        row "$W/r${round}_$threads.json" "in process, round $round, OMP_NUM_THREADS $threads:"
    done
done
for threads in ${NB_SERVED:-1 unset 1}; do
    env=(); [[ $threads == 1 ]] && env=(OMP_NUM_THREADS=1)
    i=$((${i:-0} + 1))
    env "${env[@]}" timeout 300 python3 -P benchmarks/served.py --log-level warning --timeout 200 --out "$W/served_$i.json" \
        --load "$load" -- --device cuda --dtype bfloat16 --speculative-algorithm none > "$W/served_$i.out" 2>&1
    python3 -c "import json,sys; d=json.load(open(sys.argv[1])); p=d['points'][0]; print('served, OMP_NUM_THREADS', sys.argv[2], p['served_tok_s'], p['in_process_tok_s'], p['served_over_in_process'], 'served step ms', d['served_engine_loop']['mean_ms']['step'])" \
        "$W/served_$i.json" "$threads" >> "$summary" 2>&1
done
cat "$summary"
tar czf "$OUT/omp_threads.tgz" -C "$W" .

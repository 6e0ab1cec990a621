#!/usr/bin/env bash
# Which CPU the engine's thread runs on (issue 31): the demo target's plain decoding in process (batch 16) with the
# whole process pinned to each of NB_CPUS in turn, the GPU's interrupt lines and where they go, then served
# (benchmarks/served.py, the demo target without a drafter) with the served engine thread left to the scheduler and
# pinned (SPLITSPEC_ENGINE_CPUS=<cpu>), once per word of NB_SERVED ("any" leaves it unpinned; default "any 3"); the
# machine's NUMA nodes and the GPU's CPU affinity first.     OUT=/tmp/ec bash benchmarks/engine_cpu.sh   (after scripts/gpu_env.sh)
set -u
OUT=${OUT:-/tmp/engine_cpu}; W=$(mktemp -d); mkdir -p "$OUT"
load="--batch-size ${NB_BATCH:-16} --prompt-len 128 --output-len 128 --num-prompts ${NB_PROMPTS:-96}"
flags=(--device cuda --dtype bfloat16 --no-phase-sync $load)
summary=$OUT/engine_cpu.txt
{ lscpu | grep -i -E "numa|model name|^CPU\(s\)|thread|socket"; for n in /sys/devices/system/node/node*; do
    echo "$(basename "$n"): CPUs $(cat "$n/cpulist")"; done; nvidia-smi topo -m 2>&1 | head -4
  grep -i -E "nvidia|CPU0" /proc/interrupts | cut -c1-220; for irq in $(grep -i nvidia /proc/interrupts | cut -d: -f1); do
    echo "irq $irq -> CPUs $(cat /proc/irq/$irq/effective_affinity_list 2>/dev/null || cat /proc/irq/$irq/smp_affinity_list)"; done; } > "$summary"
row() { python3 -c "import json,sys; r=json.load(open(sys.argv[1]))['rows'][0]; print(sys.argv[2], r['output_tok_s'], r['step_ms']['total'])" "$@" >> "$summary" 2>&1; }
# unpinned first: FlashInfer's JIT compiles its modules here (on one CPU a fresh machine's compile outlasts the runs'
# timeouts: the call at f828059 lost every pinned run to it), and the figure the pinned ones compare with
timeout 300 python3 -P -m splitspec bench "${flags[@]}" --out "$W/unpinned.json" > "$W/unpinned.log" 2>&1
row "$W/unpinned.json" "in process, not pinned:"
for cpu in ${NB_CPUS:-0 1 2 3 8 15}; do
    timeout 120 taskset -c "$cpu" python3 -P -m splitspec bench "${flags[@]}" --out "$W/cpu$cpu.json" > "$W/cpu$cpu.log" 2>&1
    row "$W/cpu$cpu.json" "in process, pinned to CPU $cpu:"
done
i=0
for word in ${NB_SERVED:-any 3}; do
    pin=$word; [[ $word == any ]] && pin=""; i=$((i + 1))
    SPLITSPEC_ENGINE_CPUS=$pin timeout 300 python3 -P benchmarks/served.py --log-level warning --timeout 200 \
        --out "$W/served_$i.json" --load "$load" -- --device cuda --dtype bfloat16 --speculative-algorithm none > "$W/served_$i.out" 2>&1
    python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print('served, engine thread on CPUs', sys.argv[2] or 'any', d['points'], d['served_engine_loop']['mean_ms']['step'])" \
        "$W/served_$i.json" "$pin" >> "$summary" 2>&1
done
cat "$summary"
tar czf "$OUT/engine_cpu.tgz" -C "$W" .

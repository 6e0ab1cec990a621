#!/usr/bin/env bash
# The demo target's two host speeds (issue 31, docs/performance.md): is a slow run's engine thread on a slower CPU
# (plain Python slower too) or doing slower work? One GPU call: the demo target's plain decoding in process at batch 16,
# from bash's main thread and on a thread of its own (as the served verifier's engine loop), in two rounds; then on a
# thread beside SCHED_IDLE spinners on every CPU (they run only when a CPU would idle, so the vCPUs never halt); then
# served (benchmarks/served.py, no drafter) alone and beside the spinners. Every run step-logged
# (splitspec/step_log.py: its probes time a fixed plain-Python loop on the engine's thread every 64 steps, with the
# CPU it is on and the VM's steal time); one summary line per point in $OUT/host_speed.txt, the logs in host_speed.tgz.
#   OUT=/tmp/hs bash benchmarks/host_speed.sh      (GPU: scripts/gpu_bench.sh's environment first)
set -u
OUT=${OUT:-/tmp/host_speed}; W=$(mktemp -d); mkdir -p "$OUT"
load="--batch-size ${HS_BATCH:-16} --prompt-len 128 --output-len 128 --num-prompts ${HS_PROMPTS:-96}"
flags=(--device cuda --dtype bfloat16 --no-phase-sync $load)
summary=$OUT/host_speed.txt
{ nproc; lscpu | grep -i -E "model name|^CPU\(s\)|thread|mhz|hypervisor"; grep -m1 "^cpu " /proc/stat; } > "$summary" 2>&1
cat > "$W/thread_main.py" <<'PY'
import signal, sys, threading
from splitspec.cli import main
_signal = signal.signal  # the CLI's handlers: only the main thread may set them; on the engine's thread, skipped
signal.signal = lambda *a: _signal(*a) if threading.current_thread() is threading.main_thread() else None
codes = []
worker = threading.Thread(target=lambda: codes.append(main(sys.argv[1:])), name="engine")
worker.start(); worker.join()
sys.exit(codes[0] if codes else 1)
PY
spinners=()
spin() {
    for _ in $(seq "$(nproc)"); do
        timeout 400 python3 -c 'import os; os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
while True: pass' & spinners+=($!)
    done
}
unspin() { kill "${spinners[@]}" 2>/dev/null; wait "${spinners[@]}" 2>/dev/null; spinners=(); }
report() {  # tag: its points' tok/s and step timelines
    local tag=$1
    python3 -c "import json,sys; d=json.load(open(sys.argv[1])); rows=d.get('rows') or [r for s in ('served','in_process') for r in d[s]['rows']]; print(sys.argv[2], [(r['batch_size'], r['output_tok_s']) for r in rows])" \
        "$W/$tag.json" "$tag" >> "$summary" 2>&1
    python3 benchmarks/step_timeline.py "$W"/steps_"$tag".*.jsonl 2>&1 | sed "s/^/  $tag: /" >> "$summary"
}
inproc() {  # tag, launcher (python3 -P -m splitspec | python3 -P thread_main.py)
    local tag=$1; shift
    SPLITSPEC_STEP_LOG=$W/steps_$tag timeout 150 "$@" bench "${flags[@]}" --out "$W/$tag.json" > "$W/$tag.log" 2>&1
    echo "$tag rc=$?" >> "$summary"; report "$tag"
}
served() {
    local tag=$1
    SPLITSPEC_STEP_LOG=$W/steps_$tag timeout 240 python3 -P benchmarks/served.py --log-level warning --timeout 150 \
        --out "$W/$tag.json" --load "$load" -- --device cuda --dtype bfloat16 --speculative-algorithm none > "$W/$tag.log" 2>&1
    echo "$tag rc=$?" >> "$summary"; report "$tag"
}
for round in 1 2; do
    inproc "main$round" python3 -P -m splitspec
    inproc "thread$round" python3 -P "$W/thread_main.py"
done
spin; inproc thread_spinners python3 -P "$W/thread_main.py"; unspin
served served
spin; served served_spinners; unspin
grep -m1 "^cpu " /proc/stat >> "$summary"
cat "$summary"
tar czf "$OUT/host_speed.tgz" -C "$W" .

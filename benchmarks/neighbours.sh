#!/usr/bin/env bash
# Is the served verifier's slower host step (the demo target's decode step, ~2x the in-process one per operator at
# 65ddd9a) the code or the machine? One GPU call: the demo target's plain decoding in process at one batch size,
#   alone | beside CPU burners on the other CPUs | beside an idle `splitspec up` (its processes and CUDA context) |
#   with the engine on a thread that is not the main one (as the served verifier's)
# and the served figure itself (benchmarks/served.py, demo target, no drafter), every run's CPU clock sampled.
#   OUT=/tmp/nb bash benchmarks/neighbours.sh      (GPU: scripts/gpu_bench.sh's environment first)
set -u
OUT=${OUT:-/tmp/neighbours}; mkdir -p "$OUT"
bs=${NB_BATCH:-16}
load="--batch-size $bs --prompt-len 128 --output-len 128 --num-prompts ${NB_PROMPTS:-96}"
flags=(--device cuda --dtype bfloat16 --no-phase-sync $load)
mhz() { awk -F: '/cpu MHz/ {s += $2; n++} END {printf "%.0f MHz mean over %d CPUs\n", s / n, n}' /proc/cpuinfo; }
run() {  # tag, then a command prefix (may be empty)
    local tag=$1; shift
    mhz > "$OUT/nb_$tag.mhz"
    timeout "${NB_TIMEOUT:-180}" "$@" python3 -P -m splitspec bench "${flags[@]}" --out "$OUT/nb_$tag.json" > "$OUT/nb_$tag.log" 2>&1
    echo "$tag rc=$?" | tee -a "$OUT/neighbours.log"
    mhz >> "$OUT/nb_$tag.mhz"
}
{ nproc; lscpu; } > "$OUT/cpu.txt" 2>&1
run alone
burners=()
for _ in $(seq "${NB_BURNERS:-4}"); do timeout 300 python3 -c 'while True: pass' & burners+=($!); done
run burners
kill "${burners[@]}" 2>/dev/null; wait "${burners[@]}" 2>/dev/null
python3 -P -m splitspec up --port 31000 --device cuda --dtype bfloat16 --speculative-algorithm none \
    --mem-fraction-static 0.3 > "$OUT/nb_idle_up.serve.log" 2>&1 & up=$!
for _ in $(seq 240); do curl -sf http://127.0.0.1:31000/health > /dev/null && break; sleep 1; done
run idle_up
kill -INT "$up"; wait "$up"
cat > "$OUT/thread_main.py" <<'PY'
import sys, threading
from splitspec.cli import main
codes = []
worker = threading.Thread(target=lambda: codes.append(main(sys.argv[1:])), name="engine")
worker.start(); worker.join()
sys.exit(codes[0] if codes else 1)
PY
mhz > "$OUT/nb_thread.mhz"
timeout "${NB_TIMEOUT:-180}" python3 -P "$OUT/thread_main.py" bench "${flags[@]}" --out "$OUT/nb_thread.json" > "$OUT/nb_thread.log" 2>&1
echo "thread rc=$?" | tee -a "$OUT/neighbours.log"
run alone_again
SPLITSPEC_STEP_LOG=$OUT/steps_served timeout 300 python3 -P benchmarks/served.py --log-level warning --timeout 200 \
    --out "$OUT/served_demo_plain.json" --load "$load" \
    -- --device cuda --dtype bfloat16 --speculative-algorithm none > "$OUT/served.log" 2>&1
echo "served rc=$?" | tee -a "$OUT/neighbours.log"
python3 - "$OUT" <<'PY' | tee -a "$OUT/neighbours.log"
import json, sys, pathlib
out = pathlib.Path(sys.argv[1])
for f in sorted(out.glob("nb_*.json")) + [out / "served_demo_plain.json"]:
    if not f.exists():
        continue
    d = json.loads(f.read_text())
    if "points" in d:
        for p in d["points"]:
            print(f.name, p)
        print("served engine loop", d.get("served_engine_loop"))
        continue
    for r in d.get("results", d.get("rows", [])):
        print(f.name, r.get("batch_size"), r.get("output_tok_s") or r.get("tok_s"), r.get("step_ms"))
PY
tar czf "$OUT/neighbours.tgz" -C "$OUT" --exclude neighbours.tgz . 

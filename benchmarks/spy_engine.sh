#!/usr/bin/env bash
# Where the verifier's engine thread spends its wall time, served against in process, sampled from outside with
# py-spy (its wheel carried in .whl/: pip download py-spy --no-deps -d .whl): the demo target, plain decoding at batch
# 16 (SPY_BATCH), long enough for a few seconds of steady decoding on each side (SPY_PROMPTS requests of 256 tokens).
#   OUT=/tmp/spy bash benchmarks/spy_engine.sh       # on the GPU machine; SPY_DEVICE=cpu here
#   SPY_BATCH=1 SPY_PROMPTS=96 OUT=/tmp/spy bash benchmarks/spy_engine.sh   # one request at a time
# Writes spy_served.txt and spy_in_process.txt (py-spy's raw format: one line per stack and its count, threads and
# idle samples included) and the two benches' JSONs; benchmarks/spy_compare.py sums them up per decode step.
set -uo pipefail
OUT="${OUT:-/tmp/splitspec-spy}"
mkdir -p "$OUT"
device=${SPY_DEVICE:-cuda}
if [[ $device == cuda ]]; then . scripts/gpu_env.sh || exit 1; dtype=bfloat16; else dtype=float32; fi
command -v py-spy > /dev/null || { echo "spy_engine.sh: py-spy is not installed" >&2; exit 1; }
port=${SPY_PORT:-31400} prompts=${SPY_PROMPTS:-1024} rate=${SPY_RATE:-200} batch=${SPY_BATCH:-16}
load=(--batch-size "$batch" --prompt-len 128 --output-len 256 --num-prompts "$prompts")
model=$(python3 -P -c "from splitspec.demo import demo_model_dirs; print(demo_model_dirs()['target'])")

python3 -P -m splitspec up --port "$port" --speculative-algorithm none --device "$device" --dtype "$dtype" \
    --disable-radix-cache --log-level warning > "$OUT/up.log" 2>&1 &
up=$!
trap 'kill $up 2> /dev/null; wait $up 2> /dev/null' EXIT
# a cold GPU machine compiles FlashInfer's kernels first (~40 s a family): up to 10 minutes, then a loud failure
ready=0
for _ in $(seq 1200); do curl -sf "http://127.0.0.1:$port/health" > /dev/null && { ready=1; break; }; sleep 0.5; done
[[ $ready == 1 ]] || { echo "spy_engine.sh: splitspec up not ready after 600 s (see $OUT/up.log)" >&2; exit 1; }
python3 -P -m splitspec bench --url "http://127.0.0.1:$port" --model-path "$model" --batch-size "$batch" --prompt-len 128 \
    --output-len 16 --num-prompts 32 --out "$OUT/warmup.json" > "$OUT/warmup.log" 2>&1
python3 -P -m splitspec bench --url "http://127.0.0.1:$port" --model-path "$model" "${load[@]}" \
    --out "$OUT/served.json" > "$OUT/served_bench.log" 2>&1 &
client=$!
sleep "${SPY_SETTLE:-3}"
verifier=$(pgrep -f "splitspec verifier" | head -1)
timeout 60 py-spy record --nonblocking --idle --threads -r "$rate" -d "${SPY_SECONDS:-5}" -p "$verifier" -f raw \
    -o "$OUT/spy_served.txt" > "$OUT/spy_served.log" 2>&1
wait $client
kill $up; wait $up 2> /dev/null; trap - EXIT

# in process: the whole run sampled (loading included; spy_compare.py keeps the samples under the engine's step)
timeout 300 py-spy record --nonblocking --idle --threads -r "$rate" -f raw -o "$OUT/spy_in_process.txt" -- \
    python3 -P -m splitspec bench --device "$device" --dtype "$dtype" --no-phase-sync \
    "${load[@]}" --out "$OUT/in_process.json" > "$OUT/in_process.log" 2>&1
python3 benchmarks/spy_compare.py "$OUT/spy_served.txt" "$OUT/spy_in_process.txt" | tee "$OUT/spy_compare.txt"

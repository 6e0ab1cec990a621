# issue 31 diagnosis on the GPU: the demo target served plain at batch 1 (no drafter), with and without the
# overlap, next to in process; then the serving path's own ceiling (no model)
. scripts/gpu_env.sh || exit 1
load="--batch-size 1,4 --prompt-len 128 --output-len 128 --num-prompts 8"
timeout 200 python3 -P benchmarks/served.py --out $OUT/plain_overlap.json --load "$load" -- --device cuda --dtype bfloat16 --cuda-graph-max-bs 16 > $OUT/diag.log 2>&1; echo "overlap rc $?"
timeout 150 python3 -P benchmarks/served.py --serve=--disable-overlap-schedule --out $OUT/plain_serial.json --load "$load" -- --device cuda --dtype bfloat16 --cuda-graph-max-bs 16 >> $OUT/diag.log 2>&1; echo "serial rc $?"
timeout 120 python3 -P benchmarks/gateway_ceiling.py --batch-size 1,16 --tokens-per-delta 1,4 --out $OUT/ceiling.json >> $OUT/diag.log 2>&1; echo "ceiling rc $?"

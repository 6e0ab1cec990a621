#!/usr/bin/env bash
# The GPU benchmark, from a clean checkout on the lent GPU machine (the `device` tool), carrying .fi/
# (scripts/gpu_fetch_wheels.sh fills it):
#   bash scripts/gpu_bench.sh [STAGE...]      # results in $OUT (default /tmp/splitspec-gpu)
# .ficache/*.txz (carried; scripts/gpu_env.sh) holds FlashInfer modules compiled on an earlier machine: a cold machine then
# skips ~100 s of JIT compiling per model shape (the 8B shape's modules at 0712a25+: 10 s instead of ~110 s to the first
# figure); the jitcache stage makes one. The wheels, .fi and .ficache together must stay under the call's 64 MiB.
# Stages (default: all, in this order; a device call has 10 minutes, so name a few per call):
#   decode    plain decode of a Llama-3.1-8B-shaped dummy model in bf16 (FlashInfer, CUDA graphs of the decode
#             step and of 16-node trees) at batch 1 and 8, step phases, and the tree verification's time over
#             a decode step's
#   lossless  greedy plain vs speculative decoding in bf16 on the GPU: the demo target with NGRAM, STANDALONE,
#             EAGLE, EAGLE3, and the 8B-shaped dummy with NGRAM (outputs equal, or near-ties recorded)
#   specprofile  where a speculative step's host and device time go: `splitspec bench` in process on the demo pair
#             (PROFILE_ALGORITHM, default EAGLE3; fixed trees; PROFILE_BS, default 1,16; PROFILE_FLAGS: more bench flags,
#             e.g. the 8B pair: --preset llama-3.1-8b --draft-preset eagle3-llama-3.1-8b --simulate-acceptance
#             accept-length:6 --steps 5 --topk 1 --num-draft-tokens 6) with SPLITSPEC_TORCH_PROFILE
#             (splitspec/device_profile.py: prof/<point>.txt, the ops and the labelled phases; prof/<point>.trace.json.gz)
#   profile   the 8B decode step's kernel time by kernel (torch.profiler) against its graph and eager wall time
#   opsites   where the demo chain's drafted step at batch 1 makes its tensor ops outside the graphs, by call site
#             (benchmarks/step_op_sites.py), unfed and device-fed (SPLITSPEC_DEVICE_FED=1): opsites_{unfed,fed}.txt
#   eager     the decode stage without CUDA graphs
#   bench     `splitspec bench` on the 8B-shaped dummy target with a dummy EAGLE-3 head of the published 8B shape
#             drafting for real and simulated acceptance (accept length 4): steps 3,5,7 x topk 1,4 x draft
#             tokens 8,16 at batch 1 and 8
#   draftgraphs  the bench stage's simulated EAGLE-3 at steps 3,5 x topk 1,4, with the head's beam steps replayed from
#             CUDA graphs and then eagerly (--speculative-draft-disable-cuda-graph), on the same machine
#   target    issue 13's targets: simulated EAGLE-3 at accept length 6 (steps 5,7 x topk 1,4), batch 1 and 8, with
#             the device draft loop (runtime.draft_loop), then the same points with the host reference drafting
#             (SPLITSPEC_DRAFT_LOOP=host: the beam steps as they ran before the loop) on the same machine;
#             TARGET_LOOPS=device runs the first half only
#   modes     the target stage's points with --speculative-attention-mode decode (device draft loop)
#   compile   the target stage's steps-5 top-1 point at batch 1 and 8, without and then with --enable-torch-compile
#             (inductor's default mode, to fit a device call: max-autotune benchmarks every GEMM of every shape)
#   split     issue 14's comparison on a two-GPU machine: the target stage's steps-5 top-1 point at batch 1 with the
#             drafter in process (co-located, no overlap), then as a `splitspec drafter` process over ZeroMQ on GPU 0
#             (co-located) and on GPU 1 (split), each without and with overlap (bets); SPLIT_MODES picks modes,
#             SPLIT_EXTRA adds bench flags (e.g. --topk 4), SPLIT_TAG names the files; scripts/split_summary.py
#             sums them up; SPLIT_PAIR=demo runs the demo target with its trained EAGLE-3 head (real acceptance) instead
#   bets      where a drafter's time goes with overlap: benchmarks/profile_bets.py on the split stage's point (dummy
#             EAGLE-3 head of the 8B shape, steps 5, top-1) for 1, 2 and 6 bets against a fresh tree
#   sweep     issue 15's batch sweep: the demo pair (target + its trained EAGLE-3 head, real acceptance) measured at
#             batch 1 for its per-position acceptance profile, then the 8B-shaped dummy target with a dummy EAGLE-3 head
#             drafting for real, plain vs steps 5 top-1 (6 tokens) fixed and load-adaptive, at SWEEP_BS (default
#             1,2,4,8,16,32,64,128; 128-token prompts, 256 new tokens), under that profile replayed and under accept length 6; benchmarks/plot_sweep.py
#             then sums up sweep_summary.json and draws sweep.png where matplotlib imports (SWEEP_EXTRA adds bench flags,
#             e.g. --no-phase-sync: steps overlapped as a server runs them, not phase-timed;
#             SWEEP_PROFILE=P1,P2,... replays a profile measured before instead of measuring it)
#   fp8       issue 15's FP8 weights: benchmarks/fp8_accuracy.py on the 8B-shaped dummy model, bf16 against
#             --quantization fp8 (W8A8 torch._scaled_mm): batch-1 decode tok/s with CUDA graphs, weight bytes and the
#             weight floor at the H100's 3.35e12 B/s (its agreement says little: random weights are chaotic, so any
#             perturbation flips their flat logits); then the accuracy on the trained demo target over 256 prompts
#   served    issue 31: what a user gets over HTTP next to the engine, in one run (benchmarks/served.py: `splitspec bench`
#             in process and `splitspec up` on the GPU measured by `splitspec bench --url`, round after round with the
#             same model flags and load; one JSON per case with both reports and served/in-process per point). SERVED_CASES picks among
#             demo-ngram, demo-eagle3 (the demo target, plain and speculative, batch 1 and 16), demo-plain (the demo
#             target served without a drafter: `up --speculative-algorithm none`), 8b-plain (the
#             8B-shaped dummy target with the demo tokenizer, batch 1, 8, 32, 64) and 8b-plain-serial (the same served
#             with --disable-overlap-schedule: publishing between steps), demo-ngram-grpc-here (demo-ngram with
#             --disable-frontend-multiprocessing: gRPC on the engine's process), demo-ngram-fixed (demo-ngram with
#             --speculative-adaptive off: every step drafts its full tree), demo-eagle3-local (the EAGLE-3 head in the
#             verifier's process, up --drafters 0), demo-eagle3-chain (demo-eagle3 drafting top-1 chains: steps 5, topk 1,
#             6 tokens; verified before they reach the host, runtime/launched_draft.py), demo-ngram-local (drafted in the verifier's process,
#             up --drafters 0: up's default for NGRAM since 2026-11-27), demo-ngram-remote (from a drafter process, up
#             --drafters 1: the default before), demo-ngram-local-fixed (local, fixed trees), demo-eagle3-remote (the
#             head in a drafter process, up --drafters 1: up's default on a GPU before 2026-11-28), 8b-eagle3-sim (the
#             8B-shaped dummy target with a dummy EAGLE-3 head of its shape drafting for real, as up places it: in the
#             verifier's process on a GPU; acceptance simulated at accept length 6, steps 5, top-1, fixed trees:
#             served.py --simulate-acceptance, both sides replaying the in-process side's recorded plain outputs; batch
#             1, 8, 32, 64), 8b-eagle3-sim-local (--drafters 0) and 8b-eagle3-sim-remote (--drafters 1: the head in a
#             drafter process); the in-process side runs the server's adaptive setting
#             (auto: on for a GPU target); the demo cases serve 32 requests of 256 tokens a point (since 2026-12-03;
#             before, 2 per batch slot of 128); SERVED_LOAD adds bench flags; SERVED_BS=1 runs batch 1 alone; SERVED_ROUNDS=N measures both sides N
#             times, alternating (served.py --rounds: in-process round, served round, ...; each ratio the median of the
#             paired rounds'; the simulated 8b cases' rounds repeat the reference's prompts); each
#             side's load-adaptive policy writes its observations and choices to adaptive_<case>.<side>.jsonl; SERVED_LOG_LEVEL is
#             the services' (default warning), SERVED_STEP_TIMEOUT each step's (a stuck served bench prints the stacks);
#             SERVED_PROFILE=1 runs the services' loops under cProfile (splitspec/host_profile.py: prof_<case>.*.prof;
#             a profiled run's speeds are not figures); SERVED_TORCH_PROFILE=BATCH:KIND (KIND spec or plain) profiles the
#             served verifier's whole-batch decode steps of that kind with torch.profiler beside every in-process point
#             (splitspec/device_profile.py: tprof_<case>/served_bs<BATCH>_<KIND>.txt and bs*.txt; not figures either);
#             SERVED_STEP_LOG=1 writes each side's step timeline (splitspec/step_log.py: steps_<case>.{verifier,front,
#             gateway,client,in_process}.<pid>.jsonl, packed into $OUT/steps.tgz at the end; read with
#             benchmarks/step_timeline.py); SERVED_THREADS=1 samples which threads use which CPUs meanwhile
#             (benchmarks/thread_sampler.py: threads_<case>.txt); SERVED_PIN_ENGINE=1 runs the served engine thread
#             alone on CPU 0's physical core (SPLITSPEC_ENGINE_CPUS) and every other process on the other CPUs
#             (taskset); SERVED_SYNCS=1 counts each side's synchronizing CUDA calls by call site (splitspec/sync_debug.py:
#             syncs_<case>.jsonl; a counted run's speeds are not figures); SERVED_TAG suffixes the case's file names (two runs of one case in one call); SERVED_UP adds
#             `splitspec up` flags to every case (e.g. SERVED_UP='--tokenizer-worker-num 4'); SERVED_MODEL adds model flags to
#             both sides of every case (later flags win: e.g. SERVED_CASES=demo-eagle3-chain SERVED_MODEL='--speculative-num-steps 8
#             --speculative-num-draft-tokens 9', a longer chain)
#   tracecost whether recording the load-adaptive policy's trace (SPLITSPEC_ADAPTIVE_TRACE, which every served case
#             writes) slows the steps it records: the demo EAGLE-3 chain in process as a server runs it (--no-phase-sync,
#             adaptive on), batch 1 and 16, 32 requests of 256 tokens, two rounds each way, untraced then traced then
#             untraced (tracecost_{off,on,off2}.json)
#   graphs    what a CUDA graph's launch costs the host (benchmarks/graph_launch_cost.py): synthetic graphs of 1-300 tiny
#             kernels (one stream, forked over two, kernels and copies alternating) against every graph the demo target
#             and its EAGLE-3 chain head captured, host us per replay and the device work in it, at GRAPHS_BS (default
#             1 16; graph_launch_bs<N>.txt)
#   graphattn SPLITSPEC_GRAPH_ATTENTION=triton (graphs of a few query rows a request attend by kernels.paged_attention, no
#             plan) against flashinfer, GRAPHATTN_PARTS (default all, in this order): checks (the kernel against its twin),
#             bench (each graph kind's attention alone: benchmarks/graph_attention_cost.py on the demo shape at GRAPHATTN_BS,
#             default 1,16,64; graph_attention_demo.json), bench8b (the same at the 8B shape, not by default), drafted (the demo EAGLE-3 chain's drafted steps in process at
#             REUSE_BS for each GRAPHATTN_MODES entry, default flashinfer triton flashinfer triton; triton:64 sets
#             SPLITSPEC_GRAPH_ATTENTION_MIN_CHUNK=64), tests (graphs against
#             eager with each); graphattn.log
#   reuse     SPLITSPEC_FLASHINFER_REPLAN=reuse (a graph's work split left in place while its query and page offsets stay)
#             against lean: its GPU test (and the draft loop graph's), then the demo EAGLE-3 chain's drafted steps in process
#             (benchmarks/step_host_cost.py drafted) at REUSE_BS (default 1) for each REUSE_MODES entry REPLAN:GRAPH_PREFILL
#             (SPLITSPEC_FLASHINFER_GRAPH_PREFILL: small, fa2 or auto, FA3's on Hopper; default lean:auto reuse:auto reuse:fa2
#             lean:fa2 lean:auto reuse:fa2), each line with its plans by graph kind (reuse.log)
#   arrivals  what a request joining a running batch costs, in process (benchmarks/step_host_cost.py arrival: 15 requests
#             of the demo pair decoding at batch 16, 30 arrivals of a 128-token prompt, the prompt step and the next
#             timed, then under cProfile, then under torch.profiler: the device's busy time and kernels against the wall): NGRAM and the EAGLE-3 chain, drafting off (budget 1) and drafting (12; 6),
#             the default scheduling (mixed beside a batch verifying no drafts) and --disable-mixed-chunk (arrivals.log);
#             ARRIVALS_RUNS picks runs ("EAGLE3 1,NGRAM 1"), ARRIVALS_MODES the schedulings (default: "default
#             --disable-mixed-chunk"), ARRIVALS_EXTRA adds flags to each (e.g. --prompt-cuda-graph-max-tokens 512)
#   offcost   what a drafting-off step costs at batch 16 against a plain one, in process, the demo pair: the engine at
#             budget 1 with its requests speculating, opted out, and without a drafter (benchmarks/step_host_cost.py off:
#             each timed, then by function under cProfile; EAGLE-3 chain and NGRAM, offcost_<algorithm>.log), then
#             `splitspec bench` of the chain with the load-adaptive policy at 64 and 128 requests a point (OFFCOST_PROMPTS),
#             each with the step log and the policy's trace (offcost_bench<N>.json; the logs in steps.tgz); OFFCOST_BENCH
#             names the algorithms benched (default EAGLE3, the chain; NGRAM: offcost_benchNGRAM_<N>.json), OFFCOST_TIMEOUT
#             each run's limit (200 s: a cold machine's first run compiles FlashInfer's modules; 100 s was too few on an
#             H200 at 890dcf2); STEP_HOST_POLICY=1 times the policy's choices in the steps too: in process on an H200 a
#             drafting-off step took 0.751 ms at 64 requests and 0.996 ms at 128 against plain's 0.51-0.68
#   promptgraphs  whole CUDA graphs of steps that only prefill (--prompt-cuda-graph-max-tokens, runtime/prompt_graph.py):
#             tests/test_gpu_kernels.py's prompt-graph and piecewise tests, then an arrival's prompt step into 15 requests
#             drafting NGRAM trees (benchmarks/step_host_cost.py arrival, promptgraphs_arrivals.log) without and with the
#             graphs, then `splitspec bench` in process on the demo
#             pair with NGRAM at batch 1 and 16 (128 requests of 256 tokens, two rounds, the load-adaptive policy, overlapped
#             as a server runs), without the graphs and then with them at 512 tokens, each with its step log
#             (promptgraphs_{off,on}.json; prompt steps' times from the logs in steps.tgz: benchmarks/step_timeline.py).
#             PROMPTGRAPHS_PARTS picks among tests arrivals bench, PROMPTGRAPHS_BENCH_MODES the bench runs in order (off
#             on: without and with; e.g. "off on off2 on2" alternates), PROMPTGRAPHS_PROMPTS the requests a point (128).
#             (the graphs are on by default since 2026-12-05: off is --prompt-cuda-graph-max-tokens 0). Served without
#             them: SERVED_MODEL='--prompt-cuda-graph-max-tokens 0' SERVED_TAG=-nographs ... served
#   structured issue 33: structured outputs on the GPU (benchmarks/structured_accept.py --device cuda: the demo target in
#             process under a JSON schema and not, NGRAM and EAGLE3 by default (STRUCTURED_ALGORITHMS): accept lengths,
#             valid outputs, outputs equal to plain decoding; the masks applied to CUDA logits); needs xgrammar in .whl
#   overlap   the overlap schedule (verifier_svc/overlap.py) on the GPU: tests/test_overlap_schedule.py's CUDA cases
#             (overlapped plain steps against serial ones, pinned copies and events), then plain decoding of the 8B-shaped
#             dummy in process at OVERLAP_BS (default 1,32,64): phases synchronised (step_ms's verify is the forward), then
#             --no-phase-sync with --disable-overlap-schedule (serial), then --no-phase-sync (overlapped, a server's way);
#             OVERLAP_MODES picks among phases serial overlapped sampled sampled_serial (the last two at temperature 0.8)
#   jitcache  compile FlashInfer's modules for the 8B shape and the demo's (tiny in-process benches) and write them as
#             $OUT/flashinfer-<version>-jit.txz (the modules this call compiled: those already in .ficache load as
#             they are), for .ficache/ beside the others (see above)
#   tests     the GPU equivalence tests: Triton kernels vs their torch twins, FlashInfer vs the torch backend,
#             CUDA-graph decode and tree verification vs eager (tests/test_gpu_kernels.py), FP8's torch._scaled_mm
#             path vs its twin (tests/test_fp8.py), the overlap schedule against serial steps (tests/test_overlap_schedule.py),
#             and the runtime suite with forwards on CUDA (GPU_TESTS: the test files or ids to run instead, a share per call: at
#             88f149d on a fresh H200 the whole list passed 12 tests in the call's first 500 s, each new test shape JIT-compiling
#             FlashInfer's modules; -v names each test as it ends); a device call for it
#             carries what scripts/gpu_slim.sh aside leaves (it packs the demo weights to fit the device's 64 MiB)
set -uo pipefail
OUT="${OUT:-/tmp/splitspec-gpu}"
mkdir -p "$OUT"
. scripts/gpu_env.sh || exit 1
export SPLITSPEC_TEST_DEVICE=cuda
stages=("$@")
[[ ${#stages[@]} -eq 0 ]] && stages=(decode lossless profile eager bench tests)
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch, triton, flashinfer; print('torch', torch.__version__, 'triton', triton.__version__, 'flashinfer', flashinfer.__version__)" | tee -a "$OUT/gpu.txt"
bench=(python3 -P benchmarks/decode.py --device cuda --preset llama-3.1-8b --dtype bfloat16 --batch-sizes 1,8
       --prompt-len 128 --new-tokens 128 --phases --tree-nodes 16)
spec=(python3 -P benchmarks/speculative_cpu.py --device cuda --dtype bfloat16 --batch-sizes 1 --num-prompts 8
      --new-tokens 64)
failed=0
for stage in "${stages[@]}"; do
    echo "== $stage"
    stop=0  # a loop's failed step (its break alone would leave the loop's status 0)
    case "$stage" in
        decode) "${bench[@]}" --out "$OUT/decode_8b_graphs.json" > "$OUT/decode.log" 2>&1 ;;
        eager) "${bench[@]}" --disable-cuda-graph --repeats 1 --out "$OUT/decode_8b_eager.json" > "$OUT/eager.log" 2>&1 ;;
        lossless) "${spec[@]}" --algorithms NGRAM,STANDALONE,EAGLE,EAGLE3 --out "$OUT/lossless_demo.json" > "$OUT/lossless.log" 2>&1 &&
                  "${spec[@]}" --preset llama-3.1-8b --algorithms NGRAM --out "$OUT/lossless_8b.json" >> "$OUT/lossless.log" 2>&1 ;;
        bench) python3 -P -m splitspec bench --device cuda --dtype bfloat16 --preset llama-3.1-8b \
                   --draft-preset eagle3-llama-3.1-8b --speculative-algorithm EAGLE3 --simulate-acceptance accept-length:4 \
                   --steps 3,5,7 --topk 1,4 --num-draft-tokens 8,16 --batch-size 1,8 --prompt-len 128 --output-len 128 \
                   --out "$OUT/bench_8b_eagle3_sim.json" > "$OUT/bench.log" 2>&1 ;;
        draftgraphs) for eager in "" --speculative-draft-disable-cuda-graph; do
                   python3 -P -m splitspec bench --device cuda --dtype bfloat16 --preset llama-3.1-8b \
                       --draft-preset eagle3-llama-3.1-8b --speculative-algorithm EAGLE3 --simulate-acceptance accept-length:4 \
                       --steps 3,5 --topk 1,4 --num-draft-tokens 8 --batch-size 1,8 --prompt-len 128 --output-len 128 $eager \
                       --out "$OUT/draftgraphs${eager:+_eager}.json" >> "$OUT/draftgraphs.log" 2>&1 || { stop=1; break; }
               done ;;
        target) for loop in ${TARGET_LOOPS:-device host}; do
                   SPLITSPEC_DRAFT_LOOP=$loop python3 -P -m splitspec bench --device cuda --dtype bfloat16 --preset llama-3.1-8b \
                       --draft-preset eagle3-llama-3.1-8b --speculative-algorithm EAGLE3 --simulate-acceptance accept-length:6 \
                       --steps 5,7 --topk 1,4 --num-draft-tokens 8 --batch-size 1,8 --prompt-len 128 --output-len 128 \
                       --out "$OUT/target_${loop}.json" >> "$OUT/target.log" 2>&1 || { stop=1; break; }
               done ;;
        modes) python3 -P -m splitspec bench --device cuda --dtype bfloat16 --preset llama-3.1-8b \
                   --draft-preset eagle3-llama-3.1-8b --speculative-algorithm EAGLE3 --simulate-acceptance accept-length:6 \
                   --steps 5,7 --topk 1,4 --num-draft-tokens 8 --batch-size 1,8 --prompt-len 128 --output-len 128 \
                   --speculative-attention-mode decode --out "$OUT/target_decode_mode.json" > "$OUT/modes.log" 2>&1 ;;
        compile) for compiled in "" --enable-torch-compile; do
                   SPLITSPEC_TORCH_COMPILE_MODE=${SPLITSPEC_TORCH_COMPILE_MODE:-default} python3 -P -m splitspec bench \
                       --device cuda --dtype bfloat16 --preset llama-3.1-8b --draft-preset eagle3-llama-3.1-8b \
                       --speculative-algorithm EAGLE3 --simulate-acceptance accept-length:6 --steps 5 --topk 1 \
                       --num-draft-tokens 8 --batch-size 1,8 --prompt-len 128 --output-len 128 $compiled \
                       --out "$OUT/target_compile${compiled:+_on}.json" >> "$OUT/compile.log" 2>&1 || { stop=1; break; }
               done ;;
        split) for mode in ${SPLIT_MODES:-inprocess colocated colocated_overlap split split_overlap}; do
                   case $mode in
                       inprocess) extra=() ;;
                       colocated) extra=(--drafter-transport zmq --drafter-device cuda:0 --speculative-overlap off) ;;
                       colocated_overlap) extra=(--drafter-transport zmq --drafter-device cuda:0 --speculative-overlap on) ;;
                       split) extra=(--drafter-transport zmq --drafter-device cuda:1 --speculative-overlap off) ;;
                       split_overlap) extra=(--drafter-transport zmq --drafter-device cuda:1 --speculative-overlap on) ;;
                   esac
                   pair=(--preset llama-3.1-8b --draft-preset eagle3-llama-3.1-8b --simulate-acceptance accept-length:6)
                   [[ ${SPLIT_PAIR:-} == demo ]] && pair=()  # the demo target and its trained EAGLE-3 head, real acceptance
                   python3 -P -m splitspec bench --device cuda:0 --dtype bfloat16 "${pair[@]}" --speculative-algorithm EAGLE3 \
                       --steps 5 --topk 1 --num-draft-tokens 8 --batch-size 1 --num-prompts 8 --prompt-len 128 \
                       --output-len 128 "${extra[@]}" ${SPLIT_EXTRA:-} --out "$OUT/split${SPLIT_TAG:-}_${mode}.json" \
                       >> "$OUT/split.log" 2>&1 || { stop=1; break; }
               done
               python3 -P scripts/split_summary.py "$OUT" "${SPLIT_TAG:-}" > "$OUT/split${SPLIT_TAG:-}_summary.json" ;;
        bets) python3 -P benchmarks/profile_bets.py --device cuda ${BETS_EXTRA:-} --out "$OUT/bets${SPLIT_TAG:-}.json" \
                  > "$OUT/bets.log" 2>&1 ;;
        sweep) if [[ -n ${SWEEP_PROFILE:-} ]]; then  # a profile measured before (its JSON is committed)
                   profile=$SWEEP_PROFILE; : > "$OUT/sweep.log"
               else
                   python3 -P -m splitspec bench --device cuda --dtype bfloat16 --speculative-algorithm EAGLE3 --steps 5 --topk 1 \
                       --num-draft-tokens 6 --batch-size 1 --num-prompts 16 --prompt-len 128 --output-len 128 \
                       --out "$OUT/sweep_demo_profile.json" > "$OUT/sweep.log" 2>&1 &&
                   profile=$(python3 -c "import json, sys; row = [r for r in json.load(open(sys.argv[1]))['rows'] if r['speculative']][0]; print(','.join(str(min(a, 1.0)) for a in row['accepted_per_position']))" "$OUT/sweep_demo_profile.json")
               fi &&
               echo "demo pair's profile: $profile" | tee -a "$OUT/sweep.log" &&
               python3 -P -m splitspec bench --device cuda --dtype bfloat16 --preset llama-3.1-8b --draft-preset eagle3-llama-3.1-8b \
                   --speculative-algorithm EAGLE3 --steps 5 --topk 1 --num-draft-tokens 6 --speculative-adaptive both \
                   --simulate-acceptance "$profile;accept-length:6" --batch-size "${SWEEP_BS:-1,2,4,8,16,32,64,128}" \
                   --prompt-len 128 --output-len 256 ${SWEEP_EXTRA:-} --out "$OUT/sweep.json" >> "$OUT/sweep.log" 2>&1 &&
               python3 -P benchmarks/plot_sweep.py "$OUT/sweep.json" --summary "$OUT/sweep_summary.json" >> "$OUT/sweep.log" 2>&1 &&
               { python3 -P benchmarks/plot_sweep.py "$OUT/sweep.json" --png "$OUT/sweep.png" >/dev/null 2>&1 ||
                 echo "no plot here (matplotlib): benchmarks/plot_sweep.py sweep.json --png sweep.png elsewhere" >> "$OUT/sweep.log"; } ;;
        fp8) python3 -P benchmarks/fp8_accuracy.py --device cuda --preset llama-3.1-8b --dtype bfloat16 --num-prompts 64 \
                 --prompt-len 32 --new-tokens 32 --decode-tokens 128 --out "$OUT/fp8_8b.json" > "$OUT/fp8.log" 2>&1 &&
             python3 -P benchmarks/fp8_accuracy.py --device cuda --model-path splitspec/demo_models/target --dtype bfloat16 \
                 --num-prompts 256 --prompt-len 32 --new-tokens 32 --decode-tokens 128 --out "$OUT/fp8_demo.json" >> "$OUT/fp8.log" 2>&1 ;;
        structured) python3 -P benchmarks/structured_accept.py --device cuda --algorithms "${STRUCTURED_ALGORITHMS:-NGRAM,EAGLE3}" \
                 --num-prompts 16 --max-new-tokens 96 --out "$OUT/structured_cuda.json" > "$OUT/structured.log" 2>&1 ;;
        specprofile) SPLITSPEC_TORCH_PROFILE="$OUT/prof" python3 -P -m splitspec bench --device cuda --dtype bfloat16 \
                 --speculative-algorithm "${PROFILE_ALGORITHM:-EAGLE3}" --speculative-adaptive off --batch-size "${PROFILE_BS:-1,16}" \
                 --prompt-len 128 --output-len 128 ${PROFILE_FLAGS:-} --out "$OUT/spec_profile.json" > "$OUT/spec_profile.log" 2>&1 ;;
        overlap) timeout 240 python3 -P -m pytest -q -p no:cacheprovider tests/test_overlap_schedule.py -k cuda \
                     > "$OUT/overlap.log" 2>&1 || stop=1
                 for mode in ${OVERLAP_MODES:-phases serial overlapped}; do
                     [[ $stop == 1 ]] && break
                     case $mode in
                         phases) extra=() ;;
                         serial) extra=(--no-phase-sync --disable-overlap-schedule) ;;
                         overlapped) extra=(--no-phase-sync) ;;
                         sampled) extra=(--no-phase-sync --temperature 0.8) ;;
                         sampled_serial) extra=(--no-phase-sync --disable-overlap-schedule --temperature 0.8) ;;
                     esac
                     timeout 200 python3 -P -m splitspec bench --device cuda --dtype bfloat16 --preset llama-3.1-8b \
                         --batch-size "${OVERLAP_BS:-1,32,64}" --prompt-len 128 --output-len 128 "${extra[@]}" \
                         --out "$OUT/overlap_8b_${mode}.json" >> "$OUT/overlap.log" 2>&1 || stop=1
                 done ;;
        opsites) for fed in 0 1; do
                     SPLITSPEC_DEVICE_FED=$fed timeout 120 python3 -P benchmarks/step_op_sites.py 60 6 --device cuda \
                         --dtype bfloat16 --speculative-algorithm EAGLE3 --speculative-num-steps 5 --speculative-eagle-topk 1 \
                         --speculative-num-draft-tokens 6 --batch-size 1 --prompt-len 128 \
                         > "$OUT/opsites_$([[ $fed == 1 ]] && echo fed || echo unfed).txt" 2>&1
                 done ;;
        profile) python3 -P benchmarks/profile_step.py --preset llama-3.1-8b --out "$OUT/profile_8b.json" > "$OUT/profile.log" 2>&1 ;;
        served) for case in ${SERVED_CASES:-demo-ngram demo-eagle3 8b-plain}; do
                    case $case in
                        demo-ngram) pre=(); model=(--speculative-algorithm NGRAM); bs=1,16 ;;
                        demo-plain) pre=(); model=(--speculative-algorithm none); bs=1,16 ;;
                        demo-eagle3) pre=(); model=(--speculative-algorithm EAGLE3); bs=1,16 ;;
                        demo-eagle3-chain) pre=(); model=(--speculative-algorithm EAGLE3 --speculative-num-steps 5 --speculative-eagle-topk 1 --speculative-num-draft-tokens 6); bs=1,16 ;;
                        demo-eagle3-local) pre=(--serve=--drafters=0); model=(--speculative-algorithm EAGLE3); bs=1,16 ;;
                        demo-eagle3-remote) pre=(--serve=--drafters=1); model=(--speculative-algorithm EAGLE3); bs=1,16 ;;
                        demo-ngram-local) pre=(--serve=--drafters=0); model=(--speculative-algorithm NGRAM); bs=1,16 ;;
                        demo-ngram-remote) pre=(--serve=--drafters=1); model=(--speculative-algorithm NGRAM); bs=1,16 ;;
                        demo-ngram-fixed) pre=(); model=(--speculative-algorithm NGRAM --speculative-adaptive off); bs=1,16 ;;
                        demo-ngram-local-fixed) pre=(--serve=--drafters=0); model=(--speculative-algorithm NGRAM --speculative-adaptive off); bs=1,16 ;;
                        demo-ngram-grpc-here) pre=(--serve=--disable-frontend-multiprocessing); model=(--speculative-algorithm NGRAM); bs=1,16 ;;
                        8b-plain) pre=(--dummy-preset llama-3.1-8b); model=(); bs=1,8,32,64 ;;
                        8b-eagle3-sim|8b-eagle3-sim-local|8b-eagle3-sim-remote)
                            pre=(--dummy-preset llama-3.1-8b --dummy-draft-preset eagle3-llama-3.1-8b --simulate-acceptance accept-length:6)
                            [[ $case == *-local ]] && pre+=(--serve=--drafters=0)
                            [[ $case == *-remote ]] && pre+=(--serve=--drafters=1)
                            model=(--speculative-algorithm EAGLE3 --speculative-num-steps 5 --speculative-eagle-topk 1
                                   --speculative-num-draft-tokens 6 --speculative-adaptive off); bs=1,8,32,64 ;;
                        8b-plain-serial) pre=(--dummy-preset llama-3.1-8b --serve=--disable-overlap-schedule); model=(); bs=1,8,32,64 ;;
                        *) echo "unknown served case $case" >> "$OUT/served.log"; stop=1; break ;;
                    esac
                    [[ -n "${SERVED_BS:-}" ]] && bs=$SERVED_BS  # the case's batch sizes, e.g. 1 alone
                    [[ -n "${SERVED_UP:-}" ]] && pre+=(--serve="$SERVED_UP")
                    [[ -n "${SERVED_MODEL:-}" ]] && read -r -a extra_model <<< "$SERVED_MODEL" && model+=("${extra_model[@]}")
                    # the demo pair's points last 0.2-0.3 s at 2 requests per batch slot of 128 tokens: a policy's first
                    # tries and the host's minute dominate them; 32 requests of 256 tokens run each for 0.3-5 s
                    longer=; [[ $case == demo-* ]] && longer="--num-prompts 32 --output-len 256"
                    sampler= pin=() tag=$case${SERVED_TAG:-}
                    if [[ -n "${SERVED_THREADS:-}" ]]; then  # which threads use which CPUs meanwhile
                        python3 benchmarks/thread_sampler.py --out "$OUT/threads_$tag.txt" & sampler=$!
                    fi
                    if [[ -n "${SERVED_PIN_ENGINE:-}" ]]; then  # the served engine thread alone on CPU 0's physical core
                        engine_cpus=$(cat /sys/devices/system/cpu/cpu0/topology/thread_siblings_list)
                        others=$(python3 -c "import os,sys; e={int(c) for p in sys.argv[1].split(',') for c in (range(int(p.split('-')[0]), int(p.split('-')[-1]) + 1))}; print(','.join(str(c) for c in sorted(os.sched_getaffinity(0) - e)))" "$engine_cpus")
                        pin=(env SPLITSPEC_ENGINE_CPUS="$engine_cpus" taskset -c "$others")
                        echo "$case: engine thread on CPUs $engine_cpus, every other process on $others" >> "$OUT/served.log"
                    fi
                    SPLITSPEC_TORCH_PROFILE=${SERVED_TORCH_PROFILE:+$OUT/tprof_$tag} SPLITSPEC_TORCH_PROFILE_SERVED=${SERVED_TORCH_PROFILE:-} \
                    SPLITSPEC_STEP_LOG=${SERVED_STEP_LOG:+$OUT/steps_$tag} SPLITSPEC_SYNC_DEBUG=${SERVED_SYNCS:+$OUT/syncs_$tag.jsonl} \
                    SPLITSPEC_ADAPTIVE_TRACE="$OUT/adaptive_$tag" SPLITSPEC_PROFILE_HOST=${SERVED_PROFILE:+$OUT/prof_$tag} timeout "${SERVED_TIMEOUT:-540}" "${pin[@]}" python3 -P benchmarks/served.py "${pre[@]}" --rounds "${SERVED_ROUNDS:-1}" --log-level "${SERVED_LOG_LEVEL:-warning}" --timeout "${SERVED_STEP_TIMEOUT:-300}" --out "$OUT/served_$tag.json" \
                        --load "--batch-size $bs --prompt-len 128 --output-len 128 $longer ${SERVED_LOAD:-}" \
                        -- --device cuda --dtype bfloat16 "${model[@]}" >> "$OUT/served.log" 2>&1 || stop=1
                    [[ -n "$sampler" ]] && { kill "$sampler"; wait "$sampler"; }
                    if [[ $stop -ne 0 ]]; then break; fi
                done ;;
        offcost) for algorithm in EAGLE3 NGRAM; do
                     chain=(); [[ $algorithm == EAGLE3 ]] && chain=(--speculative-num-steps 5 --speculative-eagle-topk 1
                                                                  --speculative-num-draft-tokens 6)
                     timeout "${OFFCOST_TIMEOUT:-200}" python3 -P benchmarks/step_host_cost.py off 150 --device cuda \
                         --dtype bfloat16 --speculative-algorithm "$algorithm" "${chain[@]}" --batch-size 16 --prompt-len 128 \
                         > "$OUT/offcost_$algorithm.log" 2>&1 || stop=1
                 done
                 for algorithm in ${OFFCOST_BENCH:-EAGLE3}; do
                     chain=(); [[ $algorithm == EAGLE3 ]] && chain=(--steps 5 --topk 1 --num-draft-tokens 6)
                     for n in ${OFFCOST_PROMPTS:-64 128}; do
                         tag=$n; [[ $algorithm == EAGLE3 ]] || tag=${algorithm}_$n
                         SPLITSPEC_STEP_LOG="$OUT/steps_offcost$tag" SPLITSPEC_ADAPTIVE_TRACE="$OUT/adaptive_offcost$tag.jsonl" \
                         timeout "${OFFCOST_TIMEOUT:-200}" python3 -P -m splitspec bench --device cuda --dtype bfloat16 \
                             --speculative-algorithm "$algorithm" "${chain[@]}" --speculative-adaptive on \
                             --no-phase-sync --batch-size 16 --prompt-len 128 --output-len 256 --num-prompts "$n" --log-level info \
                             --out "$OUT/offcost_bench$tag.json" >> "$OUT/offcost.log" 2>&1 || stop=1
                     done
                 done ;;
        promptgraphs) parts=" ${PROMPTGRAPHS_PARTS:-tests arrivals bench} "
                      [[ $parts == *" tests "* ]] && { timeout "${PROMPTGRAPHS_TEST_TIMEOUT:-240}" python3 -P -m pytest -p no:cacheprovider -v \
                          tests/test_gpu_kernels.py -k "prompt_graphs or piecewise" > "$OUT/promptgraphs_tests.log" 2>&1 || stop=1; }
                      [[ $parts == *" arrivals "* ]] && for mode in off on; do  # an arrival's prompt step and the next, into 15 drafting (NGRAM, budget 12)
                          graphs=(--prompt-cuda-graph-max-tokens 0); [[ $mode == on ]] && graphs=(--prompt-cuda-graph-max-tokens 512)
                          echo "== arrivals, prompt graphs $mode" >> "$OUT/promptgraphs_arrivals.log"
                          timeout "${ARRIVALS_TIMEOUT:-120}" python3 -P benchmarks/step_host_cost.py arrival 30 12 --device cuda \
                              --dtype bfloat16 --speculative-algorithm NGRAM --batch-size 16 --prompt-len 128 "${graphs[@]}" \
                              >> "$OUT/promptgraphs_arrivals.log" 2>&1 || stop=1
                      done
                      [[ $parts == *" bench "* ]] && for mode in ${PROMPTGRAPHS_BENCH_MODES:-off on}; do  # e.g. "off on off2 on2"
                          graphs=(--prompt-cuda-graph-max-tokens 0); [[ $mode == on* ]] && graphs=(--prompt-cuda-graph-max-tokens 512)
                          SPLITSPEC_STEP_LOG="$OUT/steps_promptgraphs_$mode" \
                          timeout "${PROMPTGRAPHS_TIMEOUT:-150}" python3 -P -m splitspec bench --device cuda --dtype bfloat16 \
                              --speculative-algorithm NGRAM --speculative-adaptive on --no-phase-sync --batch-size 1,16 \
                              --prompt-len 128 --output-len 256 --num-prompts "${PROMPTGRAPHS_PROMPTS:-128}" --rounds 2 "${graphs[@]}" \
                              --log-level info --out "$OUT/promptgraphs_$mode.json" >> "$OUT/promptgraphs.log" 2>&1 || stop=1
                      done
                      true ;;
        arrivals) IFS=, read -r -a runs <<< "${ARRIVALS_RUNS:-NGRAM 1,NGRAM 12,EAGLE3 1,EAGLE3 6}"
                  for run in "${runs[@]}"; do
                      read -r algorithm budget <<< "$run"
                      chain=(); [[ $algorithm == EAGLE3 ]] && chain=(--speculative-num-steps 5 --speculative-eagle-topk 1
                                                                   --speculative-num-draft-tokens 6)
                      for mode in ${ARRIVALS_MODES:-default --disable-mixed-chunk}; do
                          echo "== $algorithm budget $budget $mode ${ARRIVALS_EXTRA:-}" >> "$OUT/arrivals.log"
                          [[ $mode == default ]] && mode=
                          timeout "${ARRIVALS_TIMEOUT:-120}" python3 -P benchmarks/step_host_cost.py arrival 30 "$budget" \
                              --device cuda --dtype bfloat16 --speculative-algorithm "$algorithm" "${chain[@]}" \
                              --batch-size 16 --prompt-len 128 $mode ${ARRIVALS_EXTRA:-} >> "$OUT/arrivals.log" 2>&1 || { stop=1; break 2; }
                      done
                  done ;;
        tracecost) for mode in off on off2; do
                       SPLITSPEC_ADAPTIVE_TRACE=$([[ $mode == on ]] && echo "$OUT/tracecost_trace.jsonl") \
                       timeout 200 python3 -P -m splitspec bench --device cuda --dtype bfloat16 --speculative-algorithm EAGLE3 \
                           --steps 5 --topk 1 --num-draft-tokens 6 --speculative-adaptive on --no-phase-sync --batch-size 1,16 \
                           --num-prompts 32 --prompt-len 128 --output-len 256 --rounds 2 --out "$OUT/tracecost_$mode.json" \
                           >> "$OUT/tracecost.log" 2>&1 || stop=1
                   done
                   gzip -f "$OUT/tracecost_trace.jsonl" ;;
        reuse) timeout 300 python3 -P -m pytest -q -p no:cacheprovider tests/test_gpu_kernels.py -k "work_split or draft_loop_graphs" \
                   > "$OUT/reuse.log" 2>&1 || stop=1
               for bs in ${REUSE_BS:-1}; do
                   for mode in ${REUSE_MODES:-lean:auto reuse:auto reuse:fa2 lean:fa2 lean:auto reuse:fa2}; do  # replan:graph prefill
                       echo "== batch $bs SPLITSPEC_FLASHINFER_REPLAN=${mode%:*} SPLITSPEC_FLASHINFER_GRAPH_PREFILL=${mode#*:}" >> "$OUT/reuse.log"
                       SPLITSPEC_GRAPH_ATTENTION=flashinfer SPLITSPEC_FLASHINFER_REPLAN=${mode%:*} SPLITSPEC_FLASHINFER_GRAPH_PREFILL=${mode#*:} \
                       timeout 240 python3 -P benchmarks/step_host_cost.py drafted 150 6 \
                           --device cuda --dtype bfloat16 --speculative-algorithm EAGLE3 --speculative-num-steps 5 \
                           --speculative-eagle-topk 1 --speculative-num-draft-tokens 6 --prompt-len 128 --batch-size "$bs" \
                           2>&1 | grep -E "^unprofiled|^budget|replan|plans|torch.profiler" >> "$OUT/reuse.log" || stop=1
                   done
               done ;;
        graphattn) # FlashInfer against kernels.paged_attention for graphs of a few query rows a request, by part
                   parts=" ${GRAPHATTN_PARTS:-checks bench drafted tests} "
                   if [[ $parts == *" checks "* ]]; then  # the kernel against its twin, compiled
                       timeout 200 python3 -P -m pytest -q -p no:cacheprovider tests/test_gpu_kernels.py -k twins_compiled \
                           > "$OUT/graphattn.log" 2>&1 || stop=1
                   fi
                   if [[ $parts == *" bench "* ]]; then  # each graph kind's attention alone
                       timeout 240 python3 -P benchmarks/graph_attention_cost.py --config splitspec/demo_models/target/config.json \
                           --batch-sizes "${GRAPHATTN_BS:-1,16,64}" --min-chunks "${GRAPHATTN_CHUNKS:-64,128,256}" --out "$OUT/graph_attention_demo.json" >> "$OUT/graphattn.log" 2>&1 || stop=1
                   fi
                   if [[ $parts == *" bench8b "* ]]; then  # the same at a Llama-3.1-8B shape (32 layers, 8 x 128 key-value heads)
                       timeout 300 python3 -P benchmarks/graph_attention_cost.py --preset llama-3.1-8b --batch-sizes 1,16,64 \
                           --kv-lens 1024 --min-chunks "${GRAPHATTN_CHUNKS:-64,128,256}" --out "$OUT/graph_attention_8b.json" \
                           >> "$OUT/graphattn.log" 2>&1 || stop=1
                   fi
                   if [[ $parts == *" drafted "* ]]; then  # the demo EAGLE-3 chain's drafted steps in process
                       for bs in ${REUSE_BS:-1}; do
                           for mode in ${GRAPHATTN_MODES:-flashinfer triton flashinfer triton}; do
                               how=${mode%%:*} chunk=; [[ $mode == *:* ]] && chunk=${mode#*:}  # triton:64: 64 keys a split at least
                               echo "== batch $bs SPLITSPEC_GRAPH_ATTENTION=$how${chunk:+ SPLITSPEC_GRAPH_ATTENTION_MIN_CHUNK=$chunk}" >> "$OUT/graphattn.log"
                               SPLITSPEC_GRAPH_ATTENTION=$how SPLITSPEC_GRAPH_ATTENTION_MIN_CHUNK=$chunk timeout 240 python3 -P benchmarks/step_host_cost.py drafted 150 6 \
                                   --device cuda --dtype bfloat16 --speculative-algorithm EAGLE3 --speculative-num-steps 5 \
                                   --speculative-eagle-topk 1 --speculative-num-draft-tokens 6 --prompt-len 128 --batch-size "$bs" \
                                   2>&1 | grep -E "^unprofiled|^budget|replan|plans|torch.profiler" >> "$OUT/graphattn.log" || stop=1
                           done
                       done
                   fi
                   if [[ $parts == *" tests "* ]]; then  # graphs against eager, with each
                       timeout 420 python3 -P -m pytest -q -p no:cacheprovider tests/test_gpu_kernels.py \
                           -k "graphs_equal_eager or graph_decode_equals_eager" >> "$OUT/graphattn.log" 2>&1 || stop=1
                   fi ;;
        graphs) for bs in ${GRAPHS_BS:-1 16}; do
                    timeout 300 python3 -P benchmarks/graph_launch_cost.py --device cuda --dtype bfloat16 \
                        --speculative-algorithm EAGLE3 --speculative-num-steps 5 --speculative-eagle-topk 1 \
                        --speculative-num-draft-tokens 6 --prompt-len 128 --batch-size "$bs" \
                        > "$OUT/graph_launch_bs$bs.txt" 2>&1 || stop=1
                done ;;
        jitcache) # FlashInfer's JIT modules of the 8B shape (head dim 128) and the demo's (64), as one .txz (back in $OUT;
                  # keep it in .ficache/, carried: scripts/gpu_env.sh installs it as FlashInfer's AOT modules)
                  for shape in "--preset llama-3.1-8b --draft-preset eagle3-llama-3.1-8b" ""; do
                      timeout 200 python3 -P -m splitspec bench --device cuda --dtype bfloat16 $shape --speculative-algorithm EAGLE3 \
                          --speculative-adaptive off --steps 3 --topk 1 --num-draft-tokens 4 --batch-size 1 --num-prompts 1 \
                          --output-len 8 --prompt-len 32 --warmup-requests 1 --out "$OUT/jitcache_run.json" >> "$OUT/jitcache.log" 2>&1
                  done
                  (cd "$FLASHINFER_WORKSPACE_BASE" && find . -path '*/cached_ops/*/*.so' | tar cJf "$OUT/flashinfer-$(python3 -c 'import flashinfer; print(flashinfer.__version__)')-jit.txz" -T -) ;;
        tests) python3 -P -m pytest -p no:cacheprovider -v --durations 30 ${GPU_TESTS:-tests/test_gpu_kernels.py tests/test_tensor_plane.py \
                   tests/test_draft_loop.py tests/test_model_equivalence.py tests/test_paged_attention.py tests/test_rope.py tests/test_fp8.py \
                   tests/test_overlap_schedule.py::test_overlapped_plain_steps_give_what_serial_steps_give \
                   tests/test_overlap_schedule.py::test_preemption_lands_the_step_in_flight_first_and_keeps_outputs} \
                   --junitxml "$OUT/pytest_cuda.xml" > "$OUT/pytest_cuda.log" 2>&1 ;;
        *) echo "unknown stage $stage"; false ;;
    esac
    rc=$?
    [[ $stop -ne 0 ]] && rc=1
    echo "== $stage rc=$rc"
    [[ $rc -ne 0 ]] && failed=1
done
# the device tool brings back only a few files per call: step logs (SERVED_STEP_LOG), thread samples (SERVED_THREADS)
# and the adaptive policy's traces travel as one archive
[[ -f "$OUT/results.tgz" ]] && (cd "$OUT" && tar xzf results.tgz && rm results.tgz)  # an earlier run's in this call
[[ -f "$OUT/steps.tgz" ]] && (cd "$OUT" && tar xzf steps.tgz && rm steps.tgz)  # an earlier run's in this call: kept
packed=$(cd "$OUT" && compgen -G "steps_*.jsonl"; compgen -G "threads_*.txt"; compgen -G "adaptive_*.jsonl"; compgen -G "syncs_*.jsonl")
if [[ -n "$packed" ]]; then
    (cd "$OUT" && tar czf steps.tgz $packed && rm -f $packed)
fi
# and at most 8 files in all: past that (several served cases, tagged runs in one call), the served cases' JSON and logs
# and steps.tgz travel in results.tgz (a call that ran 4 served cases got 8 of its 11 files back, not its traces)
if (( $(find "$OUT" -type f | wc -l) > 8 )); then
    (cd "$OUT" && rest=$(compgen -G "served_*.json"; compgen -G "served_*.log"; compgen -G "steps.tgz"; true) &&
     [[ -n "$rest" ]] && tar czf results.tgz $rest && rm -f $rest)
fi
exit $failed

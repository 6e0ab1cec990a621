"""`splitspec bench`: speculative decoding measured over a grid (SGLang's bench_speculative.py, REFERENCES §11).

In process (the default) it loads the target once and, for every batch size, runs plain decoding and then
every point of the grid --steps x --topk x --num-draft-tokens with the drafter the --speculative-* flags
name, built in this process as `splitspec generate` builds it. Each point serves --num-prompts requests
with at most --batch-size running at once (a finished request's slot goes to the next prompt), after an
untimed warm-up of its own. With --url it measures a running deployment instead, over its OpenAI HTTP
API with streaming: --batch-size concurrent clients, plain (each request opting out with
"speculative": false) and speculative, the tree being whatever the deployment serves.

One JSON row per point:
    accept_length           tokens per verify step (accepted drafts + the bonus token);
                            accepted_per_position: the fraction of steps accepting at least d drafts
    output_tok_s            all output tokens over the point's wall time (first request sent to last done)
    per_request_tok_s       mean over requests of (tokens - 1) / (last token time - first token time):
                            the speed one user sees (at batch 1, the decode speed)
    ttft_ms, itl_ms         time to first token; time between token deliveries (a speculative step
                            delivers several tokens at once), mean/p50/p90/p99; tpot_ms per output token
    step_ms                 in process: mean time per decode step (steps without prefill) by phase:
                            schedule, draft (waiting for the trees), verify, accept, commit, ask (asking
                            for the next trees; with overlap, waiting for the bets first), other, total; on
                            a GPU the engine waits for the device at each boundary, so phases hold their
                            kernels' time
    speedup                 output_tok_s over plain's at the same batch size (--url --rounds N: the median of
                            the rounds' paired ratios; rounds_tok_s, windows_s: each round's tok/s and time window;
                            in process --rounds N: over the same round's plain row)
    round                   in process with --rounds N: the row's round (0-based)
    adaptive, budgets       whether the point ran load-adaptive (--speculative-adaptive on|both); decode steps per
                            tree budget the engine used (1: no drafts)
    profile                 simulated rows: the acceptance profile replayed
    with --drafter-transport zmq (a `splitspec drafter` process):
    tensor_plane            how hidden states reached it: cuda-ipc (a buffer on the verifier's GPU) or zmq-frames
    bets                    overlap: hits, misses, late, hit_rate
    drafter_reply_ms        the drafter's own time per DraftReply (trees); drafter_bets_ms per DraftBets
    round_trip_ms           from sending a DraftRequest to filing its reply, on the verifier's clock
    transport_ms            that round trip's legs by wall clocks (one host): queue (until the pool's I/O
                            thread sends), out (until the drafter has it), drafter, in (until the pool filed
                            the reply); bets_in; wake (filed -> the engine thread running again)

Targets no draft fits (--preset: a dummy model of a known shape) are measured with simulated acceptance:
--simulate-acceptance PROFILE records plain decoding's outputs as the reference and wraps the drafter in
the replay drafter (splitspec.drafter_svc.replay), which still drafts for real (--draft-preset: a dummy
head of a known shape, e.g. eagle3-llama-3.1-8b) but proposes the target's own continuation, accepted as
the profile draws. Those rows say "simulated": true.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

from splitspec import engine_args, model_flags
from splitspec.log_format import setup_logging
from splitspec.bench_measure import git_commit  # noqa: F401 (the benchmarks' scripts take it from here)

logger = logging.getLogger("splitspec.bench")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="splitspec bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    model_flags.add_model_args(parser)
    shapes = parser.add_argument_group("dummy models of known shapes (random weights: profiling only)")
    from splitspec.model_shapes import PRESETS

    shapes.add_argument("--preset", default=None, choices=sorted(p for p in PRESETS if "eagle" not in p),
                        help="The target: a dummy model of this shape (instead of --model-path; --load-format dummy).")
    shapes.add_argument("--draft-preset", default=None, choices=sorted(p for p in PRESETS if "eagle" in p),
                        help="The draft head: a dummy one of this shape (instead of --speculative-draft-model-path; "
                        "--speculative-draft-load-format dummy). Its drafts agree with nothing: pair it with "
                        "--simulate-acceptance.")
    engine_args.add_scheduler_args(parser)
    engine_args.add_speculative_args(parser)
    for action in parser._actions:  # the bench's fixed trees by default; both: every point fixed, then adaptive
        if action.dest == "speculative_adaptive":
            action.choices, action.default = ("off", "on", "both"), "off"
            action.help = ("off (the default here): every grid point's tree as given; on: the point's tree as the "
                           "largest budget of load-adaptive speculation (see `splitspec verifier --help`), one policy "
                           "learning across the batch sizes in order, as a server's does as load grows; both: each "
                           "point fixed, then adaptive. Rows say adaptive and the budgets their decode steps used.")
    grid = parser.add_argument_group("the grid and the load")
    grid.add_argument("--batch-size", default="1", help="Comma-separated: requests running at once.")
    grid.add_argument("--steps", default=None,
                      help="Comma-separated --speculative-num-steps values (default: the flag, else the automatic choice).")
    grid.add_argument("--topk", default=None, help="Comma-separated --speculative-eagle-topk values (default: likewise).")
    grid.add_argument("--num-draft-tokens", default=None,
                      help="Comma-separated --speculative-num-draft-tokens values (default: likewise). Points that do "
                      "not make a valid tree (too many tokens for steps x topk) are skipped, logged.")
    grid.add_argument("--num-prompts", type=int, default=None,
                      help="Requests per point (default: twice the batch size, at least 4).")
    grid.add_argument("--prompt-len", type=int, default=128, help="Prompt tokens per request.")
    grid.add_argument("--output-len", type=int, default=256, help="Output tokens per request (EOS is ignored).")
    grid.add_argument("--dataset", default="auto",
                      help="random: seeded random token ids; held-out: the standard-library files the demo models never "
                      "trained on, through the model's tokenizer; or a JSON-lines FILE with prompt_ids (or text). auto: "
                      "held-out when the model has a tokenizer, else random.")
    grid.add_argument("--seed", type=int, default=0, help="Seed of random prompts.")
    grid.add_argument("--temperature", type=float, default=0.0,
                      help="0: greedy; above 0 each request samples with seed = its index (lossless either way).")
    grid.add_argument("--simulate-acceptance", default=None, metavar="PROFILE",
                      help="Simulated speculation: record plain decoding's outputs and replay them as drafts accepted per "
                      "PROFILE (accept-length:L, or per-depth rates a_1,a_2,...; see --speculative-replay-profile); "
                      "several profiles separated by ';' measure every point under each. Greedy only; rows are "
                      "labelled simulated and name their profile. Dummy targets (--preset, --load-format dummy) load as "
                      "--load-format dummy-decisive.")
    grid.add_argument("--simulate-reference-out", default=None, metavar="FILE",
                      help="With --simulate-acceptance: also write the recorded reference (plain decoding's outputs at "
                      "every batch size, JSON lines of prompt_ids and output_ids) to FILE, for a server's "
                      "--speculative-replay (benchmarks/served.py --simulate-acceptance).")
    grid.add_argument("--no-phase-sync", action="store_true",
                      help="In process on a GPU: run the engine as a server does, without waiting for the device at every "
                      "phase boundary (the default waits, so that step_ms splits each step by phase, which costs some "
                      "speed); step_ms's phases are then host time and only its total is the device's. "
                      "benchmarks/served.py's in-process side runs this way.")
    grid.add_argument("--disable-overlap-schedule", action="store_true",
                      help="In process on a GPU with --no-phase-sync: land every plain decoding step's tokens before the "
                      "next step is launched. By default, as in a served verifier, the next plain step is launched first "
                      "(SGLang's flag name; the verifier's --disable-overlap-schedule).")
    grid.add_argument("--warmup-requests", type=int, default=2, help="Untimed requests before each point (8 tokens each).")
    split = parser.add_argument_group("the drafter in its own process (the split)")
    split.add_argument("--drafter-transport", default="in-process", choices=("in-process", "zmq"),
                       help="zmq: each grid point drafts with a `splitspec drafter` process started on this host, over "
                       "the ZeroMQ step channel (a drafter pool on loopback), as a deployment does.")
    split.add_argument("--drafter-device", default=None,
                       help="With --drafter-transport zmq: the drafter process's device, e.g. cuda:1 for a drafter on "
                       "its own GPU (default: --device).")
    split.add_argument("--drafter-plane", default="auto", choices=("auto", "frames"),
                       help="How hidden states reach the drafter process: auto = through a CUDA-IPC buffer on the "
                       "verifier's GPU when the drafter sees it (as `splitspec verifier` does), frames = ZeroMQ frames "
                       "through the host always (--drafter-ipc-buffer-mb 0).")
    engine_args.add_overlap_args(split)
    remote = parser.add_argument_group("against a running deployment")
    remote.add_argument("--url", default=None,
                        help="The gateway's base URL, e.g. http://127.0.0.1:30000: measure it over HTTP instead of "
                        "loading a model here (only --batch-size, --num-prompts, --prompt-len, --output-len, --dataset "
                        "and --temperature apply). The requests stream from one asyncio event loop, each concurrent "
                        "slot over its own keep-alive connection, as SGLang's and vLLM's serving benchmarks send them.")
    remote.add_argument("--api-key", default=None, help="Bearer token for --url.")
    remote.add_argument("--ready-check-timeout-sec", type=float, default=600.0,
                        help="With --url, wait up to this many seconds for a deployment still starting (nothing listening "
                        "yet, or HTTP 503 while its verifier loads) before measuring, as vLLM's bench serve does; 0: "
                        "fail at once.")
    rounds = parser.add_argument_group("rounds (a host whose speed drifts)")
    rounds.add_argument("--rounds", type=int, default=1,
                        help="Each batch size measured N times, each round with its own prompts (the dataset's next "
                        "ones; a simulated acceptance's rounds repeat the first round's, which its reference holds). With "
                        "--url plain and speculative alternate (plain, speculative, plain, ...), so that a host whose speed "
                        "drifts over minutes weighs on both alike; a row pools its rounds (all tokens over their summed wall "
                        "time; latencies over every request; rounds_tok_s: each round's), and its speedup is the median of "
                        "each speculative round over the plain round just before it. In process every point runs once a "
                        "round (plain at every batch size, then the grid), rows carry their round and a speculative row's "
                        "speedup is over the same round's plain row.")
    rounds.add_argument("--first-round", type=int, default=0,
                        help="Start at this round's prompts (--url: rounds K.. of the dataset's order; benchmarks/served.py "
                        "measures the served side of its round K this way, next to the in-process side's round K).")
    rounds.add_argument("--pause-before-rounds", action="store_true",
                        help="In process: once the model is loaded, before each round, print `round K ready` on stdout and "
                        "wait for a line on stdin (benchmarks/served.py starts the server and runs a served round between "
                        "two, the model staying loaded here).")
    parser.add_argument("--out", default=None, help="Also write the JSON report here.")
    return parser


def run(args: argparse.Namespace) -> int:
    setup_logging(args.log_level)
    commit = git_commit()  # the code that runs: a commit made while it runs is not it
    try:
        model_flags.check_sglang_server_flags(args, "splitspec bench")
        if args.rounds < 1 or args.first_round < 0:
            raise ValueError(f"--rounds {args.rounds} --first-round {args.first_round}: at least 1 round, from round 0 on")
        if args.ready_check_timeout_sec < 0:
            raise ValueError(f"--ready-check-timeout-sec {args.ready_check_timeout_sec}: must be 0 (no wait) or more")
        if args.pause_before_rounds and args.url:
            raise ValueError("--pause-before-rounds is for the in-process bench (its model stays loaded between rounds)")
        if args.url:
            from splitspec.bench_http import run_remote

            report = run_remote(args)
        else:
            from splitspec.bench_in_process import run_in_process

            report = run_in_process(args)
    except (ValueError, OSError, RuntimeError) as exc:  # ConfigError, FlagError, a path that is not there, HTTP
        print(f"splitspec bench: error: {exc}", file=sys.stderr)
        return 2
    report = {"benchmark": "splitspec bench", "command": "splitspec bench " + " ".join(sys.argv[2:]),
              "commit": commit, "prompt_len": args.prompt_len, "output_len": args.output_len,
              "temperature": args.temperature, **report}
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return 0

"""The engine's flags, SGLang's names: scheduling (--max-running-requests, --chunked-prefill-size) and
speculation (--speculative-*), and what they build: SchedulerConfig, and a drafter in this process.

What the speculative flags resolve to (the tree, the overlap, the acceptance policy, how a draft loads) is
splitspec.speculation; building a model drafter from that is splitspec.draft_models.
"""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from splitspec.speculation import HIDDEN_STATE_ALGORITHMS, MODEL_ALGORITHMS, FlagError  # noqa: F401 (for callers)

if TYPE_CHECKING:  # the drafter service uses these flags too and must not import the verifier
    from splitspec.speculation import Speculation
    from splitspec.verifier_svc.step_types import SchedulerConfig, SpecStats


SCHEDULE_POLICIES = ("fcfs", "lpm", "lof")


def add_scheduler_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("scheduling (SGLang's flags)")
    group.add_argument("--max-running-requests", type=int, default=0,
                       help="Requests decoding at once; the rest wait (0 = no limit).")
    group.add_argument("--chunked-prefill-size", type=int, default=8192,
                       help="Prompt tokens one step prefills at most; a longer prompt is prefilled over several steps "
                       "(-1 = no limit). A step that mixes prompt chunks with decoding requests counts each decoding "
                       "request's tree first (--speculative-num-draft-tokens each, 1 without speculation) and prompt "
                       "chunks share the rest.")
    group.add_argument("--schedule-policy", default="fcfs", choices=SCHEDULE_POLICIES,
                       help="The order waiting requests join the running batch in: fcfs (arrival), lpm (the longest "
                       "prompt prefix already in the prefix cache first, for more cache hits under load with shared "
                       "prefixes; arrival order past 128 waiting, as SGLang), lof (the most max_tokens first). Requests "
                       "sent back to wait by preemption always go first (SGLang's flag; its random, dfs-weight and "
                       "priority are not served).")
    mixed = group.add_mutually_exclusive_group()
    mixed.add_argument("--enable-mixed-chunk", dest="mixed_chunk", action="store_const", const="always",
                       default="auto",
                       help="Verify the decoding requests' trees in every step with prompt chunks (vLLM's chunked "
                       "prefill: decoding never pauses for a prompt). Default: mixed when the decoding requests "
                       "outnumber the arriving ones and verify no drafts that step (a request joining a running batch "
                       "that is not drafting: the batch keeps decoding beside its prompt) and the prompts alone fit no "
                       "captured prompt graph (--prompt-cuda-graph-max-tokens: that step is cheaper), else the prompts prefill "
                       "alone and the batch decodes again next step (a wave of arrivals joins one decoding batch "
                       "instead of trickling in over mixed steps; a mixed step runs tree rows outside the captured "
                       "graphs); a backlog over --chunked-prefill-size (a long prompt over several chunks) is always "
                       "mixed.")
    mixed.add_argument("--disable-mixed-chunk", dest="mixed_chunk", action="store_const", const="prefill-first",
                       help="SGLang's default scheduling: prompts that fit one step's --chunked-prefill-size prefill "
                       "alone, the decoding requests paused for that step, however many they are; only a longer "
                       "backlog is mixed.")


def scheduler_config(args: argparse.Namespace) -> SchedulerConfig:
    from splitspec.verifier_svc.step_types import SchedulerConfig

    return SchedulerConfig(max_running_requests=args.max_running_requests, chunked_prefill_size=args.chunked_prefill_size,
                           mixed_chunk=args.mixed_chunk, schedule_policy=args.schedule_policy)


def add_speculative_args(parser: argparse.ArgumentParser, side: str = "verifier") -> None:
    """SGLang's --speculative-* flags; side="drafter" leaves out what only the verifier decides
    (acceptance rules)."""
    from splitspec.runtime.attention import ATTENTION_BACKENDS, SGLANG_ATTENTION_BACKENDS

    group = parser.add_argument_group("speculative decoding (SGLang's flags)")
    group.add_argument("--speculative-algorithm", default=None, type=_algorithm,
                       choices=ALGORITHMS if side == "drafter" else _OrNone(ALGORITHMS),
                       help="Draft with this algorithm and verify losslessly (default: no speculation; none: the same, "
                       "as `splitspec up` takes it). NGRAM: "
                       "suffix matches in a trie of the requests' own tokens; STANDALONE: a small draft LLM sharing "
                       "the target's tokenizer (--speculative-draft-model-path); EAGLE: an EAGLE-1/2 head "
                       "(--speculative-draft-model-path) drafting from the target's final hidden states, or, without a "
                       "draft path, the MTP layers the target ships (MiMo); NEXTN: the same as EAGLE; EAGLE3: an EAGLE-3 "
                       "head drafting from three captured target layers.")
    group.add_argument("--speculative-draft-model-path", default=None,
                       help="STANDALONE: the draft model; EAGLE/EAGLE3: the head (HF directory or hub id); leave it out "
                       "for a target's own MTP layers.")
    group.add_argument("--speculative-draft-model-revision", default=None,
                       help="Hub branch, tag or commit of the draft model (main when a draft path is set without one).")
    group.add_argument("--speculative-draft-load-format", default=None, choices=LOAD_FORMATS,
                       help="How the draft's weights are read: auto (safetensors, else pytorch_model.bin), safetensors, "
                       "pt (pytorch_model.bin, loaded weights-only) or dummy (random, for profiling). Default: "
                       "--load-format where the command has one, else auto.")
    group.add_argument("--speculative-draft-model-quantization", default=None, choices=("unquant", "fp8"),
                       help="Quantization of the draft's weights (SGLang's flag; the draft does not follow the target's "
                       "--quantization). fp8: the draft's linear layers (a STANDALONE draft's decoder layers; an "
                       "EAGLE/EAGLE3 head's fc and layers; MTP layers) get FP8 weights as --quantization fp8 describes, "
                       "never its embedding or lm_head. unquant: unquantized in --dtype even beside an FP8 target (an "
                       "FP8 draft checkpoint is then refused). Default: as its checkpoint is (unquantized, or FP8 when "
                       "its config.json says so).")
    group.add_argument("--speculative-draft-attention-backend", default=None, choices=["auto", *sorted({*ATTENTION_BACKENDS, *SGLANG_ATTENTION_BACKENDS})],
                       help="Attention kernels of the draft model (default: the same as --attention-backend). SGLang's "
                       "names that are not implemented yet are served by torch (logged).")
    group.add_argument("--speculative-attention-mode", default="prefill", choices=("prefill", "decode"),
                       help="How target verification attends (SGLang's modes): prefill (each request's tree in one "
                       "prefill pass under a custom mask over the paged cache) or decode (every tree node a row of "
                       "the decode kernel over its request's cached prefix, merged with attention over the tree's own "
                       "nodes). Models with sliding-window layers verify in prefill mode (logged). The draft's beam "
                       "steps always attend as decode rows; its catch-up on accepted tokens is a prefill.")
    group.add_argument("--speculative-draft-disable-cuda-graph", action="store_true",
                       help="GPU: run the draft's steps eagerly (by default the whole draft, every step and the "
                       "ranking of its candidates, replays one CUDA graph per batch size up to --cuda-graph-max-bs; "
                       "--disable-cuda-graph turns off the target's graphs and these).")
    group.add_argument("--speculative-moe-runner-backend", default=None, choices=MOE_RUNNER_BACKENDS,
                       help="SGLang's MoE runner for the draft; the drafts served here are dense (MoE drafts are out "
                       "of scope), so it is checked and logged as a no-op.")
    group.add_argument("--speculative-moe-a2a-backend", default=None, choices=MOE_A2A_BACKENDS,
                       help="SGLang's MoE all-to-all backend for the draft; checked and logged as a no-op (dense drafts).")
    group.add_argument("--enable-multi-layer-eagle", action="store_true",
                       help="MTP targets shipping several MTP layers: draft step i runs MTP layer i (a chain: "
                       "--speculative-eagle-topk 1; auto: one step per layer).")
    group.add_argument("--speculative-token-map", default=None,
                       help="FR-Spec: a list of frequent target token ids (torch.save'd; a path or <org>/<repo>/<file> "
                       "on the hub); the draft head keeps only those rows and drafted ids map back. EAGLE, MTP and "
                       "STANDALONE; ignored with a warning for EAGLE3, whose heads carry their own (d2t).")
    group.add_argument("--speculative-num-steps", type=int, default=None,
                       help="Model drafters: drafting depth (auto: 5 for EAGLE/EAGLE3 on Llama targets, else 3; multi-layer "
                       "MTP: its number of layers). Set all three of "
                       "--speculative-num-steps, --speculative-eagle-topk, --speculative-num-draft-tokens, or none.")
    group.add_argument("--speculative-eagle-topk", type=int, default=None,
                       help="Model drafters: branching factor per step (auto: 4 for EAGLE/EAGLE3 on Llama targets, else 1).")
    group.add_argument("--speculative-num-draft-tokens", type=int, default=None,
                       help="Tree nodes verified per step, root included (NGRAM: the max match window size; "
                       "auto: 8 for EAGLE/EAGLE3 on Llama targets, else 4; with --speculative-eagle-topk 1 it becomes num-steps + 1).")
    if side == "verifier":
        group.add_argument("--speculative-accept-threshold-single", type=float, default=1.0,
                           help="Below 1.0: SGLang's lossy rule accepts a draft whose target probability reaches this.")
        group.add_argument("--speculative-accept-threshold-acc", type=float, default=1.0,
                           help="Below 1.0: SGLang's lossy rule accepts when the coin is below accumulated mass / this.")
        group.add_argument("--speculative-adaptive", nargs="?", const="on", default="auto", choices=("auto", "on", "off"),
                           help="Load-adaptive speculation: each step's tree budget (1 = no drafts .. "
                           "--speculative-num-draft-tokens; a chain's depth follows it, while a model drafter still runs its "
                           "--speculative-num-steps) is the one with the largest "
                           "expected throughput for the batch decoding now, from the measured acceptance per depth and "
                           "the measured cost of the target forward per token count and of drafting, so speculation "
                           "turns itself down and off as load grows, without a cliff, and back on as it falls (the "
                           "choice is the gauge splitspec:spec_adaptive_num_draft_tokens). Given alone: on. auto: on "
                           "when the target runs on a GPU, off on CPU (fixed trees).")
        group.add_argument("--speculative-adaptive-hysteresis", type=float, default=0.015,
                           help="Adaptive: the predicted relative gain a change of budget needs (against flapping).")
        group.add_argument("--speculative-adaptive-probe-interval", type=int, default=200,
                           help="Adaptive: steps without drafts after which two steps draft, to measure the acceptance "
                           "again (only when better acceptance could make speculation pay at that load); each probe that "
                           "leaves drafting off doubles the wait for the next, up to 8x, until drafting resumes or the "
                           "batch size moves to another power of two; and where a probe was timed at that load, the wait "
                           "is long enough that probing costs at most 3%% of the time (its first step catches a head up on "
                           "the whole run without drafts).")
    group.add_argument("--speculative-ngram-min-match-window-size", type=int, default=1, help="NGRAM: shortest suffix matched.")
    group.add_argument("--speculative-ngram-max-match-window-size", type=int, default=12, help="NGRAM: longest suffix matched.")
    group.add_argument("--speculative-ngram-min-bfs-breadth", type=int, default=1, help="NGRAM: BFS breadth for the longest match.")
    group.add_argument("--speculative-ngram-max-bfs-breadth", type=int, default=10, help="NGRAM: BFS breadth for the shortest match.")
    group.add_argument("--speculative-ngram-match-type", default="BFS", choices=("BFS", "PROB"),
                       help="NGRAM: BFS (recency) or PROB (frequency) tree construction.")
    group.add_argument("--speculative-ngram-branch-length", type=int, default=18, help="NGRAM: recent tokens inserted per step.")
    group.add_argument("--speculative-ngram-capacity", type=int, default=10_000_000, help="NGRAM: trie nodes kept (LRU).")
    sim = parser.add_argument_group("simulated speculation (benchmarks only; results are labelled simulated)")
    sim.add_argument("--speculative-replay", default=None, metavar="FILE",
                     help="Drafter side: propose the target's own greedy continuation recorded in FILE (JSON lines with "
                     "prompt_ids and output_ids, as `splitspec generate --json` prints them) instead of the drafted tokens, "
                     "accepted as --speculative-replay-profile draws. The drafter the other flags name still drafts for "
                     "real (its cost; --speculative-draft-load-format dummy gives a head of any shape), and its tree is "
                     "discarded. For measuring targets no draft fits, e.g. dummy 8B-shaped ones.")
    sim.add_argument("--speculative-replay-profile", default="accept-length:3", metavar="PROFILE",
                     help="With --speculative-replay: accept-length:L (depth d accepted with rate q^d, 1 + q + ... + "
                     "q^steps = L), or comma-separated rates a_1,a_2,...: the fraction of steps accepting at least d "
                     "drafts (a real run's accepted_per_position / verify_steps).")
    sim.add_argument("--speculative-replay-seed", type=int, default=0,
                     help="With --speculative-replay: seed of the acceptance draws (the same draws in every run).")
    sim.add_argument("--speculative-replay-guess-rate", type=float, default=None, metavar="RATE",
                     help="With --speculative-replay and overlap: how often the bet on the accept length a step will "
                     "have guesses its bonus token right (default: a_S / a_S-1, the profile's rate at its last depth).")
    if side == "verifier":
        group.add_argument("--speculative-ngram-force-greedy-verify", action="store_true",
                           help="NGRAM: verify by target argmax even for sampled requests (SGLANG_NGRAM_FORCE_GREEDY_VERIFY=True).")


def add_overlap_args(group) -> None:
    """The verifier's overlap flags (drafters in their own processes)."""
    group.add_argument("--speculative-overlap", default=None, choices=("auto", "on", "off"),
                       help="Overlap drafting with verification: while the verifier verifies a tree, the drafter drafts "
                       "bets, the trees it would propose next for the likely outcomes (every accept length along its "
                       "best path, with a guessed bonus token); when one comes true the next tree is ready at once, and "
                       "a wrong bet costs no correctness. auto: for drafters that do not share the verifier's device "
                       "(another GPU; a CPU drafter beside a GPU verifier, or on another host). Default: on when "
                       "SGLANG_ENABLE_SPEC_V2 is true, off when it is false, else auto.")
    group.add_argument("--speculative-num-bets", type=int, default=None,
                       help="Overlap: bets per request and step (default: --speculative-num-steps + 1, one per accept "
                       "length; more add second guesses of the bonus token).")
    group.add_argument("--speculative-overlap-max-bs", type=int, default=8,
                       help="Overlap: bet only in steps where a drafter drafts for at most this many requests (bets "
                       "multiply its work by --speculative-num-bets; past this it drafts trees alone).")


ALGORITHMS = ("NGRAM", "STANDALONE", "EAGLE", "EAGLE3", "NEXTN")  # NEXTN is read as EAGLE (SGLang's alias)
LOAD_FORMATS = ("auto", "safetensors", "pt", "dummy")
# SGLang's choices (python/sglang/srt/server_args.py); the drafts served here are dense, so these are parsed,
# checked and logged as having nothing to do
MOE_RUNNER_BACKENDS = ("auto", "deep_gemm", "triton", "triton_kernel", "flashinfer_trtllm", "flashinfer_cutlass",
                       "flashinfer_mxfp4", "flashinfer_cutedsl", "cutlass")
MOE_A2A_BACKENDS = ("none", "deepep", "mooncake", "mori", "ascend_fuseep", "flashinfer")


def _algorithm(value: str) -> str | None:
    value = value.upper()
    if value == "NONE":
        return None
    return "EAGLE" if value == "NEXTN" else value


class _OrNone(tuple):
    """The algorithms, and none (parsed as None: no speculation), as argparse checks and lists choices."""

    def __contains__(self, value) -> bool:
        return value is None or tuple.__contains__(self, value)

    def __iter__(self):
        yield from tuple.__iter__(self)
        yield "none"


def in_process_drafter(speculation: Speculation | None, max_total_tokens: int | None = None, target=None):
    """(DrafterClient or None, SpecConfig) for a resolved Speculation (splitspec.speculation.resolve): the drafter
    runs inside this process, beside `target` (a ModelRunner), whose forward is told what to capture for it."""
    from splitspec.speculation import spec_config

    if speculation is None:
        return None, spec_config(None)
    from splitspec.draft_models import build_drafter, capture_for
    from splitspec.verifier_svc.drafter_client import InProcessDrafterClient

    drafter = build_drafter(speculation, max_total_tokens, target)
    capture_for(target, drafter.hidden_state_layers)
    return InProcessDrafterClient(drafter), spec_config(speculation)


def report(algorithm: str, stats: SpecStats) -> dict:
    return {"algorithm": algorithm, "verify_steps": stats.verify_steps, "draft_tokens": stats.draft_tokens,
            "accepted_tokens": stats.accepted_tokens, "mean_accept_length": round(stats.mean_accept_length, 4),
            "accepted_per_position": stats.accepted_per_position, "fallbacks": stats.fallbacks}


def check_context(prompt_lengths: list[int], max_new_tokens: int, context: int, flag: str) -> None:
    """What the gateway refuses over HTTP (OpenAI's context_length_exceeded), refused in process too: a prompt and its
    new tokens past the model's context (ModelRunner.context_length). Past it a GPU's captured graphs have no room
    for the request's pages, and the model was never trained there. FlagError names the flag that asks for too much."""
    longest = max(prompt_lengths, default=0)
    if longest + max_new_tokens > context:
        raise FlagError(f"This model's maximum context length is {context} tokens; the longest prompt has {longest} "
                        f"tokens and {flag} asks for {max_new_tokens} more")

"""Plain vs speculative decoding with the demo target on CPU, per algorithm; JSON out, no assertions.

    python benchmarks/speculative_cpu.py --out benchmarks/results/speculative_cpu.json
    python benchmarks/speculative_cpu.py --transports inprocess,zmq --out benchmarks/results/split_cpu.json
    python benchmarks/speculative_cpu.py --algorithms NGRAM,STANDALONE,EAGLE,EAGLE3 --transports inprocess,zmq \
        --out benchmarks/results/algorithms_cpu.json

Drafters are built from the product's own flags (the demo draft model, the demo EAGLE heads), as
`splitspec generate` builds them. --transports zmq drafts with a `splitspec drafter` process over
ZeroMQ (tcp on loopback) through the verifier's DrafterPool instead of the drafter object in this
process; either is fresh for every group.

Prompts are the first --prompt-tokens tokens of the held-out standard-library files (code the demo
model never trained on). Greedy decoding unless --temperature; each configuration runs every prompt in
groups of the batch size, after an untimed warm-up of its own (two prompts, 8 tokens). Decode
throughput counts the tokens after each request's first (the prefill's) over the time from the first
step's end to the last step's end, summed over groups. In process, `draft_s` is the time spent inside
the drafter's calls (synchronized on a GPU), the rest of decode_s being the verifier's.

Where a speculative output differs from plain decoding (possible only in low precision: the tree
verify and the one-token decode round differently), `divergences` gives the first differing position
and the target's float32 logit gap there between the two tokens: a near-tie (a gap of a few hundredths)
is rounding, a large gap would be a bug.

On a GPU (--device cuda --dtype bfloat16) the target runs as the verifier runs it: FlashInfer attention
and CUDA graphs of the decode step and of full trees. --preset llama-3.1-8b swaps the target for a
dummy model of that shape (random weights; NGRAM only, since no draft fits it); its divergences report
the gap in the runner's own logits at that position (no float32 twin of random weights exists).
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import torch

from splitspec import lifeline
from splitspec.demo import demo_model_dirs
from splitspec.generate import generate_ids
from splitspec.runtime.runner import ModelRunner, RuntimeConfig
from splitspec.runtime.sampling_params import SamplingParams
from splitspec.train import corpus


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch-sizes", default="1,8", help="Comma-separated batch sizes.")
    parser.add_argument("--num-prompts", type=int, default=16, help="Held-out files used as prompts.")
    parser.add_argument("--prompt-tokens", type=int, default=96, help="Tokens of each file used as the prompt.")
    parser.add_argument("--new-tokens", type=int, default=128, help="Tokens generated per request.")
    parser.add_argument("--num-draft-tokens", type=int, default=8, help="NGRAM tree budget, root included.")
    parser.add_argument("--match-type", default="BFS", choices=("BFS", "PROB"), help="NGRAM tree construction.")
    parser.add_argument("--algorithms", default="NGRAM",
                        help="Comma-separated: NGRAM, STANDALONE (the demo draft model, --standalone-tree), EAGLE and "
                        "EAGLE3 (the demo heads, --eagle-tree).")
    parser.add_argument("--standalone-tree", default="3,1,4",
                        help="STANDALONE num_steps,topk,num_draft_tokens (SGLang's automatic choice: 3,1,4).")
    parser.add_argument("--eagle-tree", default="5,4,8",
                        help="EAGLE/EAGLE3 num_steps,topk,num_draft_tokens (SGLang's automatic choice for Llama: 5,4,8).")
    parser.add_argument("--transports", default="inprocess",
                        help="Comma-separated: inprocess (drafter object here), zmq (a drafter process over ZeroMQ).")
    parser.add_argument("--target", default=None, help="Target model directory (default: the demo target).")
    parser.add_argument("--preset", default=None,
                        help="Instead of --target, a dummy (random-weight) target of a benchmarks/decode.py preset shape, "
                        "e.g. llama-3.1-8b (NGRAM only).")
    parser.add_argument("--draft", default=None, help="STANDALONE draft model (default: the demo draft).")
    parser.add_argument("--eagle-head", default=None, help="EAGLE head (default: the demo target's).")
    parser.add_argument("--eagle3-head", default=None, help="EAGLE3 head (default: the demo target's).")
    parser.add_argument("--device", default="cpu", help="cpu or cuda (target and drafters).")
    parser.add_argument("--dtype", default="float32", help="float32 or bfloat16 (target and drafters).")
    parser.add_argument("--temperature", type=float, default=0.0,
                        help="0: greedy. Above 0: seeded sampling (request i uses seed i), which the product keeps "
                        "token for token under speculation (position-keyed noise, ARCHITECTURE §3.2).")
    parser.add_argument("--top-p", type=float, default=1.0, help="Nucleus sampling when --temperature > 0.")
    parser.add_argument("--out", default=None, help="Write the JSON here as well as to stdout.")
    return parser.parse_args()


def prompts_from_held_out(tokenizer, num: int, length: int) -> list[list[int]]:
    files = [f for f in corpus.select_files() if f.held_out]
    texts = corpus.read_texts(files, held_out=True)
    prompts = [ids[:length] for ids in (tokenizer.encode(t) for t in texts) if len(ids) >= length]
    return prompts[:num]


def algorithm_flags(algorithm: str, args: argparse.Namespace) -> list[str]:
    """The product's flags for one algorithm with the demo models."""
    dirs = {}
    if algorithm != "NGRAM" and not all((args.draft, args.eagle_head, args.eagle3_head)):
        dirs = {k: str(v) for k, v in demo_model_dirs(heads=algorithm in ("EAGLE", "EAGLE3")).items()}
    dirs.update({k: v for k, v in (("draft", args.draft), ("eagle", args.eagle_head), ("eagle3", args.eagle3_head)) if v})
    if algorithm == "NGRAM":
        return ["--speculative-algorithm", "NGRAM", "--speculative-ngram-match-type", args.match_type,
                "--speculative-num-draft-tokens", str(args.num_draft_tokens)]
    draft = {"STANDALONE": dirs.get("draft"), "EAGLE": dirs.get("eagle"), "EAGLE3": dirs.get("eagle3")}[algorithm]
    steps, topk, tokens = (args.standalone_tree if algorithm == "STANDALONE" else args.eagle_tree).split(",")
    return ["--speculative-algorithm", algorithm, "--speculative-draft-model-path", str(draft), "--speculative-num-steps",
            steps, "--speculative-eagle-topk", topk, "--speculative-num-draft-tokens", tokens]


RUNTIME = {"dtype": "float32", "device": "cpu"}  # set by main from --dtype / --device


def parse_flags(flags: list[str], target: Path) -> argparse.Namespace:
    from splitspec import engine_args

    parser = argparse.ArgumentParser()
    engine_args.add_speculative_args(parser)
    for flag, default in (("--model-path", str(target)), ("--revision", None), ("--dtype", RUNTIME["dtype"]),
                          ("--device", RUNTIME["device"]),
                          ("--page-size", 16), ("--max-total-tokens", 32768), ("--attention-backend", "auto"),
                          ("--load-format", "auto")):
        parser.add_argument(flag, default=default, type=type(default) if default is not None else None)
    return parser.parse_args(flags)


class ZmqDrafter:
    """A DrafterPool bound on loopback with one `splitspec drafter` process registered to it, running
    the algorithm the flags name."""

    def __init__(self, flags: list[str], runner, target: Path):
        import socket

        from splitspec import draft_models, speculation
        from splitspec.verifier_svc.drafter_pool import DrafterPool

        settings = speculation.resolve(parse_flags(flags, target), runner.config)
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        address = f"tcp://127.0.0.1:{port}"
        layers = settings.hidden_state_layers
        draft_models.capture_for(runner, layers)
        self.runner = runner
        self.pool = DrafterPool(address, settings.algorithm, runner.config.vocab_size,
                                draft_model=settings.draft_model, timeout=5.0, heartbeat_timeout=10.0,
                                hidden_state_layers=layers)
        self.process = lifeline.spawn([sys.executable, "-P", "-m", "splitspec", "drafter", "--verifier-drafter-addr", address,
                                         *flags, "--model-path", str(target), "--dtype", RUNTIME["dtype"],
                                         "--device", RUNTIME["device"],
                                         "--log-level", "warning"])
        if not self.pool.wait_for_drafters(1, 120):
            raise RuntimeError("the drafter process did not register")

    def close(self) -> None:
        self.process.kill()
        self.process.wait()
        self.pool.close()
        self.runner.set_capture_layers(())


class TimedDrafter:
    """The in-process drafter with the time spent inside its calls summed (synchronized on a GPU)."""

    def __init__(self, drafter):
        self._drafter, self.seconds = drafter, 0.0

    def __getattr__(self, name):
        attr = getattr(self._drafter, name)
        if not callable(attr) or name.startswith("_"):
            return attr

        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return attr(*args, **kwargs)
            finally:
                if RUNTIME["device"].startswith("cuda"):
                    torch.cuda.synchronize()
                self.seconds += time.perf_counter() - t0

        return timed


def measure(runner, prompts, batch_size: int, new_tokens: int, flags: list[str] | None, target: Path,
            transport: str = "inprocess", temperature: float = 0.0, top_p: float = 1.0) -> dict:
    """flags: the product's --speculative-* flags (None: plain decoding)."""
    from splitspec import engine_args, speculation

    params = [SamplingParams(temperature=temperature, top_p=top_p, seed=i, max_new_tokens=new_tokens, ignore_eos=True)
              for i in range(len(prompts))]
    decode_s, decode_tokens, draft_s, requests = 0.0, 0, 0.0, []
    spec = speculation.spec_config(speculation.resolve(parse_flags(flags, target), runner.config)) if flags else None
    for start in range(0, len(prompts), batch_size):
        group = slice(start, start + batch_size)
        remote = ZmqDrafter(flags, runner, target) if flags and transport == "zmq" else None
        if remote is not None:
            drafter = remote.pool
        elif flags:  # the drafter object in this process, as `splitspec generate` builds it (fresh per group)
            drafter, spec = engine_args.in_process_drafter(speculation.resolve(parse_flags(flags, target), runner.config),
                                                           target=runner)
            drafter = TimedDrafter(drafter)
        else:
            drafter = None
        stamps: list[tuple[float, int]] = []
        try:
            out = generate_ids(runner, prompts[group], params[group], set(), drafter=drafter, spec=spec,
                               on_step=lambda n: stamps.append((time.perf_counter(), n)))  # noqa: B023 (called before the loop moves on)
        finally:
            if remote is not None:
                remote.close()
            runner.set_capture_layers(())
        if isinstance(drafter, TimedDrafter):
            draft_s += drafter.seconds
        decode_s += stamps[-1][0] - stamps[0][0]
        decode_tokens += sum(n for _, n in stamps[1:])
        requests += out
    verify_steps = sum(r.stats.verify_steps for r in requests)
    accepted = sum(r.stats.accepted_tokens for r in requests)
    algorithm = flags[flags.index("--speculative-algorithm") + 1] if flags else None
    row = {"batch_size": batch_size, "speculative": algorithm, "drafter": transport if flags else None,
           "decode_s": round(decode_s, 3),
           "decode_tokens": decode_tokens, "decode_tok_s": round(decode_tokens / decode_s, 2)}
    if flags:
        row.update({"flags": " ".join(f for f in flags if "/" not in f), "num_draft_tokens": spec.num_draft_tokens,
                    "verify_steps": verify_steps, "draft_tokens": sum(r.stats.draft_tokens for r in requests),
                    "accepted_tokens": accepted, "accept_length": round(1 + accepted / verify_steps, 3) if verify_steps else None,
                    "fallbacks": sum(r.stats.fallbacks for r in requests)})
        if transport == "inprocess":
            row["draft_s"] = round(draft_s, 3)  # includes the prefill step's drafting, which decode_s does not
    return row, [r.output_ids for r in requests]


def divergences(target: Path, prompts, plain_ids, spec_ids) -> list[dict]:
    """For each output that differs from plain decoding: the first differing position and the target's
    float32 logit gap there between plain's token and the speculative one (HF transformers, on --device)."""
    from transformers import AutoModelForCausalLM

    rows = [(i, next(j for j, (a, b) in enumerate(zip(p, q)) if a != b))
            for i, (p, q) in enumerate(zip(plain_ids, spec_ids)) if p != q and any(a != b for a, b in zip(p, q))]
    if not rows:
        return []
    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).to(RUNTIME["device"]).eval()
    out = []
    with torch.no_grad():
        for i, j in rows:
            ids = torch.tensor([prompts[i] + plain_ids[i][:j]], device=RUNTIME["device"])
            logits = model(ids).logits[0, -1].float()
            a, b = plain_ids[i][j], spec_ids[i][j]
            out.append({"prompt": i, "position": j, "plain_token": a, "speculative_token": b,
                        "float32_logit_gap": round(float(logits[a] - logits[b]), 4),
                        "float32_top2_gap": round(float(logits.topk(2).values.diff().abs()), 4)})
    del model
    return out


def runner_divergences(runner, prompts, plain_ids, spec_ids) -> list[dict]:
    """divergences() for a target with no float32 twin: the gap in the runner's own logits (one plain
    forward of the prompt and plain's tokens before the divergence)."""
    from splitspec.runtime.batch import SequenceInput
    from splitspec.runtime.kv_cache import BlockTable

    out = []
    for i, (p, q) in enumerate(zip(plain_ids, spec_ids)):
        j = next((j for j, (a, b) in enumerate(zip(p, q)) if a != b), None)
        if j is None:
            continue
        table = BlockTable()
        logits = runner.forward(runner.batch([SequenceInput(table, prompts[i] + p[:j])])).logits[0]
        runner.kv_cache.release(table)
        a, b = p[j], q[j]
        out.append({"prompt": i, "position": j, "plain_token": a, "speculative_token": b,
                    "runner_logit_gap": round(float(logits[a] - logits[b]), 4),
                    "runner_top2_gap": round(float(logits.topk(2).values.diff().abs()), 4)})
    return out


def main() -> int:
    from transformers import AutoTokenizer

    args = parse_args()
    RUNTIME.update(dtype=args.dtype, device=args.device)
    demo = demo_model_dirs()["target"]
    target = Path(args.target) if args.target else demo
    tokenizer = AutoTokenizer.from_pretrained(demo if args.preset else target)
    prompts = prompts_from_held_out(tokenizer, args.num_prompts, args.prompt_tokens)
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    capacity = max(batch_sizes) * (args.prompt_tokens + args.new_tokens + 2 * args.num_draft_tokens + 64)
    load_format = "auto"
    if args.preset:
        from splitspec.model_shapes import dummy_model_dir

        target, load_format = dummy_model_dir(args.preset), "dummy"
        if args.algorithms != "NGRAM":
            raise SystemExit("--preset: only NGRAM drafts for a dummy target")
    runner = ModelRunner.load(RuntimeConfig(model_path=str(target), dtype=args.dtype, device=args.device,
                                            max_total_tokens=capacity, load_format=load_format))
    trees = {"NGRAM": args.num_draft_tokens, "STANDALONE": int(args.standalone_tree.split(",")[2]),
             "EAGLE": int(args.eagle_tree.split(",")[2]), "EAGLE3": int(args.eagle_tree.split(",")[2])}
    runner.capture_cuda_graphs(tree_nodes=tuple(sorted({trees[a] for a in args.algorithms.split(",") if a in trees})))
    sampling = {"temperature": args.temperature, "top_p": args.top_p}
    measure(runner, prompts[:2], 2, 8, None, target)  # warm-up
    results = []
    for batch_size in batch_sizes:
        plain, plain_ids = measure(runner, prompts, batch_size, args.new_tokens, None, target, **sampling)
        results.append(plain)
        for algorithm in args.algorithms.split(","):
            for transport in args.transports.split(","):
                if batch_size == batch_sizes[0]:  # warm-up of this drafter (kernels, allocator), untimed
                    measure(runner, prompts[:2], 2, 8, algorithm_flags(algorithm, args), target, transport, **sampling)
                spec, spec_ids = measure(runner, prompts, batch_size, args.new_tokens, algorithm_flags(algorithm, args),
                                         target, transport, **sampling)
                spec["speedup"] = round(spec["decode_tok_s"] / plain["decode_tok_s"], 3)
                spec["outputs_equal_plain"] = sum(a == b for a, b in zip(plain_ids, spec_ids))
                if spec["outputs_equal_plain"] < len(prompts) and args.temperature == 0:
                    spec["divergences"] = (runner_divergences(runner, prompts, plain_ids, spec_ids) if args.preset
                                           else divergences(target, prompts, plain_ids, spec_ids))
                results.append(spec)
    report = {
        "benchmark": f"demo target on CPU: plain vs {args.algorithms} speculative decoding (drafter: {args.transports}), "
                     + (f"sampling at temperature {args.temperature}, top_p {args.top_p}, seed = prompt index"
                        if args.temperature > 0 else "greedy"),
        "command": "python " + " ".join([Path(sys.argv[0]).as_posix(), *sys.argv[1:]]),
        "device": torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu", "dtype": args.dtype,
        "cpu": platform.processor() or platform.machine(), "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__, "attention_backend": runner.backend.name,
        "cuda_graphs": {"batch_sizes": runner.graphs.sizes, "tree_sizes": runner.graphs.tree_sizes,
                        "replays": runner.graphs.replays} if runner.graphs else None,
        "model": f"dummy {args.preset} (random weights)" if args.preset else str(target.name), "prompts": f"{len(prompts)} held-out stdlib files, first {args.prompt_tokens} tokens",
        "new_tokens": args.new_tokens, "results": results,
    }
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Plain vs NGRAM speculative decoding with the demo target on CPU; JSON out, no assertions.

    python benchmarks/speculative_cpu.py --out benchmarks/results/speculative_cpu.json
    python benchmarks/speculative_cpu.py --transports inprocess,zmq --out benchmarks/results/split_cpu.json
    python benchmarks/speculative_cpu.py --algorithms NGRAM,STANDALONE --out benchmarks/results/standalone_cpu.json

--transports zmq drafts with a `splitspec drafter` process over ZeroMQ (tcp on loopback) through the
verifier's DrafterPool instead of the drafter object in this process; the drafter is the same NGRAM
with the same flags, fresh for every group as the in-process one is.

Prompts are the first --prompt-tokens tokens of the held-out standard-library files (code the demo
model never trained on). Greedy decoding; each configuration runs every prompt in groups of the
batch size. Decode throughput counts the tokens after each request's first (the prefill's) over the
time from the first step's end to the last step's end, summed over groups.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import torch

from splitspec.demo import demo_model_dirs
from splitspec.drafter_svc.ngram import NgramConfig, NgramDrafter
from splitspec.generate import generate_ids
from splitspec.runtime.runner import ModelRunner, RuntimeConfig
from splitspec.runtime.sampling_params import SamplingParams
from splitspec.train import corpus
from splitspec.verifier_svc.drafter_client import InProcessDrafterClient
from splitspec.verifier_svc.engine import SpecConfig


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch-sizes", default="1,8", help="Comma-separated batch sizes.")
    parser.add_argument("--num-prompts", type=int, default=16, help="Held-out files used as prompts.")
    parser.add_argument("--prompt-tokens", type=int, default=96, help="Tokens of each file used as the prompt.")
    parser.add_argument("--new-tokens", type=int, default=128, help="Tokens generated per request.")
    parser.add_argument("--num-draft-tokens", type=int, default=8, help="NGRAM tree budget, root included.")
    parser.add_argument("--match-type", default="BFS", choices=("BFS", "PROB"), help="NGRAM tree construction.")
    parser.add_argument("--algorithms", default="NGRAM",
                        help="Comma-separated: NGRAM, STANDALONE (the demo draft model, --standalone-tree).")
    parser.add_argument("--standalone-tree", default="3,1,4",
                        help="STANDALONE num_steps,topk,num_draft_tokens (SGLang's automatic choice: 3,1,4).")
    parser.add_argument("--transports", default="inprocess",
                        help="Comma-separated: inprocess (drafter object here), zmq (a drafter process over ZeroMQ).")
    parser.add_argument("--out", default=None, help="Write the JSON here as well as to stdout.")
    return parser.parse_args()


def prompts_from_held_out(tokenizer, num: int, length: int) -> list[list[int]]:
    files = [f for f in corpus.select_files() if f.held_out]
    texts = corpus.read_texts(files, held_out=True)
    prompts = [ids[:length] for ids in (tokenizer.encode(t) for t in texts) if len(ids) >= length]
    return prompts[:num]


def standalone_client(tree: str) -> InProcessDrafterClient:
    from splitspec.drafter_svc.standalone import StandaloneDrafter

    steps, topk, tokens = (int(x) for x in tree.split(","))
    draft = ModelRunner.load(RuntimeConfig(model_path=str(demo_model_dirs()["draft"]), dtype="float32", device="cpu",
                                           max_total_tokens=32768))
    return InProcessDrafterClient(StandaloneDrafter(draft, topk=topk, num_steps=steps, num_draft_tokens=tokens))


class ZmqDrafter:
    """A DrafterPool bound on loopback with one `splitspec drafter` process registered to it."""

    def __init__(self, match_type: str, vocab_size: int):
        import socket
        import subprocess

        from splitspec.verifier_svc.drafter_pool import DrafterPool

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        address = f"tcp://127.0.0.1:{port}"
        self.pool = DrafterPool(address, "NGRAM", vocab_size, timeout=5.0, heartbeat_timeout=10.0)
        self.process = subprocess.Popen([sys.executable, "-P", "-m", "splitspec", "drafter", "--verifier-drafter-addr", address,
                                         "--speculative-algorithm", "NGRAM", "--speculative-ngram-match-type", match_type,
                                         "--log-level", "warning"])
        if not self.pool.wait_for_drafters(1, 120):
            raise RuntimeError("the drafter process did not register")

    def close(self) -> None:
        self.process.kill()
        self.process.wait()
        self.pool.close()


def measure(runner, prompts, batch_size: int, new_tokens: int, spec: SpecConfig | None, match_type: str,
            transport: str = "inprocess", algorithm: str = "NGRAM", tree: str = "3,1,4") -> dict:
    params = [SamplingParams(temperature=0.0, max_new_tokens=new_tokens, ignore_eos=True)] * len(prompts)
    decode_s, decode_tokens, requests = 0.0, 0, []
    for start in range(0, len(prompts), batch_size):
        group = slice(start, start + batch_size)
        remote = ZmqDrafter(match_type, runner.config.vocab_size) if spec and transport == "zmq" else None
        if remote is not None:
            drafter = remote.pool
        elif spec and algorithm == "STANDALONE":
            drafter = standalone_client(tree)
        else:
            drafter = InProcessDrafterClient(NgramDrafter(NgramConfig(match_type=match_type))) if spec else None
        stamps: list[tuple[float, int]] = []
        try:
            out = generate_ids(runner, prompts[group], params[group], set(), drafter=drafter, spec=spec,
                               on_step=lambda n: stamps.append((time.perf_counter(), n)))  # noqa: B023 (called before the loop moves on)
        finally:
            if remote is not None:
                remote.close()
        decode_s += stamps[-1][0] - stamps[0][0]
        decode_tokens += sum(n for _, n in stamps[1:])
        requests += out
    verify_steps = sum(r.stats.verify_steps for r in requests)
    accepted = sum(r.stats.accepted_tokens for r in requests)
    row = {"batch_size": batch_size, "speculative": algorithm if spec else None, "drafter": transport if spec else None,
           "decode_s": round(decode_s, 3),
           "decode_tokens": decode_tokens, "decode_tok_s": round(decode_tokens / decode_s, 2)}
    if spec:
        row.update({"num_draft_tokens": spec.num_draft_tokens, "verify_steps": verify_steps,
                    **({"match_type": match_type} if algorithm == "NGRAM" else {"steps_topk_tokens": tree}),
                    "draft_tokens": sum(r.stats.draft_tokens for r in requests), "accepted_tokens": accepted,
                    "accept_length": round(1 + accepted / verify_steps, 3) if verify_steps else None,
                    "fallbacks": sum(r.stats.fallbacks for r in requests)})
    return row, [r.output_ids for r in requests]


def main() -> int:
    from transformers import AutoTokenizer

    args = parse_args()
    target = demo_model_dirs()["target"]
    tokenizer = AutoTokenizer.from_pretrained(target)
    prompts = prompts_from_held_out(tokenizer, args.num_prompts, args.prompt_tokens)
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    capacity = max(batch_sizes) * (args.prompt_tokens + args.new_tokens + args.num_draft_tokens + 32)
    runner = ModelRunner.load(RuntimeConfig(model_path=str(target), dtype="float32", device="cpu", max_total_tokens=capacity))
    measure(runner, prompts[:2], 2, 8, None, args.match_type)  # warm-up
    results = []
    for batch_size in batch_sizes:
        plain, plain_ids = measure(runner, prompts, batch_size, args.new_tokens, None, args.match_type)
        results.append(plain)
        for algorithm in args.algorithms.split(","):
            transports = args.transports.split(",") if algorithm == "NGRAM" else ["inprocess"]
            if algorithm == "STANDALONE":
                steps, topk, tokens = (int(x) for x in args.standalone_tree.split(","))
                budget = steps + 1 if topk == 1 else tokens
            else:
                budget = args.num_draft_tokens
            for transport in transports:
                spec, spec_ids = measure(runner, prompts, batch_size, args.new_tokens, SpecConfig(num_draft_tokens=budget),
                                         args.match_type, transport, algorithm, args.standalone_tree)
                spec["speedup"] = round(spec["decode_tok_s"] / plain["decode_tok_s"], 3)
                spec["outputs_equal_plain"] = sum(a == b for a, b in zip(plain_ids, spec_ids))
                results.append(spec)
    report = {
        "benchmark": f"demo target on CPU: plain vs {args.algorithms} speculative decoding (drafter: {args.transports}), greedy",
        "command": "python " + " ".join([Path(sys.argv[0]).as_posix(), *sys.argv[1:]]),
        "device": "cpu", "cpu": platform.processor() or platform.machine(), "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__, "model": str(target.name), "prompts": f"{len(prompts)} held-out stdlib files, first {args.prompt_tokens} tokens",
        "new_tokens": args.new_tokens, "results": results,
    }
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

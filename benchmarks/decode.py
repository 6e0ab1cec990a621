"""Plain-decode throughput of the splitspec runtime at several batch sizes; JSON out, no assertions.

    python benchmarks/decode.py --out benchmarks/results/decode_cpu.json
    python benchmarks/decode.py --device cuda --preset llama-3.1-8b --dtype bfloat16 --batch-sizes 1,8,32 --phases

By default it builds a Llama-architecture model of a preset shape (dummy weights, labelled as such)
from a config alone; --model-path measures any HF checkpoint instead. Decode throughput excludes prefill: each point runs
the product's generate loop and times the steps after the first token (median of --repeats runs).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from splitspec.bench import git_commit
from splitspec.generate import generate_ids
from splitspec.model_shapes import PRESETS, dummy_model_dir
from splitspec.runtime.batch import SequenceInput
from splitspec.runtime.kv_cache import BlockTable
from splitspec.runtime.runner import ModelRunner, RuntimeConfig
from splitspec.runtime.sampling_params import SamplingParams
from splitspec.runtime.tree import positions as tree_positions
from splitspec.runtime.tree import tree_mask


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-path", default=None, help="HF checkpoint to measure (default: a dummy --preset model).")
    parser.add_argument("--preset", default="small", choices=sorted(PRESETS), help="Shape of the dummy model.")
    parser.add_argument("--device", default="cpu", help="cpu or cuda.")
    parser.add_argument("--batch-sizes", default="1,8", help="Comma-separated batch sizes.")
    parser.add_argument("--prompt-len", type=int, default=64, help="Prompt tokens per request.")
    parser.add_argument("--new-tokens", type=int, default=64, help="Tokens generated per request.")
    parser.add_argument("--repeats", type=int, default=3, help="Runs per point (the median is reported).")
    parser.add_argument("--dtype", default="float32", help="Model dtype.")
    parser.add_argument("--attention-backend", default="auto", help="auto, flashinfer or torch.")
    parser.add_argument("--disable-cuda-graph", action="store_true", help="Run decode steps eagerly.")
    parser.add_argument("--cuda-graph-max-bs", type=int, default=None, help="Largest batch replayed from a CUDA graph.")
    parser.add_argument("--phases", action="store_true",
                        help="Also time one step's phases at each batch size: building the batch (host), the forward "
                        "(planning, kernels, synchronised), sampling; for a plain decode step and for the verification "
                        "of a --tree-nodes tree, and their ratio.")
    parser.add_argument("--tree-nodes", type=int, default=16, help="Nodes of the tree --phases verifies (root included).")
    parser.add_argument("--phase-iters", type=int, default=50, help="Steps timed per phase measurement (median kept).")
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's).")
    parser.add_argument("--quick", action="store_true", help="The quick preset and few tokens (a smoke run for tests).")
    parser.add_argument("--out", default=None, help="Write the JSON here as well as to stdout.")
    return parser.parse_args()


def timed_generate(runner, prompts, new_tokens: int) -> tuple[float, float]:
    """(prefill seconds: start to the first token, decode seconds: first token to the last)."""
    params = [SamplingParams(temperature=0.0, max_new_tokens=new_tokens, ignore_eos=True)] * len(prompts)
    stamps: list[float] = []
    start = time.perf_counter()
    gens = generate_ids(runner, prompts, params, eos_ids=set(), on_step=lambda _: stamps.append(time.perf_counter()))
    assert all(len(g.output_ids) == new_tokens for g in gens) and len(stamps) == new_tokens
    return stamps[0] - start, stamps[-1] - stamps[0]


def measure(runner, batch_size: int, args) -> dict:
    g = torch.Generator().manual_seed(batch_size)
    prompts = [torch.randint(0, runner.config.vocab_size, (args.prompt_len,), generator=g).tolist() for _ in range(batch_size)]
    timed_generate(runner, prompts, args.new_tokens)  # warm-up at full length (first-use costs of every shape)
    runs = [timed_generate(runner, prompts, args.new_tokens) for _ in range(args.repeats)]
    prefill_s = statistics.median(r[0] for r in runs)
    decode_s = statistics.median(r[1] for r in runs)
    steps = args.new_tokens - 1
    return {
        "batch_size": batch_size,
        "prompt_len": args.prompt_len,
        "new_tokens": args.new_tokens,
        "prefill_s": round(prefill_s, 5),
        "decode_s": round(decode_s, 5),
        "decode_step_ms": round(1000 * decode_s / steps, 3),
        "decode_tok_s": round(batch_size * steps / decode_s, 2),
        "decode_tok_s_per_request": round(steps / decode_s, 2),
        "runs": [{"prefill_s": round(p, 5), "decode_s": round(d, 5)} for p, d in runs],
    }


def _sync(runner) -> None:
    if runner.device.type == "cuda":
        torch.cuda.synchronize(runner.device)


def phases(runner, batch_size: int, args) -> dict:
    """Median milliseconds of one step's phases: batch (host: pages, index tensors), forward (plan +
    kernels, synchronised), sample (greedy argmax to host); plain decode and a tree verification."""
    g = torch.Generator().manual_seed(100 + batch_size)
    vocab = runner.config.vocab_size
    tables = [BlockTable() for _ in range(batch_size)]
    prompts = [torch.randint(0, vocab, (args.prompt_len,), generator=g).tolist() for _ in range(batch_size)]
    runner.forward(runner.batch([SequenceInput(t, p) for t, p in zip(tables, prompts)]))
    for t, p in zip(tables, prompts):
        runner.kv_cache.set_length(t, len(p))
    nodes = args.tree_nodes
    parents = [-1] + [(i - 1) // 2 for i in range(1, nodes)]  # a binary tree of `nodes` nodes, breadth first
    mask = tree_mask(parents)

    def timed(make) -> dict:
        samples = {"batch": [], "forward": [], "sample": []}
        for it in range(args.phase_iters + 5):
            _sync(runner)
            t0 = time.perf_counter()
            batch = runner.batch(make())
            t1 = time.perf_counter()
            out = runner.forward(batch)
            _sync(runner)
            t2 = time.perf_counter()
            out.logits.argmax(-1).tolist()
            t3 = time.perf_counter()
            for t in tables:  # keep one token, as a decode step or a verification accepting nothing does
                runner.kv_cache.set_length(t, t.num_tokens + 1)
            if it >= 5:  # the first steps warm caches and plans
                for key, value in zip(samples, (t1 - t0, t2 - t1, t3 - t2)):
                    samples[key].append(value)
        return {f"{k}_ms": round(1000 * statistics.median(v), 4) for k, v in samples.items()} | {
            "step_ms": round(1000 * sum(statistics.median(v) for v in samples.values()), 4)}

    decode = timed(lambda: [SequenceInput(t, [7]) for t in tables])
    verify = timed(lambda: [SequenceInput(t, list(range(5, 5 + nodes)), positions=tree_positions(parents, t.num_tokens),
                                          mask=mask, logits="all") for t in tables])
    for t in tables:
        runner.kv_cache.release(t)
    return {"batch_size": batch_size, "decode": decode, f"verify_{nodes}_nodes": verify,
            "verify_over_decode_forward": round(verify["forward_ms"] / decode["forward_ms"], 3)}


def main() -> int:
    args = parse_args()
    if args.quick:
        args.prompt_len, args.new_tokens, args.repeats, args.preset = 8, 6, 1, "quick"
    if args.threads:
        torch.set_num_threads(args.threads)
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    with tempfile.TemporaryDirectory() as scratch:
        model_path, load_format = args.model_path, "auto"
        if model_path is None:
            model_path, load_format = str(dummy_model_dir(args.preset, scratch)), "dummy"
        extra = args.phase_iters + 5 if args.phases else 0
        capacity = max(batch_sizes) * (args.prompt_len + args.new_tokens + 2 * extra + args.tree_nodes + 64)
        runner = ModelRunner.load(RuntimeConfig(model_path=model_path, load_format=load_format, dtype=args.dtype,
                                                device=args.device, max_total_tokens=capacity,
                                                attention_backend=args.attention_backend,
                                                disable_cuda_graph=args.disable_cuda_graph,
                                                cuda_graph_max_bs=args.cuda_graph_max_bs))
        runner.capture_cuda_graphs(tree_nodes=(args.tree_nodes,) if args.phases else ())
        results = [measure(runner, b, args) for b in batch_sizes]
        phase_results = [phases(runner, b, args) for b in batch_sizes] if args.phases else None
    cfg = runner.config
    graphs = runner.graphs
    report = {
        "benchmark": f"plain decode throughput, splitspec runtime, {runner.backend.name} attention backend, "
                     + (f"CUDA graphs (decode{''.join(f', {q}-node trees' for q in graphs.tree_sizes)}) for batch "
                        f"sizes {graphs.sizes}" if graphs else "no CUDA graphs"),
        "cuda_graphs": {"batch_sizes": graphs.sizes,
                        "capture_s": {("decode" if q == 1 else f"verify_{q}_nodes"): round(s, 3)
                                      for q, s in graphs.capture_seconds.items()},
                        "memory_mib": {("decode" if q == 1 else f"verify_{q}_nodes"): round(b / 2**20, 1)
                                       for q, b in graphs.memory_bytes.items()}} if graphs else None,
        "command": "python " + " ".join([Path(sys.argv[0]).as_posix(), *sys.argv[1:]]),
        "commit": git_commit(Path(__file__).parent),
        "device": torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu",
        "cpu": platform.processor() or platform.machine(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "model": {
            "path": args.model_path or f"preset {args.preset}",
            "weights": "dummy (random)" if load_format == "dummy" else "checkpoint",
            "architecture": cfg.architecture, "hidden_size": cfg.hidden_size, "num_hidden_layers": cfg.num_hidden_layers,
            "num_attention_heads": cfg.num_attention_heads, "num_key_value_heads": cfg.num_key_value_heads,
            "intermediate_size": cfg.intermediate_size, "vocab_size": cfg.vocab_size,
            "parameters": sum(p.numel() for p in runner.model.parameters()),
            "dtype": str(runner.dtype).replace("torch.", ""),
        },
        "results": results,
    }
    if phase_results is not None:
        report["phases"] = phase_results
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

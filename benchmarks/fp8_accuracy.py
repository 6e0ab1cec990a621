"""FP8 weights against the unquantized model: accuracy, speed and memory; JSON out, no assertions.

    python benchmarks/fp8_accuracy.py --device cuda --preset llama-3.1-8b --out benchmarks/results/fp8_8b.json
    python benchmarks/fp8_accuracy.py --preset quick --num-prompts 4 --new-tokens 8      # a CPU smoke run

Both models hold the same weights: --model-path loads a checkpoint twice (in --dtype, and with
--quantization fp8: quantized at load, or as stored for an FP8 checkpoint); by default a dummy model of a
--preset shape (as benchmarks/decode.py builds it) is initialised from one seed and quantized from it.
For --num-prompts random prompts it reports:
- greedy agreement: each model decodes --new-tokens greedily; the fraction of tokens equal before the
  first divergence (mean over prompts), equal position by position, and the prompts decoded identically;
- teacher-forced agreement and logit error: on each prompt followed by the unquantized model's greedy
  continuation, both models' logits at every position: top-1 agreement, max and mean absolute error,
  relative error (||fp8 - ref|| / ||ref|| per position), KL(ref || fp8) in nats;
- plain decode tokens/s at batch 1 for both (--decode-tokens after a --prompt-len prompt, median of
  --repeats, CUDA graphs on a GPU);
- weight bytes, and the weight floor: weight bytes / --bandwidth, the time one decode step at batch 1
  needs only to read the weights once (3.35e12 B/s: the H100 SXM's HBM3).
Dummy weights are random: their logits are nearly flat, so greedy agreement there is a pessimistic
bound (tiny logit margins); the logit error and the speed are what the dummy run measures.
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
from splitspec.runtime.fp8 import Fp8Linear
from splitspec.runtime.kv_cache import BlockTable
from splitspec.runtime.runner import ModelRunner, RuntimeConfig
from splitspec.runtime.sampling_params import SamplingParams

H100_BANDWIDTH = 3.35e12  # bytes/s, H100 SXM5 HBM3


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-path", default=None, help="HF checkpoint (default: a dummy --preset model).")
    parser.add_argument("--preset", default="small", choices=sorted(PRESETS), help="Shape of the dummy model.")
    parser.add_argument("--device", default="cpu", help="cpu or cuda.")
    parser.add_argument("--dtype", default="auto", help="Unquantized dtype (auto: bfloat16 on a GPU, float32 on CPU).")
    parser.add_argument("--num-prompts", type=int, default=64, help="Prompts compared.")
    parser.add_argument("--prompt-len", type=int, default=32, help="Random prompt tokens per prompt.")
    parser.add_argument("--new-tokens", type=int, default=32, help="Greedy tokens per prompt for the agreement.")
    parser.add_argument("--decode-tokens", type=int, default=128, help="Tokens decoded per timed run (batch 1).")
    parser.add_argument("--repeats", type=int, default=3, help="Timed runs per model (the median is reported).")
    parser.add_argument("--bandwidth", type=float, default=H100_BANDWIDTH,
                        help="GPU memory bandwidth in bytes/s for the weight floor (default: H100 SXM, 3.35e12).")
    parser.add_argument("--attention-backend", default="auto", help="auto, flashinfer or torch.")
    parser.add_argument("--disable-cuda-graph", action="store_true", help="Decode eagerly.")
    parser.add_argument("--seed", type=int, default=0, help="Seed of the prompts and of the dummy weights.")
    parser.add_argument("--out", default=None, help="Write the JSON here as well as to stdout.")
    return parser.parse_args(argv)


def load(args, model_path: str, load_format: str, dtype: str, quantization: str | None) -> ModelRunner:
    capacity = 2 * (args.prompt_len + max(args.new_tokens, args.decode_tokens) + 64)
    runner = ModelRunner.load(RuntimeConfig(
        model_path=model_path, load_format=load_format, dtype=dtype, device=args.device, max_total_tokens=capacity,
        attention_backend=args.attention_backend, disable_cuda_graph=args.disable_cuda_graph, seed=args.seed,
        quantization=quantization))
    runner.capture_cuda_graphs()
    return runner


def greedy(runner, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    params = [SamplingParams(temperature=0.0, max_new_tokens=new_tokens, ignore_eos=True)]
    return [generate_ids(runner, [p], params, eos_ids=set())[0].output_ids for p in prompts]


@torch.inference_mode()
def all_logits(runner, ids: list[int]) -> torch.Tensor:
    """[len(ids), V] float32 logits of one forward over ids."""
    table = BlockTable()
    out = runner.forward(runner.batch([SequenceInput(table, ids, logits="all")]))
    runner.kv_cache.release(table)
    return out.logits.float()


def agreement(ref: list[list[int]], fp8: list[list[int]]) -> dict:
    prefixes, equal, total = [], 0, 0
    for a, b in zip(ref, fp8):
        n = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a))
        prefixes.append(n / len(a))
        equal += sum(x == y for x, y in zip(a, b))
        total += len(a)
    return {"before_first_divergence": round(statistics.mean(prefixes), 4), "position_by_position": round(equal / total, 4),
            "identical_prompts": sum(p == 1.0 for p in prefixes), "num_prompts": len(ref)}


def logit_errors(pairs) -> dict:
    """pairs: (ref [L, V], fp8 [L, V]) per prompt."""
    max_abs, abs_sum, count, rel, kl, top1 = 0.0, 0.0, 0, [], [], []
    for ref, got in pairs:
        diff = (got - ref).abs()
        max_abs = max(max_abs, float(diff.max()))
        abs_sum += float(diff.sum())
        count += diff.numel()
        rel += (torch.linalg.vector_norm(got - ref, dim=-1) / torch.linalg.vector_norm(ref, dim=-1)).tolist()
        logp, logq = ref.log_softmax(-1), got.log_softmax(-1)
        kl += (logp.exp() * (logp - logq)).sum(-1).tolist()
        top1 += (ref.argmax(-1) == got.argmax(-1)).tolist()
    return {"max_abs": round(max_abs, 5), "mean_abs": round(abs_sum / count, 6),
            "relative_mean": round(statistics.mean(rel), 6), "relative_max": round(max(rel), 6),
            "kl_mean": round(statistics.mean(kl), 7), "kl_max": round(max(kl), 7),
            "top1_agreement": round(sum(top1) / len(top1), 4), "positions": len(top1)}


def decode_speed(runner, args) -> dict:
    prompt = torch.randint(0, runner.config.vocab_size, (args.prompt_len,), generator=torch.Generator().manual_seed(7)).tolist()
    params = [SamplingParams(temperature=0.0, max_new_tokens=args.decode_tokens, ignore_eos=True)]

    def run() -> float:
        stamps: list[float] = []
        generate_ids(runner, [prompt], params, eos_ids=set(), on_step=lambda _: stamps.append(time.perf_counter()))
        return stamps[-1] - stamps[0]  # first token to last: decode steps only

    run()  # warm-up (first-use costs of every shape)
    seconds = statistics.median(run() for _ in range(args.repeats))
    steps = args.decode_tokens - 1
    return {"decode_tok_s": round(steps / seconds, 2), "decode_step_ms": round(1000 * seconds / steps, 4)}


def model_report(runner, args) -> dict:
    weights = runner.weight_bytes["total"]
    gemms = sorted({m.gemm for m in runner.model.modules() if isinstance(m, Fp8Linear)})
    return {"dtype": str(runner.dtype).replace("torch.", ""), "weight_bytes": weights,
            "fp8_layer_bytes": runner.weight_bytes["fp8_layers"], "fp8_gemm": gemms or None,
            "weight_floor_ms": round(1000 * weights / args.bandwidth, 4),
            "weight_floor_tok_s": round(args.bandwidth / weights, 1)}


def main(argv=None) -> int:
    args = parse_args(argv)
    dtype = args.dtype if args.dtype != "auto" else ("bfloat16" if args.device.startswith("cuda") else "float32")
    generator = torch.Generator().manual_seed(args.seed)
    with tempfile.TemporaryDirectory() as scratch:
        model_path, load_format = args.model_path, "auto"
        if model_path is None:
            model_path, load_format = str(dummy_model_dir(args.preset, scratch)), "dummy"
        ref = load(args, model_path, load_format, dtype, None)
        fp8 = load(args, model_path, load_format, dtype, "fp8")
    vocab = ref.config.vocab_size
    prompts = [torch.randint(0, vocab, (args.prompt_len,), generator=generator).tolist() for _ in range(args.num_prompts)]
    ref_out, fp8_out = greedy(ref, prompts, args.new_tokens), greedy(fp8, prompts, args.new_tokens)
    errors = logit_errors((all_logits(ref, p + o), all_logits(fp8, p + o)) for p, o in zip(prompts, ref_out))
    speeds = {"unquantized": decode_speed(ref, args), "fp8": decode_speed(fp8, args)}
    cfg = ref.config
    report = {
        "benchmark": "FP8 weights (--quantization fp8) against the unquantized model: greedy agreement, logit error, "
                     "batch-1 decode speed, weight bytes and the weight floor",
        "command": "python " + " ".join([Path(sys.argv[0]).as_posix(), *(sys.argv[1:] if argv is None else argv)]),
        "commit": git_commit(Path(__file__).parent),
        "device": torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu",
        "cpu": platform.processor() or platform.machine(),
        "torch": torch.__version__,
        "model": {"path": args.model_path or f"preset {args.preset}",
                  "weights": "dummy (random)" if load_format == "dummy" else "checkpoint",
                  "architecture": cfg.architecture, "hidden_size": cfg.hidden_size, "num_hidden_layers": cfg.num_hidden_layers,
                  "intermediate_size": cfg.intermediate_size, "vocab_size": cfg.vocab_size},
        "settings": {"num_prompts": args.num_prompts, "prompt_len": args.prompt_len, "new_tokens": args.new_tokens,
                     "decode_tokens": args.decode_tokens, "repeats": args.repeats, "bandwidth_bytes_per_s": args.bandwidth,
                     "cuda_graphs": bool(ref.cuda_graph_max_bs)},
        "greedy_agreement": agreement(ref_out, fp8_out),
        "logits": errors,
        "unquantized": {**model_report(ref, args), **speeds["unquantized"]},
        "fp8": {**model_report(fp8, args), **speeds["fp8"]},
    }
    report["fp8_over_unquantized"] = {
        "weight_bytes": round(report["fp8"]["weight_bytes"] / report["unquantized"]["weight_bytes"], 4),
        "decode_tok_s": round(report["fp8"]["decode_tok_s"] / report["unquantized"]["decode_tok_s"], 4)}
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

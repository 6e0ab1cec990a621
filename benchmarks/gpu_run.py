"""One GPU run: train a code target larger than the demo, a standalone draft and the target's EAGLE and
EAGLE3 heads on the demo dataset, then measure every algorithm against plain decoding; JSON out only,
a hard time budget per phase (the whole run fits in 9.5 minutes of wall time).

    # on the GPU machine (device tool, carry [".demo-data"]):
    . scripts/gpu_env.sh && python3 -P benchmarks/gpu_run.py --dataset .demo-data --out $OUT/gpu_run.json

Phases (seconds of training each): target 130, draft 35, eagle 50, eagle3 80; then
benchmarks/speculative_cpu.py on the GPU (bf16, in process, 8 held-out prompts, 96 new tokens, batch
1 and 8, each algorithm warmed up first) with a 200 s limit. The JSON is rewritten after every phase, so a run cut short still reports
what it finished.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import subprocess
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dataset", required=True, help="A dataset prepared for `train lm` (the demo's: .demo-data).")
    parser.add_argument("--work", default="/tmp/gpu-run", help="Where the models are written.")
    parser.add_argument("--out", required=True, help="The JSON report.")
    parser.add_argument("--budgets", default="130,35,50,80", help="Training seconds: target, draft, eagle, eagle3.")
    parser.add_argument("--measure-timeout", type=float, default=200.0, help="Seconds for the measurement phase.")
    args = parser.parse_args()
    from splitspec.train.cli import train_lm
    from splitspec.train.heads import HeadTrainer
    from splitspec.train.text_tokens import load_text_tokens
    from splitspec.train.lm import LMShape
    from splitspec.train.presets import DEMO_VOCAB_SIZE, HEAD_PRESETS, PRESETS

    work, dataset, out = Path(args.work), Path(args.dataset), Path(args.out)
    budgets = dict(zip(("target", "draft", "eagle", "eagle3"), (float(b) for b in args.budgets.split(","))))
    report = {"command": "python3 -P benchmarks/gpu_run.py " + " ".join(sys.argv[1:]),
              "device": torch.cuda.get_device_name(), "torch": torch.__version__, "phases": {}}
    start = time.perf_counter()

    def save():
        report["wall_s"] = round(time.perf_counter() - start, 1)
        out.write_text(json.dumps(report, indent=1) + "\n")

    target_shape = LMShape(hidden_size=768, num_hidden_layers=12, num_attention_heads=12, num_key_value_heads=4,
                           intermediate_size=2048)
    _, target_cfg = PRESETS["demo-target"]
    phases = [("target", target_shape, dataclasses.replace(target_cfg, steps=4000, lr=1.5e-3, warmup_steps=200,
                                                            eval_every=200, save_every=10**9))]
    draft_shape, draft_cfg = PRESETS["demo-draft"]
    phases.append(("draft", draft_shape, dataclasses.replace(draft_cfg, save_every=10**9)))
    for name, shape, cfg in phases:
        t0 = time.perf_counter()
        cfg = dataclasses.replace(cfg, device="cuda", time_budget_s=budgets[name])
        lm = train_lm(work / name, dataset, DEMO_VOCAB_SIZE, shape, cfg)
        report["phases"][name] = {k: lm[k] for k in ("parameters", "steps", "best_held_out_loss", "bigram_held_out_loss",
                                                     "stopped_by_time_budget", "seconds_this_run")}
        report["phases"][name]["wall_s"] = round(time.perf_counter() - t0, 1)
        save()
    train, held_out = load_text_tokens([str(dataset)], work / "target")
    for name in ("eagle", "eagle3"):
        t0 = time.perf_counter()
        cfg = dataclasses.replace(HEAD_PRESETS[f"demo-{name}"], device="cuda", time_budget_s=budgets[name], accept_prompts=8,
                                  accept_new_tokens=64, save_every=10**9)
        head = HeadTrainer(work / "target", work / name, train, held_out, cfg).train()
        report["phases"][name] = {"parameters": head["parameters"], "steps": head["steps"],
                                  "best_held_out_loss": head["best_held_out_loss"],
                                  "stopped_by_time_budget": head["stopped_by_time_budget"],
                                  "top1_agreement_per_step": head["history"][-1]["top1_agreement_per_step"],
                                  "trainer_accept_estimate": head["held_out_accept"], "wall_s": round(time.perf_counter() - t0, 1)}
        save()
    measure = work / "measure.json"
    command = [sys.executable, "-P", str(REPO / "benchmarks" / "speculative_cpu.py"), "--target", str(work / "target"),
               "--draft", str(work / "draft"), "--eagle-head", str(work / "eagle"), "--eagle3-head", str(work / "eagle3"),
               "--device", "cuda", "--dtype", "bfloat16", "--algorithms", "NGRAM,STANDALONE,EAGLE,EAGLE3",
               "--transports", "inprocess", "--num-prompts", "8", "--new-tokens", "96", "--batch-sizes", "1,8",
               "--out", str(measure)]
    t0 = time.perf_counter()
    try:
        result = subprocess.run(command, capture_output=True, text=True, timeout=args.measure_timeout)
        if result.returncode == 0:
            report["measurement"] = json.loads(measure.read_text())
        else:
            report["measurement_error"] = result.stderr[-3000:]
    except subprocess.TimeoutExpired:
        report["measurement_error"] = f"timed out after {args.measure_timeout} s"
    report["phases"]["measure"] = {"wall_s": round(time.perf_counter() - t0, 1)}
    rows = report.get("measurement", {}).get("results", [])
    lengths = {(r["batch_size"], r["speculative"]): r.get("accept_length") for r in rows if r["speculative"]}
    if (1, "EAGLE") in lengths and (1, "EAGLE3") in lengths:
        report["eagle3_over_eagle_accept_length"] = round(lengths[(1, "EAGLE3")] / lengths[(1, "EAGLE")], 3)
    save()
    print(json.dumps({k: v for k, v in report.items() if k != "measurement"}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""A captured graph's attention planning on the host, per plan: FlashInfer's own `plan` against flashinfer_replan's
(one copy, FlashInfer's C++ planner called directly), and that C++ planner's share, for decode steps, trees and
causal chains at a few batch sizes. CUDA only (FlashInfer).

    python -P benchmarks/plan_cost.py --batch-sizes 16,64 --kv-len 300

The shapes are the demo target's (or --model-path's); page tables are random, key lengths spread around --kv-len.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from splitspec.runtime.attention.base import AttentionBatch
from splitspec.runtime.tree import ancestor_rows

TREE = (-1, 0, 0, 1, 1, 2, 3, 4, 5, 6, 7, 8)  # 12 nodes, NGRAM's trees' size in the served cases


def batches(r, bs: int, q_len: int, kv_len: int, tree: bool, count: int, g: torch.Generator) -> list[AttentionBatch]:
    page_size, out = r.kv_cache.page_size, []
    parents = TREE[:q_len] if tree else None
    mask = None if parents is None else torch.tensor([[bool(row >> j & 1) for j in range(q_len)]
                                                      for row in ancestor_rows(parents)])
    for _ in range(count):
        kv_lens = torch.randint(max(q_len + 1, kv_len // 2), kv_len * 3 // 2, (bs,), generator=g).tolist()
        pages = torch.randperm(r.kv_cache.num_pages, generator=g).tolist()
        tables, start = [], 0
        for n in kv_lens:
            tables.append(pages[start : start + -(-n // page_size)])
            start += len(tables[-1])
        out.append(AttentionBatch([q_len] * bs, kv_lens, tables, torch.zeros(bs * q_len, dtype=torch.long),
                                  torch.zeros(bs * q_len, dtype=torch.long), [mask] * bs,
                                  None if parents is None else [parents] * bs))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-path", default=None, help="Default: the demo target.")
    parser.add_argument("--batch-sizes", default="1,16,64")
    parser.add_argument("--kv-len", type=int, default=300)
    parser.add_argument("--plans", type=int, default=200, help="Timed plans per point (after 20 untimed).")
    args = parser.parse_args()
    from splitspec.demo import SHIPPED_ROOT
    from splitspec.runtime.runner import ModelRunner, RuntimeConfig

    path = args.model_path or str(Path(SHIPPED_ROOT) / "target")
    r = ModelRunner.load(RuntimeConfig(model_path=path, dtype="bfloat16", device="cuda", attention_backend="flashinfer",
                                       disable_cuda_graph=True, max_total_tokens=1 << 17))
    backend, g = r.backend, torch.Generator().manual_seed(0)
    cpp_seconds: list[float] = []

    class TimedPlanner:
        """A wrapper's FlashInfer module with its C++ `plan` timed (what the one-copy replan calls)."""

        def __init__(self, module):
            self.module = module

        def plan(self, *a):
            start = time.perf_counter()
            try:
                return self.module.plan(*a)
            finally:
                cpp_seconds.append(time.perf_counter() - start)

        def __getattr__(self, name):
            return getattr(self.module, name)

    print(f"{'shape':28s} {'FlashInfer plan':>16s} {'one-copy replan':>16s} {'its C++ planner':>16s}  (us per plan, median)")
    for bs in (int(b) for b in args.batch_sizes.split(",")):
        for name, q_len, causal in (("decode", 1, False), ("tree of 12", 12, False), ("chain of 6", 6, True)):
            state = backend.graph_state(bs, max_pages=r.kv_cache.num_pages, q_len=q_len, max_kv_len=2 * args.kv_len,
                                        causal=causal)
            work = batches(r, bs, q_len, args.kv_len, q_len > 1 and not causal, args.plans + 20, g)
            row, wrapper = [], state.wrappers[None]
            for lean in (False, True):
                backend.lean_replan = lean
                if lean:  # FlashInfer planned it (the pass before): its module exists now
                    wrapper._cached_module = TimedPlanner(wrapper._cached_module)
                cpp_seconds.clear()
                seconds = []
                for i, batch in enumerate(work):
                    torch.cuda.synchronize()
                    start = time.perf_counter()
                    backend.graph_plan(state, batch)
                    if i >= 20:
                        seconds.append(time.perf_counter() - start)
                row.append(statistics.median(seconds) * 1e6)
            cpp = statistics.median(cpp_seconds[20:]) * 1e6 if len(cpp_seconds) > 20 else float("nan")
            print(f"{name + f' x {bs}':28s} {row[0]:16.1f} {row[1]:16.1f} {cpp:16.1f}", flush=True)


if __name__ == "__main__":
    main()

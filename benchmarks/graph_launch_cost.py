"""What a CUDA graph's launch costs the host: synthetic graphs of N tiny kernels (one stream; forked over two; kernels
and device-to-device copies alternating), then every graph the engine's target and in-process drafter captured, each
with its device work (kernels, copies, memsets) per replay. No assertions; GPU only.

    python -P benchmarks/graph_launch_cost.py --device cuda --dtype bfloat16 --speculative-algorithm EAGLE3 \
        --speculative-num-steps 5 --speculative-eagle-topk 1 --speculative-num-draft-tokens 6 --batch-size 1 \
        --prompt-len 128

A drafted step launches three graphs (verification, the head's catch-up, the draft loop); on an H100 they cost
~1 us of host time per node (benchmarks/results/host_profile_h100_074a548_drafted_bs1.txt). The synthetic rows say
whether that is the platform's price per node or something in how ours are built.
"""

from __future__ import annotations

import statistics
import sys
import time

import torch

REPLAYS = 200


def host_us(replay, replays: int = REPLAYS) -> float:
    """The median host time of one replay call, the device drained before each."""
    replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(replays):
        began = time.perf_counter()
        replay()
        times.append(time.perf_counter() - began)
        torch.cuda.synchronize()
    return statistics.median(times) * 1e6


def device_work(replay) -> int:
    """The kernels, copies and memsets one replay runs on the device."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        replay()
        torch.cuda.synchronize()
    return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)


def synthetic(n: int, kind: str) -> torch.cuda.CUDAGraph:
    x, y = torch.zeros(64, device="cuda"), torch.zeros(64, device="cuda")
    stream = torch.cuda.Stream()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        if kind == "forked":
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(n // 2):
                    y.add_(1)
            for _ in range(n - n // 2):
                x.add_(1)
            torch.cuda.current_stream().wait_stream(side)
        else:
            for i in range(n):
                if kind == "copies" and i % 2:
                    y.copy_(x)
                else:
                    x.add_(1)
    return graph


def graphs_in(root, name: str, depth: int = 8, seen: set | None = None) -> list[tuple[str, torch.cuda.CUDAGraph]]:
    """Every CUDAGraph reachable from root's attributes, dicts and lists (depth levels), by path."""
    seen = set() if seen is None else seen
    if id(root) in seen or depth < 0 or isinstance(root, (torch.Tensor, str, bytes, int, float, type)):
        return []
    seen.add(id(root))
    if isinstance(root, torch.cuda.CUDAGraph):
        return [(name, root)]
    if isinstance(root, dict):
        items = [(f"{name}[{k!r}]", v) for k, v in root.items()]
    elif isinstance(root, (list, tuple)):
        items = [(f"{name}[{i}]", v) for i, v in enumerate(root)]
    elif hasattr(root, "__dict__") and type(root).__module__.startswith(("splitspec", "verifier_svc", "drafter_svc")):
        items = [(f"{name}.{k}", v) for k, v in vars(root).items()]
    else:
        return []
    found = []
    for path, value in items:
        found += graphs_in(value, path, depth - 1, seen)
    return found


def main(flags: list[str]) -> None:
    sys.path.insert(0, __file__.rsplit("/", 1)[0])
    from step_host_cost import Setup

    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, CUDA {torch.version.cuda}")
    print("synthetic graphs: host us per replay (device work per replay)")
    for kind in ("chain", "forked", "copies"):
        for n in (1, 10, 30, 100, 300):
            graph = synthetic(n, kind)
            print(f"  {kind:7s} {n:4d} nodes: {host_us(graph.replay):7.1f} us ({device_work(graph.replay)})")
    setup = Setup(flags, 2000)
    engine = setup.engine(setup.spec.num_draft_tokens, 400)
    for _ in range(5):  # every graph a drafted step uses has replayed with this batch's plans
        engine.step()
    setup.sync()
    print("the engine's graphs: host us per replay (device work per replay, host us per item)")
    for path, graph in graphs_in(setup.runner, "target") + graphs_in(setup.drafter, "drafter"):
        work, cost = device_work(graph.replay), host_us(graph.replay, 50)
        print(f"  {path}: {cost:7.1f} us ({work}, {cost / max(work, 1):.2f})")
    setup.drafter.close()


if __name__ == "__main__":
    main(sys.argv[1:])

"""What a graph's attention costs, FlashInfer against kernels.paged_attention (SPLITSPEC_GRAPH_ATTENTION=triton): for a
model's attention shape, each graph kind a speculative step replays (a tree verification, a causal chain, a draft loop's
beams over the prefix) and a decode step's, at a few batch sizes and key lengths, every layer's attention captured in
one CUDA graph and replayed; the device time a layer (CUDA events over REPLAYS replays) and the host time of the
graph's plan a step (graph_plan / plan_prefix, pages moved every step so that no plan is reused). No assertions; GPU
only.

    python -P benchmarks/graph_attention_cost.py --config splitspec/demo_models/target/config.json [--out FILE]
    python -P benchmarks/graph_attention_cost.py --preset llama-3.1-8b --batch-sizes 1,16,64

The demo target: 3 layers of 3 query heads over 1 key-value head of 64."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch

REPLAYS = 200
PLANS = 200
PAGE = 16


@torch.inference_mode()  # as the engine's forwards (kernels.ops runs the Triton kernels there, not their twins)
def measure(config, kind: str, bs: int, rows: int, kv_len: int, how: str, min_chunk: int | None = None) -> dict:
    from splitspec.runtime.attention.base import AttentionBatch
    from splitspec.runtime.attention.flashinfer_backend import FlashInferAttentionBackend
    from splitspec.runtime.kv_cache import KVCache
    from splitspec.runtime.tree import ancestor_rows

    from splitspec.runtime.attention import paged_graphs

    # the backend's graphs read both when it is made: the kernel, and its least keys a split (unset: its default)
    os.environ[paged_graphs.GRAPH_ATTENTION_ENV] = how
    if min_chunk:
        os.environ[paged_graphs.MIN_CHUNK_ENV] = str(min_chunk)
    else:
        os.environ.pop(paged_graphs.MIN_CHUNK_ENV, None)
    pages_each = -(-(kv_len + rows) // PAGE)
    cache = KVCache(config, bs * pages_each + 8, PAGE, torch.bfloat16, torch.device("cuda"))
    cache.pool.normal_()
    backend = FlashInferAttentionBackend(config, cache)
    max_pages = bs * pages_each
    tables = [list(range(i * pages_each, (i + 1) * pages_each)) for i in range(bs)]
    parents = tuple(range(-1, rows - 1))  # a chain, as a tree
    mask = torch.tensor([[bool(a >> j & 1) for j in range(rows)] for a in ancestor_rows(parents)])
    if kind == "prefix":
        state = backend.prefix_graph_state(bs, bs * rows, max_pages)

        def plan(shift: int):
            return backend.plan_prefix([kv_len] * bs, [t[shift:] + t[:shift] for t in tables], [rows] * bs, state=state)

        def attend(layer, q, p):
            return backend.attend_prefix(layer, q, p)[0]
    else:
        state = backend.graph_state(bs, max_pages, q_len=rows, max_kv_len=kv_len + rows, causal=kind == "causal")

        def plan(shift: int):
            tree = kind == "tree"
            batch = AttentionBatch([rows] * bs, [kv_len + rows] * bs, [t[shift:] + t[:shift] for t in tables],
                                   torch.zeros(bs * rows, dtype=torch.long), torch.zeros(bs * rows, dtype=torch.long),
                                   [mask if tree else None] * bs, [parents] * bs if tree else None)
            return backend.graph_plan(state, batch)

        def attend(layer, q, p):
            return backend._attend(layer, q, p)
    p = plan(0)
    plan(0)  # FlashInfer's own first plan, then a lean one
    q = torch.randn(bs * rows, config.num_attention_heads, config.head_dim, device="cuda", dtype=torch.bfloat16)
    layers = config.num_hidden_layers

    def body():
        if kind != "prefix":
            backend.graph_prologue(state)  # FlashInfer's trees: their masks packed on the device
        x = q
        for layer in range(layers):
            x = attend(layer, x, p)
        return x

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            body()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        body()
    torch.cuda.synchronize()
    host = []
    for i in range(PLANS):  # pages moved every step: no plan is reused
        began = time.perf_counter()
        plan(i % 2)
        host.append(time.perf_counter() - began)
        torch.cuda.synchronize()
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(REPLAYS):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return dict(kind=kind, attention=how, min_chunk=min_chunk if how == "triton" else None, batch_size=bs, rows=rows,
                kv_len=kv_len,
                device_us_per_layer=round(start.elapsed_time(end) * 1e3 / REPLAYS / layers, 2),
                plan_host_us=round(statistics.median(host) * 1e6, 1))


def main() -> None:
    from splitspec.runtime.config import ModelConfig

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", help="a model's config.json (its attention shape and layers)")
    parser.add_argument("--preset", help="or a preset's shape (splitspec.model_shapes), e.g. llama-3.1-8b")
    parser.add_argument("--batch-sizes", default="1,16,64")
    parser.add_argument("--kv-lens", default="256,1024")
    parser.add_argument("--min-chunks", default="256", help="the Triton kernel's least keys a split, each measured")
    parser.add_argument("--out", help="write the rows as JSON here")
    args = parser.parse_args()
    if args.preset:
        from splitspec.model_shapes import dummy_model_dir

        config = ModelConfig.from_dir(dummy_model_dir(args.preset))
    else:
        config = ModelConfig.from_dir(os.path.dirname(os.path.abspath(args.config)))
    rows = []
    for kind, q in (("tree", 6), ("causal", 6), ("prefix", 1), ("decode", 1)):
        for bs in (int(b) for b in args.batch_sizes.split(",")):
            for kv in (int(k) for k in args.kv_lens.split(",")):
                pair = [measure(config, kind, bs, q, kv, "flashinfer")]
                pair += [measure(config, kind, bs, q, kv, "triton", int(c)) for c in args.min_chunks.split(",")]
                rows += pair
                print(f"{kind:7s} bs {bs:3d} rows {q} kv {kv:5d}: device us/layer flashinfer "
                      f"{pair[0]['device_us_per_layer']:7.2f}, triton " + ", ".join(
                          f"{p['device_us_per_layer']:.2f} (chunk {p['min_chunk']})" for p in pair[1:])
                      + "; plan host us " + " / ".join(f"{p['plan_host_us']:.1f}" for p in pair), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(benchmark=__doc__.split("\n\n")[0], config=args.preset or args.config,
                           device=torch.cuda.get_device_name(), rows=rows), f, indent=1)


if __name__ == "__main__":
    main()

"""CUDA graphs of the decode forward: every request adds one token (no tree), for batch sizes up to
--cuda-graph-max-bs. A step's ~10 kernels per layer launch as one graph replay instead of one Python
call each, which is most of an eager decode step's time at small batch sizes.

Each captured size has static inputs (token ids, positions, KV slots, FlashInfer's page-table buffers)
and static outputs (final hidden states, captured layer inputs, logits). A batch of r requests runs in
the smallest captured size b >= r: its inputs are copied in, the b - r padding rows decode a dummy token
into a scratch page of their own, and the first r rows of the outputs are returned (copied, since the
next replay overwrites them). The graphs share one memory pool, captured largest first.
"""

from __future__ import annotations

import logging
import time

import torch

logger = logging.getLogger(__name__)


def capture_sizes(max_bs: int) -> list[int]:
    """SGLang's ladder: 1, 2, 4, 8, then every 8 up to max_bs (max_bs itself included)."""
    sizes = [b for b in (1, 2, 4) if b < max_bs] + list(range(8, max_bs + 1, 8))
    if not sizes or sizes[-1] != max_bs:
        sizes.append(max_bs)
    return sorted(set(sizes))


class _Graph:
    def __init__(self, batch_size: int, state, graph, hidden, captured, logits):
        self.batch_size, self.state, self.graph = batch_size, state, graph
        self.hidden, self.captured, self.logits = hidden, captured, logits


class DecodeGraphs:
    def __init__(self, runner, max_bs: int):
        self.runner = runner
        self.sizes = capture_sizes(max_bs)
        self.max_bs = self.sizes[-1]
        self.graphs: dict[int, _Graph] = {}
        self.capture_seconds = 0.0
        self.memory_bytes = 0
        cache = runner.kv_cache
        self.scratch_page = cache.allocator.alloc(1)[0]  # the padding rows' own page, never freed
        self.input_ids = torch.zeros(self.max_bs, dtype=torch.long, device=runner.device)
        self.positions = torch.zeros(self.max_bs, dtype=torch.long, device=runner.device)
        self.pool = None
        self.replays = 0

    @torch.inference_mode()
    def capture(self) -> None:
        from splitspec.runtime.attention.base import AttentionBatch

        runner = self.runner
        config = runner.config
        runner.model.rotary_emb.reserve(config.max_position_embeddings, runner.device)  # never grows after this
        torch.cuda.synchronize(runner.device)
        free_before = torch.cuda.mem_get_info(runner.device)[0]
        start = time.perf_counter()
        self.pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream(runner.device)
        for bs in sorted(self.sizes, reverse=True):
            state = runner.backend.graph_state(bs, runner.kv_cache.num_pages)
            runner.backend.graph_plan(state, self._dummy(bs, AttentionBatch))
            ids, pos = self.input_ids[:bs], self.positions[:bs]

            def forward():
                hidden, captured = runner.model(ids, pos, runner.backend, state.plan, runner.capture_layers)
                return hidden, captured, runner.model.logits(hidden)

            stream.wait_stream(torch.cuda.current_stream(runner.device))
            with torch.cuda.stream(stream):
                for _ in range(2):  # warm up outside the graph (lazy inits, Triton autotuning)
                    forward()
            torch.cuda.current_stream(runner.device).wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool, stream=stream):
                hidden, captured, logits = forward()
            self.graphs[bs] = _Graph(bs, state, graph, hidden, captured, logits)
        torch.cuda.synchronize(runner.device)
        self.capture_seconds = time.perf_counter() - start
        self.memory_bytes = max(0, free_before - torch.cuda.mem_get_info(runner.device)[0])
        logger.info("captured CUDA graphs of the decode step for batch sizes %s in %.1f s (%.0f MiB of GPU memory)",
                    self.sizes, self.capture_seconds, self.memory_bytes / 2**20)

    def _dummy(self, bs: int, batch_type):
        page_size = self.runner.kv_cache.page_size
        slots = torch.full((bs,), self.scratch_page * page_size, dtype=torch.long)
        return batch_type(q_lens=[1] * bs, kv_lens=[1] * bs, page_tables=[[self.scratch_page]] * bs, out_slots=slots,
                          positions=torch.zeros(bs, dtype=torch.long), masks=[None] * bs)

    def fits(self, batch) -> bool:
        attention = batch.attention
        n = attention.num_requests
        return (n <= self.max_bs and all(q == 1 for q in attention.q_lens) and all(m is None for m in attention.masks)
                and batch.cu_logits == list(range(n + 1)))

    def run(self, batch):
        """(hidden [r, H], captured [r, ...] list, logits [r, V]) of a decode batch that fits."""
        from splitspec.runtime.attention.base import AttentionBatch

        attention = batch.attention
        r = attention.num_requests
        bs = next(b for b in self.sizes if b >= r)
        entry = self.graphs[bs]
        pad = bs - r
        page_size = self.runner.kv_cache.page_size
        padded = AttentionBatch(
            q_lens=[1] * bs, kv_lens=attention.kv_lens + [1] * pad,
            page_tables=attention.page_tables + [[self.scratch_page]] * pad,
            out_slots=torch.cat([attention.out_slots, torch.full((pad,), self.scratch_page * page_size, dtype=torch.long)])
            if pad else attention.out_slots,
            positions=attention.positions, masks=[None] * bs)
        self.runner.backend.graph_plan(entry.state, padded)
        self.input_ids[:r].copy_(batch.input_ids, non_blocking=True)
        self.positions[:r].copy_(batch.positions, non_blocking=True)
        if pad:
            self.input_ids[r:bs].zero_()
            self.positions[r:bs].zero_()
        entry.graph.replay()
        self.replays += 1
        return entry.hidden[:r].clone(), [c[:r].clone() for c in entry.captured], entry.logits[:r].clone()

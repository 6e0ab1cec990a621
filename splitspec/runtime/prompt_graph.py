"""Whole CUDA graphs of prompt steps: a step that only prefills (a request joining a speculating batch, which
prefills alone while the batch waits; a wave of arrivals; each chunk of a long prompt) replays one graph, attention
included, instead of piecewise graphs with every layer's attention launched eagerly between them
(runtime.piecewise_graph). On a lent H200 the demo target's forward of one 128-token prompt took ~2.5-3.2 ms that
way, while a captured verification of ~180 tree rows took 0.65 ms (a mixed step of such a chunk kept an H100 busy
0.28 ms): the eager attention's launches and plans are most of it, and at batch 16 a speculating batch pays one such
step per arrival (plain decoding's requests arrive in waves; docs/performance.md).

A captured shape is (b requests, q new tokens each), causal after each request's cached prefix, as a draft head's
catch-up chains are captured (runtime.cuda_graph, `causal`): the attention backend plans the batch's real page
tables and key lengths into the graph's buffers at every replay. A chunk shorter than q is padded by
`ModelRunner.pad_prompts` with filler tokens after its own, in its own next KV slots (the request's pages; causal,
so no real row sees them, and the request's committed length stays its real one: decoding overwrites those
slots before anything reads them); fewer than b requests are padded with StepGraphs' dummy requests in scratch
pages. The graph computes logits only at one row per request, the rows the batch asks for (a prompt's last real
token), chosen by a static index tensor: a prompt graph holds b rows of logits, not b x q.

Sizes: q in SIZES up to --prompt-cuda-graph-max-tokens, for the batch sizes of the decode ladder whose b x q fit
it. Memory: one set of outputs per q (the largest batch's hidden states and captured layers), in StepGraphs'
memory pool.
"""

from __future__ import annotations

import logging
import time

import torch
from tqdm import tqdm

from splitspec.runtime.cuda_graph import StepGraphs, graph_outputs, warm_and_capture
from splitspec.runtime.inference import inference

logger = logging.getLogger(__name__)

SIZES = (16, 32, 64, 128, 256, 512, 1024, 2048)


class _Entry:
    def __init__(self, state, graph, hidden, captured, logits):
        self.state, self.graph = state, graph
        self.hidden, self.captured, self.logits = hidden, captured, logits


class PromptGraphs:
    """The prompt graphs of one runner (see the module's doc); its StepGraphs lends the memory pool, the scratch
    pages and the padding requests."""

    def __init__(self, steps: StepGraphs, max_tokens: int):
        self.steps, self.runner = steps, steps.runner
        self.max_tokens = max_tokens
        self.batch_sizes: dict[int, list[int]] = {}  # q -> captured batch sizes
        self.entries: dict[tuple[int, int], _Entry] = {}  # (batch size, q) -> its graph
        self.inputs: dict[int, tuple] = {}  # q -> static (ids, positions, logits rows)
        self.capture_seconds = 0.0
        self.replays = 0

    @property
    def sizes(self) -> list[int]:
        return sorted(self.batch_sizes)

    def size_for(self, num_requests: int, longest: int) -> int | None:
        """The q a prompt step of num_requests chunks, the longest of `longest` tokens, is padded to: the smallest
        captured q that holds it at that batch size; None where none does."""
        return min((q for q, sizes in self.batch_sizes.items() if q >= longest and sizes[-1] >= num_requests),
                   default=None)

    def shape_of(self, batch) -> int | None:
        """q when the batch replays a prompt graph: every request adds q tokens causally (no mask), at most one
        logits row each, and q's graphs hold that many requests."""
        attention = batch.attention
        if not attention.q_lens or any(m is not None for m in attention.masks):
            return None
        q = attention.q_lens[0]
        sizes = self.batch_sizes.get(q)
        if sizes is None or attention.num_requests > sizes[-1] or any(x != q for x in attention.q_lens):
            return None
        cu = batch.cu_logits
        return q if all(cu[i + 1] - cu[i] <= 1 for i in range(attention.num_requests)) else None

    @inference
    def capture(self) -> None:
        """Every q of SIZES up to max_tokens, each at the decode ladder's batch sizes whose rows fit max_tokens
        (batch 1 always), largest first, in StepGraphs' pool."""
        runner, steps = self.runner, self.steps
        device, kv = runner.device, runner.kv_cache
        runner.model.rotary_emb.reserve_for_graphs(runner.context_length, device)  # never moves after this
        torch.cuda.synchronize(device)
        start = time.perf_counter()
        if steps.pool is None:
            steps.pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream(device)
        max_kv = min(kv.capacity_tokens, runner.context_length)
        for q in tqdm([q for q in SIZES if q <= self.max_tokens], desc="CUDA graphs (prompt steps)", unit="length",
                      disable=None, leave=False):
            sizes = [b for b in steps.sizes if b * q <= self.max_tokens] or steps.sizes[:1]
            self.batch_sizes[q] = sizes
            max_bs = sizes[-1]
            ids = torch.zeros(max_bs * q, dtype=torch.long, device=device)
            positions = torch.zeros(max_bs * q, dtype=torch.long, device=device)
            rows = torch.zeros(max_bs, dtype=torch.long, device=device)
            self.inputs[q] = (ids, positions, rows)
            shared = None
            for bs in sorted(sizes, reverse=True):
                max_pages = bs * (min(kv.num_pages, kv.pages_for(max_kv)) + kv.pages_for(q + 1))
                state = runner.backend.graph_state(bs, max_pages, q_len=q, max_kv_len=max_kv, causal=True)
                runner.backend.graph_plan(state, steps._pad(None, bs, q))
                forward = self._forward(state, ids[: bs * q], positions[: bs * q], rows[:bs], shared)
                graph, outputs = warm_and_capture(forward, steps.pool, stream, device)
                shared = shared or outputs
                self.entries[(bs, q)] = _Entry(state, graph, *outputs)
        torch.cuda.synchronize(device)
        self.capture_seconds = time.perf_counter() - start
        logger.info("captured CUDA graphs of prompt steps for %s in %.1f s",
                    ", ".join(f"{q} tokens x {self.batch_sizes[q]}" for q in self.sizes), self.capture_seconds)

    def _forward(self, state, ids, positions, rows, shared):
        """The captured work of one shape: the layers, and the logits of the rows `rows` names (one per request);
        a smaller batch copies its outputs into the largest's (shared), as StepGraphs' do."""
        runner = self.runner

        def forward():
            hidden, captured = runner.model_call(None, ids, positions, runner.backend, state.plan, runner.capture_layers)
            return graph_outputs(hidden, captured, runner.model.logits(hidden.index_select(0, rows)), shared)

        return forward

    def run(self, batch, q: int, return_hidden: bool) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor]:
        """(hidden [r*q, H] or None, captured layers [r*q, n*H] or None, logits of the rows the batch asks for) of a
        batch shape_of accepts; copies (the next replay overwrites the graph's buffers), made only of what is read."""
        attention = batch.attention
        r = attention.num_requests
        bs = next(b for b in self.batch_sizes[q] if b >= r)
        entry = self.entries[(bs, q)]
        self.runner.backend.graph_plan(entry.state, self.steps._pad(attention, bs, q))
        ids, positions, rows_in = self.inputs[q]
        rows, wanted = r * q, batch.cu_logits[-1]
        ids[:rows].copy_(batch.source("input_ids"), non_blocking=True)
        positions[:rows].copy_(batch.source("positions"), non_blocking=True)
        if bs > r:
            ids[rows : bs * q].zero_()
            positions[rows : bs * q].zero_()
        if wanted:
            rows_in[:wanted].copy_(batch.source("logits_indices"), non_blocking=True)
        if wanted < bs:
            rows_in[wanted:bs].zero_()
        entry.graph.replay()
        self.replays += 1
        captured = entry.captured[:rows].clone() if entry.captured is not None else None
        return entry.hidden[:rows].clone() if return_hidden else None, captured, entry.logits[:wanted].clone()

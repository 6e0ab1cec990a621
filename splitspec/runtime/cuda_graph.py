"""CUDA graphs of the steps that repeat: decode (every request adds one token) and tree verification
(every request adds a tree of the same node count, under its mask), for batch sizes up to
--cuda-graph-max-bs. A step's ~10 kernels per layer launch as one graph replay instead of one Python
call each, which is most of an eager step's time at small batch sizes.

Each captured shape (batch size b, tokens per request q) has static inputs (token ids, positions, KV
slots, FlashInfer's page-table and mask buffers) and static outputs (final hidden states, captured
layer inputs, logits of every row). A batch of r requests runs in the smallest captured b >= r: its
inputs are copied in, the b - r padding requests run a dummy chain in scratch pages of their own, and
the first r requests' rows of the outputs are returned (copied: the next replay overwrites them). The
graphs share one memory pool, captured largest first, and one set of outputs per shape: the largest batch's,
into whose first rows a smaller batch's graph copies its own. Other batches (prompt chunks, mixed batches,
trees of another size) run eagerly. A draft's steps have graphs of their own (runtime.draft_loop).

A draft head's forwards outside its steps are fed features (a catch-up: the target's; overlap's bets:
the head's own outputs) and add a chain of q tokens per request: `capture(q, width)` captures those with
a static feature input of that width, planned causally (no mask), so catch-ups and bets of a few tokens
per request replay too, and so do a drafter process's catch-ups of its feeds while drafting is off
(drafter_svc.base.FEED_EVERY tokens a request; their batch sizes capped by rows: `capture(q, width, max_rows)`).
"""

from __future__ import annotations

import contextlib
import gc
import logging
import time

import torch
from tqdm import tqdm

from splitspec.runtime.attention.base import AttentionBatch
from splitspec.runtime.batch_shift import settle_on_host, shift_graph_inputs, shiftable
from splitspec.runtime.inference import inference
from splitspec.runtime.tree import tree_mask

logger = logging.getLogger(__name__)


def capture_sizes(max_bs: int) -> list[int]:
    """SGLang's ladder: 1, 2, 4, 8, then every 8 up to max_bs (max_bs itself included)."""
    sizes = [b for b in (1, 2, 4) if b < max_bs] + list(range(8, max_bs + 1, 8))
    if not sizes or sizes[-1] != max_bs:
        sizes.append(max_bs)
    return sorted(set(sizes))


@contextlib.contextmanager
def collector_paused(collect: bool = True):
    """Python's cyclic garbage collector collected first, then held off while graphs are captured: a collection
    during a capture may destroy graphs that went out of use (their owners sit in reference cycles, e.g. a
    runner's graphs after set_capture_layers), and destroying a graph while a stream captures is an error
    that invalidates the capture (CUDA: "operation not permitted when stream is capturing"; seen on an H100
    as a CUBLAS execution failure at the next grid point of `splitspec bench`). collect=False: the caller's
    capture collects on entry itself (torch.cuda.graph does)."""
    if collect:
        gc.collect()
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def warm_and_capture(forward, pool, stream: torch.cuda.Stream, device: torch.device):
    """Run forward twice on stream outside any graph (lazy inits, Triton compilation), then capture it into
    a graph in the shared memory pool: (graph, forward's outputs, static: each replay overwrites them)."""
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        for _ in range(2):
            forward()
    torch.cuda.current_stream(device).wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with collector_paused(collect=False), torch.cuda.graph(graph, pool=pool, stream=stream):
        outputs = forward()
    return graph, outputs


def graph_outputs(hidden: torch.Tensor, captured: list, logits: torch.Tensor, shared: tuple | None) -> tuple:
    """A captured forward's static outputs (hidden, the captured layers' states side by side [rows, n*H] or None,
    logits): the largest batch's own, or a smaller one's written into the first rows of the largest's (shared). The
    layers are joined inside the graph, so that a replay's reader copies one tensor out (three slices and a
    concatenation after every replay: 21 us of an EAGLE-3 target's step on an H200, under cProfile)."""
    if shared is None:
        return hidden, torch.cat(captured, dim=-1) if captured else None, logits
    rows = hidden.shape[0]
    shared[0][:rows].copy_(hidden)
    if captured:
        torch.cat(captured, dim=-1, out=shared[1][:rows])
    shared[2][: logits.shape[0]].copy_(logits)
    return shared[0][:rows], None if shared[1] is None else shared[1][:rows], shared[2][: logits.shape[0]]


class _Graph:
    def __init__(self, state, graph, hidden, captured, logits):
        self.state, self.graph = state, graph
        self.hidden, self.captured, self.logits = hidden, captured, logits


class StepGraphs:
    def __init__(self, runner, max_bs: int):
        self.runner = runner
        self.sizes = capture_sizes(max_bs)
        self.max_bs = self.sizes[-1]
        self.graphs: dict[tuple[int, int, int], _Graph] = {}  # (batch size, tokens per request, feature width) -> graph
        self.capture_seconds: dict[int, float] = {}  # tokens per request -> seconds capturing its sizes (no features)
        self.memory_bytes: dict[int, int] = {}
        self.feature_seconds: dict[tuple[int, int], float] = {}  # (tokens per request, feature width) -> seconds
        self.scratch_pages: list[int] = []  # the padding requests' own pages, never freed
        self.inputs: dict[tuple[int, int], tuple] = {}  # (q, width) -> static (ids, positions, features or None)
        self.dummies: dict[int, tuple] = {}  # q -> the padding request of q tokens
        self.max_bs_of: dict[tuple[int, int], int] = {}  # (q, width) -> its largest captured batch (max_rows)
        self.pool = None
        self.replays = 0

    @property
    def tree_sizes(self) -> list[int]:
        return sorted(q for q in self.capture_seconds if q > 1)

    def _scratch(self, num_tokens: int) -> list[int]:
        cache = self.runner.kv_cache
        missing = cache.pages_for(num_tokens) - len(self.scratch_pages)
        if missing > 0:
            self.scratch_pages += cache.allocator.alloc(missing)
        return self.scratch_pages[: cache.pages_for(num_tokens)]

    def _dummy(self, q: int) -> tuple:
        """A padding request, built once per q: (kv_len, pages, slots, positions, parents) of a chain of q
        tokens at positions 1..q after one cached key, in the scratch pages (parents None for q = 1: no mask)."""
        if q not in self.dummies:
            pages = self._scratch(q + 1)
            page_size = self.runner.kv_cache.page_size
            slots = torch.tensor([pages[i // page_size] * page_size + i % page_size for i in range(1, q + 1)],
                                 dtype=torch.long)
            chain = None if q == 1 else tuple(range(-1, q - 1))
            self.dummies[q] = (q + 1, pages, slots, torch.arange(1, q + 1), chain)
        return self.dummies[q]

    def has(self, q: int, width: int = 0, num_requests: int = 1) -> bool:
        """Whether a batch of num_requests requests of q new tokens each, fed features this wide, replays a graph."""
        captured = q in self.capture_seconds if not width else (q, width) in self.feature_seconds
        return captured and num_requests <= self.max_bs_of.get((q, width), self.max_bs)

    def forget(self, q: int, width: int = 0) -> None:
        """Drop the graphs of one shape (a capture that failed part-way): its batches run eagerly, the others' replay."""
        for key in [k for k in self.graphs if k[1:] == (q, width)]:
            del self.graphs[key]
        self.inputs.pop((q, width), None)
        self.max_bs_of.pop((q, width), None)
        if width:
            self.feature_seconds.pop((q, width), None)
        else:
            self.capture_seconds.pop(q, None)
            self.memory_bytes.pop(q, None)

    @inference
    def capture(self, q: int = 1, width: int = 0, max_rows: int | None = None) -> None:
        """Capture every batch size for requests of q new tokens (1: decode; more: trees of q nodes), fed
        features of this width (0: none; a head's catch-ups and bets); max_rows: only the batch sizes of at most
        that many rows (bs * q; at least batch 1): a long chain's graphs hold every row's logits, so their memory
        grows with q."""
        if self.has(q, width):
            return
        sizes = self.sizes if max_rows is None else [b for b in self.sizes if b * q <= max_rows] or self.sizes[:1]
        self.max_bs_of[(q, width)] = sizes[-1]
        runner = self.runner
        device = runner.device
        runner.model.rotary_emb.reserve_for_graphs(runner.context_length, device)  # never moves after this
        torch.cuda.synchronize(device)
        free_before, reserved_before = torch.cuda.mem_get_info(device)[0], torch.cuda.memory_reserved(device)
        start = time.perf_counter()
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        max_bs = sizes[-1]
        ids = torch.zeros(max_bs * q, dtype=torch.long, device=device)
        positions = torch.zeros(max_bs * q, dtype=torch.long, device=device)
        features = torch.zeros(max_bs * q, width, dtype=runner.dtype, device=device) if width else None
        self.inputs[(q, width)] = (ids, positions, features)
        max_kv = min(runner.kv_cache.capacity_tokens, runner.context_length + q)
        kv = runner.kv_cache
        stream = torch.cuda.Stream(device)
        # the largest size's outputs are every size's: a smaller graph copies its rows into their first rows, so that
        # its own outputs are intermediates the pool reuses (run() copies the rows out after each replay). Graphs are
        # taken after the KV cache is sized: an 8B target's with its EAGLE-3 head's, up to 256 requests, took 14.8 GiB
        # with per-size outputs and ran a served verifier out of memory; shared, 5.3 GiB less
        shared = None
        label = f"CUDA graphs ({q}-token {'chains' if width else 'steps' if q > 1 else 'decode'})"
        for bs in tqdm(sorted(sizes, reverse=True), desc=label, unit="batch size", disable=None, leave=False):
            # page-table entries, listed per request: at most a longest context each (overlap's bets fork a request's
            # KV, so requests share pages and the pool does not bound them), plus the padding requests' scratch pages
            max_pages = bs * (min(kv.num_pages, kv.pages_for(max_kv)) + kv.pages_for(q + 1))
            state = runner.backend.graph_state(bs, max_pages, q_len=q, max_kv_len=max_kv, **({"causal": True} if width else {}))
            runner.backend.graph_plan(state, self._pad(None, bs, q))
            ids_b, pos_b = ids[: bs * q], positions[: bs * q]
            extra = {} if features is None else {"features": features[: bs * q]}

            def forward():
                runner.backend.graph_prologue(state)  # e.g. a tree graph's masks, packed on the device
                hidden, captured = runner.model_call(bs, ids_b, pos_b, runner.backend, state.plan, runner.capture_layers,
                                                     **extra)
                return graph_outputs(hidden, captured, runner.model.logits(hidden), shared)

            graph, (hidden, captured, logits) = warm_and_capture(forward, self.pool, stream, device)
            if shared is None:
                shared = (hidden, captured, logits)
            self.graphs[(bs, q, width)] = _Graph(state, graph, hidden, captured, logits)
        torch.cuda.synchronize(device)
        seconds = time.perf_counter() - start
        memory = max(free_before - torch.cuda.mem_get_info(device)[0], torch.cuda.memory_reserved(device) - reserved_before, 0)
        if width:
            self.feature_seconds[(q, width)] = seconds
            what = f"{q}-token chain fed {width}-wide features"
        else:
            self.capture_seconds[q], self.memory_bytes[q] = seconds, memory
            what = "decode step" if q == 1 else f"{q}-node tree verification step"
        logger.info("captured CUDA graphs of the %s for batch sizes %s in %.1f s (%.0f MiB of GPU memory)",
                    what, sizes, seconds, memory / 2**20)

    def _pad(self, attention: AttentionBatch | None, bs: int, q: int) -> AttentionBatch:
        """The attention batch (None: no request) with padding requests appended up to bs requests."""
        pad = bs - (attention.num_requests if attention is not None else 0)
        if pad == 0:
            return attention
        kv_len, pages, slots, positions, chain = self._dummy(q)
        mask = None if chain is None else tree_mask(chain)  # built once per shape (tree_mask's cache)
        if attention is None:
            attention = AttentionBatch([], [], [], slots[:0], positions[:0], [], [])
        return AttentionBatch(q_lens=[q] * bs, kv_lens=attention.kv_lens + [kv_len] * pad,
                              page_tables=attention.page_tables + [pages] * pad,
                              out_slots=torch.cat([attention.out_slots, slots.repeat(pad)]),
                              positions=torch.cat([attention.positions, positions.repeat(pad)]),
                              masks=attention.masks + [mask] * pad,
                              trees=None if attention.trees is None else attention.trees + [chain] * pad)

    def tokens_per_request(self, batch, chains: bool = False) -> int | None:
        """q when the batch is graph-shaped: at most max_bs requests of q tokens each (q = 1 without masks,
        q > 1 each under a tree mask), every row asking for logits; None otherwise. chains (a head's
        forwards fed features): q tokens each without a mask (causal chains; no trees), any rows asking
        for logits."""
        attention = batch.attention
        n, q = attention.num_requests, attention.step_tokens
        if chains:
            q = None
            if attention.q_lens and all(m is None for m in attention.masks) \
                    and all(x == attention.q_lens[0] for x in attention.q_lens):
                q = attention.q_lens[0]
        if q is None or n > self.max_bs:
            return None
        return q if chains or batch.cu_logits == list(range(0, n * q + 1, q)) else None

    def run(self, batch, q: int, features: torch.Tensor | None = None, return_hidden: bool = True, borrow: bool = False):
        """(hidden [r*q, H] or None when not asked for, the captured layers' states concatenated [r*q, n*H] or None,
        logits of the rows asking for them) of a graph-shaped batch (see tokens_per_request), fed features [r*q,
        width] when given; all copies (the next replay overwrites the graph's buffers), made only of what is read;
        borrow: the graph's own buffers where they hold what is asked (no copy: read them before the next replay)."""
        attention = batch.attention
        r = attention.num_requests
        bs = next(b for b in self.sizes if b >= r)
        width = 0 if features is None else features.shape[-1]
        entry = self.graphs[(bs, q, width)]
        page_size = self.runner.kv_cache.page_size
        if batch.shift is not None and not shiftable(entry.state):  # planned on the host: moved there first
            settle_on_host(batch, page_size)
            attention = batch.attention
        self.runner.backend.graph_plan(entry.state, self._pad(attention, bs, q))
        ids, positions, static_features = self.inputs[(q, width)]
        rows = r * q
        ids[:rows].copy_(batch.source("input_ids"), non_blocking=True)
        positions[:rows].copy_(batch.source("positions"), non_blocking=True)
        if static_features is not None:
            static_features[:rows].copy_(features)
        if batch.shift is not None:  # built at the upper lengths: moved back on the device (runtime.batch_shift)
            shift_graph_inputs(entry.state, positions, r, q, batch.shift, page_size)
        if bs > r:
            ids[rows : bs * q].zero_()
            positions[rows : bs * q].zero_()
            if static_features is not None:
                static_features[rows : bs * q].zero_()
        entry.graph.replay()
        self.replays += 1
        keep = (lambda t: t) if borrow else torch.Tensor.clone
        if batch.cu_logits[-1] == rows:  # every row's logits
            logits = keep(entry.logits[:rows])
        else:
            logits = entry.logits.index_select(0, batch.logits_indices)
        captured = keep(entry.captured[:rows]) if entry.captured is not None else None
        return keep(entry.hidden[:rows]) if return_hidden else None, captured, logits

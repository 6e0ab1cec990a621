"""Piecewise CUDA graphs: the forwards the step graphs (runtime.cuda_graph) cannot replay, prompt chunks and
mixed steps (a chunk beside decoding requests and trees, every arrival's step on a busy server), replayed in
pieces instead of launching each of their ~12 kernels per layer from Python (SGLang's piecewise CUDA graph,
on by default there and here; vLLM V1's piecewise graphs). On a lent H100 the demo target's mixed step of one
128-token chunk and 15 decoding requests kept the GPU busy 0.26 ms and took 8 ms eagerly
(benchmarks/profile_mixed.py).

A forward of T new tokens is split at its attention calls: for each captured token count S (SIZES up to
--piecewise-cuda-graph-max-tokens) piece 0 is the embedding and layer 0 up to its attention, piece i + 1
layer i's output projection, MLP and layer i + 1 up to its attention, the last piece the final norm. Everything
in a piece works row by row (projections, norms, SwiGLU, residual adds), so a batch of T <= S tokens runs in the
smallest S: its ids are copied into the static input, the S - T padding rows compute garbage nobody reads, and
between the pieces the batch's own attention runs eagerly on its T rows (RoPE, the KV write and FlashInfer's
kernels, planned for the real batch as always) into the static buffer the next piece reads. Attention, the only
part that depends on the batch's layout, is never captured, so one set of graphs serves every mix of chunks,
decodes and trees of up to S tokens.

Memory: every piece of every size shares one memory pool. The tensors a piece hands to the attention after it
(q, k, v) are kept as aliases that do not own their memory (as vLLM's weak references): a later capture may
reuse those addresses, which is safe because pieces replay one at a time, a piece's outputs are read by the
attention right after it, and the pool's memory stays reserved while its graphs live. The attention outputs go
to one buffer shared by all layers and sizes.
"""

from __future__ import annotations

import logging
import time

import torch

from splitspec.runtime.cuda_graph import collector_paused
from splitspec.runtime.inference import inference

logger = logging.getLogger(__name__)

SIZES = (16, 32, 48, 64, 96, 128, 160, 192, 256, 320, 384, 448, 512, 640, 768, 896, 1024, 1536, 2048, 3072, 4096)


def capture_sizes(max_tokens: int) -> list[int]:
    """The token counts captured: SIZES up to max_tokens, and max_tokens itself."""
    sizes = [s for s in SIZES if s < max_tokens]
    return sorted({*sizes, max_tokens}) if max_tokens > 0 else []


class _CudaArray:
    """A view of device memory through __cuda_array_interface__: torch.as_tensor of it aliases the memory
    without holding the tensor that owns it."""

    def __init__(self, pointer: int, nbytes: int):
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (pointer, False), "version": 3,
                                         "strides": None}


def weak_alias(t: torch.Tensor) -> torch.Tensor:
    """t's values at t's address, without keeping t's memory allocated (see the module's doc)."""
    storage = t.untyped_storage()
    flat = torch.as_tensor(_CudaArray(storage.data_ptr(), storage.nbytes()), device=t.device)
    return flat.view(t.dtype).as_strided(t.shape, t.stride(), t.storage_offset())


class _Break:
    """One attention call between two pieces: the layer and its inputs as the piece before left them (its output
    goes to the shared buffer)."""

    __slots__ = ("layer_id", "q", "k", "v")

    def __init__(self, layer_id: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
        self.layer_id, self.q, self.k, self.v = layer_id, q, k, v


class _Splitter:
    """The attention backend a capture pass sees: it ends the piece being captured at each attention call,
    records the call's inputs and starts the next piece, which reads the attention's output from the shared
    buffer. Warming (capturing False), it only hands the buffer back."""

    def __init__(self, pool, out: torch.Tensor, capturing: bool):
        self.pool, self.out, self.capturing = pool, out, capturing
        self.graphs: list[torch.cuda.CUDAGraph] = []
        self.breaks: list[_Break] = []

    def begin(self) -> None:
        graph = torch.cuda.CUDAGraph()
        graph.capture_begin(pool=self.pool)
        self.graphs.append(graph)

    def run_rope(self, layer_id: int, q, k, v, plan, rope, positions):
        out = self.out[: q.shape[0]].view(q.shape)
        if self.capturing:
            self.graphs[-1].capture_end()
            self.breaks.append(_Break(layer_id, weak_alias(q), weak_alias(k), weak_alias(v)))
            self.begin()
        return out


class _Entry:
    def __init__(self, graphs, breaks, hidden, captured):
        self.graphs, self.breaks, self.hidden, self.captured = graphs, breaks, hidden, captured


class PiecewiseGraphs:
    """The piecewise graphs of one runner's model (see the module's doc)."""

    def __init__(self, runner, max_tokens: int):
        self.runner = runner
        self.sizes = capture_sizes(max_tokens)
        self.max_tokens = self.sizes[-1] if self.sizes else 0
        self.entries: dict[int, _Entry] = {}
        self.capture_seconds = 0.0
        self.memory_bytes = 0
        self.replays = 0
        self.pool = None
        config = runner.config
        device = runner.device
        self.ids = torch.zeros(self.max_tokens, dtype=torch.long, device=device)
        self.positions = torch.zeros(self.max_tokens, dtype=torch.long, device=device)
        self.out = torch.zeros(self.max_tokens, config.q_size, dtype=runner.dtype, device=device)

    @inference
    def capture(self) -> None:
        """Capture every size, largest first, in a memory pool of their own."""
        runner, device = self.runner, self.runner.device
        torch.cuda.synchronize(device)
        free_before, reserved_before = torch.cuda.mem_get_info(device)[0], torch.cuda.memory_reserved(device)
        start = time.perf_counter()
        self.pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        with collector_paused(), torch.cuda.stream(stream):
            for size in sorted(self.sizes, reverse=True):
                ids, positions = self.ids[:size], self.positions[:size]
                for _ in range(2):  # lazy inits and Triton's compiles happen outside the capture
                    runner.model(ids, positions, _Splitter(self.pool, self.out, False), None, runner.capture_layers)
                splitter = _Splitter(self.pool, self.out, True)
                splitter.begin()
                hidden, captured = runner.model(ids, positions, splitter, None, runner.capture_layers)
                splitter.graphs[-1].capture_end()
                self.entries[size] = _Entry(splitter.graphs, splitter.breaks, hidden, captured)
        torch.cuda.current_stream(device).wait_stream(stream)
        torch.cuda.synchronize(device)
        self.capture_seconds = time.perf_counter() - start
        self.memory_bytes = max(free_before - torch.cuda.mem_get_info(device)[0],
                                torch.cuda.memory_reserved(device) - reserved_before, 0)
        logger.info("captured piecewise CUDA graphs of prompt chunks and mixed steps for %s tokens in %.1f s "
                    "(%d pieces each, %.0f MiB of GPU memory)", self.sizes, self.capture_seconds,
                    len(self.entries[self.sizes[0]].graphs) if self.sizes else 0, self.memory_bytes / 2**20)

    def covers(self, num_tokens: int) -> bool:
        return 0 < num_tokens <= self.max_tokens and bool(self.entries)

    def run(self, batch, plan) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """(final hidden [T, H], captured layer inputs) of a batch of T <= max_tokens new tokens: the pieces
        replayed, the batch's attention (planned: plan) run eagerly between them. Views of the static outputs: the
        next replay overwrites them, so a caller that keeps one copies it."""
        runner = self.runner
        rows = batch.num_tokens
        size = next(s for s in self.sizes if s >= rows)
        entry = self.entries[size]
        self.ids[:rows].copy_(batch.source("input_ids"), non_blocking=True)
        backend, rope, positions = runner.backend, runner.model.rotary_emb, batch.positions
        out = self.out
        for graph, brk in zip(entry.graphs, entry.breaks):
            graph.replay()
            attended = backend.run_rope(brk.layer_id, brk.q[:rows], brk.k[:rows], brk.v[:rows], plan, rope, positions)
            out[:rows].view(attended.shape).copy_(attended)
        entry.graphs[-1].replay()
        self.replays += 1
        return entry.hidden[:rows], [c[:rows] for c in entry.captured]

"""Torch's host threads: in a process whose model runs on a GPU, and per forward on a CPU device.

torch starts one intra-op (OpenMP) worker per CPU in every process. A GPU process's host work is small
operators on small tensors (batch building, index arrays, token copies) that gain nothing from them, while the
pool's workers spin between parallel regions on the CPUs the engine's thread needs: on a lent H200 (16 vCPUs,
the demo target, batch 16, in process) plain decoding made 15.8K / 15.7K / 14.0K tok/s with torch's default and
19.7K / 18.3K / 19.0K with one thread, interleaved in one call (benchmarks/omp_threads.sh, docs/performance.md).
vLLM's GPU workers set one thread too. OMP_NUM_THREADS, when set, is the user's choice and is kept.
"""

from __future__ import annotations

import logging
import os
from contextlib import contextmanager

import torch

logger = logging.getLogger(__name__)


def one_thread_for_gpu(device: torch.device, environ=os.environ) -> bool:
    """On a CUDA device and without OMP_NUM_THREADS: torch computes on one host thread. True if it set it."""
    if device.type != "cuda" or environ.get("OMP_NUM_THREADS") or torch.get_num_threads() == 1:
        return False
    logger.info("the model runs on %s: torch's host threads %d -> 1 (set OMP_NUM_THREADS to choose)", device,
                torch.get_num_threads())
    torch.set_num_threads(1)
    return True


WIDE_FORWARD_TOKENS = 64  # a forward of this many tokens or more is compute, not per-step overhead


class WideForwards:
    """On a CPU device beside other services (`splitspec up`): torch threads per forward. A narrow forward (a decode
    step) keeps the process's count (OMP_NUM_THREADS: up leaves a core to the gateway and the drafters, who work while
    tokens stream, and more threads only contend with them); a forward of WIDE_FORWARD_TOKENS tokens or more (prompt
    chunks, a batch of wide trees) is compute that gains from every core: it runs on `threads`. On this project's
    2-core machine (the demo target, NGRAM, `python -P benchmarks/served.py`), served tokens/s at batch 8 went from
    374-402 to 471-505 and at batch 1 from 185-193 to 198-206 (docs/performance.md)."""

    def __init__(self, threads: int):
        self.threads = threads

    @contextmanager
    def around(self, tokens: int):
        narrow = torch.get_num_threads()
        if tokens < WIDE_FORWARD_TOKENS or self.threads <= narrow:
            yield
            return
        torch.set_num_threads(self.threads)
        try:
            yield
        finally:
            torch.set_num_threads(narrow)


def wide_forwards(device: torch.device, threads: int) -> WideForwards | None:
    """WideForwards for a CPU model given --cpu-wide-forward-threads (> 0), else None."""
    if device.type != "cpu" or threads <= 0:
        return None
    logger.info("forwards of %d tokens or more compute on %d torch threads, narrower ones on %d", WIDE_FORWARD_TOKENS,
                threads, torch.get_num_threads())
    return WideForwards(threads)

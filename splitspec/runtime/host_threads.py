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


WIDE_FORWARD_TOKENS = 1  # a forward of this many tokens or more computes on `threads`: every forward (see below)


class WideForwards:
    """On a CPU device beside other services (`splitspec up`): the model's forwards compute on `threads` (every core),
    the process's other torch work (sampling, index arithmetic) on its own count (OMP_NUM_THREADS: up leaves a core to
    the gateway and the drafters). On this project's 2-core machine (the demo target, NGRAM, `python -P
    benchmarks/served.py`) prompt chunks and wide trees on both cores took served tokens/s at batch 8 from 374-402 to
    471-505 (2026-11-29, forwards of 64 tokens or more); on the faster 2-core machine of 2026-12-02, where a second
    thread buys 1.4-1.5x on a decode step, decode steps on both cores too took served NGRAM from 0.70-0.71 to 0.91-0.92
    of in process at batch 1 and from 0.85-0.88 to 0.98-1.00 at batch 8 (plain decoding 0.66 -> 0.74-0.76 and 0.59-0.61
    -> 0.83), and on the earlier machine they changed nothing beyond its runs' noise (docs/performance.md)."""

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
    logger.info("forwards compute on %d torch threads, the process's other torch work on %d", threads,
                torch.get_num_threads())
    return WideForwards(threads)

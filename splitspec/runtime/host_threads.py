"""Torch's host threads in a process whose model runs on a GPU.

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

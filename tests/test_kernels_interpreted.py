"""The Triton kernels against their torch twins on CPU, under Triton's interpreter (TRITON_INTERPRET=1 must be
set before triton compiles anything, so the checks run in their own process): KV-slot compaction, greedy tree
acceptance, SGLang's threshold acceptance with the bonus draw, keyed Gumbel-max sampling, top-k/top-p, the draft
step's top-k, RMSNorm with and without the residual add, SiLU-and-mul. On a GPU, tests/test_gpu_kernels.py runs
the same checks compiled."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from splitspec import lifeline



def test_triton_kernels_match_their_twins_under_the_interpreter():
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    result = lifeline.run([sys.executable, str(Path(__file__).with_name("kernel_checks.py")), "cpu"],
                            capture_output=True, text=True, timeout=600, env=env)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    assert "all equal their twins" in result.stdout

"""A very long prompt is prefilled in chunks with bounded memory while other requests keep decoding
(issue 16, overload).

Two `splitspec verifier` processes on the demo target (float32, CPU) get the same 4096-token prompt, twice
the target's trained context (--context-length lifts the limit, as SGLang's
SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN does): one with --chunked-prefill-size 256, one with -1 (the
whole prompt in one forward). Each process's peak RSS is reset (/proc/PID/clear_refs) just before the
prompt is submitted, so VmHWM afterwards is the most that prefilling it ever held. Chunking must hold
far less than the one-forward prefill, and a short stream that runs alongside on the chunked verifier
must keep getting tokens throughout: its largest gap between two deltas is a few chunks' time, not the
whole prompt's.
"""

from __future__ import annotations

import os
import random
import threading
import time
from pathlib import Path

from test_verifier_service import collect, start_verifier, stop, submit

from splitspec.protos import verifier_pb2 as pb

PROMPT_LEN = 4096
CHUNK = 256
NEIGHBOUR = 300  # tokens of the short stream (plain decoding: one a step)


def _status_kib(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise AssertionError(f"no {field} in /proc/{pid}/status")


def _reset_peak(pid: int) -> None:
    Path(f"/proc/{pid}/clear_refs").write_text("5")  # VmHWM := VmRSS now
    assert _status_kib(pid, "VmHWM") <= _status_kib(pid, "VmRSS") + 4096, "the kernel did not reset the peak RSS"


def _verifier(chunk: int):
    os.environ["SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN"] = "1"
    try:
        return start_verifier("--context-length", str(PROMPT_LEN + 64), "--max-total-tokens", str(PROMPT_LEN + 1024),
                              "--chunked-prefill-size", str(chunk))
    finally:
        os.environ.pop("SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN", None)


def _long_prompt_peak(chunk: int, prompt: list[int], neighbour: bool) -> dict:
    process, stub = _verifier(chunk)
    try:
        collect(stub, [submit("warm", prompt[:300], max_new_tokens=8)], 1)  # kernels, allocator pools, first chunks
        _reset_peak(process.pid)
        before = _status_kib(process.pid, "VmRSS")
        gaps: list[float] = []
        neighbour_tokens: list[int] = []
        started = threading.Event()

        def stream() -> None:  # a short request decoding while the long prompt is prefilled
            last = None
            for response in stub.Generate(iter([submit("short", [5, 6, 7, 8], max_new_tokens=NEIGHBOUR,
                                                                   ignore_eos=True, speculate=False)]),
                                          timeout=300):
                for delta in response.deltas:
                    if delta.token_ids:
                        now = time.monotonic()
                        if last is not None:
                            gaps.append(now - last)
                        last = now
                        neighbour_tokens.extend(delta.token_ids)
                        started.set()
                    if delta.finish_reason != pb.FINISH_REASON_UNSPECIFIED:
                        return

        thread = threading.Thread(target=stream, daemon=True)
        if neighbour:
            thread.start()
            assert started.wait(120)
        start = time.monotonic()
        result = collect(stub, [submit("long", prompt, max_new_tokens=4, ignore_eos=True)], 1)["long"]
        seconds = time.monotonic() - start
        peak = _status_kib(process.pid, "VmHWM")
        if neighbour:
            thread.join(timeout=300)
        assert result["error"] == "" and len(result["tokens"]) == 4, result
        return {"peak_growth_mib": (peak - before) / 1024, "seconds": seconds, "gaps": gaps,
                "neighbour_tokens": len(neighbour_tokens)}
    finally:
        stop(process, stub)


def test_a_very_long_prompt_is_chunked_with_bounded_memory_while_others_decode():
    rng = random.Random(7)
    prompt = [rng.randrange(1, 4096) for _ in range(PROMPT_LEN)]
    chunked = _long_prompt_peak(CHUNK, prompt, neighbour=True)
    whole = _long_prompt_peak(-1, prompt, neighbour=False)
    print(f"{PROMPT_LEN}-token prompt: peak RSS grew {chunked['peak_growth_mib']:.0f} MiB prefilled in chunks of {CHUNK} "
          f"({chunked['seconds']:.1f} s) vs {whole['peak_growth_mib']:.0f} MiB in one forward ({whole['seconds']:.1f} s); "
          f"a neighbour stream got {chunked['neighbour_tokens']} tokens meanwhile, largest gap "
          f"{max(chunked['gaps']):.2f} s, median {sorted(chunked['gaps'])[len(chunked['gaps']) // 2]:.3f} s")
    # the KV cache of the prompt is the same in both (8 layers x 2 x 2 heads x 64 x 4 B = 8 KiB a token: 32 MiB);
    # what chunking bounds is everything else a forward holds at once (masks, scores, activations)
    kv_mib = PROMPT_LEN * 8 * 2 * 2 * 64 * 4 / 2**20
    assert chunked["peak_growth_mib"] < kv_mib + 64, chunked  # its KV pages and about one chunk's forward
    assert chunked["peak_growth_mib"] < 0.5 * whole["peak_growth_mib"], (chunked, whole)
    # the neighbour decoded throughout: no gap near the whole prefill's length
    assert chunked["neighbour_tokens"] == NEIGHBOUR
    assert max(chunked["gaps"]) < max(1.0, 0.35 * chunked["seconds"]), (max(chunked["gaps"]), chunked["seconds"])

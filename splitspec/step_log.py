"""A timeline of the engine's steps: with SPLITSPEC_STEP_LOG=PREFIX in its environment, an engine loop (a served
verifier's engine thread, or `splitspec bench` in process) writes PREFIX.<name>.<pid>.jsonl, one JSON object per
event, timed on the system's monotonic clock (time.perf_counter, the same in every process of the machine):

- {"kind": "arrive", "received": t, "taken": t}: a request reached the engine's process, and the loop took it in;
- {"kind": "step", "began": t, "ended": t, "running": n, "waiting": n, "prefill_tokens": n, "forward_tokens": n,
  "generated": n, "finished": n, "budget": n, "ms": {phase: ms}, "cpu_ms": ms, "gc_ms": ms, "switches": [voluntary,
  involuntary], "cuda_mib": [allocated, reserved]}: one engine step, with the CPU time its thread got meanwhile (a CUDA
  synchronize spins, so it counts), the time the process spent in the garbage collector, the thread's context
  switches (involuntary: preempted) and, on a GPU, the caching allocator's memory after it;
- {"kind": "publish", "at": t, "deltas": n, "first": n, "finished": n}: deltas handed to their streams (first: how
  many carry their request's first token);
- {"kind": "client", "sent": t, "first": t, "done": t}: a request as the bench's client saw it;
- {"kind": "point", "batch_size": n, "speculative": bool, "began": t, "ended": t}: one bench point's measured run;
- {"kind": "hop", "name": name, "at": t}: a submission passing a named point on its way in (the gateway's
  "gateway_handler" and "gateway_submitted", the verifier front's "front_received"), so that the way from the
  client to the engine can be split leg by leg;
- {"kind": "probe", "at": t, "calib_us": us, "cpu": n, "steal_ticks": n}: every PROBE_EVERY steps, how fast the loop's
  thread runs plain Python (a fixed loop of CALIBRATION_ITERATIONS additions, timed), the CPU it is on and the
  machine's steal time so far (/proc/stat, clock ticks: a VM's vCPUs waiting for the host), so that a slow step can be
  told apart as a slow CPU (the loop slower too) or slower work (the loop as fast).

`python benchmarks/step_timeline.py FILE...` reads them back wave by wave. Off unless the variable is set; a
write per event costs microseconds, but the figures of a logged run are the log's, not speeds to quote."""

from __future__ import annotations

import ctypes
import gc
import json
import os
import resource
import time

ENV = "SPLITSPEC_STEP_LOG"
PROBE_EVERY = 64
CALIBRATION_ITERATIONS = 5000

try:
    _sched_getcpu = ctypes.CDLL(None, use_errno=True).sched_getcpu
except (OSError, AttributeError):  # not glibc / not Linux
    _sched_getcpu = None


def _steal_ticks() -> int | None:
    try:
        with open("/proc/stat") as f:
            fields = f.readline().split()
        return int(fields[8]) if fields[0] == "cpu" and len(fields) > 8 else None
    except OSError:
        return None


def calibration_us() -> float:
    """A fixed loop of plain Python additions, timed (us): the thread's CPU speed as Python sees it."""
    began, total = time.perf_counter(), 0
    for i in range(CALIBRATION_ITERATIONS):
        total += i
    return (time.perf_counter() - began) * 1e6


def _device_memory() -> dict:
    """The CUDA caching allocator's allocated and reserved MiB after the step (host counters: no device sync), where
    this process uses CUDA."""
    import sys

    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_initialized():
        return {}
    return {"cuda_mib": [torch.cuda.memory_allocated() >> 20, torch.cuda.memory_reserved() >> 20]}


class StepLog:
    def __init__(self, path: str):
        self.path = path
        self.file = open(path, "a", buffering=1 << 16)  # noqa: SIM115 (open for the loop's life; flushed per step)
        self.gc_seconds, self._gc_began = 0.0, 0.0  # the collector is timed once a step is (begin): hops need not
        self.steps = 0
        self._began = self._counters()

    def _gc(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._gc_began = time.perf_counter()
        else:
            self.gc_seconds += time.perf_counter() - self._gc_began

    def _counters(self) -> tuple[float, float, int, int]:
        usage = resource.getrusage(getattr(resource, "RUSAGE_THREAD", resource.RUSAGE_SELF))
        return time.thread_time(), self.gc_seconds, usage.ru_nvcsw, usage.ru_nivcsw

    def begin(self) -> None:
        """On the loop's thread, as a step begins: the counters its step line is the difference from."""
        if self._gc not in gc.callbacks:
            gc.callbacks.append(self._gc)
        self._began = self._counters()

    @classmethod
    def from_env(cls, name: str) -> StepLog | None:
        prefix = os.environ.get(ENV)
        return cls(f"{prefix}.{name}.{os.getpid()}.jsonl") if prefix else None

    def _write(self, event: dict) -> None:
        self.file.write(json.dumps(event) + "\n")

    def arrived(self, received: float, taken: float) -> None:
        self._write({"kind": "arrive", "received": received, "taken": taken})

    def step(self, began: float, ended: float, report, running: int, waiting: int) -> None:
        """On the loop's thread, as the step (begun with begin()) has ended."""
        now = self._counters()
        cpu, gc_seconds, voluntary, involuntary = (b - a for a, b in zip(self._began, now))
        self._write({"kind": "step", "began": began, "ended": ended, "running": running, "waiting": waiting,
                     "prefill_tokens": report.prefill_tokens, "forward_tokens": report.forward_tokens,
                     "generated": report.generated_tokens, "finished": len(report.finished), "budget": report.budget,
                     "ms": {k: round(v * 1e3, 3) for k, v in report.seconds.items()}, "cpu_ms": round(cpu * 1e3, 3),
                     "gc_ms": round(gc_seconds * 1e3, 3), "switches": [voluntary, involuntary], **_device_memory()})
        self.steps += 1
        if self.steps % PROBE_EVERY == 1:
            self.probe()
        self.file.flush()

    def probe(self) -> None:
        at = time.perf_counter()
        self._write({"kind": "probe", "at": at, "calib_us": round(calibration_us(), 1),
                     "cpu": _sched_getcpu() if _sched_getcpu is not None else None, "steal_ticks": _steal_ticks()})

    def published(self, at: float, deltas: int, first: int, finished: int) -> None:
        self._write({"kind": "publish", "at": at, "deltas": deltas, "first": first, "finished": finished})

    def point(self, batch_size: int, speculative: bool, began: float, ended: float, timelines) -> None:
        """A bench point: its requests as the client saw them (bench_measure.Timeline), then the point."""
        for t in timelines:
            first, done = (t.deliveries[0][0], t.deliveries[-1][0]) if t.deliveries else (None, None)
            self._write({"kind": "client", "sent": t.sent, "first": first, "done": done})
        self._write({"kind": "point", "batch_size": batch_size, "speculative": speculative, "began": began,
                     "ended": ended})
        self.file.flush()

    def hop(self, name: str, at: float | None = None) -> None:
        self._write({"kind": "hop", "name": name, "at": time.perf_counter() if at is None else at})
        self.file.flush()  # a service stopped by a signal keeps what it logged

    def close(self) -> None:
        if self._gc in gc.callbacks:
            gc.callbacks.remove(self._gc)
        self.file.close()

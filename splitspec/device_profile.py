"""Where a step's device and host time go, on a GPU: with SPLITSPEC_TORCH_PROFILE=DIR in its environment,
`splitspec bench` (in process) runs decode steps STEPS_FROM..STEPS_TO of every timed point under torch.profiler
and writes DIR/<point>.txt (the ops by self host time and by device time; the phases named below by their
wall time) and DIR/<point>.trace.json.gz (a Chrome trace). The engine's phases and the drafters' parts are
labelled with `phase(name)` (record_function when profiling is on, nothing otherwise). A profiled step runs
slower: its figures are for proportions, not speed. Off unless the variable is set.

A served verifier (EngineWorker) profiles too when SPLITSPEC_TORCH_PROFILE_SERVED=BATCH:KIND is set as well (KIND
spec or plain): its decode steps of BATCH requests, every one verifying a tree (spec) or none (plain), the 4th to
the 16th of those (a served load's waves hold fewer whole-batch steps than a point in process), into
DIR/served_bs<BATCH>_<KIND>.txt: the served step beside the in-process one.

SPLITSPEC_CPROFILE=DIR instead: the same steps under cProfile (the host's Python by function, which the torch
profiler shows only as gaps between operators), into DIR/<point>.prof (pstats) and DIR/<point>.cprofile.txt (the
functions by own time, per step). Its slowdown of Python is smaller than the torch profiler's; proportions still."""

from __future__ import annotations

import contextlib
import gzip
import os
import shutil
from pathlib import Path

ENV = "SPLITSPEC_TORCH_PROFILE"
CPROFILE_ENV = "SPLITSPEC_CPROFILE"
STEPS_FROM, STEPS_TO = 20, 40
ENABLED = bool(os.environ.get(ENV))
_OFF = contextlib.nullcontext()  # reusable: what phase() returns on every call when profiling is off


def phase(name: str):
    """A labelled range in the profile (a no-op context unless profiling is on)."""
    if not ENABLED:
        return _OFF
    import torch

    return torch.profiler.record_function(name)


SERVED_ENV = "SPLITSPEC_TORCH_PROFILE_SERVED"


def served_selector():
    """(profiler, does this step count) for a served verifier, from SPLITSPEC_TORCH_PROFILE_SERVED; None when off."""
    spec = os.environ.get(SERVED_ENV)
    if not (ENABLED and spec):
        return None
    batch, _, kind = spec.partition(":")
    batch, speculative = int(batch), kind == "spec"

    def counts(report) -> bool:  # a decode step of that many requests, all verifying trees (spec) or none (plain)
        trees = len(report.accept_lengths)
        return (report.prefill_tokens == 0 and report.generated_tokens > 0
                and (trees == batch if speculative else trees == 0 and report.forward_tokens == batch))

    return StepProfiler(f"served_bs{batch}_{'spec' if speculative else 'plain'}", 4, 16), counts


class StepProfiler:
    """Call step() after every decode step of a point; the profile covers steps STEPS_FROM..STEPS_TO."""

    def __init__(self, name: str, start: int = STEPS_FROM, stop: int = STEPS_TO):
        self.directory = os.environ.get(ENV) or os.environ.get(CPROFILE_ENV)
        self.cprofile = not os.environ.get(ENV) and bool(os.environ.get(CPROFILE_ENV))
        self.name, self.steps, self.profiler = name, 0, None
        self.start, self.stop = start, stop

    def step(self) -> None:
        if not self.directory:
            return
        self.steps += 1
        if self.steps == self.start and self.cprofile:
            import cProfile

            self.profiler = cProfile.Profile()
            self.profiler.enable()
        elif self.steps == self.start:
            import torch

            activities = [torch.profiler.ProfilerActivity.CPU]
            if torch.cuda.is_available():
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            self.profiler = torch.profiler.profile(activities=activities)
            self.profiler.__enter__()
        elif self.steps == self.stop and self.profiler is not None:
            self.close()

    def _write_cprofile(self, profiler, out: Path) -> None:
        import io
        import pstats

        profiler.disable()
        profiler.dump_stats(str(out / f"{self.name}.prof"))
        steps = max(min(self.steps, self.stop) - self.start, 1)
        stats = pstats.Stats(profiler, stream=io.StringIO())
        rows = sorted(((tt, nc, f"{Path(file).name}:{line} {fn}") for (file, line, fn), (_, nc, tt, _, _)
                       in stats.stats.items()), reverse=True)[:60]
        with open(out / f"{self.name}.cprofile.txt", "w") as f:
            f.write(f"{self.name}: decode steps {self.start}..{self.stop} under cProfile ({steps} steps); own time\n")
            f.write(f"{'us/step':>9} {'calls/step':>10}  function\n")
            for tt, nc, where in rows:
                f.write(f"{tt / steps * 1e6:9.1f} {nc / steps:10.1f}  {where}\n")

    def close(self) -> None:
        if self.profiler is None:
            return
        profiler, self.profiler = self.profiler, None
        out = Path(self.directory)
        out.mkdir(parents=True, exist_ok=True)
        if self.cprofile:
            self._write_cprofile(profiler, out)
            return
        profiler.__exit__(None, None, None)
        events = profiler.key_averages()
        if not len(events):
            return
        steps = self.stop - self.start
        device_key = "self_device_time_total" if hasattr(events[0], "self_device_time_total") else "self_cuda_time_total"
        with open(out / f"{self.name}.txt", "w") as f:
            f.write(f"{self.name}: decode steps {self.start}..{self.stop} ({steps} steps)\n\n== by self host time\n")
            f.write(events.table(sort_by="self_cpu_time_total", row_limit=45, max_name_column_width=70))
            f.write("\n== by device time\n")
            f.write(events.table(sort_by=device_key, row_limit=30, max_name_column_width=70))
            f.write("\n== labelled phases (host wall ms per step)\n")
            for event in sorted(events, key=lambda e: -e.cpu_time_total):
                if event.key.startswith(("engine.", "draft.", "loop.")):
                    f.write(f"{event.key:40s} {event.cpu_time_total / 1e3 / steps:9.3f} ms/step  x{event.count / steps:.1f}\n")
        trace = out / f"{self.name}.trace.json"
        profiler.export_chrome_trace(str(trace))
        with open(trace, "rb") as src, gzip.open(f"{trace}.gz", "wb") as dst:
            shutil.copyfileobj(src, dst)
        trace.unlink()

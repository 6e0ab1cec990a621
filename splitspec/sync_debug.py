"""Where the host waits for the device, on a GPU: with SPLITSPEC_SYNC_DEBUG=FILE in its environment, `splitspec bench`
(in process) and a served verifier's engine loop run under torch.cuda.set_sync_debug_mode("warn") and count every
synchronizing CUDA call (an .item(), a .tolist(), a copy to pageable host memory, a tensor built from a list on the
device, a stream or event wait) by where it was called from: the innermost three frames of this project's code. FILE
gets one JSON line per bench point, or per 256 served steps, with the steps counted and each site's count, so that a
site that runs every step (count = steps) tells apart from one that runs now and then. With the overlap schedule a
plain step should wait once (for the step before's tokens, while this one runs); every other wait is the host stopping
the device's queue from filling. Off unless the variable is set; a no-op without CUDA."""

from __future__ import annotations

import json
import os
import threading
import time
import traceback
import warnings
from collections import Counter

ENV = "SPLITSPEC_SYNC_DEBUG"
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repository (or site-packages) above splitspec/


def _own(filename: str, roots: tuple[str, ...]) -> bool:
    """A frame of this project (or of the code run from the working directory: a test, a benchmark), not a library's."""
    return filename.startswith(roots) and "site-packages" not in filename and not filename.endswith("sync_debug.py")


def _site(stack: list[traceback.FrameSummary]) -> str:
    roots = (_ROOT + os.sep, os.getcwd() + os.sep)
    own = [f for f in stack if _own(f.filename, roots)]
    return " <- ".join(f"{os.path.relpath(f.filename, next(r for r in roots if f.filename.startswith(r)))}:{f.lineno}:"
                       f"{f.name}" for f in reversed(own[-3:]))


class SyncCounter:
    """Counts the synchronizing CUDA calls made while it is on (start .. stop), per call site; step() counts steps."""

    def __init__(self, name: str, path: str, report_every: int = 0):
        self.name, self.path, self.report_every = name, path, report_every  # report_every: steps between two lines
        self.sites: Counter = Counter()
        self.steps = 0
        self._previous = None
        self._lock = threading.Lock()

    @classmethod
    def from_env(cls, name: str, report_every: int = 0) -> "SyncCounter | None":
        path = os.environ.get(ENV)
        if not path:
            return None
        import torch

        return cls(name, path, report_every) if torch.cuda.is_available() else None

    def start(self) -> None:
        import torch

        self._previous = warnings.showwarning
        warnings.filterwarnings("always", message=".*synchroniz.*")
        warnings.showwarning = self._show
        torch.cuda.set_sync_debug_mode("warn")

    def _show(self, message, category, filename, lineno, file=None, line=None) -> None:
        if "synchroniz" not in str(message):
            return self._previous(message, category, filename, lineno, file, line)
        with self._lock:
            self.sites[_site(traceback.extract_stack()[:-1])] += 1

    def step(self) -> None:
        self.steps += 1
        if self.report_every and self.steps % self.report_every == 0:  # a loop that never stops: cumulative lines
            self.write()

    def write(self) -> None:
        with self._lock:
            record = {"name": self.name, "time": time.time(), "steps": self.steps, "syncs": sum(self.sites.values()),
                      "sites": dict(self.sites.most_common())}
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")

    def stop(self) -> None:
        import torch

        torch.cuda.set_sync_debug_mode("default")
        if self._previous is not None:
            warnings.showwarning = self._previous
        self.write()


def main(argv: list[str] | None = None) -> None:
    """python -m splitspec.sync_debug FILE...: each line's steps, waits and most frequent call sites."""
    import argparse

    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("files", nargs="+")
    parser.add_argument("--sites", type=int, default=8, help="Call sites shown per line (the most frequent).")
    args = parser.parse_args(argv)
    for path in args.files:
        with open(path) as f:
            for line in f:
                record = json.loads(line)
                print(f"{record['name']}: {record['syncs']} waits in {record['steps']} decode steps")
                for site, count in list(record["sites"].items())[: args.sites]:
                    print(f"  {count:6d}  {site or '(outside this project)'}")


if __name__ == "__main__":
    main()

"""A timeline of the engine's steps: with SPLITSPEC_STEP_LOG=PREFIX in its environment, an engine loop (a served
verifier's engine thread, or `splitspec bench` in process) writes PREFIX.<name>.<pid>.jsonl, one JSON object per
event, timed on the system's monotonic clock (time.perf_counter, the same in every process of the machine):

- {"kind": "arrive", "received": t, "taken": t}: a request reached the engine's process, and the loop took it in;
- {"kind": "step", "began": t, "ended": t, "running": n, "waiting": n, "prefill_tokens": n, "forward_tokens": n,
  "generated": n, "finished": n, "budget": n, "ms": {phase: ms}}: one engine step;
- {"kind": "publish", "at": t, "deltas": n, "first": n, "finished": n}: deltas handed to their streams (first: how
  many carry their request's first token);
- {"kind": "client", "sent": t, "first": t, "done": t}: a request as the bench's client saw it;
- {"kind": "point", "batch_size": n, "speculative": bool, "began": t, "ended": t}: one bench point's measured run.

`python benchmarks/step_timeline.py FILE...` reads them back wave by wave. Off unless the variable is set; a
write per event costs microseconds, but the figures of a logged run are the log's, not speeds to quote."""

from __future__ import annotations

import json
import os

ENV = "SPLITSPEC_STEP_LOG"


class StepLog:
    def __init__(self, path: str):
        self.path = path
        self.file = open(path, "a", buffering=1 << 16)  # noqa: SIM115 (open for the loop's life; flushed per step)

    @classmethod
    def from_env(cls, name: str) -> StepLog | None:
        prefix = os.environ.get(ENV)
        return cls(f"{prefix}.{name}.{os.getpid()}.jsonl") if prefix else None

    def _write(self, event: dict) -> None:
        self.file.write(json.dumps(event) + "\n")

    def arrived(self, received: float, taken: float) -> None:
        self._write({"kind": "arrive", "received": received, "taken": taken})

    def step(self, began: float, ended: float, report, running: int, waiting: int) -> None:
        self._write({"kind": "step", "began": began, "ended": ended, "running": running, "waiting": waiting,
                     "prefill_tokens": report.prefill_tokens, "forward_tokens": report.forward_tokens,
                     "generated": report.generated_tokens, "finished": len(report.finished), "budget": report.budget,
                     "ms": {k: round(v * 1e3, 3) for k, v in report.seconds.items()}})
        self.file.flush()

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

    def close(self) -> None:
        self.file.close()

"""What the verifier is doing, in its log (SGLang's "Prefill batch" and "Decode batch" lines): a line for each step
that prefilled prompts, and every --decode-log-interval steps that decoded a line with the batch, the KV cache, the
generation throughput since the last line and, where requests speculate, the tokens a drafted step made a request
(the accept length) and how many of the requests' steps drafted (the load-adaptive policy turns drafting off where
it does not pay). Fed by the engine's thread once per step (worker.EngineWorker._flush)."""

from __future__ import annotations

import logging
import time

logger = logging.getLogger("splitspec.verifier")

DEFAULT_DECODE_LOG_INTERVAL = 40  # SGLang's default


class StatsLog:
    def __init__(self, interval: int = DEFAULT_DECODE_LOG_INTERVAL, clock=time.perf_counter):
        """interval: decode steps a line (0: no lines)."""
        self.interval, self.clock = interval, clock
        self.last: float | None = None  # when the last step was observed, None once the engine went idle
        self._window(None)

    def _window(self, began: float | None) -> None:
        self.began, self.steps, self.tokens, self.request_steps = began, 0, 0, 0
        self.drafted, self.drafted_tokens = 0, 0

    def observe(self, engine, report) -> None:
        """One step's report, with the engine as it is after it."""
        if self.interval <= 0:
            return
        now = self.clock()
        if report.prefill_tokens:
            self._prefill(engine, report)
        # first tokens come from the prompts' prefill; a step may also land the tokens of one launched before it (the
        # overlap schedule: its own forward in flight, or none when the run ends), so tokens, not forwards, count
        decoded = report.generated_tokens - report.new_requests
        if decoded > 0:
            if self.steps == 0:
                self._window(self.last if self.last is not None else now)
            drafted = report.accept_lengths
            self.steps += 1
            self.tokens += decoded
            self.drafted += len(drafted)
            self.drafted_tokens += sum(drafted)
            self.request_steps += report.decode_requests
            if self.steps >= self.interval:
                self._decode(engine, now)
                self.steps = 0
        self.last = now if engine.running or engine.waiting else None

    def _cache(self, engine) -> str:
        kv = engine.runner.kv_cache
        used, total = kv.allocator.num_used, kv.num_pages
        cached = engine.prefix_cache.num_pages if engine.prefix_cache is not None else 0
        share = f" ({100 * cached / total:.1f}% the prefix cache's)" if cached else ""
        return f"KV cache {100 * used / total:.1f}% used{share}"

    def _prefill(self, engine, report) -> None:
        cached = f", {report.cached_tokens} from the prefix cache" if report.cached_tokens else ""
        logger.info("prefill: %d new request(s), %d prompt tokens computed%s; %d running, %d waiting; %s",
                    report.new_requests, report.prefill_tokens, cached, len(engine.running), len(engine.waiting),
                    self._cache(engine))

    def _decode(self, engine, now: float) -> None:
        seconds = max(now - self.began, 1e-9)
        speculation = ""
        if engine.drafter is not None and self.request_steps:
            accept = f"accept length {self.drafted_tokens / self.drafted:.2f}, " if self.drafted else ""
            speculation = f"; speculation: {accept}{100 * self.drafted / self.request_steps:.0f}% of request-steps drafted"
        logger.info("decode: %d running, %d waiting; %s; %.1f tokens/s over the last %d steps (%.2f ms a step)%s",
                    len(engine.running), len(engine.waiting), self._cache(engine), self.tokens / seconds, self.steps,
                    1e3 * seconds / self.steps, speculation)

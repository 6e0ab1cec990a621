"""How fast the serving path alone carries tokens: the gateway, gRPC and the HTTP client, with no model.

    python -P benchmarks/gateway_ceiling.py --batch-size 1,16 --tokens-per-delta 1,4 --out ceiling.json

A verifier stand-in serves the real splitspec.v1.Verifier service (grpc_front.VerifierServicer) on this
process's event loop; its backend answers every request with deltas of --tokens-per-delta tokens (ids
that the demo tokenizer decodes to text), as fast as the stream takes them or one every --interval-ms. A real
`splitspec gateway` process serves it over HTTP and `splitspec bench --url` (streaming completions, the same
client as every served figure) measures it. The tok/s it reports is the ceiling the engine's own speed
meets: at batch 1, a served deployment whose engine makes tokens faster than this is bound by the path,
not the model. Nothing here is a model's output: use it to size the path, never as a served figure.

With --step-ms the stand-in steps in lockstep as an engine does: the requests that arrived are prefilled together
(--prefill-fixed-ms plus --prefill-ms each), else every --step-ms each running request gets one token, all in one
message; a request submitted meanwhile starts at the next step. When every request
has the same length (the bench's waves), each wave's last step is followed by the next wave coming in through
the gateway; the report gives, per wave, the milliseconds from that last step to the next wave's first,
middle and last submission reaching the stand-in (`wave_edges_ms`): the time a served engine sits idle between
waves that no in-process run has, i.e. the path's cost per wave, measurable without a GPU; and each wave's time
against an in-process run's with the same steps (`in_process_over_wave`: the served / in-process ratio those step
times would give if nothing else differed).

    # an 8B target on an H200 at batch 64: decode steps of 5.5 ms, a prefill of 128-token prompts 7 ms + 2.8 ms each
    python -P benchmarks/gateway_ceiling.py --batch-size 64 --prompt-len 128 --output-len 128 --step-ms 5.5 \
        --prefill-fixed-ms 7 --prefill-ms 2.8 --num-prompts 512 --out edges.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shlex
import socket
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

from splitspec import lifeline
from splitspec.bench import git_commit
from splitspec.demo import demo_model_dirs
from splitspec.protos import verifier_pb2 as pb
from splitspec.verifier_svc.grpc_front import Limits, NoCounts, Stream, VerifierServicer, set_serving, start_server

ORDINARY = 1000  # the demo tokenizer's ids 1000-2999 each decode to text (100-256 are bytes: no text alone)


class PacedBackend:
    """Every request: max_new_tokens tokens in deltas of `per_delta`, the first carrying the prompt's counts."""

    def __init__(self, per_delta: int, interval: float):
        self.per_delta, self.interval = per_delta, interval
        self.tasks: dict[str, asyncio.Task] = {}

    def submit(self, submit: pb.SubmitRequest, params, stream: Stream) -> None:
        self.tasks[submit.request_id] = asyncio.get_running_loop().create_task(self._emit(submit, params, stream))

    async def _emit(self, submit: pb.SubmitRequest, params, stream: Stream) -> None:
        total, sent, first = params.max_new_tokens, 0, True
        while sent < total:
            n = min(self.per_delta, total - sent)
            ids = [ORDINARY + (sent + i) % 2000 for i in range(n)]
            delta = pb.TokenDelta(request_id=submit.request_id, token_ids=ids)
            if first:
                delta.prompt_tokens, first = len(submit.prompt_ids), False
            sent += n
            if sent >= total:
                delta.finish_reason = pb.FINISH_REASON_LENGTH
                delta.prompt_tokens = len(submit.prompt_ids)
            stream.put(delta)
            await asyncio.sleep(self.interval)  # 0: yield, so the stream writes what is waiting

    async def abort(self, request_id: str) -> None:
        task = self.tasks.pop(request_id, None)
        if task is not None:
            task.cancel()

    def finished(self, request_id: str) -> None:
        self.tasks.pop(request_id, None)


class LockstepBackend:
    """An engine's schedule without a model: the requests that arrived are prefilled together in one step that takes
    prefill_fixed_s plus prefill_s per request (their first tokens), else every running request gets one token per
    decode step of step_s, all in one message. Records when each submission arrived, each decode step's time, and when
    the steps that left nothing running ended, for wave_edges()."""

    def __init__(self, step_s: float, prefill_s: float, prefill_fixed_s: float = 0.0):
        self.step_s, self.prefill_s, self.prefill_fixed_s = step_s, prefill_s, prefill_fixed_s
        self.running: dict[str, list] = {}  # request id -> [stream, prompt tokens, tokens left, tokens sent]
        self.waiting: list[tuple[str, list]] = []
        self.arrivals: list[float] = []
        self.decode_steps: list[float] = []  # each decode step's seconds (the sleep's own overshoot included)
        self.final_steps: list[float] = []  # when a step left nothing running or waiting
        self.wake: asyncio.Event | None = None
        self.task: asyncio.Task | None = None

    def submit(self, submit: pb.SubmitRequest, params, stream: Stream) -> None:
        self.arrivals.append(time.perf_counter())
        self.waiting.append((submit.request_id, [stream, len(submit.prompt_ids), params.max_new_tokens, 0]))
        if self.task is None:
            self.wake = asyncio.Event()
            self.task = asyncio.get_running_loop().create_task(self._steps())
        self.wake.set()

    async def _step(self, seconds: float, states: list[tuple[str, list]]) -> float:
        began = time.perf_counter()
        await asyncio.sleep(seconds)
        took = time.perf_counter() - began
        for request_id, state in states:
            stream, prompt, left, sent = state
            delta = pb.TokenDelta(request_id=request_id, token_ids=[ORDINARY + sent % 2000])
            if sent == 0:
                delta.prompt_tokens = prompt
            state[2], state[3] = left - 1, sent + 1
            if left == 1:
                delta.finish_reason = pb.FINISH_REASON_LENGTH
                delta.prompt_tokens = prompt
                self.running.pop(request_id, None)
            stream.put(delta)
        return took

    async def _steps(self) -> None:
        while True:
            if self.waiting:
                batch, self.waiting = self.waiting, []
                self.running.update(batch)
                await self._step(self.prefill_fixed_s + self.prefill_s * len(batch), batch)
            elif self.running:
                self.decode_steps.append(await self._step(self.step_s, list(self.running.items())))
            else:
                self.wake.clear()
                await self.wake.wait()
                continue
            if not self.running and not self.waiting:
                self.final_steps.append(time.perf_counter())

    def wave_edges(self, wave: int, output_len: int) -> dict:
        """Over the waves that followed a finished one (the bench's warm-up and each point's first wave have none): ms
        from the last step before to the wave's first, middle and last arrival; each wave's ms (from the last step
        before it to its own last); and `in_process_over_wave`: what the wave would take with its whole prefill in one
        step and no edge (an in-process run's wave: one prefill, output_len - 1 decode steps of their measured mean),
        over what it took, i.e. the served / in-process ratio these step times would give if nothing else differed."""
        edges = {"first": [], "middle": [], "last": [], "wave": [], "in_process_over_wave": []}
        step = statistics.fmean(self.decode_steps) if self.decode_steps else self.step_s
        in_process = self.prefill_fixed_s + self.prefill_s * wave + (output_len - 1) * step
        for end, following in zip(self.final_steps, self.final_steps[1:]):
            arrived = [t for t in self.arrivals if end < t < following]
            if len(arrived) != wave:
                continue
            for name, at in (("first", arrived[0]), ("middle", arrived[wave // 2]), ("last", arrived[-1])):
                edges[name].append((at - end) * 1e3)
            edges["wave"].append((following - end) * 1e3)
            edges["in_process_over_wave"].append(in_process / (following - end))
        return {name: {"mean": round(statistics.fmean(v), 3), "median": round(statistics.median(v), 3), "waves": len(v)}
                for name, v in edges.items() if v}

    async def abort(self, request_id: str) -> None:
        self.running.pop(request_id, None)

    def finished(self, request_id: str) -> None:
        pass


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve_stand_in(address: str, backend: PacedBackend, model_dir: Path, ready: threading.Event,
                   stop: threading.Event) -> None:
    async def main():
        info = pb.ModelInfo(model_id="ceiling", model_path=str(model_dir), vocab_size=4096, max_context_tokens=4096,
                            eos_token_ids=[0])
        server, health = await start_server(VerifierServicer(backend, Limits(4096, 4096, 1 << 20, 16, 1), info,
                                                             NoCounts()), address)
        await set_serving(health)
        ready.set()
        while not stop.is_set():
            await asyncio.sleep(0.2)
        await server.stop(1)

    asyncio.run(main())


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch-size", default="1,16", help="Concurrent streams (comma-separated).")
    parser.add_argument("--tokens-per-delta", default="1,4", help="Tokens in each delta (comma-separated).")
    parser.add_argument("--interval-ms", type=float, default=0.0, help="Pause between a stream's deltas (0: none).")
    parser.add_argument("--output-len", type=int, default=256, help="Tokens per request.")
    parser.add_argument("--prompt-len", type=int, default=32, help="Tokens per prompt (the bench's random ids).")
    parser.add_argument("--step-ms", type=float, default=None,
                        help="Lockstep decode steps this long (one token per request each; the waves' edges reported).")
    parser.add_argument("--prefill-ms", type=float, default=0.0,
                        help="With --step-ms: a prefill step's milliseconds per request it admits.")
    parser.add_argument("--prefill-fixed-ms", type=float, default=0.0,
                        help="With --step-ms: a prefill step's milliseconds besides its requests' (what a small "
                             "prefill costs more).")
    parser.add_argument("--num-prompts", type=int, default=None,
                        help="Requests per point (the bench's default if unset).")
    parser.add_argument("--out", required=True, help="The JSON report.")
    args = parser.parse_args(argv)
    if args.step_ms is not None and "," in args.batch_size:
        parser.error("--step-ms measures one batch size's waves at a time")
    model_dir = demo_model_dirs()["target"]
    report = {"benchmark": "serving path ceiling (no model)", "command": shlex.join(["python", "-P", *sys.argv]),
              "commit": git_commit(), "points": []}
    for per_delta in (int(x) for x in args.tokens_per_delta.split(",")):
        grpc_port, http_port = free_port(), free_port()
        ready, stop = threading.Event(), threading.Event()
        if args.step_ms is not None:
            backend = LockstepBackend(args.step_ms / 1000, args.prefill_ms / 1000, args.prefill_fixed_ms / 1000)
        else:
            backend = PacedBackend(per_delta, args.interval_ms / 1000)
        thread = threading.Thread(target=serve_stand_in, args=(f"127.0.0.1:{grpc_port}", backend, model_dir, ready, stop),
                                  daemon=True)
        thread.start()
        ready.wait(30)
        gateway = lifeline.spawn([sys.executable, "-P", "-m", "splitspec", "gateway", "--port", str(http_port),
                                  "--verifier", f"127.0.0.1:{grpc_port}", "--log-level", "warning"])
        try:
            with tempfile.TemporaryDirectory() as work:
                out = Path(work) / "bench.json"
                command = [sys.executable, "-P", "-m", "splitspec", "bench", "--url", f"http://127.0.0.1:{http_port}",
                           "--model-path", str(model_dir), "--batch-size", args.batch_size,
                           "--prompt-len", str(args.prompt_len),
                           "--output-len", str(args.output_len), "--out", str(out), "--log-level", "warning",
                           *(["--num-prompts", str(args.num_prompts)] if args.num_prompts else [])]
                deadline = time.monotonic() + 60
                while True:  # the gateway connects to the stand-in
                    result = lifeline.run(command, capture_output=True, text=True, timeout=600)
                    if result.returncode == 0 or time.monotonic() > deadline:
                        break
                    time.sleep(1)
                if result.returncode != 0:
                    print(result.stderr[-3000:], file=sys.stderr)
                    return 1
                rows = json.loads(out.read_text())["rows"]
        finally:
            gateway.terminate()
            gateway.wait(10)
            stop.set()
            thread.join(10)
        for row in rows:
            if row["speculative"] not in (None, "off"):
                continue
            point = {"tokens_per_delta": per_delta, "batch_size": row["batch_size"], "output_tok_s": row["output_tok_s"],
                     "itl_ms": row.get("itl_ms"), "ttft_ms": row.get("ttft_ms")}
            report["points"].append(point)
            print(json.dumps(point))
        if args.step_ms is not None:
            report["wave_edges_ms"] = backend.wave_edges(int(args.batch_size), args.output_len)
            print(json.dumps({"wave_edges_ms": report["wave_edges_ms"]}))
            break  # tokens per delta is one in lockstep
    Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

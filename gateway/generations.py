"""The gateway's requests against the verifier: admission (--max-queued-requests), submission of a request's
n choices on the shared gRPC stream, and each delta absorbed into its choice (incremental detokenization, stop
strings matched across token boundaries, logprobs, finish reasons), with the latency metrics."""

from __future__ import annotations

import asyncio
import logging
import os
import time
from dataclasses import dataclass, field

from splitspec import event_loop, heap
from splitspec.step_log import StepLog
from splitspec.gateway.client import StreamBroken, VerifierClient
from splitspec.gateway.ids import process_tag
from splitspec.gateway.metrics import GatewayMetrics
from splitspec.gateway.protocol import APIError, Generation, invalid
from splitspec.gateway.request_log import log_request
from splitspec.gateway.text import IncrementalDecoder, StopMatcher, TextCodec
from splitspec.gateway.tools import ToolOutput
from splitspec.gateway.tokenizing import Tokenizing, is_token_ids
from splitspec.protos import verifier_pb2 as pb

logger = logging.getLogger("splitspec.gateway")

# tokens per delta the gateway asks of the verifier for an answer it does not stream and need not read before its end
# (no stop strings to match as the text grows): SGLang's scheduler sends such requests' output every 50 tokens too
UNSTREAMED_INTERVAL = 50
FINISH = {pb.FINISH_REASON_STOP: "stop", pb.FINISH_REASON_LENGTH: "length", pb.FINISH_REASON_ABORT: "abort"}
GRPC_INVALID_ARGUMENT, GRPC_RESOURCE_EXHAUSTED = 3, 8


@dataclass(frozen=True)
class GatewayConfig:
    verifier: str = "127.0.0.1:30001"
    tokenizer_path: str | None = None
    served_model_name: str | None = None
    api_key: str | None = None
    max_queued_requests: int = 1024
    max_request_body_bytes: int = 8 << 20
    tokenizer_threads: int = 2
    workers_dir: str | None = None  # one of --tokenizer-worker-num's processes: where each marks itself ready
    workers: int = 1
    serve_when_ready: bool = False  # accept no connection before the verifier's info and the tokenizer are in
    log_requests_level: int = -1  # --log-requests: a line per answered request at this level (-1: none)


@dataclass
class Choice:
    index: int
    request_id: str
    decoder: IncrementalDecoder
    stop: StopMatcher
    queue: asyncio.Queue | None = None
    tokens: int = 0
    pieces: list[str] = field(default_factory=list)  # the text released so far (joined once: `text`)
    text_length: int = 0
    finish_reason: str | None = None
    logprobs: list = field(default_factory=list)  # (token_id, logprob, top [(id, lp)], text_offset)
    speculation: pb.SpeculationCounts | None = None
    cached_tokens: int = 0
    error: APIError | None = None
    echo: str | None = None  # completions with echo: the prompt's text, sent before the completion's
    echo_sent: bool = False  # streamed: the echo went out (with the first delta)
    prompt: list[int] = field(default_factory=list)
    prompt_logprobs: list = field(default_factory=list)  # with echo and logprobs: entries as logprobs', the first None
    grammar_field: str | None = None  # structured outputs: the field of the request's grammar
    tools: ToolOutput | None = None  # chat with tools: the output's calls (gateway/tools.py)

    @property
    def text(self) -> str:
        """The output text released so far (a stop string and what follows it never are)."""
        if len(self.pieces) > 1:
            self.pieces[:] = ["".join(self.pieces)]
        return self.pieces[0] if self.pieces else ""


class LatencyClock:
    """A request's latency metrics: time to first token, the gaps between token deliveries, end to end."""

    def __init__(self, metrics: GatewayMetrics, arrival: float):
        self.metrics, self.arrival = metrics, arrival
        self.last: float | None = None

    def delivered(self, delta) -> None:
        if isinstance(delta, StreamBroken) or not delta.token_ids:
            return
        now = time.perf_counter()
        if self.last is None:
            self.metrics.ttft_served.observe(now - self.arrival)
        else:
            self.metrics.itl_served.observe(now - self.last)
        self.last = now

    def done(self) -> None:
        self.metrics.e2e_served.observe(time.perf_counter() - self.arrival)


class Gateway:
    def __init__(self, config: GatewayConfig, codec: TextCodec | None = None):
        self.config = config
        self.codec = codec
        self.client: VerifierClient | None = None
        self.metrics: GatewayMetrics | None = None
        self.tokenizing: Tokenizing | None = None
        self.created = int(time.time())
        self.model_name = config.served_model_name
        self.ready = False
        self.admitted = 0  # choices admitted and not yet finished (the --max-queued-requests budget)
        self.verify_steps = self.accepted_tokens = 0  # over every finished choice: /get_server_info's accept length
        self._connector: asyncio.Task | None = None
        self.http_state = None  # set by gateway/server.py: a line per open HTTP connection (for `kill -USR2`)
        self.step_log = StepLog.from_env("gateway")  # SPLITSPEC_STEP_LOG: each submission's way in

    # lifecycle ---------------------------------------------------------------------------------------
    async def start(self) -> None:
        event_loop.print_tasks_on_sigusr2(self._held)
        self.client = VerifierClient(self.config.verifier, on_grpc_error=self._grpc_error, step_log=self.step_log)
        self._connector = asyncio.get_running_loop().create_task(self._connect())

    async def _connect(self) -> None:
        """Wait for the verifier's model info (it may start after the gateway), then serve."""
        began, said = time.monotonic(), -1.0
        while True:
            try:  # waits for the channel: the first call after the verifier's port opens answers (gRPC reconnects
                # by its own backoff, at most 1 s apart); a fixed retry delay on top of it added up to 3 s more
                info = await self.client.model_info(timeout=2.0, wait_for_ready=True)
                break
            except Exception as exc:  # noqa: BLE001 (grpc.aio raises several kinds while the verifier is down)
                waited = time.monotonic() - began
                if said < 0 or waited - said >= 30:  # once, then every 30 s (a GPU verifier warms up for minutes)
                    logger.info("waiting for the verifier at %s (%s; %.0f s so far)", self.config.verifier,
                                type(exc).__name__, waited)
                    said = waited
                await asyncio.sleep(0.1)  # an answer that was an error (a verifier still starting its server)
        self.model_name = self.model_name or info.model_id
        if self.codec is None:
            self.codec = TextCodec(self.config.tokenizer_path or info.model_path)
        if self.metrics is None:
            self.metrics = GatewayMetrics(self.model_name)
        self.tokenizing = Tokenizing(self.codec, self.config.tokenizer_threads,
                                     self.metrics.tokenize_batch.labels(**self.metrics.model))
        heap.freeze("gateway")
        self.ready = True
        if self.config.workers_dir is not None:
            open(os.path.join(self.config.workers_dir, f"ready-{os.getpid()}"), "w").close()
        logger.info("serving %s (context %d tokens, speculation %s) from the verifier at %s", self.model_name,
                     info.max_context_tokens, info.speculative_algorithm or "off", self.config.verifier)

    async def until_ready(self) -> None:
        await asyncio.shield(self._connector)

    async def stop(self) -> None:
        if self._connector is not None:
            self._connector.cancel()
        if self.client is not None:
            await self.client.close()

    def _held(self) -> list[str]:
        """What `kill -USR2` prints after the tasks: the choices admitted and the requests open on the stream."""
        open_ = self.client.open_requests() if self.client is not None else {}
        lines = [f"gateway: {self.admitted} choice(s) admitted, {len(open_)} open on the verifier stream: "
                 + " ".join(f"{r} ({n} queued)" for r, n in sorted(open_.items())[:64])]
        if self.http_state is not None:
            lines += self.http_state()
        return lines

    def _grpc_error(self, code: str) -> None:
        if self.metrics is not None:
            self.metrics.grpc_errors.labels(code).inc()

    # requests ----------------------------------------------------------------------------------------
    def all_ready(self) -> bool:
        """This process serves, and so do its sibling workers (their supervisor drops a dead one's mark)."""
        if not self.ready:
            return False
        if self.config.workers_dir is None:
            return True
        marks = [n for n in os.listdir(self.config.workers_dir) if n.startswith("ready-")]
        return len(marks) >= self.config.workers

    def check_ready(self) -> None:
        if not self.ready:
            raise APIError(503, "the verifier is not ready yet", "service_unavailable", code="verifier_unavailable",
                           headers={"Retry-After": "1"})

    def check_model(self, name: str) -> None:
        if name != self.model_name:
            raise APIError(404, f"The model '{name}' does not exist (this server serves '{self.model_name}')",
                           "invalid_request_error", "model", "model_not_found")

    def admit(self, g: Generation) -> int:
        """Reserve the request's choices in the queue budget (released by release())."""
        self.check_ready()
        self.check_model(g.model)
        n = g.n * max(1, len(g.prompts))
        if self.admitted + n > self.config.max_queued_requests:
            raise APIError(429, f"the server is at its limit of {self.config.max_queued_requests} queued requests; "
                           "retry shortly", "rate_limit_exceeded", code="queue_full", headers={"Retry-After": "1"})
        self.admitted += n
        return n

    def release(self, n: int) -> None:
        self.admitted -= n

    async def prepare(self, g: Generation) -> list[list[int]]:
        """The request's prompts as token ids, each checked against the context."""
        jobs = [g.messages] if g.messages is not None else g.prompts
        if all(is_token_ids(job) for job in jobs):  # nothing to tokenize: no turn of the event loop before submission
            prompts = jobs
        else:
            prompts = await asyncio.gather(*(self.tokenizing.prompt_ids(job) for job in jobs))
        context = self.client.info.max_context_tokens
        for i, prompt in enumerate(prompts):
            where = "messages" if g.messages is not None else "prompt" if len(prompts) == 1 else f"prompt[{i}]"
            if not prompt:
                raise invalid(where, "the prompt is empty after tokenization")
            if len(prompt) >= context:
                raise invalid(where, f"This model's maximum context length is {context} tokens; the prompt has "
                              f"{len(prompt)} tokens", "context_length_exceeded")
            if g.max_tokens is not None and len(prompt) + g.max_tokens > context:
                raise invalid("max_tokens", f"This model's maximum context length is {context} tokens; the prompt has "
                              f"{len(prompt)} tokens and max_tokens asks for {g.max_tokens} more", "context_length_exceeded")
            most = g.most_tokens(len(prompt), context)
            if g.min_tokens > most:
                raise invalid("min_tokens", f"'min_tokens' ({g.min_tokens}) must not exceed the {most} tokens this "
                              "request may generate")
        return list(prompts)

    def submit(self, g: Generation, prompts: list[list[int]]) -> list[Choice]:
        """n choices per prompt, indexed prompt by prompt (OpenAI's order for a batch)."""
        base = self.client.new_id(process_tag()[:12])  # unique: a random tag per gateway process, a counter
        choices = []
        context = self.client.info.max_context_tokens
        for index in range(len(prompts) * g.n):
            prompt, i = prompts[index // g.n], index % g.n
            most = g.most_tokens(len(prompt), context)
            sampling = pb.SamplingParams(
                temperature=g.temperature, top_p=g.top_p, top_k=g.top_k, max_new_tokens=most,
                ignore_eos=g.ignore_eos, frequency_penalty=g.frequency_penalty, presence_penalty=g.presence_penalty)
            if g.seed is not None:
                sampling.seed = (g.seed + i) % (2**63 - 1)  # each choice its own sample, reproducibly
            if g.repetition_penalty != 1.0:
                sampling.repetition_penalty = g.repetition_penalty
            if g.logprobs:
                sampling.top_logprobs = g.top_logprobs
            sampling.logit_bias.update(g.logit_bias)
            sampling.stop_token_ids.extend(g.stop_token_ids)
            sampling.min_p, sampling.min_tokens = g.min_p, g.min_tokens
            if g.grammar is not None:
                sampling.grammar_kind, sampling.grammar = g.grammar
            if g.echo and (g.logprobs or most == 0):  # the verifier computes the prompt's logprobs (0: nothing else)
                sampling.prompt_logprobs = g.top_logprobs
            choice = Choice(index, f"{base}-{index}", IncrementalDecoder(self.codec, g.skip_special_tokens),
                            StopMatcher(g.stop, g.include_stop), prompt=prompt)
            if g.echo:
                source = g.prompts[index // g.n] if g.prompts else None
                choice.echo = source if isinstance(source, str) else self.codec.decode(prompt, skip_special_tokens=False)
            choice.grammar_field = g.grammar_field
            choice.tools = ToolOutput(g.tools) if g.tools is not None else None
            choice.queue = self.client.submit(choice.request_id, prompt, sampling, g.speculative,
                                              0 if g.stream or g.stop else UNSTREAMED_INTERVAL)
            choices.append(choice)
        self.metrics.prompt_tokens_served.inc(sum(len(p) for p in prompts))
        return choices

    def absorb(self, choice: Choice, delta: pb.TokenDelta | StreamBroken) -> str:
        """Apply one delta to a choice; returns the text that may be sent now."""
        if isinstance(delta, StreamBroken):
            choice.finish_reason = "error"
            choice.error = APIError(503, f"the verifier became unavailable ({delta.code}: {delta.details})",
                                    "service_unavailable", code="verifier_unavailable")
            return ""
        out = []
        if delta.prompt_logprobs and not choice.prompt_logprobs:  # the first delta: the prompt tokens' logprobs
            offsets = [0]
            for token in choice.prompt[:-1]:
                offsets.append(offsets[-1] + len(self.codec.token_text(token)))
            choice.prompt_logprobs = [(choice.prompt[0], None, None, 0)] + [
                (token, lp.logprob, list(zip(lp.top_token_ids, lp.top_logprobs)), offset)
                for token, lp, offset in zip(choice.prompt[1:], delta.prompt_logprobs, offsets[1:])]
        for j, token in enumerate(delta.token_ids):
            if choice.stop.hit is not None:
                break
            offset = choice.text_length + sum(len(p) for p in out)
            choice.tokens += 1
            if j < len(delta.logprobs):
                lp = delta.logprobs[j]
                choice.logprobs.append((token, lp.logprob, list(zip(lp.top_token_ids, lp.top_logprobs)), offset))
            out.append(choice.stop.feed(choice.decoder.step(token)))
        if delta.HasField("speculation"):
            choice.speculation = delta.speculation
        choice.cached_tokens = max(choice.cached_tokens, delta.cached_prompt_tokens)
        if choice.stop.hit is not None and choice.finish_reason is None:
            choice.finish_reason = "stop"
            self.client.abort(choice.request_id)
            self.metrics.aborts.labels("stop_string").inc()
        elif delta.finish_reason != pb.FINISH_REASON_UNSPECIFIED and choice.finish_reason is None:
            if delta.finish_reason == pb.FINISH_REASON_ERROR:
                choice.finish_reason = "error"
                status = 400 if delta.error_code in (GRPC_INVALID_ARGUMENT, GRPC_RESOURCE_EXHAUSTED) else 503
                grammar = delta.error.startswith("INVALID_ARGUMENT: grammar: ") and choice.grammar_field is not None
                choice.error = APIError(status, f"'{choice.grammar_field}': {delta.error.split('grammar: ', 1)[1]}"
                                        if grammar else f"the verifier refused the request: {delta.error}",
                                        "invalid_request_error" if status == 400 else "service_unavailable",
                                        choice.grammar_field if grammar else None, "invalid_value" if grammar else None)
            else:
                choice.finish_reason = FINISH.get(delta.finish_reason, "stop")
                out.append(choice.stop.feed(choice.decoder.flush()))
                out.append(choice.stop.finish())
            self.client.done(choice.request_id)
        piece = "".join(out)
        if piece:
            choice.pieces.append(piece)
            choice.text_length += len(piece)
        return piece

    def finished(self, choice: Choice) -> None:
        if choice.speculation is not None:
            self.verify_steps += choice.speculation.verify_steps
            self.accepted_tokens += choice.speculation.accepted_tokens
        self.metrics.completion_tokens_served.inc(choice.tokens)
        self.metrics.finished_as(choice.finish_reason or "abort").inc()

    def log_request(self, endpoint: str, rid: str, status: str, g, prompts: list[list[int]], choices: list[Choice],
                    arrival: float) -> None:
        """--log-requests: the request's line, as it ends (gateway/request_log.py)."""
        if self.config.log_requests_level >= 0:
            log_request(self.config.log_requests_level, endpoint, rid, status, g, prompts, choices,
                        time.perf_counter() - arrival)

    def abort_unfinished(self, choices: list[Choice], cause: str) -> None:
        for choice in choices:
            if choice.finish_reason is None:
                choice.finish_reason = "abort"
                self.client.abort(choice.request_id)
                self.metrics.aborts.labels(cause).inc()

    def server_info(self) -> dict:
        """SGLang's /get_server_info in the shape its clients read: the served model and, in internal_states, the
        mean accept length of the choices finished so far (SGLang's bench_serving prints it)."""
        info = self.client.info
        steps = self.verify_steps
        return {"model_path": info.model_path, "served_model_name": self.model_name,
                "speculative_algorithm": info.speculative_algorithm or None, "context_length": info.max_context_tokens,
                "internal_states": [{"avg_spec_accept_length": round(1 + self.accepted_tokens / steps, 4) if steps else None}]}

    # response pieces -----------------------------------------------------------------------------------
    def speculative(self, choices: list[Choice], g: Generation) -> dict:
        counts = [c.speculation for c in choices if c.speculation is not None]
        steps = sum(c.verify_steps for c in counts)
        accepted = sum(c.accepted_tokens for c in counts)
        algorithm = self.client.info.speculative_algorithm or None
        return {"algorithm": algorithm if g.speculative else None, "verify_steps": steps,
                "draft_tokens": sum(c.draft_tokens for c in counts), "accepted_tokens": accepted,
                "mean_accept_length": round(1 + accepted / steps, 4) if steps else None}

    def usage(self, choices: list[Choice], prompts: list[list[int]]) -> dict:
        completion = sum(c.tokens for c in choices)
        prompt = sum(len(p) for p in prompts)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
                "prompt_tokens_details": {"cached_tokens": max((c.cached_tokens for c in choices), default=0)}}

    def chat_logprobs(self, entries: list) -> dict:
        def item(token, lp):
            raw = self.codec.token_bytes(token)
            return {"token": raw.decode("utf-8", errors="replace"), "logprob": max(lp, -9999.0), "bytes": list(raw)}

        return {"content": [{**item(t, lp), "top_logprobs": [item(i, v) for i, v in top]} for t, lp, top, _ in entries],
                "refusal": None}

    def completion_logprobs(self, entries: list, base_offset: int = 0) -> dict:
        """Entries (token, logprob, top, text offset); an echoed prompt's first token has logprob and top None."""
        return {"tokens": [self.codec.token_text(t) for t, _, _, _ in entries],
                "token_logprobs": [None if lp is None else max(lp, -9999.0) for _, lp, _, _ in entries],
                "top_logprobs": [None if top is None else {self.codec.token_text(i): max(v, -9999.0) for i, v in top}
                                 for _, _, top, _ in entries],
                "text_offset": [base_offset + off for _, _, _, off in entries]}

    def echoed(self, choice: Choice) -> tuple[str, list]:
        """A completion's text and logprob entries with its echoed prompt before them (offsets shifted past it)."""
        if choice.echo is None:
            return choice.text, choice.logprobs
        shift = len(choice.echo)
        return choice.echo + choice.text, choice.prompt_logprobs + [(t, lp, top, off + shift)
                                                                      for t, lp, top, off in choice.logprobs]

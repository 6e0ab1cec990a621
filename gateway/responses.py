"""The answers of a completion request: assembled whole (chat.completion / text_completion) or streamed as
server-sent events (chat.completion.chunk / text_completion chunks), from the choices' deltas (generations.py)."""

from __future__ import annotations

import asyncio
import json
import logging
import time

from starlette.responses import StreamingResponse

from splitspec.gateway.client import StreamBroken
from splitspec.gateway.generations import Choice, Gateway, LatencyClock
from splitspec.gateway.protocol import Generation
from splitspec.protos import verifier_pb2 as pb

logger = logging.getLogger("splitspec.gateway")


DONE = b"data: [DONE]\n\n"  # a stream's last event


async def watch_disconnect(receive, task: asyncio.Task, gone: asyncio.Event, answered=lambda: False) -> None:
    """Wait for the client to leave (ASGI's http.disconnect); then, unless the answer was already complete (uvicorn's
    receive says disconnect after the last write too), mark it gone and cancel the task answering it."""
    while (await receive())["type"] != "http.disconnect":
        pass
    if not answered():
        gone.set()
        task.cancel()


class EventStream(StreamingResponse):
    """A streamed answer's server-sent events: Starlette's StreamingResponse without its task group per request (an
    anyio task group, two tasks and their cancel scopes, to hear a disconnect; uvicorn's send is silent once the
    client is gone). Here one plain task (watch_disconnect) cancels the writing task when the client leaves before the
    last event; the events' generator is closed either way, so its cleanup (the requests aborted) runs at once."""

    def __init__(self, events, headers: dict[str, str]):
        super().__init__(events, media_type="text/event-stream", headers=headers)

    async def __call__(self, scope, receive, send) -> None:
        task, gone, finished = asyncio.current_task(), asyncio.Event(), False
        watcher = asyncio.get_running_loop().create_task(watch_disconnect(receive, task, gone, lambda: finished))
        try:
            await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
            async for chunk in self.body_iterator:
                if finished:  # nothing follows [DONE] (the generator only ends after it)
                    continue
                body = chunk.encode(self.charset)
                finished = body.endswith(DONE)  # the last event ends the body in the same write
                await send({"type": "http.response.body", "body": body, "more_body": not finished})
            if not finished:
                finished = True
                await send({"type": "http.response.body", "body": b"", "more_body": False})
        except asyncio.CancelledError:
            if not gone.is_set():  # the server is shutting down: the cancellation is not ours to swallow
                raise
            task.uncancel()  # the client went away: an ordinary end, answered to no one
        finally:
            finished = True
            watcher.cancel()
            await self.body_iterator.aclose()


async def collect(gateway: Gateway, choices: list[Choice], arrival: float) -> None:
    """A whole (not streamed) request: every choice's deltas absorbed until each has finished."""
    clock = LatencyClock(gateway.metrics, arrival)
    for choice in choices:
        while choice.finish_reason is None:
            delta = await choice.queue.get()
            clock.delivered(delta)
            gateway.absorb(choice, delta)
    clock.done()


def whole_response(gateway: Gateway, g: Generation, prompts: list[list[int]], choices: list[Choice], rid: str, chat: bool) -> dict:
    body = {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": int(time.time()),
            "model": gateway.model_name, "choices": [], "usage": gateway.usage(choices, prompts),
            "speculative": gateway.speculative(choices, g)}
    for c in choices:
        finish = c.finish_reason if c.finish_reason in ("stop", "length") else "stop"
        if chat:
            message = {"role": "assistant", "content": c.text, "refusal": None}
            if c.tools is not None:  # the output parsed into tool calls (gateway/tools.py)
                message["content"], calls = c.tools.result(c.text)
                if calls:
                    message["tool_calls"] = calls
                finish = c.tools.finish_reason(finish, calls)
            body["choices"].append({"index": c.index, "message": message, "finish_reason": finish,
                                    "logprobs": gateway.chat_logprobs(c.logprobs) if g.logprobs else None})
        else:
            text, entries = gateway.echoed(c)
            body["choices"].append({"index": c.index, "text": text, "finish_reason": finish,
                                    "logprobs": gateway.completion_logprobs(entries) if g.logprobs else None})
    return body


class _Events:
    """One streamed answer's server-sent events: the chunks of its choices' pieces, as OpenAI streams them."""

    def __init__(self, gateway: Gateway, g: Generation, rid: str, chat: bool, usage=None):
        self.gateway, self.g, self.rid, self.chat = gateway, g, rid, chat
        self.usage = usage if g.continuous_usage else None  # () -> the usage so far, in every chunk (vLLM's)
        self.created = int(time.time())
        self.kind = "chat.completion.chunk" if chat else "text_completion"
        self.held: dict[int, list] = {}  # tool calls: logprob entries of text held back, sent with the next delta
        # every chunk's fields before its choices, encoded once per stream, not per delta; the chunks are the same bytes
        # as json.dumps of the whole body (no gain measurable above this CPU's noise: docs/performance.md, 2026-12-02)
        head = {"id": rid, "object": self.kind, "created": self.created, "model": gateway.model_name}
        self.head = "data: " + json.dumps(head, ensure_ascii=False)[:-1] + ', "choices": '
        self.usage_null = g.include_usage and chat  # chat chunks carry usage null until the last (completions: absent)

    def event(self, choice_body: dict | None, **extra) -> str:
        choices = "[]" if choice_body is None else "[" + json.dumps(choice_body, ensure_ascii=False) + "]"
        tail = ""
        if "usage" not in extra:  # the usage so far (continuous_usage_stats), or null before the usage chunk
            tail = ', "usage": ' + json.dumps(self.usage()) if self.usage is not None else \
                ', "usage": null' if self.usage_null else ""
        if extra:
            tail += ", " + json.dumps(extra, ensure_ascii=False)[1:-1]
        return self.head + choices + tail + "}\n\n"

    def _logprobs(self, entries: list, chat: bool):
        if not (self.g.logprobs and entries):
            return None
        return self.gateway.chat_logprobs(entries) if chat else self.gateway.completion_logprobs(entries)

    def piece(self, c: Choice, text: str, entries: list, finish: str | None) -> dict:
        if self.chat:
            return {"index": c.index, "delta": {"content": text} if text or finish is None else {},
                    "finish_reason": finish, "logprobs": self._logprobs(entries, True)}
        return {"index": c.index, "text": text, "finish_reason": finish, "logprobs": self._logprobs(entries, False)}

    def delta(self, c: Choice, delta: dict, entries: list, finish: str | None = None) -> dict:
        return {"index": c.index, "delta": delta, "finish_reason": finish, "logprobs": self._logprobs(entries, True)}

    def pieces(self, c: Choice, text: str, entries: list) -> list[dict]:
        """The chunk bodies a choice's new text makes; with tools, text held back where a call may begin and the
        calls as delta.tool_calls (gateway/tools.py)."""
        if c.tools is None:
            return [self.piece(c, text, entries, None)] if text or entries else []
        self.held[c.index] = self.held.get(c.index, []) + entries
        deltas = c.tools.feed(text) + (c.tools.finish() if c.finish_reason is not None else [])
        return [self.delta(c, d, self.held.pop(c.index, [])) for d in deltas]

    def finish(self, c: Choice) -> dict:
        reason = c.finish_reason if c.finish_reason in ("stop", "length") else "stop"
        if c.tools is None:
            return self.piece(c, "", [], reason)
        return self.delta(c, {}, self.held.pop(c.index, []), c.tools.finish_reason(reason, c.tools.calls))


def _deltas(choices: list[Choice]):
    """(next_delta, ready, pumps) of a streamed answer: the next (choice, delta) to absorb, whether one waits, and the
    tasks that merge several choices' queues into one in arrival order (none for one choice: its own queue)."""
    if len(choices) == 1:
        only = choices[0]

        async def next_delta():
            return only, await only.queue.get()

        return next_delta, lambda: not only.queue.empty(), []
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(c: Choice):
        while True:
            delta = await c.queue.get()
            await queue.put((c, delta))
            if isinstance(delta, StreamBroken) or delta.finish_reason != pb.FINISH_REASON_UNSPECIFIED:
                return

    pumps = [asyncio.get_running_loop().create_task(pump(c)) for c in choices]
    return queue.get, lambda: not queue.empty(), pumps


async def stream(gateway: Gateway, g: Generation, prompts: list[list[int]], choices: list[Choice], rid: str, chat: bool, arrival: float,
                 admitted: int):
    """The server-sent events of a streamed answer. What is ready goes out in one write: the events of every delta
    already delivered (a step's tokens, a finish, the usage and [DONE]) are joined and yielded once, before the
    stream waits for the next delta, so a request costs the event loop and the socket a write per step, not one
    per event."""
    events = _Events(gateway, g, rid, chat, lambda: gateway.usage(choices, prompts))
    next_delta, ready, pumps = _deltas(choices)
    clock, sent_done, ended = LatencyClock(gateway.metrics, arrival), False, None
    out: list[str] = []  # events not yet written
    try:
        if chat:
            for c in choices:
                out.append(events.event({"index": c.index, "delta": {"role": "assistant", "content": ""},
                                         "finish_reason": None, "logprobs": None}))
        open_choices = len(choices)
        while open_choices:
            if out and not ready():
                yield "".join(out)
                out.clear()
            c, delta = await next_delta()
            if c.finish_reason is not None:  # stopped by a stop string; later deltas are dropped
                continue
            before = len(c.logprobs)
            text = gateway.absorb(c, delta)
            if c.echo is not None and not c.echo_sent:  # the first delta: the prompt (and its logprobs) goes first
                c.echo_sent = True
                out.append(events.event(events.piece(c, c.echo, c.prompt_logprobs, None)))
            clock.delivered(delta)
            if c.error is not None:
                open_choices -= 1
                gateway.finished(c)
                gateway.abort_unfinished(choices, "error")
                out.append(f"data: {json.dumps(c.error.body())}\n\n")
                break
            out.extend(events.event(body) for body in events.pieces(c, text, c.logprobs[before:]))
            if c.finish_reason is not None:
                open_choices -= 1
                gateway.finished(c)
                out.append(events.event(events.finish(c), speculative=gateway.speculative([c], g)))
        else:
            clock.done()
            if g.include_usage:
                body = {"id": rid, "object": events.kind, "created": events.created, "model": gateway.model_name,
                        "choices": [], "usage": gateway.usage(choices, prompts)}
                out.append(f"data: {json.dumps(body)}\n\n")
        out.append(DONE.decode())
        yield "".join(out)
        sent_done = True
    except BaseException as exc:
        ended = exc
        raise
    finally:
        for task in pumps:
            task.cancel()
        if not sent_done:  # the client left (the response's task cancelled), or a failure: said, and aborted
            logger.info("stream %s ended before its last event (%s) after %s tokens: requests %s are aborted", rid,
                        type(ended).__name__ if ended is not None else "closed", [c.tokens for c in choices],
                        [c.request_id for c in choices])
            gateway.abort_unfinished(choices, "disconnect")
        failed = next((c.error for c in choices if c.error is not None), None)
        gateway.log_request("/v1/chat/completions" if chat else "/v1/completions", rid,
                            "200, streamed" + (f", ended by an error {failed.status} ({failed.message})" if failed else
                                               "" if sent_done else ", the client left"), g, prompts, choices, arrival)
        gateway.release(admitted)
        gateway.metrics.in_flight_served.dec()

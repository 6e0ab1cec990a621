"""The gateway's tokenizer front: requests rendered (chat template) and encoded in batches in a worker thread,
so that the event loop never runs the tokenizer."""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

from splitspec.gateway.protocol import invalid
from splitspec.gateway.text import TemplateError, TextCodec


def is_token_ids(job) -> bool:
    """A prompt given as token ids (a list of ints, or empty): it needs no tokenizer."""
    return isinstance(job, list) and (not job or isinstance(job[0], int))


class Tokenizing:
    """Requests are rendered and encoded in batches, in a worker thread (the event loop never runs the
    tokenizer): those that arrive in the same event-loop turn, and those that arrive while a batch is
    being encoded, go together in the next batch."""

    def __init__(self, codec: TextCodec, threads: int, batch_metric=None):
        self.codec = codec
        self.batch_metric = batch_metric
        self.executor = ThreadPoolExecutor(threads, thread_name_prefix="tokenize")
        self.pending: list[tuple[list[dict] | str, asyncio.Future]] = []
        self.busy = False
        self.scheduled = False

    async def encode(self, job: list[dict] | str, add_special_tokens: bool | None = None) -> list[int]:
        """/tokenize: one prompt (special tokens added by default) or chat (rendered; none added by default),
        alone in the worker thread."""
        def work() -> list[int]:
            try:
                text = job if isinstance(job, str) else self.codec.render_chat(job)
            except TemplateError as exc:
                return invalid("messages", str(exc))
            special = isinstance(job, str) if add_special_tokens is None else add_special_tokens
            try:
                return self.codec.encode_batch([text], add_special_tokens=special)[0]
            except Exception as exc:  # noqa: BLE001
                return invalid("prompt" if isinstance(job, str) else "messages", f"the text cannot be tokenized: {exc}")

        result = await asyncio.get_running_loop().run_in_executor(self.executor, work)
        if isinstance(result, BaseException):
            raise result
        return result

    async def decode(self, ids: list[int]) -> str:
        """/detokenize, in the worker thread (special tokens kept, as transformers' decode does)."""
        return await asyncio.get_running_loop().run_in_executor(
            self.executor, lambda: self.codec.decode(ids, skip_special_tokens=False))

    async def prompt_ids(self, job: list[dict] | str | list[int]) -> list[int]:
        """job: chat messages, a completion text, or token ids (returned as they are)."""
        if is_token_ids(job):
            return job
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self.pending.append((job, future))
        if not self.busy and not self.scheduled:
            self.scheduled = True
            loop.call_soon(self._flush)
        return await future

    def _flush(self) -> None:
        self.scheduled = False
        if not self.pending:
            return
        jobs, self.pending = self.pending, []
        self.busy = True
        if self.batch_metric is not None:
            self.batch_metric.observe(len(jobs))
        work = asyncio.get_running_loop().run_in_executor(self.executor, self._work, [job for job, _ in jobs])

        def resolve(done: asyncio.Future) -> None:
            results = done.result() if done.exception() is None else [done.exception()] * len(jobs)
            for (_, future), result in zip(jobs, results):
                if future.done():
                    continue
                if isinstance(result, BaseException):
                    future.set_exception(result)
                else:
                    future.set_result(result)
            self.busy = False
            self._flush()  # whatever arrived meanwhile

        work.add_done_callback(resolve)

    def _work(self, jobs: list[list[dict] | str]) -> list:
        texts, results = [], []
        for job in jobs:
            try:
                texts.append((job, True) if isinstance(job, str) else (self.codec.render_chat(job), False))
                results.append(None)
            except TemplateError as exc:
                texts.append(None)
                results.append(invalid("messages", str(exc)))
        for special in (False, True):
            index = [i for i, t in enumerate(texts) if t is not None and t[1] is special]
            if not index:
                continue
            try:
                encoded = self.codec.encode_batch([texts[i][0] for i in index], add_special_tokens=special)
            except Exception:  # noqa: BLE001 (one bad text fails the batch: encode one by one to find it)
                encoded = []
                for i in index:
                    try:
                        encoded.append(self.codec.encode_batch([texts[i][0]], add_special_tokens=special)[0])
                    except Exception as exc:  # noqa: BLE001
                        encoded.append(invalid("prompt" if isinstance(jobs[i], str) else "messages",
                                               f"the text cannot be tokenized: {exc}"))
            for i, ids in zip(index, encoded):
                results[i] = ids
        return results

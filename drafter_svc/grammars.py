"""A drafter process's view of its constrained requests' grammars (structured outputs): the verifier opens a
request with its grammar (kind and text) and its prompt's length (step.proto's OpenRequest); this process
compiles the grammar against the target's tokenizer (runtime/grammar.py's Compiler, off this thread, once per
distinct grammar), keeps a matcher per request and advances it by every output token the request's asks bring,
so that at each draft it stands where the verifier's matcher stands: after the tree's root. Its guide
(runtime/grammar_guide.GrammarGuide) then keeps the request's tree to what the grammar allows, as a drafter in
the verifier's process is kept (grammar_guide.draft_to_grammar).

Nothing here can change an output: the verifier prunes and masks every tree to the grammar itself. A grammar
that does not compile here, a matcher that refuses a token (this process's tokenizer is not the verifier's), or
a grammar still compiling leaves that request drafted unguided for the moment, logged once.

    open(r, tokens, ("json_schema", s), prompt_tokens=12)   compile (async); the output tokens so far wait
    extend(r, new tokens)                                    the matcher takes them (after the compile)
    guide(r)                                                 a GrammarGuide, or None (no grammar, not ready, broken)
"""

from __future__ import annotations

import logging
from concurrent.futures import Future
from dataclasses import dataclass, field

from splitspec.runtime.grammar_guide import GrammarGuide

logger = logging.getLogger("splitspec.drafter")


@dataclass
class _Tracked:
    compiled: Future
    backlog: list[int] = field(default_factory=list)  # output tokens taken before the matcher existed
    skip: int = 0  # prompt tokens still to come in extends (a drafter of hidden states is opened with one token)
    matcher: object = None
    broken: bool = False


class RequestGrammars:
    def __init__(self, compiler, vocab_size: int, metrics=None):
        """compiler: a runtime.grammar.Compiler over the target's tokenizer; None: no grammars here (every request
        drafts unguided). metrics: DrafterMetrics (compiles counted) or None."""
        self.compiler, self.vocab_size, self.metrics = compiler, vocab_size, metrics
        self.tracked: dict[str, _Tracked] = {}
        self.warned_no_compiler = False

    @classmethod
    def for_model(cls, model_path: str, revision: str | None, metrics=None) -> RequestGrammars:
        """The target's grammars: compiled over its tokenizer, vocabulary and stop tokens, as the verifier compiles
        them (nothing loads until a constrained request comes)."""
        from splitspec.runtime.config import ModelConfig, eos_token_ids
        from splitspec.runtime.grammar import Compiler
        from splitspec.runtime.hub import resolve_model_dir

        model_dir = resolve_model_dir(model_path, revision)
        config = ModelConfig.from_dir(model_dir)
        eos = eos_token_ids(model_dir, config.eos_token_ids, None)
        return cls(Compiler.for_model(str(model_dir), config.vocab_size, eos), config.vocab_size, metrics)

    def open(self, request_id: str, token_ids: list[int], grammar: tuple[str, str] | None, prompt_tokens: int) -> None:
        self.tracked.pop(request_id, None)
        if grammar is None:
            return
        if self.compiler is None:
            if not self.warned_no_compiler:
                logger.warning("constrained requests draft without their grammars here: this drafter has no "
                               "tokenizer for them (start it with the target's --model-path)")
                self.warned_no_compiler = True
            return
        tracked = _Tracked(self.compiler.compile(grammar))
        if self.metrics is not None:
            tracked.compiled.add_done_callback(self._count)
        tracked.backlog = list(token_ids[prompt_tokens:])
        tracked.skip = max(0, prompt_tokens - len(token_ids))
        self.tracked[request_id] = tracked

    def extend(self, request_id: str, tokens: list[int]) -> None:
        tracked = self.tracked.get(request_id)
        if tracked is None or tracked.broken:
            return
        if tracked.skip:
            skipped = min(tracked.skip, len(tokens))
            tracked.skip -= skipped
            tokens = tokens[skipped:]
        if tracked.matcher is None:
            tracked.backlog.extend(tokens)
            return
        self._accept(request_id, tracked, tokens)

    def constrained(self, request_id: str) -> bool:
        """Whether the request has a grammar this process tracks (guided or not yet)."""
        return request_id in self.tracked

    def _count(self, compiled: Future) -> None:  # on the compile's thread
        self.metrics.grammar_compiles.labels(outcome="ok" if compiled.exception() is None else "error").inc()

    def guide(self, request_id: str) -> GrammarGuide | None:
        matcher = self._matcher(request_id)
        return None if matcher is None else GrammarGuide(matcher, self.vocab_size)

    def guided(self, request_id: str) -> bool:
        """Whether the request drafts to its grammar now (guide() would give one)."""
        return self._matcher(request_id) is not None

    def _matcher(self, request_id: str):
        """The request's matcher where it stands now, or None (no grammar, still compiling, broken, complete)."""
        tracked = self.tracked.get(request_id)
        if tracked is None or tracked.broken:
            return None
        if tracked.matcher is None:
            if not tracked.compiled.done():
                return None  # still compiling: this step drafts unguided
            try:
                tracked.matcher = self.compiler.matcher(tracked.compiled.result())
            except Exception as exc:  # noqa: BLE001 (the verifier refuses such a request itself)
                logger.warning("%s: its grammar does not compile here (%s); drafting it unguided", request_id, exc)
                tracked.broken = True
                return None
            backlog, tracked.backlog = tracked.backlog, []
            if not self._accept(request_id, tracked, backlog):
                return None
        return None if tracked.matcher.is_terminated() else tracked.matcher

    def release(self, request_id: str) -> None:
        self.tracked.pop(request_id, None)

    def clear(self) -> None:
        self.tracked.clear()

    @staticmethod
    def _accept(request_id: str, tracked: _Tracked, tokens: list[int]) -> bool:
        for token in tokens:
            if tracked.matcher.is_terminated():  # complete: the request ends with this step (no guide from now on)
                return True
            if not tracked.matcher.accept_token(token):
                logger.warning("%s: its grammar refuses output token %d here; drafting it unguided", request_id, token)
                tracked.broken = True
                return False
        return True

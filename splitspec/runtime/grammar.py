"""Structured outputs through xgrammar (the grammar engine vLLM and SGLang use): a request's grammar is
(kind, text), kind one of sampling_params.GRAMMAR_KINDS:

    json_object   any JSON object (OpenAI's response_format {"type": "json_object"}); text empty
    json_schema   a JSON Schema document (response_format {"type": "json_schema"}, SGLang's json_schema)
    regex         a regular expression (SGLang's regex)
    ebnf          a grammar in xgrammar's EBNF (GBNF; SGLang's ebnf), its start rule `root`

check() parses a grammar without a tokenizer and says what is wrong with it; Compiler checks and compiles it
against the target's vocabulary on a worker thread (xgrammar caches each distinct grammar), its failure phrased
"grammar: ..." (the verifier ends the request with INVALID_ARGUMENT, the gateway answers a 400 naming the field),
and the engine's GrammarMasks (verifier_svc/grammar_masks.py) constrain the target's logits with it. JSON is generated in one line with ", " and ": " between its tokens (vLLM's and
SGLang's disable-any-whitespace mode): a model that may put whitespace anywhere can spend its whole output on
it, as the demo target does, and the text is the same JSON either way.
"""

from __future__ import annotations

import json
import re
from concurrent.futures import Future, ThreadPoolExecutor

_LOCATION = re.compile(r"^\[[0-9:]+\] \S+:\d+: ")  # xgrammar's "[12:00:00] /path/file.cc:83: " prefix


def xgrammar_module():
    """xgrammar, imported on first use (it imports torch); a clear error where it is missing."""
    try:
        import xgrammar
    except ImportError as exc:  # pragma: no cover - a dependency of the package
        raise RuntimeError("structured outputs need xgrammar (pip install xgrammar)") from exc
    return xgrammar


def _message(exc: Exception) -> str:
    return _LOCATION.sub("", str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__)


def check(kind: str, text: str) -> None:
    """Raises ValueError saying what is wrong with a grammar (parsed, not compiled: no tokenizer needed)."""
    xgr = xgrammar_module()
    if kind == "json_object":
        return
    if not text:
        raise ValueError(f"the {kind} grammar is empty")
    try:
        if kind == "json_schema":
            schema = json.loads(text)
            if not isinstance(schema, (dict, bool)):
                raise ValueError("a JSON schema must be an object or a boolean")
            xgr.Grammar.from_json_schema(text)
        elif kind == "regex":
            xgr.Grammar.from_regex(text)
        elif kind == "ebnf":
            xgr.Grammar.from_ebnf(text)
        else:
            raise ValueError(f"unknown grammar kind {kind!r}")
    except json.JSONDecodeError as exc:
        raise ValueError(f"the JSON schema is not JSON: {exc}") from None
    except (RuntimeError, ValueError, TypeError) as exc:  # xgrammar raises RuntimeError with its parser's message
        raise ValueError(f"invalid {kind.replace('_', ' ')}: {_message(exc)}") from None


class Compiler:
    """Compiles grammars against a tokenizer's vocabulary, off the caller's thread: compile() returns a Future
    of xgrammar's CompiledGrammar (its own cache makes a repeated grammar a lookup). Nothing is loaded until the
    first grammar comes: xgrammar and the tokenizer are imported and built on the grammar thread then, so a
    server that never sees one never pays for them (seconds of CPU at every start)."""

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids, threads: int = 2):
        """tokenizer: a Hugging Face tokenizer, or the path to load one from (on first use)."""
        self.tokenizer, self.vocab_size, self.stop_token_ids, self.threads = tokenizer, vocab_size, sorted(stop_token_ids), threads
        self.compiler = None
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar")

    @classmethod
    def for_model(cls, tokenizer_path: str, vocab_size: int, stop_token_ids) -> "Compiler":
        return cls(tokenizer_path, vocab_size, stop_token_ids)

    def _ready(self):
        if self.compiler is None:  # on the grammar thread
            xgr = xgrammar_module()
            tokenizer = self.tokenizer
            try:
                if isinstance(tokenizer, str):
                    from transformers import AutoTokenizer

                    tokenizer = AutoTokenizer.from_pretrained(tokenizer)
                info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=self.vocab_size,
                                                          stop_token_ids=self.stop_token_ids)
            except Exception as exc:  # noqa: BLE001 - a model without a usable tokenizer: no structured outputs
                raise RuntimeError(f"structured outputs are unavailable: no tokenizer for the grammar engine ({exc})") from None
            self.compiler = xgr.GrammarCompiler(info, max_threads=self.threads)
        return self.compiler

    def compile(self, grammar: tuple[str, str]) -> Future:
        """A Future of the compiled grammar; one that does not compile fails with ValueError("grammar: ...")."""
        return self.pool.submit(self._checked, *grammar)

    def _checked(self, kind: str, text: str):
        try:
            check(kind, text)
            return self._compile(kind, text)
        except (ValueError, RuntimeError) as exc:
            raise ValueError(f"grammar: {_message(exc)}") from None

    def _compile(self, kind: str, text: str):
        compiler = self._ready()
        if kind == "json_object":  # a JSON object (OpenAI's JSON mode), any properties
            return compiler.compile_json_schema('{"type": "object"}', strict_mode=False, any_whitespace=False)
        if kind == "json_schema":  # properties and items the schema does not name are not generated (vLLM's default)
            return compiler.compile_json_schema(text, strict_mode=True, any_whitespace=False)
        if kind == "regex":
            return compiler.compile_regex(text)
        return compiler.compile_grammar(text)

    def matcher(self, compiled):
        return xgrammar_module().GrammarMatcher(compiled)

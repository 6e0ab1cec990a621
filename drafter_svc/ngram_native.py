"""NGRAM's trie in C (ngram_trie.c), built once with the system's C compiler and loaded through ctypes.

The Python trie in ngram.py is its twin (same trees, node for node; tests/test_ngram.py holds them to it) and
the fallback where no compiler is found. $SPLITSPEC_NGRAM_TRIE picks: `auto` (the default: C when it builds,
else Python, said once in the log), `native` (C or an error), `python`. The library is cached under
$SPLITSPEC_CACHE_DIR (default ~/.cache/splitspec)/native, keyed by the source's hash; a build takes ~1 s.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import itertools
import logging
import os
import platform
import shutil
import subprocess
import threading
from pathlib import Path

from splitspec.runtime.tree import DraftTree

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("ngram_trie.c")
BACKEND_ENV = "SPLITSPEC_NGRAM_TRIE"
BACKENDS = ("auto", "native", "python")


def cache_dir() -> Path:
    return Path(os.environ.get("SPLITSPEC_CACHE_DIR") or Path.home() / ".cache" / "splitspec") / "native"


def backend() -> str:
    choice = os.environ.get(BACKEND_ENV, "auto").strip().lower() or "auto"
    if choice not in BACKENDS:
        raise ValueError(f"${BACKEND_ENV} must be one of {BACKENDS}, got {choice!r}")
    return choice


def _build(target: Path) -> None:
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if not compiler:
        raise RuntimeError("no C compiler found ($CC, cc, gcc or clang)")
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_name(f"{target.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    done = subprocess.run([compiler, "-O2", "-shared", "-fPIC", "-o", str(partial), str(SOURCE)],
                          capture_output=True, text=True, timeout=300)
    if done.returncode:
        partial.unlink(missing_ok=True)
        raise RuntimeError(f"{compiler} failed on {SOURCE.name}: {done.stderr.strip()[-2000:]}")
    os.replace(partial, target)  # atomic: processes building at once each write their own file


@functools.cache
def library() -> ctypes.CDLL:
    """The built library (built first if this source's build is not cached); raises when it cannot be."""
    digest = hashlib.sha256(SOURCE.read_bytes()).hexdigest()[:16]
    target = cache_dir() / f"ngram_trie_{digest}_{platform.machine()}.so"
    if not target.exists():
        logger.info("building the NGRAM trie's C library into %s", target)
        _build(target)
    lib = ctypes.CDLL(str(target))  # ctypes releases the GIL during each call
    i32p, i64 = ctypes.POINTER(ctypes.c_int32), ctypes.c_int64
    lib.ngram_trie_new.restype = ctypes.c_void_p
    lib.ngram_trie_new.argtypes = [ctypes.c_int] * 6 + [i64]
    lib.ngram_trie_free.argtypes = [ctypes.c_void_p]
    lib.ngram_trie_num_nodes.restype = i64
    lib.ngram_trie_num_nodes.argtypes = [ctypes.c_void_p]
    lib.ngram_trie_insert.restype = ctypes.c_int
    lib.ngram_trie_insert.argtypes = [ctypes.c_void_p, i32p, i32p, ctypes.c_int32]
    lib.ngram_trie_draft.restype = ctypes.c_int32
    lib.ngram_trie_draft.argtypes = [ctypes.c_void_p, i32p, ctypes.c_int32, ctypes.c_int32, i32p, i32p]
    lib.ngram_trie_draft_batch.restype = ctypes.c_int32
    lib.ngram_trie_draft_batch.argtypes = [ctypes.c_void_p, i32p, i32p, ctypes.c_int32, i32p, i32p, i32p, i32p]
    return lib


@functools.cache
def native_available() -> bool:
    """Whether the C trie is to be used ($SPLITSPEC_NGRAM_TRIE, and for auto whether it builds)."""
    choice = backend()
    if choice == "python":
        return False
    try:
        library()
    except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
        if choice == "native":
            raise RuntimeError(f"${BACKEND_ENV}=native but the NGRAM trie's C library is unavailable: {exc}") from exc
        logger.warning("NGRAM uses its Python trie (slower: ~0.2 ms of host time per request per step): %s", exc)
        return False
    return True


class NativeNgramTrie:
    """NgramTrie's interface over the C trie. One lock per trie: the library runs without the GIL."""

    def __init__(self, config):
        self.config = config
        self._lib = library()
        handle = self._lib.ngram_trie_new(config.min_match_window_size, config.max_match_window_size,
                                          config.min_bfs_breadth, config.max_bfs_breadth,
                                          int(config.match_type == "PROB"), config.branch_length, config.capacity)
        if not handle:
            raise MemoryError("the NGRAM trie could not be allocated")
        self._handle = handle
        self._lock = threading.Lock()
        self._out_size = 0
        self._out_tokens = self._out_parents = None

    def __del__(self):
        handle, self._handle = getattr(self, "_handle", None), None
        if handle:
            self._lib.ngram_trie_free(handle)

    @property
    def num_nodes(self) -> int:
        with self._lock:
            return self._lib.ngram_trie_num_nodes(self._handle)

    def insert_window(self, window: list[int]) -> None:
        self.insert_windows([window])

    def insert_windows(self, windows: list[list[int]]) -> None:
        """Insert windows in order, in one call."""
        if not windows:
            return
        flat = [token for window in windows for token in window]
        tokens = (ctypes.c_int32 * max(len(flat), 1))(*flat)
        lengths = (ctypes.c_int32 * len(windows))(*map(len, windows))
        with self._lock:
            status = self._lib.ngram_trie_insert(self._handle, tokens, lengths, len(windows))
        if status:
            raise MemoryError("the NGRAM trie ran out of memory while inserting")

    def draft_batch(self, contexts: list[list[int]], max_nodes: list[int]) -> list[DraftTree | None]:
        """draft() of each context, in one call into the library: the FFI crossed once a step, not once a request
        (16 trees: ~145 against ~195 us on a 2-core CPU, benchmarks/ngram_draft_cost.py)."""
        window = max(self.config.max_match_window_size, 1)
        cut = [context[-window:] for context in contexts]
        budgets = [budget if budget >= 2 else 0 for budget in max_nodes]  # 0: no tree asked (count 0)
        flat = [token for context in cut for token in context]
        starts = list(itertools.accumulate(map(len, cut), initial=0))
        offsets = list(itertools.accumulate(budgets, initial=0))
        n, size = len(cut), max(offsets[-1], 1)
        tokens, parents, counts = (ctypes.c_int32 * size)(), (ctypes.c_int32 * size)(), (ctypes.c_int32 * max(n, 1))()
        with self._lock:
            status = self._lib.ngram_trie_draft_batch(self._handle, (ctypes.c_int32 * max(len(flat), 1))(*flat),
                                                      (ctypes.c_int32 * (n + 1))(*starts), n,
                                                      (ctypes.c_int32 * (n + 1))(*offsets), tokens, parents, counts)
        if status:
            raise MemoryError("the NGRAM trie ran out of memory while drafting")
        trees = []
        for i in range(n):
            count, start = counts[i], offsets[i]
            trees.append(DraftTree(tuple(tokens[start : start + count]), tuple(parents[start : start + count]))
                         if count >= 2 else None)
        return trees

    def draft(self, context: list[int], max_nodes: int) -> DraftTree | None:
        """The tree for a context (root = its last token), or None when the trie suggests nothing."""
        if not context or max_nodes < 2:
            return None
        context = context[-max(self.config.max_match_window_size, 1):]
        tokens = (ctypes.c_int32 * len(context))(*context)
        with self._lock:
            if max_nodes > self._out_size:
                self._out_size = max_nodes
                self._out_tokens = (ctypes.c_int32 * max_nodes)()
                self._out_parents = (ctypes.c_int32 * max_nodes)()
            count = self._lib.ngram_trie_draft(self._handle, tokens, len(context), max_nodes, self._out_tokens,
                                               self._out_parents)
            if count < 0:
                raise MemoryError("the NGRAM trie ran out of memory while drafting")
            if count < 2:
                return None
            return DraftTree(tuple(self._out_tokens[:count]), tuple(self._out_parents[:count]))

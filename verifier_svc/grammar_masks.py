"""Structured outputs in the step (runtime/grammar.py compiles the grammars): for every request with a grammar,
its tree is pruned to the nodes its grammar allows (a drafted token the grammar forbids can never be accepted,
so it and its subtree are dropped before they cost verification), and every logits row it verifies is masked
to the tokens the grammar allows after the path to that node (xgrammar's matcher walks the tree, advancing
and rolling back along each path). Acceptance then runs on the masked logits exactly as plain constrained
decoding samples from them, so speculation stays lossless; the request's matcher is advanced by the tokens
it emits (Request.emit).

    tree  n0 -{"}-> n1 -{a}-> n2        grammar after n0 allows {"}, after n1 {a, b}
             -{x}-> n3                  x is not allowed after n0: n3 pruned; rows n0, n1, n2 masked
"""

from __future__ import annotations

from concurrent.futures import Future

import torch

from splitspec.runtime.grammar import xgrammar_module
from splitspec.runtime.grammar_guide import GrammarGuide, grammar_rows, subtree
from splitspec.verifier_svc.step_types import Chunk, Request


class GrammarMasks:
    """One step's masks: (sequence index in the forward, first logits row offset, bitmask rows)."""

    def __init__(self, vocab_size: int):
        self.xgr = xgrammar_module()
        self.vocab_size = vocab_size
        self.entries: list[tuple[int, int, torch.Tensor]] = []
        self.pruned_nodes = 0

    @classmethod
    def build(cls, prefills: list[Chunk], verifies: list, vocab_size: int) -> "GrammarMasks | None":
        """None when no request of the step has a grammar. Prunes the constrained requests' trees in place."""
        constrained = [(i, c.request) for i, c in enumerate(prefills) if c.samples and _live(c.request)]
        constrained += [(len(prefills) + j, v) for j, v in enumerate(verifies) if _live(v.request)]
        if not constrained:
            return None
        masks = cls(vocab_size)
        for index, item in constrained:
            if isinstance(item, Request):  # a prompt's last row: its first output token
                rows = masks._rows(1)
                item.matcher.fill_next_token_bitmask(rows, 0)
                masks.entries.append((index, -1, rows))
            else:
                masks.entries.append((index, 0, masks._tree(item)))
        return masks

    def _rows(self, n: int) -> torch.Tensor:
        return self.xgr.allocate_token_bitmask(n, self.vocab_size)

    def _tree(self, verify) -> torch.Tensor:
        """The bitmask of every node of the request's tree, after pruning it to what the grammar allows."""
        rows, keep = grammar_rows(verify.tree, verify.request.matcher, self._rows(verify.tree.num_nodes))
        if len(keep) < verify.tree.num_nodes:
            self.pruned_nodes += verify.tree.num_nodes - len(keep)
            verify.tree = subtree(verify.tree, keep)
            rows = rows[keep]
        return rows

    def apply(self, logits: torch.Tensor, cu_logits: list[int]) -> None:
        """Mask the constrained rows of the forward's logits [rows, V] in place (-inf where not allowed)."""
        indices, parts = [], []
        for index, offset, rows in self.entries:
            first = cu_logits[index + 1] - 1 if offset < 0 else cu_logits[index]
            indices += range(first, first + rows.shape[0])
            parts.append(rows)
        full = self._rows(logits.shape[0])
        full[indices] = torch.cat(parts)
        self.xgr.apply_token_bitmask_inplace(logits, full.to(logits.device, non_blocking=True),
                                             vocab_size=min(self.vocab_size, logits.shape[-1]), indices=indices)


def draft_guide(request: Request, vocab_size: int) -> GrammarGuide | None:
    """The guide of a request whose output a grammar constrains (and is not yet complete); None otherwise."""
    return GrammarGuide(request.matcher, vocab_size) if _live(request) else None


def _live(request: Request) -> bool:
    return request.matcher is not None and not request.matcher.is_terminated()


def no_grammars() -> Future:
    """The compile of a request with a grammar on an engine without a grammar compiler: failed."""
    future = Future()
    future.set_exception(RuntimeError("this server has no grammar engine (xgrammar) for structured outputs"))
    return future

"""The head's catch-up queued behind the verification, before its acceptance reaches the host.

A drafted step of a model drafter in the verifier's process ran, one after another: the verification, the host
waiting for the target's tokens and walking the trees, the head's catch-up on the accepted rows (built on the host,
then queued), the draft loop. For top-1 chains verified by the target's own tokens (greedy, or keyed sampling) the
catch-up needs no acceptance: row j of a chain pairs the target's token at row j with that row's state, and for every
row up to the bonus token that is exactly what the accepted path sends (an accepted draft equals the target's token
there; the bonus token is the target's). So a step whose every request verifies such a chain queues, right behind
the verification, the target's tokens (one kernel) and their copy to the host, then the head's catch-up on all n rows
of every chain, with each root picked on the device at its chain's accepted row (drafts matching the target's tokens,
counted there). The host waits for the tokens only: it walks the trees while the device catches up, and the draft
loop is launched from roots already there. The rows past a chain's accepted one hold keys past the head's length,
overwritten by its next catch-up (drafter_svc.eagle: catch_up_ahead, keep_ahead).

    before  device  verify ......|          | catch-up |       | draft loop ...
            host        wait ....| accept   | build    | launch ...
    ahead   device  verify ......| catch-up | draft loop ...
            host        wait ....| accept, launch ...

SPLITSPEC_CATCH_UP_AHEAD=0 turns it off (every step as before: measured against it).
"""

from __future__ import annotations

import os

import torch

from splitspec import kernels
from splitspec.runtime.batch import device_tensor
from splitspec.runtime.host_tensors import copy_to_host
from splitspec.verifier_svc.step_types import SpecConfig
from splitspec.verifier_svc.verification import Verify, by_target, target_row_ids

ENV = "SPLITSPEC_CATCH_UP_AHEAD"


def enabled() -> bool:
    return os.environ.get(ENV, "1") != "0"


class CatchUpAhead:
    """One step's catch-up ahead: its verifies (every one a chain of n nodes) and, once launched, the target's tokens
    on their way to the host and whether the drafter queued the catch-up (caught_up: its requests' ids)."""

    __slots__ = ("verifies", "nodes", "_host", "_event", "caught_up", "upper", "verified", "roots", "lengths_after")

    def __init__(self, verifies: list[Verify], nodes: int, upper: list[int] | None = None,
                 verified: torch.Tensor | None = None):
        """upper, verified: a device-fed step's (verifier_svc.device_fed): each chain built at its upper length, its
        verified length on the device only."""
        self.verifies, self.nodes = verifies, nodes
        self.upper, self.verified = upper, verified
        self._host: torch.Tensor | None = None
        self._event = None
        self.caught_up: frozenset[str] = frozenset()
        # once caught up, on the device: each chain's bonus token (the next root) and its length after acceptance
        self.roots: torch.Tensor | None = None
        self.lengths_after: torch.Tensor | None = None

    @classmethod
    def plan(cls, spec: SpecConfig, drafter, prefills: list, verifies: list[Verify], chains: list,
             masks) -> "CatchUpAhead | None":
        """The step's plan where its every request verifies a chain still on the device (a top-1 draft) of one length,
        by the target's own tokens, with nothing unsent to its drafter, and that drafter can catch up ahead; else None."""
        if prefills or masks is not None or not chains or len(chains) != len(verifies) or drafter is None \
                or not drafter.catches_up_ahead or not enabled():
            return None
        nodes = verifies[0].tree.num_nodes
        if nodes < 2 or any(v.tree.num_nodes != nodes or v.request.unsent or not by_target(spec, v.request.params)
                            for v in verifies):
            return None
        return cls(verifies, nodes)

    def launch(self, spec: SpecConfig, drafter, batch, logits: torch.Tensor, features: torch.Tensor) -> None:
        """Queued behind the verification: the target's tokens and their copy to the host, then the drafter's
        catch-up on every chain row with each chain's acceptance counted on the device (kernels.chain_acceptance)."""
        ids = target_row_ids(spec, logits, batch.cu_logits, [], self.verifies)
        self._host, self._event = copy_to_host(ids)
        count, n = len(self.verifies), self.nodes
        q = ids.shape[0] // count  # rows a request (a chain padded to a captured graph's shape: its first n)
        if q * count != ids.shape[0] or batch.input_ids.shape[0] != ids.shape[0] or features is None:
            return
        tokens = ids.view(count, q)[:, :n]
        lengths = [v.seq_len for v in self.verifies] if self.upper is None else self.upper
        verified = device_tensor(lengths, ids.device) if self.verified is None else self.verified
        # each chain's leading drafts equal to the target's, its accepted row and its length after, in one kernel
        acceptance = kernels.chain_acceptance(ids, batch.input_ids, verified, n)
        states = features.view(count, q, -1)[:, :n].reshape(count * n, -1)
        request_ids = [v.request.request_id for v in self.verifies]
        if drafter.catch_up_ahead(request_ids, lengths, tokens, states, acceptance, verified=self.verified):
            self.caught_up = frozenset(request_ids)
            self.roots, self.lengths_after = tokens.reshape(-1).index_select(0, acceptance[1]), acceptance[2]

    def wait(self) -> None:
        """Until the target's tokens are on the host (the verification done; not the catch-up queued after it)."""
        if self._event is not None:
            self._event.synchronize()

    def targets(self) -> list[int]:
        self.wait()
        return self._host.tolist()

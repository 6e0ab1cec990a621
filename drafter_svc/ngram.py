"""NGRAM drafting with SGLang's semantics (REFERENCES §5.3): one trie of recent token paths shared by
all requests; the longest suffixes of a request's context that the trie knows anchor a tree.

    insert   after each verify, the request's last branch_length tokens (prompt + output) are a window; every
             start i (i + min_window < len) adds the path window[i : i+branch_length]; each node on it gets
             freq += 1 and becomes the most recent child of its parent. The rest of a prompt is not inserted
    match    for w = min(len, max_window) .. min_window, walk the last w context tokens: anchors, longest first
    BFS      per anchor, breadth (max_window - w) * scale + min_bfs with scale = (max_bfs - min_bfs) /
             (max_window - min_window + 1): a longer match gives a narrower tree; take the first
             max(1, int(breadth)) children in recency order, breadth shrinking by scale per level
    PROB     a max-heap over path probability, child p = freq / sum(freq of the parent's top max_bfs
             children) x the parent's path probability
Trees from all anchors merge (one node per (parent, token)) until the budget is filled. The root is
the request's last token.

The trie used is the C one (ngram_native.py, ngram_trie.c) wherever it builds; the Python one here is its twin,
tree for tree, and the fallback ($SPLITSPEC_NGRAM_TRIE).
"""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass

from splitspec.drafter_svc import ngram_native
from splitspec.drafter_svc.base import Bet, Drafter
from splitspec.runtime.tree import DraftTree, leaf_outcomes

MATCH_TYPES = ("BFS", "PROB")


@dataclass(frozen=True)
class NgramConfig:
    """SGLang's --speculative-ngram-* settings and their defaults."""

    min_match_window_size: int = 1
    max_match_window_size: int = 12
    min_bfs_breadth: int = 1
    max_bfs_breadth: int = 10
    match_type: str = "BFS"
    branch_length: int = 18
    capacity: int = 10_000_000

    def __post_init__(self) -> None:
        if self.match_type not in MATCH_TYPES:
            raise ValueError(f"--speculative-ngram-match-type must be one of {MATCH_TYPES}, got {self.match_type!r}")
        if not 1 <= self.min_match_window_size <= self.max_match_window_size:
            raise ValueError("need 1 <= --speculative-ngram-min-match-window-size <= --speculative-ngram-max-match-window-size")
        if not 1 <= self.min_bfs_breadth <= self.max_bfs_breadth:
            raise ValueError("need 1 <= --speculative-ngram-min-bfs-breadth <= --speculative-ngram-max-bfs-breadth")


class TrieNode:
    __slots__ = ("children", "freq", "stamp", "parent", "token")

    def __init__(self, parent: "TrieNode | None" = None, token: int = -1):
        self.children: dict[int, TrieNode] = {}
        self.freq = 0
        self.stamp = 0
        self.parent, self.token = parent, token

    def by_recency(self) -> list["TrieNode"]:
        return sorted(self.children.values(), key=lambda n: -n.stamp)

    def by_frequency(self) -> list["TrieNode"]:
        return sorted(self.children.values(), key=lambda n: (-n.freq, n.token))  # SGLang: ties by token id


class NgramTrie:
    """The shared cache: token paths with frequencies and recency, evicting least recent leaves."""

    def __init__(self, config: NgramConfig):
        self.config = config
        self.root = TrieNode()
        self.num_nodes = 0
        self._stamp = 0  # the recency clock: every node update takes the next tick

    def insert_window(self, window: list[int]) -> None:
        root, length, stamp, added = self.root, self.config.branch_length, self._stamp, 0
        for start in range(len(window) - self.config.min_match_window_size):
            node = root
            for token in window[start : start + length]:
                children = node.children
                child = children.get(token)
                if child is None:
                    child = children[token] = TrieNode(node, token)
                    added += 1
                child.freq += 1
                stamp += 1
                child.stamp = stamp
                node = child
        self._stamp = stamp
        self.num_nodes += added
        if self.num_nodes > self.config.capacity:
            self._evict(self.num_nodes - self.config.capacity)

    def insert_windows(self, windows: list[list[int]]) -> None:
        for window in windows:
            self.insert_window(window)

    def draft(self, context: list[int], max_nodes: int) -> DraftTree | None:
        """The tree for a context (root = its last token), or None when the trie suggests nothing."""
        builder = TreeBuilder(context[-1], max_nodes)
        if max_nodes > 1:
            build = build_bfs if self.config.match_type == "BFS" else build_prob
            build(self.anchors(context), builder, self.config)
        return builder.tree()

    def draft_batch(self, contexts: list[list[int]], max_nodes: list[int]) -> list[DraftTree | None]:
        """draft() of each context (the C trie's in one call)."""
        return [self.draft(context, budget) for context, budget in zip(contexts, max_nodes)]

    def _evict(self, count: int) -> None:
        """Drop the `count` least recently used leaves (repeatedly, as parents become leaves)."""
        while count > 0:
            leaves = sorted(self._leaves(), key=lambda n: n.stamp)[:count]
            for leaf in leaves:
                del leaf.parent.children[leaf.token]
            self.num_nodes -= len(leaves)
            count -= len(leaves)

    def _leaves(self):
        stack = [self.root]
        while stack:
            node = stack.pop()
            if not node.children and node is not self.root:
                yield node
            stack.extend(node.children.values())

    def anchors(self, context: list[int]) -> list[tuple[TrieNode, int]]:
        """(trie node reached by the last w context tokens, w), longest w first."""
        found = []
        for w in range(min(len(context), self.config.max_match_window_size), self.config.min_match_window_size - 1, -1):
            node = self.root
            for token in context[-w:]:
                node = node.children.get(token)
                if node is None:
                    break
            if node is not None and node.children:
                found.append((node, w))
        return found


class TreeBuilder:
    """Merges drafts from several anchors into one tree, one node per (parent, token)."""

    def __init__(self, root_token: int, max_nodes: int):
        self.tokens, self.parents = [root_token], [-1]
        self.index: dict[tuple[int, int], int] = {}
        self.max_nodes = max_nodes

    @property
    def full(self) -> bool:
        return len(self.tokens) >= self.max_nodes

    def add(self, parent: int, token: int) -> int:
        key = (parent, token)
        if key not in self.index:
            self.index[key] = len(self.tokens)
            self.tokens.append(token)
            self.parents.append(parent)
        return self.index[key]

    def tree(self) -> DraftTree | None:
        return DraftTree(tuple(self.tokens), tuple(self.parents)) if len(self.tokens) > 1 else None


def build_bfs(anchors: list[tuple[TrieNode, int]], builder: TreeBuilder, config: NgramConfig) -> None:
    scale = (config.max_bfs_breadth - config.min_bfs_breadth) / (config.max_match_window_size - config.min_match_window_size + 1)
    for anchor, w in anchors:
        queue = [(anchor, 0, (config.max_match_window_size - w) * scale + config.min_bfs_breadth)]
        while queue and not builder.full:
            node, parent, breadth = queue.pop(0)
            for child in node.by_recency()[: max(1, int(breadth))]:
                if builder.full:
                    break
                queue.append((child, builder.add(parent, child.token), breadth - scale))
        if builder.full:
            return


def build_prob(anchors: list[tuple[TrieNode, int]], builder: TreeBuilder, config: NgramConfig) -> None:
    order = itertools.count()
    heap: list = []

    def push_children(node: TrieNode, parent: int, probability: float) -> None:
        top = node.by_frequency()[: config.max_bfs_breadth]
        total = sum(child.freq for child in top)
        for child in top:
            heapq.heappush(heap, (-probability * child.freq / total, next(order), child, parent))

    for anchor, _ in anchors:  # one heap across anchors, as SGLang's
        push_children(anchor, 0, 1.0)
        while heap and not builder.full:
            negative_p, _, node, parent = heapq.heappop(heap)
            push_children(node, builder.add(parent, node.token), -negative_p)
        if builder.full:
            return


def draft_from_context(trie, context: list[int], max_nodes: int) -> DraftTree | None:
    """The tree for a context (root = its last token), or None when the trie suggests nothing."""
    return trie.draft(context, max_nodes)


def make_trie(config: NgramConfig):
    """The C trie where it is available ($SPLITSPEC_NGRAM_TRIE), else the Python twin."""
    return ngram_native.NativeNgramTrie(config) if ngram_native.native_available() else NgramTrie(config)


class NgramDrafter(Drafter):
    """Drafts from the shared trie; per request it keeps only the recent context."""

    name = "NGRAM"

    supports_bets = True
    fills_budget = True

    def __init__(self, config: NgramConfig | None = None):
        self.config = config or NgramConfig()
        self.trie = make_trie(self.config)
        self.contexts: dict[str, list[int]] = {}
        self.current: dict[str, tuple[DraftTree | None, int]] = {}  # request -> (tree being verified, budget)
        self.bets: dict[str, list[Bet]] = {}
        # windows waiting for the trie (inserting is most of NGRAM's host time: ~170 node updates per request
        # per step): those of the extends since the last draft, and those before it, which the next idle()
        # inserts, or the next draft() first if no idle moment came. So a draft sees every window but the
        # newest ask's, whether or not idle() ran (deterministic), as SGLang's asynchronous cache insert does
        self._fresh: list[list[int]] = []
        self._held: list[list[int]] = []

    def open(self, request_id: str, prompt_ids: list[int]) -> None:
        # the prompt is context, not trie: SGLang inserts only each verify's last branch_length tokens (the
        # prompt's tail among them), and a whole prompt's insert (~18 node updates per token) would cost a
        # long prompt milliseconds of host time at its admission
        self.contexts[request_id] = list(prompt_ids)

    def extend(self, request_id: str, tokens: list[int]) -> None:
        context = self.contexts[request_id]
        context.extend(tokens)
        self._fresh.append(context[-self.config.branch_length :])
        keep = max(self.config.branch_length, self.config.max_match_window_size)
        del context[:-keep]

    def idle(self) -> None:
        if self._held:
            self.trie.insert_windows(self._held)
            self._held = []

    def draft(self, request_ids: list[str], max_nodes: list[int]) -> list[DraftTree | None]:
        self.idle()
        self._held, self._fresh = self._fresh, []
        trees = self.trie.draft_batch([self.contexts[r] for r in request_ids], max_nodes)
        for request_id, budget, tree in zip(request_ids, max_nodes, trees):
            self.current[request_id] = (tree, budget)
        return trees

    def draft_bets(self, request_ids: list[str], num_bets: int) -> list[list[Bet]]:
        """For the deepest leaves of the current tree: the path to the leaf accepted, the bonus token the
        trie's best continuation after it, and the tree for the context grown by both."""
        out = []
        for request_id in request_ids:
            tree, budget = self.current.get(request_id, (None, 0))
            bets = []
            for path in leaf_outcomes(tree):
                if len(bets) >= num_bets:
                    break
                context = self.contexts[request_id] + path
                guess = draft_from_context(self.trie, context, 2)
                if guess is None:
                    continue
                bet_tree = draft_from_context(self.trie, context + [guess.tokens[1]], budget)
                if bet_tree is not None:
                    bets.append(Bet(tuple(path + [guess.tokens[1]]), bet_tree))
            self.bets[request_id] = bets
            out.append(bets)
        return out

    def take_bet(self, request_id: str, index: int) -> None:
        bet = self.bets[request_id][index]
        self.current[request_id] = (bet.tree, self.current[request_id][1])

    def release(self, request_id: str) -> None:
        self.contexts.pop(request_id, None)
        self.current.pop(request_id, None)
        self.bets.pop(request_id, None)

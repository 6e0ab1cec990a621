"""The radix prefix cache: KV pages of finished requests, keyed by their tokens, reused by later
requests with the same prompt prefix (ARCHITECTURE §3.3: pages are shared only through this cache).

Granularity is one full page: a node is a page whose page_size tokens follow its parent's. Sharing
whole pages only means a request never writes into a shared page: its new tokens start on a page of
its own. The cache holds one reference to each page it keeps; evict() frees least-recently-used
leaves that nobody else references.

    root -- [t0..t15] page 7 -- [t16..t31] page 2 -- [t32..t47] page 9
                             \\- [u16..u31] page 4
"""

from __future__ import annotations

import itertools

from splitspec.runtime.kv_cache import PageAllocator


class _Node:
    __slots__ = ("page", "children", "parent", "key", "stamp")

    def __init__(self, page: int, parent: "_Node | None", key: tuple[int, ...]):
        self.page, self.parent, self.key = page, parent, key
        self.children: dict[tuple[int, ...], _Node] = {}
        self.stamp = 0


class PrefixCache:
    def __init__(self, allocator: PageAllocator, page_size: int):
        self.allocator, self.page_size = allocator, page_size
        self.root = _Node(-1, None, ())
        self.num_pages = 0
        self.evicted_pages = 0  # since start
        self._clock = itertools.count(1)

    def _chunks(self, tokens: list[int]):
        for start in range(0, len(tokens) - self.page_size + 1, self.page_size):
            yield tuple(tokens[start : start + self.page_size])

    def match(self, tokens: list[int]) -> list[int]:
        """Pages holding the longest cached full-page prefix of tokens (no references taken)."""
        node, pages, stamp = self.root, [], next(self._clock)
        for key in self._chunks(tokens):
            node = node.children.get(key)
            if node is None:
                break
            node.stamp = stamp
            pages.append(node.page)
        return pages

    def insert(self, tokens: list[int], pages: list[int]) -> None:
        """Keep the full pages of a sequence's KV (tokens[i] lives in pages[i // page_size])."""
        node, stamp = self.root, next(self._clock)
        for key, page in zip(self._chunks(tokens), pages):
            child = node.children.get(key)
            if child is None:
                child = node.children[key] = _Node(page, node, key)
                self.allocator.incref([page])
                self.num_pages += 1
            child.stamp = stamp
            node = child

    @property
    def num_evictable(self) -> int:
        """Pages only the cache holds: evict() can free all of them (a page someone else holds keeps
        its ancestors held too, so these always drain leaf by leaf)."""
        return sum(1 for node in self._nodes() if self.allocator.refcount(node.page) == 1)

    def evict(self, num_pages: int) -> int:
        """Free up to num_pages pages held only by the cache, least recently used leaves first."""
        freed = 0
        while freed < num_pages:
            leaves = [n for n in self._nodes() if not n.children and self.allocator.refcount(n.page) == 1]
            if not leaves:
                break
            for leaf in sorted(leaves, key=lambda n: n.stamp)[: num_pages - freed]:
                del leaf.parent.children[leaf.key]
                self.allocator.decref([leaf.page])
                self.num_pages -= 1
                freed += 1
        self.evicted_pages += freed
        return freed

    def _nodes(self):
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

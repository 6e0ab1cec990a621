"""FlashInfer attention over the paged KV cache (CUDA): paged decode, paged prefill/append with causal
masks, and tree verification with custom masks, each planned once per batch and run per layer.

A batch is split into groups that one planned FlashInfer wrapper each serves:
- every request decodes one token (q_len 1, no tree mask): BatchDecodeWithPagedKVCacheWrapper
  (tensor cores for grouped-query heads, as SGLang and vLLM choose);
- requests without a tree mask (prompt chunks): BatchPrefillWithPagedKVCacheWrapper, causal, aligned
  to the end of each request's keys;
- requests with a tree mask: the same wrapper kind with a custom mask over all of the request's keys
  (the cached prefix visible, the new tokens by their mask), packed to bits by FlashInfer.
A mixed batch runs each group on its rows of q. Sliding-window layers get wrappers of their own:
FlashInfer's window_left for causal groups, the window folded into the custom mask for trees (whose
positions are not their key indices).

Our cache layer [2, pages, page_size, kv_heads, head_dim] is FlashInfer's NHD layout as a (K, V) pair.
New K/V are written by slot before the layer attends, as the torch backend does.

CUDA graphs (`graph_state`, `graph_plan`): wrappers with fixed buffers per captured shape, a decode
wrapper for one token per request, a prefill wrapper with a custom-mask buffer for trees of a fixed
size; planning copies the batch's page tables (and packed masks) into them and the captured kernels
read them at replay.
"""

from __future__ import annotations

import builtins
import collections
import itertools
import logging
import re
from dataclasses import dataclass, field

import torch

from splitspec import kernels
from splitspec.runtime.attention.base import AttentionBackend, AttentionBatch
from splitspec.runtime.attention.base import env_choice as _env_choice
from splitspec.runtime.attention import paged_graphs
from splitspec.runtime.attention.flashinfer_replan import Arena, replan, replannable
from splitspec.runtime.attention.paged_graphs import PagedGraph
from splitspec.runtime.host_tensors import host_tensor
from splitspec.runtime.tree import ancestor_rows

# how a captured graph's attention is re-planned each step: reuse (default; lean, and a work split left in place while
# the offsets it was planned for stay), lean (flashinfer_replan, the C++ planner every time) or flashinfer (its own plan)
REPLAN_ENV = "SPLITSPEC_FLASHINFER_REPLAN"
# the FlashInfer backend of graphs' mask-free prefill wrappers (causal chains, a draft's catch-up, a draft loop's
# prefix): small (default: fa2 up to SMALL_GRAPH_ROWS query rows a request, above them auto), fa2, or auto (FA3 on
# Hopper, whose planner reads key lengths, so that reuse never applies). FA2's planner reads only offsets.
GRAPH_PREFILL_ENV = "SPLITSPEC_FLASHINFER_GRAPH_PREFILL"
SMALL_GRAPH_ROWS = 16
LN2 = 0.6931471805599453
WORKSPACE_BYTES = 256 << 20  # FlashInfer's float workspace (split-KV partial results), shared by the wrappers
_OVERFLOW = re.compile(r"Buffer overflow when allocating memory for (\w+) with size (\d+)")
logger = logging.getLogger(__name__)


_BIT_WEIGHTS = torch.tensor([1 << j for j in range(8)], dtype=torch.uint8)


def pack_bits(bits: torch.Tensor) -> torch.Tensor:
    """bool [n] -> uint8 [ceil(n / 8)], little bit order (numpy.packbits(bitorder="little"), FlashInfer's)."""
    padded = torch.zeros(-(-bits.numel() // 8) * 8, dtype=torch.uint8)
    padded[: bits.numel()] = bits
    return (padded.view(-1, 8) * _BIT_WEIGHTS).sum(1).to(torch.uint8)


def _packed_trees(trees: list[tuple[int, ...]], kv_lens: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """_tree_mask for trees without a window, from their masks' bits as Python ints: per request one int of
    q_len x kv_len bits (row i: the prefix's kv_len - q_len ones, then node i's ancestors), its bytes
    little-endian (bit e of the int is bit e % 8 of byte e // 8: pack_bits' order); no tensor op per request."""
    chunks, offsets = [], [0]
    for parents, kv_len in zip(trees, kv_lens):
        rows = ancestor_rows(parents)
        prefix = kv_len - len(rows)
        ones, bits = (1 << prefix) - 1, 0
        for i, row in enumerate(rows):
            bits |= (ones | row << prefix) << (i * kv_len)
        chunks.append(bits.to_bytes(-(-len(rows) * kv_len // 8), "little"))
        offsets.append(offsets[-1] + len(chunks[-1]))
    return torch.frombuffer(bytearray(b"".join(chunks)), dtype=torch.uint8), torch.tensor(offsets, dtype=torch.int32)


def _tensor_max(*args, **kwargs):
    """builtins.max, except that one non-empty 1-D tensor's largest element comes from one reduction (a 0-d tensor,
    as iterating gives) instead of a Python loop over its elements."""
    if len(args) == 1 and not kwargs and isinstance(args[0], torch.Tensor) and args[0].dim() == 1 and args[0].numel():
        return args[0].max()
    return builtins.max(*args, **kwargs)


def _tensor_max_in(flashinfer) -> None:
    """FlashInfer's paged prefill plan (0.6) finds its longest query and key with the builtin max over host tensors:
    two tensor ops per request each (a comparison and its truth value), ~130 at batch 32 on every plan, three plans a
    speculative step. Its module's `max` becomes _tensor_max (same values: callers take .item()). Telling the plan
    those maxima instead (max_token_per_sequence, max_sequence_kv) skips host arrays its FA2 path reads later."""
    prefill = getattr(flashinfer, "prefill", None)
    if prefill is not None and getattr(prefill, "max", None) is not _tensor_max:
        prefill.max = _tensor_max


@dataclass
class _Group:
    wrapper: object
    rows: torch.Tensor | None  # rows of q it serves; None = all


@dataclass
class FlashInferPlan:
    out_slots: torch.Tensor  # [T] flat slot where each new token's K/V goes
    groups: dict = field(default_factory=dict)  # window (None = full) -> [_Group]
    paged: PagedGraph | None = None  # a graph attending by kernels.paged_attention instead (paged_graphs)


@dataclass
class GraphState:
    """What a captured graph of one shape reads: its wrappers' fixed buffers and the slots."""

    batch_size: int
    q_len: int  # new tokens per request: 1 (decode) or a tree's node count
    wrappers: dict  # window -> wrapper in CUDA-graph mode
    out_slots: torch.Tensor  # [batch_size * q_len] int64, static
    plan: FlashInferPlan
    causal: bool = False  # q_len > 1: chains (each token sees the ones before it), planned without a mask
    arenas: dict = field(default_factory=dict)  # window -> Arena: its wrapper's index buffers
    words: int = 0  # a tree graph's 16-bit words of ancestor bits a node, its masks packed on the device (0: host)


@dataclass
class PrefixState:
    wrapper: object  # a prefill wrapper without a mask (None: paged)
    arena: Arena | None = None  # a graph's: its wrapper's index buffers
    paged: PagedGraph | None = None  # a graph attending by kernels.paged_attention instead (paged_graphs)


class FlashInferAttentionBackend(AttentionBackend):
    name = "flashinfer"

    def __init__(self, config, kv_cache):
        super().__init__(config, kv_cache)
        import flashinfer

        if kv_cache.device.type != "cuda":
            raise ValueError("--attention-backend flashinfer needs a CUDA device (use torch on CPU)")
        self.flashinfer = flashinfer
        _tensor_max_in(flashinfer)
        self.device = kv_cache.device
        self.workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=self.device)
        self.windows = sorted(set(config.sliding_windows), key=lambda w: -1 if w is None else w)
        group_size = config.num_attention_heads // config.num_key_value_heads
        self.decode_tensor_cores = group_size >= 4
        self._wrappers: dict = {}
        # a captured graph's wrappers re-planned by flashinfer_replan once FlashInfer planned them (at capture)
        replan_mode = _env_choice(REPLAN_ENV, "reuse", ("reuse", "lean", "flashinfer"))
        self.lean_replan, self.reuse_plans = replan_mode != "flashinfer", replan_mode == "reuse"
        self.graph_prefill = _env_choice(GRAPH_PREFILL_ENV, "small", ("small", "fa2", "auto"))
        self.paged = paged_graphs.PagedGraphs(config, kv_cache.dtype, self.windows, self.device)
        self._shape = dict(page_size=kv_cache.page_size, num_qo_heads=config.num_attention_heads,
                           num_kv_heads=config.num_key_value_heads, head_dim=config.head_dim)  # replan's, fixed
        self.full_plans = 0  # graph plans by FlashInfer's own plan
        # lean plans (flashinfer_replan) by (graph kind, FlashInfer's backend of the wrapper, whether its planner ran)
        self.lean_plans_by_kind: collections.Counter = collections.Counter()

    # wrappers ----------------------------------------------------------------------------------------
    def _wrapper(self, kind: str, window):
        key = (kind, window)
        if key not in self._wrappers:
            if kind == "decode":
                self._wrappers[key] = self.flashinfer.BatchDecodeWithPagedKVCacheWrapper(
                    self.workspace, "NHD", use_tensor_cores=self.decode_tensor_cores)
            else:
                self._wrappers[key] = self.flashinfer.BatchPrefillWithPagedKVCacheWrapper(self.workspace, "NHD")
        return self._wrappers[key]

    def _common(self):
        c, dtype = self.config, self.kv_cache.dtype
        return dict(num_qo_heads=c.num_attention_heads, num_kv_heads=c.num_key_value_heads, page_size=self.kv_cache.page_size,
                    q_data_type=dtype, kv_data_type=dtype, sm_scale=self.scaling)

    @staticmethod
    def _pages(batch: AttentionBatch, requests: list[int], page_size: int):
        """(kv page indptr, page indices, last page lengths) of these requests, int32 on CPU."""
        kv_lens, tables = batch.kv_lens, batch.page_tables
        counts = [-(-kv_lens[i] // page_size) for i in requests]
        indptr = host_tensor(list(itertools.accumulate(counts, initial=0)), torch.int32)
        indices = host_tensor([p for i, n in zip(requests, counts) for p in tables[i][:n]], torch.int32)
        last = host_tensor([kv_lens[i] - (n - 1) * page_size for i, n in zip(requests, counts)], torch.int32)
        return indptr, indices, last

    # planning ----------------------------------------------------------------------------------------
    def plan(self, batch: AttentionBatch) -> FlashInferPlan:
        n = batch.num_requests
        starts = self._starts(batch)
        if all(q == 1 for q in batch.q_lens) and all(m is None for m in batch.masks):
            kinds = [("decode", list(range(n)))]
        else:
            kinds = [(kind, requests) for kind, requests in
                     (("causal", [i for i in range(n) if batch.masks[i] is None]),
                      ("tree", [i for i in range(n) if batch.masks[i] is not None])) if requests]
        groups = []  # (kind, requests, rows of q, pages), the same for every window
        for kind, requests in kinds:
            rows = None if len(requests) == n else torch.cat(
                [torch.arange(starts[i], starts[i + 1]) for i in requests]).to(self.device, non_blocking=True)
            groups.append((kind, requests, rows, self._pages(batch, requests, self.kv_cache.page_size)))
        plan = FlashInferPlan(out_slots=batch.out_slots.to(self.device, non_blocking=True))
        for window in self.windows:
            plan.groups[window] = []
            for kind, requests, rows, pages in groups:
                wrapper = self._wrapper(kind, window)
                self._plan_wrapper(wrapper, kind, batch, requests, starts, pages, window)
                plan.groups[window].append(_Group(wrapper, rows))
        return plan

    @staticmethod
    def _starts(batch: AttentionBatch) -> list[int]:
        """Row of q where each request's new tokens start (and the total at the end)."""
        starts = [0]
        for q in batch.q_lens:
            starts.append(starts[-1] + q)
        return starts

    def _plan_wrapper(self, wrapper, kind: str, batch: AttentionBatch, requests: list[int], starts: list[int], pages,
                      window) -> None:
        """_plan_once, with a larger float workspace for this wrapper (and the ones made after it) when FlashInfer
        says its split-KV partial results do not fit (large batches of trees): wrappers planned before keep
        the buffer their captured graphs point at."""
        for _ in range(8):
            try:
                return self._plan_once(wrapper, kind, batch, requests, starts, pages, window)
            except RuntimeError as exc:
                overflow = _OVERFLOW.search(str(exc))
                if overflow is None or wrapper._float_workspace_buffer.numel() >= (8 << 30):
                    raise
                size = max(2 * self.workspace.numel(), 2 * int(overflow.group(2)))
                if wrapper._float_workspace_buffer is self.workspace or self.workspace.numel() < size:
                    logger.info("FlashInfer's workspace grows from %d to %d MiB (%s of %s bytes for %d requests of %s)",
                                self.workspace.numel() >> 20, size >> 20, overflow.group(1), overflow.group(2),
                                len(requests), kind)
                    self.workspace = torch.zeros(size, dtype=torch.uint8, device=self.device)
                wrapper.reset_workspace_buffer(self.workspace, wrapper._int_workspace_buffer)
        raise RuntimeError("FlashInfer's workspace kept overflowing")

    def _plan_once(self, wrapper, kind: str, batch: AttentionBatch, requests: list[int], starts: list[int], pages,
                   window) -> None:
        """Plan one wrapper for these requests: kind "decode" (one token each), "causal" (prompt chunks)
        or "tree" (custom masks; FlashInfer packs them to bits on the GPU, its index arrays there too)."""
        indptr, indices, last = pages
        common = self._common()
        window_left = -1 if window is None else window - 1
        head_dim = self.config.head_dim
        if kind == "decode":
            wrapper.plan(indptr, indices.to(self.device, non_blocking=True), last, head_dim=head_dim,
                         window_left=window_left, **common)
            return
        qo_indptr = host_tensor([0, *itertools.accumulate(starts[i + 1] - starts[i] for i in requests)], torch.int32)
        if kind == "causal":
            wrapper.plan(qo_indptr, indptr, indices.to(self.device, non_blocking=True), last, head_dim_qk=head_dim,
                         causal=True, window_left=window_left, **common)
        else:
            # the masks packed here and every index array on the host: FlashInfer's plan reads its index arrays on
            # the host and packs a mask with a device kernel whose size it reads back, so arrays given on the device
            # cost a device sync each (the host then waits for the step before instead of running ahead of it)
            packed, mask_indptr = self._tree_mask(batch, requests, starts, window)
            wrapper.plan(qo_indptr, indptr, indices.to(self.device, non_blocking=True), last, head_dim_qk=head_dim,
                         packed_custom_mask=packed.to(self.device, non_blocking=True), **common)
            # given a packed mask, FlashInfer 0.6 keeps the unpacked mask's offsets (bits); its kernels read bytes
            if wrapper.is_cuda_graph_enabled:
                wrapper._mask_indptr_buf.copy_(mask_indptr, non_blocking=True)
            else:
                wrapper._mask_indptr_buf = mask_indptr.to(self.device, non_blocking=True)

    @staticmethod
    def _tree_mask(batch: AttentionBatch, requests: list[int], starts: list[int], window) -> tuple[torch.Tensor, torch.Tensor]:
        """(packed uint8, byte offsets int32 [R+1]) on the host: each request's [q_len, kv_len] bool (prefix
        visible, new tokens by their mask), flattened and packed to bits in FlashInfer's order (little: element
        8k+j is bit j of byte k), each request starting on a byte; a sliding window is applied by positions."""
        trees = batch.trees or [None] * batch.num_requests
        if window is None and all(trees[i] is not None for i in requests):  # every mask a tree's: from its bits
            return _packed_trees([trees[i] for i in requests], [batch.kv_lens[i] for i in requests])
        positions = batch.positions.cpu()
        parts, offsets = [], [0]
        for i in requests:
            q_len, kv_len = batch.q_lens[i], batch.kv_lens[i]
            prefix = kv_len - q_len
            full = torch.ones(q_len, kv_len, dtype=torch.bool)
            full[:, prefix:] = batch.masks[i].to("cpu", torch.bool)
            if window is not None:
                q_pos = positions[starts[i]:starts[i + 1]]
                k_pos = torch.cat([torch.arange(prefix), q_pos])
                full &= (q_pos[:, None] - k_pos[None, :]) < window
            parts.append(pack_bits(full.flatten()))
            offsets.append(offsets[-1] + parts[-1].numel())
        return torch.cat(parts), torch.tensor(offsets, dtype=torch.int32)

    # CUDA graphs -------------------------------------------------------------------------------------
    def graph_state(self, batch_size: int, max_pages: int, q_len: int = 1, max_kv_len: int = 0,
                    causal: bool = False) -> GraphState:
        """Fixed buffers and wrappers for a graph of `batch_size` requests of `q_len` new tokens each (1:
        decode; more: trees, whose requests hold at most `max_kv_len` keys, or with causal chains, planned
        without a mask: no mask to build, pack or copy), `max_pages` pages in all."""
        if self.paged.usable(q_len):  # a decode row sees every key, as a chain's last row does
            paged = self.paged.make(batch_size, q_len, max_pages,
                                    paged_graphs.CAUSAL if causal or q_len == 1 else paged_graphs.TREE)
            out_slots = torch.zeros(batch_size * q_len, dtype=torch.long, device=self.device)
            return GraphState(batch_size, q_len, {}, out_slots, FlashInferPlan(out_slots, paged=paged), causal,
                              {None: paged.arena}, paged.words)
        wrappers, arenas = {}, {}
        tree = q_len > 1 and not causal
        # a tree graph without sliding windows packs its masks on the device from the nodes' ancestor bits
        words = -(-q_len // 16) if tree and self.windows == [None] else 0
        for window in self.windows:  # a wrapper's index buffers are views of one arena (flashinfer_replan)
            arena = arenas[window] = Arena.make(batch_size, max_pages, self.device, mask=tree,
                                                ancestors=batch_size * q_len * words)
            pages = dict(paged_kv_indptr_buf=arena.view("kv_indptr"), paged_kv_indices_buf=arena.view("ids"),
                         paged_kv_last_page_len_buf=arena.view("last"))
            if q_len == 1:
                wrappers[window] = self.flashinfer.BatchDecodeWithPagedKVCacheWrapper(
                    self.workspace, "NHD", use_cuda_graph=True, use_tensor_cores=self.decode_tensor_cores,
                    **{name.replace("_buf", "_buffer"): view for name, view in pages.items()})
            else:  # trees: each request's mask is q_len x kv_len bits, packed to whole bytes
                mask = {} if not tree else dict(
                    custom_mask_buf=torch.zeros(batch_size * (-(-q_len * max_kv_len // 8)), dtype=torch.uint8,
                                                device=self.device), mask_indptr_buf=arena.view("mask_indptr"))
                wrappers[window] = self.flashinfer.BatchPrefillWithPagedKVCacheWrapper(
                    self.workspace, "NHD", use_cuda_graph=True, qo_indptr_buf=arena.view("qo"), **pages, **mask,
                    backend=self._graph_prefill_backend(q_len))
                wrappers[window]._kv_lens_buffer = arena.view("kv_lens")  # its plan writes there, its kernels read it
        out_slots = torch.zeros(batch_size * q_len, dtype=torch.long, device=self.device)
        plan = FlashInferPlan(out_slots=out_slots, groups={w: [_Group(wr, None)] for w, wr in wrappers.items()})
        return GraphState(batch_size, q_len, wrappers, out_slots, plan, causal and q_len > 1, arenas, words)

    def graph_prologue(self, state) -> None:
        """What a captured graph runs before its layers: a tree graph's masks packed from its arena's ancestor bits
        and key lengths (kernels.tree_mask_bits) into the buffer FlashInfer's kernels read."""
        if isinstance(state, GraphState) and state.words and state.plan.paged is None:
            arena = state.arenas[None]
            kernels.tree_mask_bits(arena.view("kv_lens"), arena.view("mask_indptr"),
                                   arena.view("ancestors").view(state.batch_size, state.q_len, state.words),
                                   state.wrappers[None]._custom_mask_buf)

    def graph_plan(self, state: GraphState, batch: AttentionBatch) -> FlashInferPlan:
        """Plan a batch of exactly state.batch_size requests of state.q_len tokens into the graph's buffers."""
        n = batch.num_requests
        assert n == state.batch_size and all(q == state.q_len for q in batch.q_lens)
        requests, pages, starts = list(range(n)), None, None
        kind = "decode" if state.q_len == 1 else "causal" if state.causal else "tree"
        if state.plan.paged is not None:  # no plan: the arena is what its kernel reads
            ancestors = self._ancestor_words(batch, state) if state.words else None
            state.plan.paged.fill(batch.q_lens, batch.kv_lens, batch.page_tables, self.kv_cache.page_size, ancestors)
            self.lean_plans_by_kind[kind, "triton", False] += 1
        for window, wrapper in state.wrappers.items():
            if self.lean_replan and replannable(wrapper):
                try:
                    self._replan(state, wrapper, kind, batch, window)
                    continue
                except RuntimeError as exc:  # its workspace overflowed, say: FlashInfer's own plan deals with that
                    logger.debug("re-planning a graph's %s wrapper by FlashInfer's plan: %s", kind, exc)
            if pages is None:
                pages, starts = self._pages(batch, requests, self.kv_cache.page_size), self._starts(batch)
            self._plan_wrapper(wrapper, kind, batch, requests, starts, pages, window)
            if state.words:  # the graph packs its masks again from the ancestor bits: those too
                state.arenas[window].view("ancestors").copy_(host_tensor(self._ancestor_words(batch, state), torch.int32),
                                                             non_blocking=True)
            self.full_plans += 1
        state.out_slots.copy_(batch.out_slots, non_blocking=True)
        return state.plan

    def _replan(self, state: GraphState, wrapper, kind: str, batch: AttentionBatch, window) -> None:
        mask = {}
        if kind == "tree" and state.words:  # packed by the graph: each request's byte offset and ancestor bits
            sizes = (-(-q * k // 8) for q, k in zip(batch.q_lens, batch.kv_lens))
            mask = dict(mask_offsets=list(itertools.accumulate(sizes, initial=0)),
                        ancestors=self._ancestor_words(batch, state))
        elif kind == "tree":
            packed, offsets = self._tree_mask(batch, list(range(batch.num_requests)), self._starts(batch), window)
            mask = dict(packed_mask=packed, mask_offsets=offsets.tolist())
        planned = replan(wrapper, state.arenas[window], q_lens=batch.q_lens, kv_lens=batch.kv_lens,
                         page_tables=batch.page_tables, causal=kind == "causal",
                         window_left=-1 if window is None else window - 1, decode=kind == "decode",
                         reuse=self.reuse_plans, **self._shape, **mask)
        self._count_lean(kind, wrapper, planned)

    def _graph_prefill_backend(self, rows: int) -> str:
        """FlashInfer's backend for a graph's prefill wrapper of `rows` query rows a request (GRAPH_PREFILL_ENV)."""
        small = self.graph_prefill == "small" and rows <= SMALL_GRAPH_ROWS
        return "fa2" if self.graph_prefill == "fa2" or small else "auto"

    def _count_lean(self, kind: str, wrapper, planned: bool) -> None:
        self.lean_plans_by_kind[kind, getattr(wrapper, "_backend", "-"), planned] += 1

    @property
    def lean_plans(self) -> int:
        return sum(self.lean_plans_by_kind.values())

    @property
    def reused_plans(self) -> int:
        """Lean plans whose planner was skipped (REPLAN_ENV=reuse)."""
        return sum(n for (_, _, planned), n in self.lean_plans_by_kind.items() if not planned)

    @staticmethod
    def _ancestor_words(batch: AttentionBatch, state: GraphState) -> list[int]:
        """Each request's nodes' ancestor bits (tree.ancestor_rows), state.words 16-bit words a node."""
        words, out = state.words, []
        for i, tree in enumerate(batch.trees or [None] * batch.num_requests):
            if tree is not None:
                rows = ancestor_rows(tuple(tree))
            else:  # a mask without its tree's parents: its rows as bits
                mask = batch.masks[i].to("cpu", torch.long)
                rows = (mask << torch.arange(mask.shape[1])).sum(1).tolist()
            out += rows if words == 1 else [row >> (16 * w) & 0xFFFF for row in rows for w in range(words)]
        return out

    # cascade attention (the device draft loop) ---------------------------------------------------------
    def prefix_graph_state(self, num_requests: int, num_rows: int, max_pages: int) -> PrefixState:
        rows = -(-num_rows // num_requests)
        if self.paged.usable(rows):
            return PrefixState(None, paged=self.paged.make(num_requests, rows, max_pages, paged_graphs.PREFIX))
        arena = Arena.make(num_requests, max_pages, self.device, mask=False)  # its index buffers (flashinfer_replan)
        wrapper = self.flashinfer.BatchPrefillWithPagedKVCacheWrapper(
            self.workspace, "NHD", use_cuda_graph=True, qo_indptr_buf=arena.view("qo"),
            paged_kv_indptr_buf=arena.view("kv_indptr"), paged_kv_indices_buf=arena.view("ids"),
            paged_kv_last_page_len_buf=arena.view("last"), backend=self._graph_prefill_backend(rows))
        wrapper._kv_lens_buffer = arena.view("kv_lens")
        return PrefixState(wrapper, arena)

    def prefix_key_lengths(self, state: PrefixState) -> torch.Tensor | None:
        """kernels.paged_attention reads its key lengths as it runs (FlashInfer's plans depend on them)."""
        return state.paged.arena.view("kv_lens") if state.paged is not None else None

    def plan_prefix(self, kv_lens: list[int], page_tables: list[list[int]], q_lens: list[int],
                    state: PrefixState | None = None) -> PrefixState:
        """A prefill wrapper without a mask: a request's rows share one pass over its keys (a draft's beams)."""
        if any(w is not None for w in self.windows):
            raise NotImplementedError("prefix attention under a sliding window")
        if state is not None and state.paged is not None:  # no plan: the arena is what its kernel reads
            state.paged.fill(list(q_lens), list(kv_lens), page_tables, self.kv_cache.page_size)
            self.lean_plans_by_kind["prefix", "triton", False] += 1
            return state
        if state is None:
            state = PrefixState(self._wrapper("prefix", None))
        elif state.arena is not None and self.lean_replan and replannable(state.wrapper):
            planned = replan(state.wrapper, state.arena, q_lens=list(q_lens), kv_lens=list(kv_lens),
                             page_tables=page_tables, causal=False, window_left=-1, decode=False, reuse=self.reuse_plans,
                             **self._shape)
            self._count_lean("prefix", state.wrapper, planned)
            return state
        batch = AttentionBatch(list(q_lens), list(kv_lens), page_tables, None, None, [])
        indptr, indices, last = self._pages(batch, list(range(len(kv_lens))), self.kv_cache.page_size)
        qo_indptr = host_tensor([0, *itertools.accumulate(q_lens)], torch.int32)
        state.wrapper.plan(qo_indptr, indptr, indices.to(self.device, non_blocking=True), last,
                           head_dim_qk=self.config.head_dim, causal=False, **self._common())
        return state

    def attend_prefix(self, layer_id: int, q: torch.Tensor, plan: PrefixState) -> tuple[torch.Tensor, torch.Tensor]:
        if plan.paged is not None:
            return plan.paged.attend(q, *self.kv_cache.flat_kv(layer_id), self.kv_cache.page_size, self.scaling)
        cache = self.kv_cache.layers[layer_id]
        out, lse2 = plan.wrapper.run(q.contiguous(), (cache[0], cache[1]), return_lse=True)
        return out, lse2 * LN2  # FlashInfer's sums of exp are base 2

    # per layer ---------------------------------------------------------------------------------------
    def run(self, layer_id: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: FlashInferPlan) -> torch.Tensor:
        k_flat, v_flat = self.kv_cache.flat_kv(layer_id)
        k_flat[plan.out_slots] = k.to(k_flat.dtype)
        v_flat[plan.out_slots] = v.to(v_flat.dtype)
        return self._attend(layer_id, q, plan)

    def run_rope(self, layer_id: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: FlashInferPlan, rope,
                 positions: torch.Tensor) -> torch.Tensor:
        """One kernel rotates q and k and writes k and v into the cache (splitspec.kernels.rope_and_store)."""
        k_flat, v_flat = self.kv_cache.flat_kv(layer_id)
        q = kernels.rope_and_store(q, k, v, rope.cos_cache, rope.sin_cache, positions, rope.rot_dim, k_flat, v_flat,
                                   plan.out_slots)
        return self._attend(layer_id, q, plan)

    def _attend(self, layer_id: int, q: torch.Tensor, plan: FlashInferPlan) -> torch.Tensor:
        if plan.paged is not None:
            return plan.paged.attend(q, *self.kv_cache.flat_kv(layer_id), self.kv_cache.page_size, self.scaling)[0]
        cache = self.kv_cache.layers[layer_id]
        paged = (cache[0], cache[1])
        groups = plan.groups[self.config.sliding_windows[layer_id]]
        if len(groups) == 1 and groups[0].rows is None:
            return groups[0].wrapper.run(q.contiguous(), paged)
        out = torch.empty_like(q)
        for group in groups:
            out[group.rows] = group.wrapper.run(q[group.rows].contiguous(), paged)
        return out

"""SGLang's beam draft (REFERENCES §3.1, runtime.beam_draft.BeamDraft) for a batch of requests, on the device.

runtime.beam_draft.BeamDraft is the reference: the same steps, on the host, one request at a time. Here every
step of every request is one batch of fixed shape, so that the whole draft (steps 1..S-1, the scoring
and the ranking of the candidates) runs as one CUDA graph replay with one transfer at the end:

    in       each request's root distribution [V] (the draft model's logits after the committed root)
             and, for a head, the root's output feature [H]
    step 0   softmax + top-K: beams, scores
    step i   the K beams of every request in one forward (q = B*K rows at position root + i, each fed
             its parent's output for a head); softmax + top-K per beam; K*K candidates scored
             beam score x probability; the best K become the beams
    out      the flat candidates' scores ranked (stable: ties to the lower flat index), the best N-1
             with their tokens, and each step's parent list; the host turns them into trees

Attention of a beam node (cascade attention): the request's committed keys in the paged cache (one
prefix plan for all steps and layers: they do not change during a draft), merged with attention over
the node's own ancestors and itself, whose keys live in a small dense buffer [layers, 2, B, K, S-1,
Hkv, D]. When new beams are chosen each inherits its parent's rows of that buffer (one gather), so a
beam's row j always holds its ancestor at depth j + 1 and nothing is ever written to the paged cache.
"""

from __future__ import annotations

import logging
import time

import torch

from splitspec import kernels
from splitspec.device_profile import phase as device_phase
from splitspec.runtime.batch import to_device
from splitspec.runtime.cuda_graph import capture_sizes, warm_and_capture
from splitspec.runtime.host_tensors import copy_to_host, host_tensor
from splitspec.runtime.inference import inference
from splitspec.runtime.kv_cache import BlockTable
from splitspec.runtime.tree import NO_NODE, DraftTree, parents_from_selection

logger = logging.getLogger(__name__)


class _Cascade:
    """What the model's layers see as their attention backend during a beam step."""

    def __init__(self, loop: "DraftLoop", batch_size: int):
        self.loop, self.batch_size, self.depth = loop, batch_size, 1
        self.backend = loop.runner.backend
        self.scaling = self.backend.scaling

    def run_rope(self, layer_id: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: object, rope,
                 positions: torch.Tensor) -> torch.Tensor:
        bs, depth = self.batch_size, self.depth
        layer = self.loop.local[layer_id]  # [2, B, K, S-1, Hkv, D]
        # q and k rotated, and k and v written to this step's column of the beams' own keys, in one kernel (on a GPU)
        flat_k, flat_v = (layer[i].view(-1, *layer.shape[-2:]) for i in (0, 1))
        q = kernels.rope_and_store(q, k, v, rope.cos_cache, rope.sin_cache, positions, rope.rot_dim, flat_k, flat_v,
                                   self.loop.own_slots[depth - 1, : bs * self.loop.topk])
        local = layer[:, :bs]  # [2, bs, K, S-1, Hkv, D]
        out_prefix, lse_prefix = self.backend.attend_prefix(layer_id, q, plan)
        keys, values = (local[i, :, :, :depth].flatten(0, 1) for i in (0, 1))  # [bs*K, depth, Hkv, D]
        return kernels.merge_own_attention(q, keys, values, out_prefix, lse_prefix, self.scaling)


class _Graph:
    def __init__(self, graph, prefix_state, outputs, positions_in_graph: bool = False):
        self.graph, self.prefix_state, self.outputs = graph, prefix_state, outputs
        # the roots' positions computed in the graph from the key counts its attention reads (no copy, no op a launch)
        self.positions_in_graph = positions_in_graph


class DraftLoop:
    def __init__(self, runner, topk: int, num_steps: int, num_draft_tokens: int, token_map: torch.Tensor | None = None,
                 feature_size: int = 0):
        """feature_size: a head's output width, fed back as the next step's features (0: a draft LM)."""
        if topk < 1 or num_steps < 1 or num_draft_tokens < 2:
            raise ValueError(f"topk {topk}, steps {num_steps}, draft tokens {num_draft_tokens}: need >= 1, >= 1, >= 2")
        self.runner, self.topk, self.num_steps, self.num_draft_tokens = runner, topk, num_steps, num_draft_tokens
        self.feature_size = feature_size
        self.device = runner.device
        self.token_map = None if token_map is None else token_map.to(self.device)
        self._id_bound: int | None = None
        self.num_candidates = topk + (num_steps - 1) * topk * topk
        self.keep = min(num_draft_tokens - 1, self.num_candidates)
        # made once, outside any graph: each step's position offset per beam [S-1, 1, K] (a step's positions are one
        # add for all steps), and a chain's ranking and parents (top-1: kept in chain order, see _body)
        self._step_offsets = torch.arange(1, num_steps, device=self.device)[:, None, None].expand(
            num_steps - 1, 1, topk).contiguous()
        self._chain_order = torch.arange(self.keep, device=self.device)
        self._chain_parents = torch.arange(1, max(num_steps - 1, 1), device=self.device)
        self._make_buffers(1)  # self.local, self.own_slots, self.ones
        self.graphs: dict[int, _Graph] = {}
        self.capture_seconds = 0.0
        self.replays = 0
        # LoopRun.path_hidden kept (a copy a launch) for overlap's bets; off where none are made (the verifier's process)
        self.keep_path_hidden = True
        self._scratch: list[int] = []

    @property
    def id_bound(self) -> int:
        """Every draft id is below it: the token map's largest id + 1, else the model's logits' width (found once)."""
        if self._id_bound is None:
            if self.token_map is not None:
                self._id_bound = int(self.token_map.max()) + 1
            else:
                hidden = torch.zeros(1, self.runner.config.hidden_size, dtype=self.runner.dtype, device=self.device)
                with torch.inference_mode():
                    self._id_bound = self.runner.model.logits(hidden).shape[-1]
        return self._id_bound

    def _make_buffers(self, batch_size: int) -> None:
        """The loop's buffers for up to batch_size requests, made outside any graph (a graph reads them in place):
        local, the beams' own keys and values [layers, 2, batch_size, K, S-1, Hkv, D]; own_slots [S-1, batch_size * K],
        the rows of a layer's keys (flattened) where step d writes each beam's (d - 1: column d); ones [batch_size],
        the roots' scores."""
        c = self.runner.config
        columns = max(self.num_steps - 1, 1)
        rows = torch.arange(batch_size * self.topk, device=self.device)
        self.own_slots = (rows[None, :] * columns + torch.arange(columns, device=self.device)[:, None]).contiguous()
        self.ones = torch.ones(batch_size, dtype=torch.float32, device=self.device)
        self.local = torch.zeros(c.num_hidden_layers, 2, batch_size, self.topk, columns,
                                 c.num_key_value_heads, c.head_dim, dtype=self.runner.dtype, device=self.device)

    # the steps -------------------------------------------------------------------------------------------
    def _ids(self, indices: torch.Tensor) -> torch.Tensor:
        return indices if self.token_map is None else self.token_map[indices]

    def _body(self, root_logits: torch.Tensor, root_features: torch.Tensor | None, root_positions: torch.Tensor | None,
              plan: object, key_lengths: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:
        """Steps 0..S-1 and the ranking for bs requests (the batch size of root_logits [bs, V]): the kept candidates'
        order, tokens and scores, the parents, the best path's tokens and (heads) outputs, and the host's row of the
        first five as doubles [bs, width].

        At top-k > 1 a request's step positions are one position expanded over its beams (at batch 1 a stride-0
        view): the RoPE kernel reads positions by their stride (read as contiguous, it read past them and faulted
        in the capture; until that was found, top-k > 1 drafts ran every kernel's torch twin)."""
        model, topk = self.runner.model, self.topk
        bs = root_logits.shape[0]
        if root_positions is None:  # each root's position is its key count - 1 (key_lengths [bs], int32)
            root_positions = torch.sub(key_lengths, 1).long()
        scores, index = kernels.draft_topk(root_logits.float(), self.ones[:bs], topk)  # [bs, K]
        tokens = self._ids(index)
        flat_scores, flat_tokens, parent_list = [scores], [tokens], []
        features = None if root_features is None else root_features[:, None].expand(bs, topk, root_features.shape[-1])
        cascade = _Cascade(self, bs)
        # the beams of each step (their tokens, outputs and parent beams), to trace the best path at the end
        beam_tokens, beam_hidden, beam_parents = [], [], []
        candidates, step_tokens = scores, tokens
        step_positions = root_positions.view(1, bs, 1) + self._step_offsets  # [S-1, bs, K]
        for step in range(1, self.num_steps):
            cascade.depth = step
            positions = step_positions[step - 1].view(-1)
            extra = {} if features is None else {"features": features.reshape(bs * topk, -1)}
            hidden, _ = self.runner.model_call(bs, tokens.reshape(-1), positions, cascade, plan, (), **extra)
            beam_tokens.append(tokens)
            beam_hidden.append(hidden.view(bs, topk, -1))
            # each beam's top-K children, scored beam score x probability: [bs*K, K] -> [bs, K*K]
            # the logits as the head computes them: the top-k kernel reads them as fp32 (no upcast copy a step)
            candidates, top_index = kernels.draft_topk(model.logits(hidden, upcast=False), scores.reshape(-1), topk)
            candidates = candidates.view(bs, topk * topk)
            step_tokens = self._ids(top_index).view(bs, topk * topk)
            flat_scores.append(candidates)
            flat_tokens.append(step_tokens)
            if step == self.num_steps - 1:
                break
            if topk == 1:  # a chain: the one child is the next beam, nothing to choose, gather or move
                scores, tokens = candidates, step_tokens
                features = None if features is None else hidden.view(bs, 1, -1)
                continue
            chosen = candidates.topk(topk, dim=-1).indices  # [bs, K]
            parent_list.append(chosen + topk * topk * (step - 1) + topk)
            parent_beam = chosen // topk
            beam_parents.append(parent_beam)
            scores, tokens = candidates.gather(1, chosen), step_tokens.gather(1, chosen)
            if features is not None:
                features = hidden.view(bs, topk, -1).gather(1, parent_beam[..., None].expand(-1, -1, hidden.shape[-1]))
            # each new beam takes its parent's ancestors' keys (rows 0..step-1)
            local = self.local[:, :, :bs, :, :step]
            index = parent_beam.view(1, 1, bs, topk, 1, 1, 1).expand(local.shape)
            local.copy_(local.gather(3, index))
        all_scores, all_tokens = torch.cat(flat_scores, 1), torch.cat(flat_tokens, 1)
        keep = self.keep
        if topk == 1:
            # a chain's scores never rise (each is the last times a probability <= 1: 1 / the softmax's normaliser, at
            # least 1, at its top token; float rounding keeps the order), so the stable ranking is the chain's own
            # order: no sort, no gathers. Node i's parent is node i - 1 (flat index i: node i + 1 of the tree).
            order = self._chain_order.expand(bs, -1)
            ranked_tokens, ranked_scores = all_tokens[:, :keep], all_scores[:, :keep]
            parents = self._chain_parents.expand(bs, -1)
        else:
            order = torch.sort(all_scores, dim=1, descending=True, stable=True).indices[:, :keep]
            ranked_tokens, ranked_scores = all_tokens.gather(1, order), all_scores.gather(1, order)
            parents = (torch.cat(parent_list, 1) if parent_list
                       else torch.zeros(bs, 0, dtype=torch.long, device=self.device))
        path_tokens, path_hidden = self._best_path(candidates, step_tokens, beam_tokens, beam_hidden, beam_parents)
        outputs = (order, ranked_tokens, ranked_scores, parents, path_tokens)
        # what the host reads, as one row a request for one transfer (ids < 2**53), packed in the graph: outside it,
        # six more launches a step
        return (*outputs, path_hidden, torch.cat([o.double() for o in outputs], 1))

    def _best_path(self, candidates, step_tokens, beam_tokens, beam_hidden, beam_parents):
        """The most likely full-depth path (the best last-step candidate and its beam ancestors): its tokens
        [bs, S] and, for a head, the outputs of its first S-1 nodes [bs, S-1, H] (the features their
        children were drafted with; overlap's bets continue from them)."""
        if self.topk == 1 and beam_tokens:  # the chain itself
            return (torch.cat([*beam_tokens, step_tokens], 1),
                    torch.cat(beam_hidden, 1) if self.feature_size else None)
        best = candidates.argmax(-1, keepdim=True)  # [bs, 1]
        tokens = [step_tokens.gather(1, best)]
        hidden = []
        beam = best // self.topk
        for step in range(len(beam_tokens), 0, -1):
            tokens.append(beam_tokens[step - 1].gather(1, beam))
            if self.feature_size:
                h = beam_hidden[step - 1]
                hidden.append(h.gather(1, beam[..., None].expand(-1, -1, h.shape[-1])))
            if step >= 2:
                beam = beam_parents[step - 2].gather(1, beam)
        path_tokens = torch.cat(tokens[::-1], 1)
        if not self.feature_size:
            return path_tokens, None
        if not hidden:
            return path_tokens, torch.zeros(candidates.shape[0], 0, self.feature_size, dtype=self.runner.dtype,
                                            device=self.device)
        return path_tokens, torch.cat(hidden[::-1], 1)

    # driving it ------------------------------------------------------------------------------------------
    @inference
    def run(self, roots: list[int], root_logits: torch.Tensor, root_features: torch.Tensor | None,
            tables: list[BlockTable], budgets: list[int]) -> list[DraftTree]:
        """Trees of at most budgets[i] (<= num_draft_tokens) nodes for requests whose committed keys (the
        root's row last) are in tables; root_logits [B, V], root_features [B, H] (heads)."""
        return self.launch(roots, root_logits, root_features, tables, budgets).finish()

    @inference
    def launch(self, roots: list[int], root_logits: torch.Tensor, root_features: torch.Tensor | None,
               tables: list[BlockTable], budgets: list[int]) -> "LoopRun":
        """run()'s draft queued on the device with its copy to the host, not waited for: LoopRun.finish() gives the
        trees. Meanwhile the host may queue work that reads the drafts on the device (LoopRun.chain_tokens)."""
        return self._launch(roots, root_logits, root_features, tables, budgets, [t.num_tokens for t in tables], None)

    @inference
    def launch_ahead(self, root_logits: torch.Tensor, root_features: torch.Tensor | None, tables: list[BlockTable],
                     upper: list[int], lengths: torch.Tensor, budgets: list[int]) -> "LoopRun | None":
        """launch() for requests whose committed keys are known on the device only (lengths [B], a catch-up ahead's:
        at most upper[i], for which tables hold pages): the graph's plan made for upper, each request's key count and
        root position then written on the device. The roots' tokens are not needed until the trees are read: set
        LoopRun.roots before. On a CPU the lengths are read (no wait there). None where a GPU's batch replays no
        graph whose attention reads its key lengths as it runs (FlashInfer's plans depend on them)."""
        if lengths.device.type != "cuda":
            kv_lens = lengths.tolist()
            return self._launch([0] * len(kv_lens), root_logits, root_features, tables, budgets, kv_lens, None)
        graph_bs = next((b for b in sorted(self.graphs) if b >= len(upper)), None)
        if self.num_steps == 1 or graph_bs is None \
                or self.runner.backend.prefix_key_lengths(self.graphs[graph_bs].prefix_state) is None:
            return None
        return self._launch([0] * len(upper), root_logits, root_features, tables, budgets, upper, lengths)

    def _launch(self, roots: list[int], root_logits: torch.Tensor, root_features: torch.Tensor | None,
                tables: list[BlockTable], budgets: list[int], kv_lens: list[int],
                lengths: torch.Tensor | None) -> "LoopRun":
        count = len(roots)
        self.runner.model.rotary_emb.reserve(max(kv_lens) + self.num_steps, self.device)
        graph_bs = next((b for b in sorted(self.graphs) if b >= count), None)
        if graph_bs is None and self.local.shape[2] < count:  # run eagerly: buffers for count requests
            self._make_buffers(count)
        if self.num_steps == 1:
            outputs = self._body(root_logits, root_features, _root_positions(kv_lens, self.device), None)
        elif graph_bs is not None:
            with device_phase("loop.replay"):
                outputs = self._replay(graph_bs, root_logits, root_features, tables, kv_lens, lengths)
        else:
            plan = self.runner.backend.plan_prefix(kv_lens, [t.pages for t in tables], [self.topk] * count)
            outputs = self._body(root_logits, root_features, _root_positions(kv_lens, self.device), plan)
        with device_phase("loop.to_host"):
            host, copied = copy_to_host(outputs[6][:count])
        # a copy for overlap's bets (the next replay overwrites the graph's outputs), where a drafter makes them
        path_hidden = None if outputs[5] is None or not self.keep_path_hidden else outputs[5][:count].clone()
        chain = outputs[1][:count] if self.topk == 1 else None
        return LoopRun(self, list(roots), list(budgets), host, copied, outputs[3].shape[1], path_hidden, chain)

    def _trees(self, roots: list[int], rows: list[list[float]], budgets: list[int], parents_width: int) -> list[DraftTree]:
        keep = self.keep
        chain = list(range(keep)) if self.topk == 1 else None
        trees = []
        for i, root in enumerate(roots):
            row = rows[i]
            order = [int(x) for x in row[:keep]]
            if order == chain:  # top-1 ranked in its own order (each score a product of the last): the first nodes
                n = min(budgets[i] - 1, keep)
                trees.append(DraftTree.chain(root, [int(x) for x in row[keep : keep + n]], row[2 * keep : 2 * keep + n]))
                continue
            tokens, scores = [int(x) for x in row[keep : 2 * keep]], row[2 * keep : 3 * keep]
            parent_list = [NO_NODE, *range(self.topk), *(int(x) for x in row[3 * keep : 3 * keep + parents_width])]
            take = sorted(range(min(budgets[i] - 1, keep)), key=lambda j: order[j])  # by flat index
            selected = [order[j] for j in take]
            trees.append(DraftTree(tuple([root, *(tokens[j] for j in take)]),
                                   tuple(parents_from_selection(selected, parent_list, self.topk)),
                                   tuple([1.0, *(scores[j] for j in take)])))
        return trees

    # CUDA graphs -----------------------------------------------------------------------------------------
    @inference
    def capture(self, max_bs: int) -> None:
        """One graph per batch size of SGLang's ladder up to max_bs: all S-1 steps and the ranking."""
        if self.num_steps == 1 or self.device.type != "cuda":
            return
        runner = self.runner
        kv = runner.kv_cache
        if runner.backend.prefix_graph_state(1, 1, 1) is None:  # its plans are not graph-safe: steps run eagerly
            return
        runner.model.rotary_emb.reserve_for_graphs(runner.context_length, self.device)  # never moves after
        sizes = capture_sizes(max_bs)
        max_bs = sizes[-1]
        self._make_buffers(max_bs)
        vocab = runner.model.logits(torch.zeros(1, runner.config.hidden_size, dtype=runner.dtype,
                                                device=self.device)).shape[-1]
        self.static_logits = torch.zeros(max_bs, vocab, device=self.device)
        self.static_features = (torch.zeros(max_bs, self.feature_size, dtype=runner.dtype, device=self.device)
                                if self.feature_size else None)
        self.static_positions = torch.zeros(max_bs, dtype=torch.long, device=self.device)
        self._scratch = kv.allocator.alloc(1)  # the padding requests' one key
        torch.cuda.synchronize(self.device)
        start = time.perf_counter()
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream(self.device)
        for bs in sorted(sizes, reverse=True):
            # page indices of bs requests: distinct pages, except that overlap's bets draft in KV forks sharing
            # them, so bound each request by the longest context instead of the pool
            per_request = min(kv.num_pages, kv.pages_for(runner.context_length))
            state = runner.backend.prefix_graph_state(bs, bs * self.topk, max(kv.num_pages, bs * per_request) + bs)
            plan = runner.backend.plan_prefix(*self._padding(bs, [], []), state=state)
            features = None if self.static_features is None else self.static_features[:bs]
            # where the prefix attention reads its key counts as it runs (our Triton kernel), the roots' positions
            # are computed from them in the graph; FlashInfer's plans do not keep them on the device
            lengths = runner.backend.prefix_key_lengths(state)
            args = (self.static_logits[:bs], features, None if lengths is not None else self.static_positions[:bs],
                    plan, None if lengths is None else lengths[:bs])
            graph, outputs = warm_and_capture(lambda: self._body(*args), pool, stream, self.device)
            self.graphs[bs] = _Graph(graph, state, outputs, positions_in_graph=lengths is not None)
        torch.cuda.synchronize(self.device)
        self.capture_seconds = time.perf_counter() - start
        logger.info("captured CUDA graphs of the whole %d-step draft (top-%d, %d tree nodes) for batch sizes %s "
                    "in %.1f s", self.num_steps, self.topk, self.num_draft_tokens, sizes, self.capture_seconds)

    def _padding(self, bs: int, kv_lens: list[int], pages: list[list[int]]) -> tuple[list[int], list[list[int]], list[int]]:
        """plan_prefix's arguments for these requests and bs - len(kv_lens) padding requests (one key each)."""
        pad = bs - len(kv_lens)
        return kv_lens + [1] * pad, pages + [self._scratch] * pad, [self.topk] * bs

    def _replay(self, bs: int, root_logits, root_features, tables, kv_lens: list[int],
                lengths: torch.Tensor | None) -> tuple[torch.Tensor, ...]:
        """lengths: each request's key count on the device (launch_ahead's), at most kv_lens, which the plan was made for."""
        entry = self.graphs[bs]
        count = root_logits.shape[0]
        backend = self.runner.backend
        backend.plan_prefix(*self._padding(bs, kv_lens, [t.pages for t in tables]), state=entry.prefix_state)
        self.static_logits[:count].copy_(root_logits)
        if lengths is not None:  # after the plan's own copy of the arena, in stream order
            backend.prefix_key_lengths(entry.prefix_state)[:count].copy_(lengths)
        if not entry.positions_in_graph:
            if lengths is None:
                self.static_positions[:count].copy_(_root_positions(kv_lens, None), non_blocking=True)
            else:
                torch.sub(lengths, 1, out=self.static_positions[:count])
            if bs > count:
                self.static_positions[count:bs].zero_()
        if self.static_features is not None:
            self.static_features[:count].copy_(root_features)
        if bs > count:
            self.static_logits[count:bs].zero_()
        entry.graph.replay()
        self.replays += 1
        return entry.outputs


def _root_positions(kv_lens: list[int], device: torch.device | None) -> torch.Tensor:
    """Each root's position (its key count - 1), on the device (None: on the host)."""
    positions = host_tensor([n - 1 for n in kv_lens])
    return positions if device is None else to_device(positions, device)


class LoopRun:
    """A launched draft (DraftLoop.launch): its outputs on their way to the host. chain_tokens [B, keep] (top-1
    drafts only, else None): every request's drafts in chain order on the device, readable by work queued before
    the loop's next launch (a graph replay overwrites them)."""

    def __init__(self, loop: DraftLoop, roots: list[int], budgets: list[int], host: torch.Tensor, copied,
                 parents_width: int, path_hidden: torch.Tensor | None, chain_tokens: torch.Tensor | None):
        self.loop, self.roots, self.budgets, self.host, self.copied = loop, roots, budgets, host, copied
        self.parents_width, self.path_hidden, self.chain_tokens = parents_width, path_hidden, chain_tokens
        self.paths: list[list[int]] = []
        self._trees: list[DraftTree] | None = None

    def sizes(self) -> list[int]:
        """Each request's tree size (known at launch: its budget, at most the loop's kept candidates + the root)."""
        return [min(b - 1, self.loop.keep) + 1 for b in self.budgets]

    def finish(self) -> list[DraftTree]:
        """The trees (waiting for the copy once); the loop's paths and path_hidden are this run's afterwards."""
        if self._trees is None:
            if self.copied is not None:
                self.copied.synchronize()
            loop, keep = self.loop, self.loop.keep
            rows = self.host.tolist()  # Python floats once for the whole batch (per-row tensor ops cost ~10 us each)
            # the best path of each request (overlap's bets start from it)
            self.paths = [[int(x) for x in row[3 * keep + self.parents_width :]] for row in rows]
            with device_phase("loop.trees"):
                self._trees = loop._trees(self.roots, rows, self.budgets, self.parents_width)
        self.loop.paths, self.loop.path_hidden = self.paths, self.path_hidden
        return self._trees

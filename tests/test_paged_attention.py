"""The paged KV cache and masked attention: token-by-token decoding through the cache equals one full
forward; a tree-masked forward equals separate forwards of each root-to-leaf path; pages come back."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from helpers import hf_logits, hf_model, load_runner, random_ids

from splitspec.runtime.batch import SequenceInput
from splitspec.runtime.kv_cache import BlockTable, KVCache, OutOfPagesError, PageAllocator

TOL = 1e-4


@pytest.mark.parametrize("family", ["llama-gqa-llama3", "qwen2-sliding", "qwen3-qk-norm"])
def test_incremental_decode_equals_full_forward(tiny_checkpoints, family):
    """Three requests with different prompt lengths, chunked prefill, one joining late, page size 3:
    every logit row equals the full-sequence forward of the same tokens."""
    path = tiny_checkpoints[family]
    runner, reference = load_runner(path, page_size=3, max_total_tokens=3 * 40), hf_model(path)
    vocab = runner.config.vocab_size
    sequences = [random_ids(n, vocab, seed) for n, seed in ((14, 1), (5, 2), (9, 3))]
    # (start step, prompt chunk sizes); afterwards one token per step until the sequence is consumed
    schedule = {0: [6, 8], 1: [5], 2: [1, 8]}
    join_step = {0: 0, 1: 0, 2: 1}
    tables = [BlockTable() for _ in sequences]
    chunks = {i: list(schedule[i]) + [1] * (len(s) - sum(schedule[i])) for i, s in enumerate(sequences)}
    got: dict[int, list[torch.Tensor]] = {i: [] for i in range(len(sequences))}
    step = 0
    while any(chunks.values()):
        batch = [i for i in chunks if chunks[i] and join_step[i] <= step]
        seqs = []
        for i in batch:
            start, size = tables[i].num_tokens, chunks[i].pop(0)
            seqs.append(SequenceInput(tables[i], sequences[i][start : start + size], logits="all"))
        out = runner.forward(runner.batch(seqs))
        row = 0
        for i, seq in zip(batch, seqs):
            n = len(seq.input_ids)
            got[i].append(out.logits[row : row + n])
            row += n
            runner.kv_cache.set_length(tables[i], tables[i].num_tokens + n)
        step += 1
    for i, ids in enumerate(sequences):
        assert tables[i].num_tokens == len(ids)
        assert len(tables[i].pages) == -(-len(ids) // 3)
        assert (torch.cat(got[i]) - hf_logits(reference, ids)).abs().max().item() < TOL
        runner.kv_cache.release(tables[i])
    assert runner.kv_cache.allocator.num_free == runner.kv_cache.num_pages


# A branching tree after the prefix:     r
#                                      /   \
#                                     a     b
#                                    / \     \
#                                   c   d     e
TREE_PARENTS = [-1, 0, 0, 1, 1, 2]
TREE_PATHS = [[0, 1, 3], [0, 1, 4], [0, 2, 5]]


def tree_mask(parents: list[int]) -> torch.Tensor:
    """[n, n] bool: node i sees node j iff j is i or an ancestor of i."""
    n = len(parents)
    mask = torch.eye(n, dtype=torch.bool)
    for i in range(n):
        j = parents[i]
        while j != -1:
            mask[i, j] = True
            j = parents[j]
    return mask


def depths(parents: list[int]) -> list[int]:
    out = []
    for p in parents:
        out.append(0 if p == -1 else out[p] + 1)
    return out


@pytest.mark.parametrize("family", ["llama-gqa-llama3", "mistral-sliding"])
def test_tree_forward_equals_path_forwards(tiny_checkpoints, family):
    """Two requests verify trees in one forward beside a plain decode request; each tree node's
    logits equal the full forward of prefix + its root-to-node path."""
    path = tiny_checkpoints[family]
    runner, reference = load_runner(path, page_size=4), hf_model(path)
    vocab = runner.config.vocab_size
    prefixes = [random_ids(n, vocab, seed) for n, seed in ((7, 11), (10, 12), (5, 13))]
    tables = [BlockTable() for _ in prefixes]
    runner.forward(runner.batch([SequenceInput(t, p, logits="none") for t, p in zip(tables, prefixes)]))
    for t, p in zip(tables, prefixes):
        runner.kv_cache.set_length(t, len(p))
    trees = [random_ids(len(TREE_PARENTS), vocab, 20 + i) for i in range(2)]
    mask = tree_mask(TREE_PARENTS)
    seqs = [
        SequenceInput(tables[i], trees[i], positions=[len(prefixes[i]) + d for d in depths(TREE_PARENTS)],
                      mask=mask, logits="all")
        for i in range(2)
    ]
    plain_token = random_ids(1, vocab, 30)
    seqs.append(SequenceInput(tables[2], plain_token, logits="all"))
    out = runner.forward(runner.batch(seqs))
    for i in range(2):
        node_logits = out.logits[i * len(TREE_PARENTS) : (i + 1) * len(TREE_PARENTS)]
        for path_nodes in TREE_PATHS:
            ids = prefixes[i] + [trees[i][n] for n in path_nodes]
            expected = hf_logits(reference, ids)[len(prefixes[i]) :]
            assert (node_logits[path_nodes] - expected).abs().max().item() < TOL
    expected_plain = hf_logits(reference, prefixes[2] + plain_token)[-1]
    assert (out.logits[-1] - expected_plain).abs().max().item() < TOL
    # commit: keep the accepted path r, a, d (nodes 0, 1, 4) of request 0 by compacting its slots
    kv = runner.kv_cache
    start = len(prefixes[0])
    accepted = [0, 1, 4]
    kv.copy_slots(kv.slot_ids(tables[0], start, start + len(TREE_PARENTS))[accepted], kv.slot_ids(tables[0], start, start + 3))
    kv.set_length(tables[0], start + 3)
    nxt = random_ids(1, vocab, 40)
    after = runner.forward(runner.batch([SequenceInput(tables[0], nxt)]))
    committed = prefixes[0] + [trees[0][n] for n in accepted] + nxt
    assert (after.logits[0] - hf_logits(reference, committed)[-1]).abs().max().item() < TOL
    for t in tables:
        kv.release(t)
    assert kv.allocator.num_free == kv.num_pages


def test_tree_mask_matters(tiny_checkpoints):
    """Without the tree mask (causal over the nodes) siblings would see each other: results differ."""
    runner = load_runner(tiny_checkpoints["llama-gqa-llama3"])
    ids = random_ids(len(TREE_PARENTS), runner.config.vocab_size, 50)
    positions = [5 + d for d in depths(TREE_PARENTS)]
    outs = []
    for mask in (tree_mask(TREE_PARENTS), None):
        table = BlockTable()
        runner.forward(runner.batch([SequenceInput(table, list(range(5)), logits="none")]))
        runner.kv_cache.set_length(table, 5)
        outs.append(runner.forward(runner.batch([SequenceInput(table, ids, positions, mask, "all")])).logits)
        runner.kv_cache.release(table)
    assert not torch.allclose(outs[0][2:], outs[1][2:], atol=1e-3)


def test_page_allocator_counts_and_reuses():
    alloc = PageAllocator(4)
    a = alloc.alloc(3)
    assert alloc.num_free == 1 and alloc.num_used == 3
    with pytest.raises(OutOfPagesError, match="need 2 KV pages, 1 of 4 free"):
        alloc.alloc(2)
    alloc.incref(a[:1])  # shared (prefix cache) page survives one release
    alloc.decref(a)
    assert alloc.num_free == 3 and alloc.refcount(a[0]) == 1
    alloc.decref(a[:1])
    assert alloc.num_free == 4
    assert sorted(alloc.alloc(4)) == [0, 1, 2, 3]


def test_slot_ids():
    from splitspec.runtime.kv_cache import slot_ids

    # pages [7, 2], page size 4: logical 2, 3 -> page 7 offsets 2, 3; logical 4, 5 -> page 2 offsets 0, 1
    assert slot_ids([7, 2], 4, 2, 6).tolist() == [30, 31, 8, 9]
    assert slot_ids([5], 1, 0, 1).tolist() == [5]


def test_batch_inputs_are_checked_before_pages_are_reserved(tiny_checkpoints):
    runner = load_runner(tiny_checkpoints["llama-tied"])
    good, bad = BlockTable(), BlockTable()
    cases = [
        (SequenceInput(bad, [1, 2], positions=[0]), "1 positions for 2 new tokens"),
        (SequenceInput(bad, [1, 2], mask=torch.zeros(2, 2, dtype=torch.bool)), "attend to itself"),
        (SequenceInput(bad, []), "at least one new token"),
    ]
    for seq, message in cases:
        with pytest.raises(ValueError, match=message):
            runner.batch([SequenceInput(good, [1, 2, 3]), seq])
        assert good.pages == [] and runner.kv_cache.allocator.num_used == 0


def test_block_table_reserve_and_truncate(tiny_checkpoints):
    from splitspec.runtime.config import ModelConfig

    config = ModelConfig.from_dir(tiny_checkpoints["llama-tied"])
    kv = KVCache(config, num_pages=5, page_size=4, dtype=torch.float32, device=torch.device("cpu"))
    table = BlockTable()
    kv.reserve(table, 9)  # 3 pages
    assert len(table.pages) == 3 and kv.allocator.num_free == 2
    assert kv.slot_ids(table, 3, 6).tolist() == [
        table.pages[0] * 4 + 3, table.pages[1] * 4 + 0, table.pages[1] * 4 + 1,
    ]
    kv.set_length(table, 5)  # keeps 2 pages
    assert len(table.pages) == 2 and kv.allocator.num_free == 3 and table.num_tokens == 5
    with pytest.raises(OutOfPagesError):
        kv.reserve(table, 4 * 6)
    kv.release(table)
    assert kv.allocator.num_free == 5 and table.pages == []


def test_flashinfer_tree_masks_are_packed_on_the_host_per_request():
    """FlashInfer's tree plan gets its masks packed on the host (no device round trip): each request's
    [q_len, kv_len] mask, prefix visible, packed in little bit order from a byte of its own; the offsets
    are bytes. Checked against numpy.packbits on a batch whose segments do not end on a byte."""
    np = pytest.importorskip("numpy")
    from splitspec.runtime.attention.base import AttentionBatch
    from splitspec.runtime.attention.flashinfer_backend import FlashInferAttentionBackend
    from splitspec.runtime.tree import tree_mask

    parents = [(-1, 0, 0, 1), (-1, 0, 1)]
    kv_lens = [13, 6]  # prefixes of 9 and 3 keys
    masks = [tree_mask(p) for p in parents]
    q_lens = [len(p) for p in parents]
    batch = AttentionBatch(q_lens=q_lens, kv_lens=kv_lens, page_tables=[[0], [1]], out_slots=torch.zeros(7, dtype=torch.long),
                           positions=torch.tensor([9, 10, 10, 11, 3, 4, 5]), masks=masks)
    expected, expected_offsets = [], [0]
    for mask, q_len, kv_len in zip(masks, q_lens, kv_lens):
        full = np.ones((q_len, kv_len), dtype=bool)
        full[:, kv_len - q_len:] = mask.numpy()
        expected.append(np.packbits(full.flatten(), bitorder="little"))
        expected_offsets.append(expected_offsets[-1] + expected[-1].size)
    # from the mask tensors, and from the trees' bits (a batch that knows its trees: the engine's)
    for trees in (None, parents):
        batch.trees = trees
        packed, offsets = FlashInferAttentionBackend._tree_mask(batch, [0, 1], [0, 4, 7], None)
        assert offsets.tolist() == expected_offsets == [0, 7, 10]  # 52 bits -> 7 bytes, 18 bits -> 3 bytes
        assert packed.dtype == torch.uint8 and packed.tolist() == np.concatenate(expected).tolist()


def test_tree_masks_from_bits_equal_tree_masks_from_tensors():
    """Random trees and prefixes: the packing from the trees' bits equals the packing from their masks."""
    import random

    from splitspec.runtime.attention.base import AttentionBatch
    from splitspec.runtime.attention.flashinfer_backend import FlashInferAttentionBackend
    from splitspec.runtime.tree import tree_mask

    rng = random.Random(0)
    for _ in range(100):
        trees = [tuple([-1] + [rng.randrange(i) for i in range(1, rng.randint(2, 20))]) for _ in range(rng.randint(1, 6))]
        q_lens = [len(t) for t in trees]
        kv_lens = [q + rng.randint(0, 70) for q in q_lens]
        starts = [sum(q_lens[:i]) for i in range(len(trees) + 1)]
        batch = AttentionBatch(q_lens=q_lens, kv_lens=kv_lens, page_tables=[[0]] * len(trees),
                               out_slots=torch.zeros(starts[-1], dtype=torch.long),
                               positions=torch.zeros(starts[-1], dtype=torch.long), masks=[tree_mask(t) for t in trees])
        from_tensors = FlashInferAttentionBackend._tree_mask(batch, list(range(len(trees))), starts, None)
        batch.trees = trees
        from_bits = FlashInferAttentionBackend._tree_mask(batch, list(range(len(trees))), starts, None)
        assert all(torch.equal(a, b) for a, b in zip(from_tensors, from_bits))


def test_flashinfer_plans_max_is_the_builtin_max_from_one_reduction():
    """The max FlashInfer's prefill module is given (flashinfer_backend._tensor_max) returns what the builtin does:
    a 1-D host tensor's largest element as a 0-d tensor, and the builtin's answer for anything else."""
    import builtins
    import types

    from splitspec.runtime.attention.flashinfer_backend import _tensor_max, _tensor_max_in

    generator = torch.Generator().manual_seed(0)
    for n in (1, 2, 33, 257):
        lens = torch.randint(1, 5000, (n,), generator=generator, dtype=torch.int32)
        indptr = torch.cat([torch.zeros(1, dtype=torch.int32), lens.cumsum(0).to(torch.int32)])
        for t in (lens, indptr[1:] - indptr[:-1]):
            got, want = _tensor_max(t), builtins.max(t)
            assert got.dim() == 0 and got.dtype == want.dtype and got.item() == want.item() == int(lens.max())
    assert _tensor_max([3, 9, 4]) == 9 and _tensor_max(7, 128) == 128 and _tensor_max([], default=5) == 5
    module = types.SimpleNamespace(prefill=types.SimpleNamespace())
    _tensor_max_in(module)
    _tensor_max_in(module)  # idempotent
    assert module.prefill.max is _tensor_max
    assert builtins.max is not _tensor_max and max is builtins.max  # nothing but that module changes


def test_forward_batch_equals_a_token_by_token_reference():
    """build_forward_batch (its loop inlined for a step's host time; ints packed with the array module) against the
    definition, token by token: each sequence's tokens, positions (given, or consecutive after its committed ones),
    flat KV slots through its pages, logits rows ("last", "all", "none"), page tables after its reservation. Random
    batches of decodes, trees, masked rows and chunks longer than the short-slot path, on pages of 1, 4 and 16."""
    import random
    import types

    from splitspec.runtime.batch import SHORT_SLOTS, build_forward_batch, device_tensor
    from splitspec.runtime.tree import positions, tree_mask

    config = types.SimpleNamespace(num_hidden_layers=1, num_key_value_heads=1, head_dim=2)
    rng = random.Random(7)
    for _ in range(150):
        page = rng.choice([1, 4, 16])
        kv = KVCache(config, 6000, page, torch.float32, torch.device("cpu"))
        sequences = []
        for _ in range(rng.randint(1, 10)):
            table = BlockTable()
            committed = rng.randint(0, 200)
            if committed:
                kv.reserve(table, committed + rng.choice([0, 5]))
                kv.set_length(table, committed)
            kind = rng.choice(["decode", "tree", "mask", "chunk"])
            q = {"decode": 1, "tree": rng.randint(2, 8), "mask": 2, "chunk": rng.randint(2, SHORT_SLOTS + 60)}[kind]
            ids, logits = [rng.randrange(1 << 40) for _ in range(q)], rng.choice(["last", "all", "none"])
            if kind == "tree":
                parents = tuple([-1] + [rng.randrange(j) for j in range(1, q)])
                sequences.append(SequenceInput(table, ids, positions(list(parents), committed), tree_mask(parents),
                                               logits, parents))
            elif kind == "mask":
                sequences.append(SequenceInput(table, ids, None, torch.tensor([[1, 0], [1, 1]], dtype=torch.bool), logits))
            else:
                sequences.append(SequenceInput(table, ids, logits=logits))
        starts = [s.table.num_tokens for s in sequences]
        batch = build_forward_batch(kv, sequences, torch.device("cpu"))
        want_ids, want_positions, want_slots, want_rows, cu = [], [], [], [], [0]
        for seq, start in zip(sequences, starts):
            q = len(seq.input_ids)
            assert len(seq.table.pages) * page >= start + q  # reserved
            row0 = len(want_ids)
            want_ids += seq.input_ids
            want_positions += seq.positions if seq.positions is not None else list(range(start, start + q))
            want_slots += [seq.table.pages[p // page] * page + p % page for p in range(start, start + q)]
            rows = {"last": [row0 + q - 1], "all": list(range(row0, row0 + q)), "none": []}[seq.logits]
            want_rows += rows
            cu.append(cu[-1] + len(rows))
        assert batch.input_ids.tolist() == want_ids and batch.input_ids.dtype == torch.long
        assert batch.positions.tolist() == want_positions == batch.attention.positions.tolist()
        assert batch.attention.out_slots.tolist() == want_slots and batch.attention.out_slots.dtype == torch.long
        assert batch.logits_indices.tolist() == want_rows and batch.cu_logits == cu
        assert batch.attention.q_lens == [len(s.input_ids) for s in sequences]
        assert batch.attention.kv_lens == [st + len(s.input_ids) for s, st in zip(sequences, starts)]
        assert batch.attention.page_tables == [s.table.pages for s in sequences]
        assert batch.attention.page_tables[0] is not sequences[0].table.pages  # a copy: later steps change the table
    # device_tensor: flat int lists take the packed path, anything else torch.tensor's, same values and dtypes
    cpu = torch.device("cpu")
    assert device_tensor([3, 1, 2], cpu).dtype == torch.long and device_tensor([3, 1], cpu, torch.int32).dtype == torch.int32
    assert device_tensor([1, 2.5], cpu).tolist() == [1.0, 2.5] and device_tensor([[1, 2], [3, 4]], cpu).shape == (2, 2)
    with pytest.raises(ValueError, match="Overflow"):  # past int64: torch.tensor's own error, as before
        device_tensor([1 << 70], cpu)


def test_flashinfer_page_arrays_are_the_requests_pages():
    """FlashInfer's paged-KV arrays of a plan, built on the host as int32 (kv page indptr, page indices, last page
    lengths), for a subset of a batch's requests: each request's first ceil(kv_len / page) pages, in order."""
    import random

    from splitspec.runtime.attention.base import AttentionBatch
    from splitspec.runtime.attention.flashinfer_backend import FlashInferAttentionBackend

    rng = random.Random(3)
    for _ in range(100):
        page, n = rng.choice([1, 16]), rng.randint(1, 9)
        kv_lens = [rng.randint(1, 90) for _ in range(n)]
        tables = [[rng.randrange(10000) for _ in range(-(-k // page) + rng.randint(0, 2))] for k in kv_lens]
        batch = AttentionBatch([1] * n, kv_lens, tables, None, None, [])
        requests = sorted(rng.sample(range(n), rng.randint(1, n)))
        indptr, indices, last = FlashInferAttentionBackend._pages(batch, requests, page)
        counts = [-(-kv_lens[i] // page) for i in requests]
        assert all(t.dtype == torch.int32 for t in (indptr, indices, last))
        assert indptr.tolist() == [sum(counts[:j]) for j in range(len(counts) + 1)]
        assert indices.tolist() == [p for i, c in zip(requests, counts) for p in tables[i][:c]]
        assert last.tolist() == [kv_lens[i] - (c - 1) * page for i, c in zip(requests, counts)]


def test_graph_prefill_backend_and_replan_modes_from_the_environment(monkeypatch):
    """SPLITSPEC_FLASHINFER_GRAPH_PREFILL: small (default) gives a graph's mask-free prefill wrapper FA2 up to 16 query
    rows a request (the planner REPLAN=reuse can skip) and leaves larger ones to FlashInfer's choice; fa2 and auto
    apply to all. A value neither variable knows is refused with its name, not read as the default."""
    from types import SimpleNamespace

    from splitspec.runtime.attention import flashinfer_backend as fb

    pick = fb.FlashInferAttentionBackend._graph_prefill_backend
    assert [pick(SimpleNamespace(graph_prefill="small"), rows) for rows in (1, 6, 16, 17, 512)] == \
        ["fa2", "fa2", "fa2", "auto", "auto"]
    assert {pick(SimpleNamespace(graph_prefill="fa2"), rows) for rows in (1, 512)} == {"fa2"}
    assert {pick(SimpleNamespace(graph_prefill="auto"), rows) for rows in (1, 512)} == {"auto"}
    monkeypatch.delenv(fb.REPLAN_ENV, raising=False)
    assert fb._env_choice(fb.REPLAN_ENV, "reuse", ("reuse", "lean", "flashinfer")) == "reuse"
    monkeypatch.setenv(fb.REPLAN_ENV, "lean")
    assert fb._env_choice(fb.REPLAN_ENV, "reuse", ("reuse", "lean", "flashinfer")) == "lean"
    for name, choices in ((fb.REPLAN_ENV, ("reuse", "lean", "flashinfer")), (fb.GRAPH_PREFILL_ENV, ("small", "fa2", "auto"))):
        monkeypatch.setenv(name, "fa3")
        with pytest.raises(ValueError, match=name):
            fb._env_choice(name, choices[0], choices)


def test_paged_graphs_read_the_arena_their_plan_fills(monkeypatch):
    """SPLITSPEC_GRAPH_ATTENTION=triton (and auto, the default, where it was measured: Hopper GPUs): graphs of at most
    16 query rows a request (no sliding window, a bf16 or fp16 cache) attend by kernels.paged_attention from the arena
    one copy fills. On CPU its twin reads the same arena: a batch of trees, of causal chains and of beams over a
    prefix, with pages shuffled, equals the torch backend's attention over the same cache (the new tokens' K/V written
    by it first). The choice refuses unknown values."""
    from splitspec.runtime.attention import paged_graphs
    from splitspec.runtime.attention.base import AttentionBatch
    from splitspec.runtime.attention.torch_backend import TorchAttentionBackend
    from splitspec.runtime.config import ModelConfig
    from splitspec.runtime.tree import ancestor_rows
    from splitspec.runtime.tree import tree_mask as mask_of

    config = ModelConfig.from_dir("splitspec/demo_models/target")
    monkeypatch.setenv(paged_graphs.GRAPH_ATTENTION_ENV, "triton")
    graphs = paged_graphs.PagedGraphs(config, torch.bfloat16, [None], torch.device("cpu"))
    assert [graphs.usable(rows) for rows in (1, 16, 17)] == [True, True, False]
    assert not paged_graphs.PagedGraphs(config, torch.bfloat16, [None, 7], torch.device("cpu")).usable(6)
    assert not paged_graphs.PagedGraphs(config, torch.float8_e4m3fn, [None], torch.device("cpu")).usable(6)
    monkeypatch.setenv(paged_graphs.GRAPH_ATTENTION_ENV, "flashinfer")
    assert not paged_graphs.PagedGraphs(config, torch.bfloat16, [None], torch.device("cpu")).usable(6)
    # auto (the default): only where the kernel was measured, Hopper GPUs and the shapes measured (heads of 256, groups
    # of 8 query heads a key-value head were not); not on a CPU
    monkeypatch.delenv(paged_graphs.GRAPH_ATTENTION_ENV)
    assert paged_graphs.graph_attention_choice() == "auto"
    assert not paged_graphs.PagedGraphs(config, torch.bfloat16, [None], torch.device("cpu")).usable(6)
    assert not paged_graphs.measured_device(torch.device("cpu")) and paged_graphs.measured_shape(config)
    for wide in (dict(head_dim=256), dict(num_attention_heads=8, num_key_value_heads=1)):
        assert not paged_graphs.measured_shape(dataclasses.replace(config, **wide)), wide
    monkeypatch.setenv(paged_graphs.GRAPH_ATTENTION_ENV, "fa3")
    with pytest.raises(ValueError, match=paged_graphs.GRAPH_ATTENTION_ENV):
        paged_graphs.graph_attention_choice()
    # the least keys a split: a positive multiple of 64, or the kernel's default
    assert paged_graphs.min_chunk_choice({}) is None
    assert paged_graphs.min_chunk_choice({paged_graphs.MIN_CHUNK_ENV: "128"}) == 128
    for bad in ("100", "0", "-64", "many"):
        with pytest.raises(ValueError, match=paged_graphs.MIN_CHUNK_ENV):
            paged_graphs.min_chunk_choice({paged_graphs.MIN_CHUNK_ENV: bad})
    monkeypatch.setenv(paged_graphs.MIN_CHUNK_ENV, "128")
    monkeypatch.setenv(paged_graphs.GRAPH_ATTENTION_ENV, "triton")
    graphs = paged_graphs.PagedGraphs(config, torch.bfloat16, [None], torch.device("cpu"))
    assert graphs.make(2, 6, 8, paged_graphs.CAUSAL).min_chunk == 128

    g = torch.Generator().manual_seed(9)
    cache = KVCache(config, 64, 4, torch.float32, torch.device("cpu"))
    cache.pool.copy_(torch.randn(cache.pool.shape, generator=g))
    torch_backend = TorchAttentionBackend(config, cache)
    heads, kv_heads, dim = config.num_attention_heads, config.num_key_value_heads, config.head_dim
    parents = (-1, 0, 0, 1, 2, 2)
    pages = torch.randperm(64, generator=g).tolist()
    bs = 3
    tables = [pages[i * 16:(i + 1) * 16] for i in range(bs)]
    # trees, chains and beams of 6 rows; a decode step's one row a request (a causal chain of one)
    for mode, rows in ((paged_graphs.TREE, 6), (paged_graphs.CAUSAL, 6), (paged_graphs.PREFIX, 6), (paged_graphs.CAUSAL, 1)):
        kv_lens = [rows + 9, rows + 30, rows + 57]
        graph = graphs.make(bs, rows, 64, mode)
        q = torch.randn(bs * rows, heads, dim, generator=g)
        slots = torch.tensor([t[j // 4] * 4 + j % 4 for t, k in zip(tables, kv_lens) for j in range(k - rows, k)])
        positions = torch.tensor([j for k in kv_lens for j in range(k - rows, k)])
        masks = {paged_graphs.TREE: [mask_of(list(parents))] * bs, paged_graphs.CAUSAL: [None] * bs}
        if mode == paged_graphs.PREFIX:  # beams over the prefix: what the torch backend's prefix attention gives
            want, want_lse = torch_backend.attend_prefix(0, q, torch_backend.plan_prefix(kv_lens, tables, [rows] * bs))
        else:
            batch = AttentionBatch([rows] * bs, kv_lens, tables, slots, positions, masks[mode])
            k, v = (torch.randn(bs * rows, kv_heads, dim, generator=g) for _ in range(2))
            want = torch_backend.run(0, q, k, v, torch_backend.plan(batch))  # writes the new tokens' K/V
        words = [a for a in ancestor_rows(parents)] * bs if mode == paged_graphs.TREE else None
        graph.fill([rows] * bs, kv_lens, tables, 4, words)
        got, lse = graph.attend(q, *cache.flat_kv(0), 4, config.head_dim ** -0.5)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
        if mode == paged_graphs.PREFIX:
            torch.testing.assert_close(lse, want_lse, rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match="rows"):
        graph.fill([rows + 1] * bs, kv_lens, tables, 4)

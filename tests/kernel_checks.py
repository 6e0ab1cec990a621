"""Each Triton kernel against its torch twin and, where one exists, against the plain reference it must
equal. Run on a GPU (tests/test_gpu_kernels.py) and on CPU under Triton's interpreter
(tests/test_kernels_interpreted.py runs `python tests/kernel_checks.py` with TRITON_INTERPRET=1)."""

from __future__ import annotations

import itertools
import random
import sys

import torch

from splitspec.kernels import (torch_ops, triton_batch_shift, triton_ops, triton_own_attention, triton_paged_attention,
                               triton_rope, triton_tree_mask)
from splitspec.runtime.attention.flashinfer_backend import _packed_trees
from splitspec.runtime.kv_cache import slot_list
from splitspec.runtime.tree import NO_NODE, ancestor_rows, child_links
from splitspec.verifier_svc.acceptance import accept_target_tokens


def check_move_kv_slots(device: str, dtype: torch.dtype) -> int:
    """Random trees' accepted paths compacted in a pool of several planes, every request's moves in one call."""
    rng = random.Random(0)
    checked = 0
    for planes, slots, width in ((2, 64, 24), (6, 200, 1000), (4, 96, 1024 + 8)):
        pool = torch.randn(planes, slots, width, generator=torch.Generator().manual_seed(checked)).to(device, dtype)
        src, dst, free = [], [], list(range(slots))
        rng.shuffle(free)
        while len(free) >= 12:  # a request: a tree of up to 12 slots, its accepted path moved to the front
            tree_slots, free = free[:12], free[12:]
            path = sorted(rng.sample(range(1, 12), rng.randrange(0, 6)))
            for j, node in enumerate([0, *path]):
                if node != j:
                    src.append(tree_slots[node])
                    dst.append(tree_slots[j])
        expected = pool.clone()
        for s, d in zip(src, dst):  # the moves, one after another
            expected[:, d] = expected[:, s]
        s_t, d_t = torch.tensor(src, device=device), torch.tensor(dst, device=device)
        twin, kernel = pool.clone(), pool.clone()
        torch_ops.move_kv_slots(twin, s_t, d_t)
        triton_ops.move_kv_slots(kernel, s_t, d_t)
        assert torch.equal(twin, expected) and torch.equal(kernel, expected), (planes, slots, width)
        checked += len(src)
    return checked


def random_tree(rng: random.Random, n: int, vocab: int) -> tuple[list[int], list[int]]:
    """Tokens and parents of an n-node tree, children after their parents, siblings with distinct tokens."""
    tokens, parents = [rng.randrange(vocab)], [NO_NODE]
    while len(tokens) < n:
        parent = rng.randrange(len(tokens))
        taken = {tokens[i] for i in range(len(tokens)) if parents[i] == parent}
        options = [t for t in range(vocab) if t not in taken]
        if options:
            tokens.append(rng.choice(options))
            parents.append(parent)
    return tokens, parents


def check_verify_tree_greedy(device: str) -> int:
    """Batches of padded random trees against accept_target_tokens (the engine's host walk), with targets
    that follow the tree for a while and then leave it."""
    rng = random.Random(1)
    accepted_total = 0
    for batch, n, vocab in ((1, 1, 5), (5, 8, 4), (16, 16, 6), (3, 33, 3)):
        trees = [random_tree(rng, rng.randint(1, n), vocab) for _ in range(batch)]
        cand = torch.full((batch, n), -1, dtype=torch.long)
        par = torch.full((batch, n), NO_NODE, dtype=torch.long)
        tgt = torch.zeros((batch, n), dtype=torch.long)
        expected = []
        for b, (tokens, parents) in enumerate(trees):
            targets = [rng.randrange(vocab) for _ in tokens]
            node = 0
            while rng.random() < 0.8:  # make the target agree along a random path
                children = [i for i, p in enumerate(parents) if p == node]
                if not children:
                    break
                child = rng.choice(children)
                targets[node], node = tokens[child], child
            cand[b, : len(tokens)] = torch.tensor(tokens)
            par[b, : len(tokens)] = torch.tensor(parents)
            tgt[b, : len(tokens)] = torch.tensor(targets)
            next_token, next_sibling = child_links(parents)
            expected.append(accept_target_tokens(tokens, next_token, next_sibling, targets))
        depth = max(1, n - 1)
        args = (cand.to(device), par.to(device), tgt.to(device), depth)
        for name, (index, length, bonus) in (("twin", torch_ops.verify_tree_greedy(*args)),
                                              ("triton", triton_ops.verify_tree_greedy(*args))):
            for b, acc in enumerate(expected):
                path = index[b].tolist()
                assert path[: len(acc.path)] == acc.path and all(x == -1 for x in path[len(acc.path):]), (name, b, path, acc)
                assert int(length[b]) == acc.num_accepted and int(bonus[b]) == acc.tokens[-1], (name, b)
        accepted_total += sum(a.num_accepted for a in expected)
    assert accepted_total > 10  # the targets did follow the trees
    return accepted_total


def check_tree_mask_bits(device: str) -> int:
    """Batches of random trees' packed masks (prefix visible, nodes by their ancestors) against the host packer the
    FlashInfer backend uses (_packed_trees), trees of up to 33 nodes (three 16-bit words a row), written into a
    buffer sized for the longest keys, its bytes past the requests' kept."""
    rng = random.Random(3)
    checked = 0
    for batch, n, max_kv in ((1, 1, 9), (4, 12, 70), (16, 6, 300), (3, 33, 100)):
        trees = [tuple(random_tree(rng, n, 5)[1]) for _ in range(batch)]
        kv_lens = [rng.randint(n, max_kv) for _ in range(batch)]
        want, offsets = _packed_trees(trees, kv_lens)
        words = -(-n // 16)
        ancestors = torch.tensor([[[row >> (16 * w) & 0xFFFF for w in range(words)] for row in ancestor_rows(t)]
                                  for t in trees], dtype=torch.int32)
        args = (torch.tensor(kv_lens, dtype=torch.int32).to(device), offsets.to(device), ancestors.to(device))
        size = batch * -(-n * max_kv // 8)
        for name, kernel in (("twin", torch_ops.tree_mask_bits), ("triton", triton_tree_mask.tree_mask_bits)):
            out = torch.full((size,), 0xA5, dtype=torch.uint8, device=device)
            kernel(*args, out)
            got = out.cpu()
            assert torch.equal(got[: want.numel()], want), (name, batch, n)
            assert bool((got[want.numel():] == 0xA5).all()), (name, "bytes past the masks changed")
        checked += want.numel()
    return checked


def _attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain attention of q [R, Hq, D] over keys/values [R, J, Hkv, D] in float64: (output, natural-log sum of exp)."""
    group = q.shape[1] // keys.shape[2]
    k, v = (t.double().repeat_interleave(group, 2) for t in (keys, values))
    scores = torch.einsum("rhd,rjhd->rhj", q.double(), k) * scale
    return torch.einsum("rhj,rjhd->rhd", torch.softmax(scores, -1), v), torch.logsumexp(scores, -1)


def check_merge_own_attention(device: str, dtype: torch.dtype) -> int:
    """A draft node's attention over a committed prefix (its output and log-sum-exp given) and its own keys (strided
    views of a draft loop's dense buffer [B, K, S-1, Hkv, D]) against attention over both at once: grouped-query
    heads (3 and 4 per key-value head), head sizes 64, 128 and 48 (not a power of two), 1 to 6 own keys."""
    g = torch.Generator().manual_seed(11)
    rows_checked = 0
    tol = 2e-5 if dtype == torch.float32 else 2e-2
    for bs, topk, depth, slots, heads, kv, dim, prefix in ((1, 1, 1, 4, 6, 2, 64, 5), (3, 4, 4, 6, 6, 2, 64, 40),
                                                            (2, 4, 6, 6, 32, 8, 128, 100), (3, 1, 3, 3, 4, 1, 48, 7)):
        rows, scale = bs * topk, dim ** -0.5
        q = torch.randn(rows, heads, dim, generator=g).to(dtype)
        keys = torch.randn(rows, prefix, kv, dim, generator=g).to(dtype)
        values = torch.randn(rows, prefix, kv, dim, generator=g).to(dtype)
        local = torch.randn(2, bs, topk, slots, kv, dim, generator=g).to(dtype)  # one layer's dense buffer
        own_k, own_v = (local[i, :, :, :depth].flatten(0, 1) for i in (0, 1))
        want, _ = _attention(q, torch.cat([keys, own_k], 1), torch.cat([values, own_v], 1), scale)
        out_prefix, lse_prefix = _attention(q, keys, values, scale)
        args = [t.to(device) for t in (q, own_k, own_v, out_prefix.to(dtype), lse_prefix.float())]
        for name, kernel in (("twin", torch_ops.merge_own_attention), ("triton", triton_own_attention.merge_own_attention)):
            got = kernel(*args, scale)
            assert got.dtype == dtype and got.shape == q.shape, (name, got.dtype, got.shape)
            error = (got.cpu().double() - want).abs().max().item()
            assert error < tol, (name, dtype, bs, topk, depth, heads, kv, dim, error)
        rows_checked += rows
    return rows_checked


def _paged_case(g: torch.Generator, rng: random.Random, requests: int, rows: int, kv_heads: int, group: int, dim: int,
                page: int, max_kv: int, mode: int, dtype: torch.dtype) -> tuple:
    """A paged cache holding `requests` requests' keys in shuffled pages, their query rows (mode 0: 1 to rows each;
    causal and tree: rows each), and the expected (output, natural-log sum of exp) in float64."""
    kv_lens = [rng.randint(rows, max_kv) for _ in range(requests)]
    counts = [-(-k // page) for k in kv_lens]
    pages = list(range(sum(counts) + 3))
    rng.shuffle(pages)
    ids, n_q, parents = pages[: sum(counts)], [], []
    for _ in range(requests):
        n_q.append(rng.randint(1, rows) if mode == triton_paged_attention.PREFIX else rows)
        parents.append(random_tree(rng, rows, 50)[1] if mode == triton_paged_attention.TREE else None)
    slots = len(pages) * page
    k_cache = torch.randn(slots, kv_heads, dim, generator=g).to(dtype)
    v_cache = torch.randn(slots, kv_heads, dim, generator=g).to(dtype)
    q = torch.randn(sum(n_q) + 2, kv_heads * group, dim, generator=g).to(dtype)  # two rows past the requests
    words = -(-rows // 16)
    ancestors = torch.tensor([[[a >> (16 * w) & 0xFFFF for w in range(words)] for a in ancestor_rows(tuple(p))]
                              if p is not None else [[0] * words] * rows for p in parents], dtype=torch.int32)
    want_out = torch.zeros(q.shape, dtype=torch.float64)
    want_lse = torch.full(q.shape[:2], float("-inf"), dtype=torch.float64)
    qo, base = [0], 0
    for b, (kv, n) in enumerate(zip(kv_lens, n_q)):
        table = ids[base: base + counts[b]]
        base += counts[b]
        slot = torch.tensor([table[j // page] * page + j % page for j in range(kv)])
        seen = torch.ones(n, kv, dtype=torch.bool)
        for i in range(n):
            for j in range(kv - n, kv):
                if mode == triton_paged_attention.CAUSAL:
                    seen[i, j] = j <= kv - n + i
                elif mode == triton_paged_attention.TREE:
                    seen[i, j] = bool(ancestor_rows(tuple(parents[b]))[i] >> (j - (kv - n)) & 1)
        keys = k_cache[slot].double().repeat_interleave(group, 1)
        values = v_cache[slot].double().repeat_interleave(group, 1)
        scores = torch.einsum("ihd,jhd->hij", q[qo[-1]: qo[-1] + n].double(), keys) * dim ** -0.5
        scores = scores.masked_fill(~seen, float("-inf"))
        want_out[qo[-1]: qo[-1] + n] = torch.einsum("hij,jhd->ihd", torch.softmax(scores, -1), values)
        want_lse[qo[-1]: qo[-1] + n] = torch.logsumexp(scores, -1).t()
        qo.append(qo[-1] + n)
    indptr = list(itertools.accumulate(counts, initial=0))
    index = [torch.tensor(x, dtype=torch.int32) for x in (qo, indptr, kv_lens, ids)]
    return q, k_cache, v_cache, index, ancestors, sum(n_q), want_out, want_lse


def check_paged_attention(device: str, dtype: torch.dtype) -> int:
    """A few query rows a request over a paged cache (shuffled pages, partly filled last pages) against attention in
    float64 over the gathered keys: beams over a prefix (with their log-sum-exp), causal chains and trees; grouped
    heads 1, 2, 3 and 4 a key-value head, head sizes 64, 48 and 32, trees of up to 16 nodes and of 20; keys in one split and in up to four (each at least 64
    keys), merged by the last split; the rows past the requests left as they were."""
    g, rng = torch.Generator().manual_seed(17), random.Random(17)
    tol = 2e-5 if dtype == torch.float32 else 3e-2
    checked = 0
    for mode in (triton_paged_attention.PREFIX, triton_paged_attention.CAUSAL, triton_paged_attention.TREE):
        for requests, rows, kv_heads, group, dim, page, max_kv, splits in (
                (1, 6, 2, 3, 64, 16, 300, 4), (3, 4, 2, 4, 48, 4, 90, 1), (2, 8, 1, 1, 64, 16, 200, 3),
                (2, 20, 1, 2, 32, 16, 150, 2)):  # 20 rows: a tree's ancestor bits in two words a row
            q, k_cache, v_cache, index, ancestors, used, want_out, want_lse = _paged_case(
                g, rng, requests, rows, kv_heads, group, dim, page, max_kv, mode, dtype)
            qo, indptr, kv_lens, ids = (t.to(device) for t in index)
            args = (q.to(device), k_cache.to(device), v_cache.to(device), page, qo, indptr, kv_lens, ids,
                    ancestors.to(device) if mode == triton_paged_attention.TREE else None, mode, dim ** -0.5)
            work = (*triton_paged_attention.shared_scratch(rows, group, dim, torch.device(device)), splits)
            for name in ("twin", "triton"):
                out = torch.full(q.shape, 7.0, dtype=dtype, device=device)
                lse = torch.zeros(q.shape[:2], dtype=torch.float32, device=device)
                if name == "twin":
                    torch_ops.paged_attention(*args, out=out, lse=lse)
                else:
                    triton_paged_attention.paged_attention(*args, rows, work, out=out, lse=lse, min_chunk=64)
                    assert int(work[2].abs().sum()) == 0, "the split counts were not reset"
                got, got_lse = out.cpu().double(), lse.cpu().double()
                error = (got[:used] - want_out[:used]).abs().max().item()
                lse_error = (got_lse[:used] - want_lse[:used]).abs().max().item()
                assert error < tol and lse_error < tol, (name, mode, dtype, requests, rows, group, dim, splits, error,
                                                         lse_error)
                assert bool((got[used:] == 7.0).all()), (name, mode, "rows past the requests were written")
            checked += used
    return checked


def check_gumbel_argmax(device: str) -> int:
    """Position-keyed Gumbel-max samples, the fused kernel against the twin (which builds the [B, V] noise),
    with filtered (-inf) tokens, and both against what sampling.sample draws for those seeds and positions."""
    from splitspec.runtime.sampling import position_keys, process_logits, sample
    from splitspec.runtime.sampling_params import SamplingParams

    g = torch.Generator().manual_seed(3)
    drawn = 0
    for rows, vocab in ((1, 5), (7, 1000), (16, 4099)):
        logits = (3 * torch.randn(rows, vocab, generator=g)).to(device)
        seeds = torch.randint(0, 2**40, (rows,), generator=g).to(device)
        positions = torch.randint(0, 5000, (rows,), generator=g).to(device)
        temps, top_ks = torch.full((rows,), 0.8, device=device), torch.full((rows,), min(50, vocab), device=device)
        processed = process_logits(logits, temps, top_ks, torch.full((rows,), 0.95, device=device))
        keys = position_keys(seeds, positions)
        twin, kernel = torch_ops.gumbel_argmax(processed, keys), triton_ops.gumbel_argmax(processed, keys)
        assert torch.equal(twin, kernel), (rows, vocab, twin, kernel)
        assert bool(torch.isfinite(processed.gather(1, kernel[:, None])).all())  # never a filtered token
        params = [SamplingParams(temperature=0.8, top_k=min(50, vocab), top_p=0.95, seed=int(s)) for s in seeds]
        assert torch.equal(sample(logits, params, positions.tolist()), twin)
        drawn += rows
    return drawn


def check_chain_acceptance(device: str) -> int:
    """Verified chains' accepted drafts, rows and lengths: the kernel's equal the twin's, for chains accepting
    nothing, some drafts and all of them, padded rows (q > n) and n of one, two and past a power of two."""
    g = torch.Generator().manual_seed(6)
    chains = 0
    for count, q, n in ((1, 6, 6), (3, 8, 5), (5, 9, 9), (2, 2, 2), (4, 4, 1), (7, 17, 17)):
        targets = torch.randint(0, 5, (count * q,), generator=g)
        ids = torch.randint(0, 5, (count * q,), generator=g)
        for b in range(count):  # chain b accepts b % n drafts at least (the rest random)
            for j in range(min(b, n - 1)):
                ids[b * q + 1 + j] = targets[b * q + j]
        lengths = torch.randint(1, 1000, (count,), generator=g)
        want = torch_ops.chain_acceptance(targets, ids, lengths, n)
        got = triton_ops.chain_acceptance(targets.to(device), ids.to(device), lengths.to(device), n)
        assert torch.equal(got.cpu(), want), (count, q, n, got, want)
        assert (want[0] >= torch.arange(count).clamp(max=n - 1)).all() and (want[0] <= n - 1).all()
        chains += count
    return chains


def check_shift_paged_inputs(device: str) -> int:
    """A paged graph's inputs moved back by a shift: the kernel's key counts, positions and K/V slots equal the twin's,
    and both equal a batch planned at the moved lengths (slot_list of each request's pages), for shifts of 0 to q - 1
    keys across page boundaries, one row a request and trees of 6 and 17."""
    g = torch.Generator().manual_seed(8)
    moved = 0
    for count, q, page_size in ((1, 6, 4), (3, 1, 16), (5, 6, 1), (4, 17, 8)):
        upper = torch.randint(q + 20, 200, (count,), generator=g)
        shift = -torch.randint(0, q, (count,), generator=g)
        pages = [torch.randperm(500, generator=g)[: -(-int(n) // page_size)].tolist() for n in upper]
        kv_indptr = torch.tensor(list(itertools.accumulate([len(p) for p in pages], initial=0)), dtype=torch.int32)
        page_ids = torch.tensor([p for table in pages for p in table] + [7] * 5, dtype=torch.int32)
        depth = torch.randint(0, q, (count, q), generator=g)
        positions = (upper.view(-1, 1) - q + depth).view(-1)
        want_slots = torch.tensor([s for table, n in zip(pages, upper + shift)
                                   for s in slot_list(table, page_size, int(n) - q, int(n))])
        results = []
        for shift_paged_inputs in (torch_ops.shift_paged_inputs, triton_batch_shift.shift_paged_inputs):
            kv_lens, pos = upper.to(torch.int32).to(device), positions.clone().to(device)
            slots = torch.full((count * q + 3,), -1, dtype=torch.long, device=device)  # rows past the batch's kept
            shift_paged_inputs(shift.to(device), kv_lens, pos, kv_indptr.to(device), page_ids.to(device), slots, q,
                               page_size)
            results.append((kv_lens.cpu(), pos.cpu(), slots.cpu()))
        for kv_lens, pos, slots in results:
            assert torch.equal(kv_lens, (upper + shift).to(torch.int32)), (count, q, kv_lens, upper + shift)
            assert torch.equal(pos, positions + shift.repeat_interleave(q)), (count, q)
            assert torch.equal(slots[: count * q], want_slots) and (slots[count * q :] == -1).all(), (count, q, page_size)
        moved += count
    return moved


def check_draft_topk(device: str) -> int:
    """A draft step's softmax + top-k scored by the parent beam: the same tokens, in the same order, and the
    same scores to fp32 rounding, for vocabularies across block boundaries."""
    g = torch.Generator().manual_seed(4)
    rows_checked = 0
    for rows, vocab, k in ((1, 7, 1), (6, 1000, 4), (9, 5000, 8), (4, 32000, 3)):
        logits = (4 * torch.randn(rows, vocab, generator=g)).to(device)
        parents = torch.rand(rows, generator=g).to(device)
        want_scores, want_index = torch_ops.draft_topk(logits, parents, k)
        got_scores, got_index = triton_ops.draft_topk(logits, parents, k)
        assert torch.equal(got_index, want_index), (rows, vocab, k)
        torch.testing.assert_close(got_scores, want_scores, rtol=1e-5, atol=1e-7)
        rows_checked += rows
        # a model's own logits, read as float32 in the kernel: what it gives their float32 copy (fp16 only under
        # Triton's interpreter, which reads bf16 wrong; both on a GPU)
        for dtype in (torch.float16,) if device == "cpu" else (torch.bfloat16, torch.float16):
            low = logits.to(dtype)
            got_scores, got_index = triton_ops.draft_topk(low, parents, k)
            want_scores, want_index = triton_ops.draft_topk(low.float(), parents, k)
            assert torch.equal(got_index, want_index), (dtype, rows, vocab, k)
            # the normaliser's sum may group its terms otherwise (a block's layout follows the loaded dtype)
            torch.testing.assert_close(got_scores, want_scores, rtol=1e-6, atol=1e-8)
            rows_checked += rows
    return rows_checked


def check_top_k_top_p(device: str) -> int:
    """Temperature, top-k and top-p: the kernel's threshold search keeps exactly the twin's tokens, also
    with ties at the cut (bf16-rounded logits), with filters off, and at the rule's edges."""
    from splitspec.runtime.sampling import process_logits

    g = torch.Generator().manual_seed(5)
    rows_checked = 0
    for rows, vocab, tie in ((3, 4, False), (16, 1000, False), (16, 1000, True), (8, 5003, True)):
        logits = 3 * torch.randn(rows, vocab, generator=g)
        if tie:  # bf16 logits tie often: every kept set must take or leave a tie group whole
            logits = logits.bfloat16().float()
        logits = logits.to(device)
        temps = (0.3 + torch.rand(rows, generator=g)).to(device)
        top_ks = torch.randint(-1, min(vocab, 60), (rows,), generator=g)
        top_ks[0] = -1
        top_ps = torch.rand(rows, generator=g)
        top_ps[1] = 1.0
        top_ks, top_ps = top_ks.to(device), top_ps.to(device)
        want = torch_ops.top_k_top_p(logits, temps, top_ks, top_ps)
        got = triton_ops.top_k_top_p(logits, temps, top_ks, top_ps)
        assert torch.equal(torch.isfinite(got), torch.isfinite(want)), (rows, vocab, tie)
        assert torch.equal(got[torch.isfinite(got)], want[torch.isfinite(want)])
        assert torch.equal(process_logits(logits, temps, top_ks, top_ps).isfinite(), want.isfinite())
        rows_checked += rows
    # the rule on a known row (SGLang's: mass ranked strictly before a token must not exceed top_p)
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]] * 4)
    logits = probs.log().to(device)
    ones = torch.ones(4, device=device)
    kept = triton_ops.top_k_top_p(logits, ones, torch.tensor([-1, 2, 3, -1], device=device),
                                  torch.tensor([0.7, 1.0, 0.6, 0.01], device=device)).isfinite().cpu()
    assert kept.tolist() == [[True, True, False, False], [True, True, False, False],
                             [True, True, False, False], [True, False, False, False]], kept
    return rows_checked


def check_accept_tree_coins(device: str) -> int:
    """SGLang's threshold rule with the bonus draw, kernel and twin, against the engine's host walk
    (verifier_svc.acceptance.accept_with_coins) on random trees, coins and thresholds, lossless (1, 1) and lossy."""
    from splitspec.verifier_svc.acceptance import accept_with_coins

    rng = random.Random(6)
    g = torch.Generator().manual_seed(6)
    accepted_total = 0
    for batch, n, vocab, single, acc in ((1, 1, 5, 1.0, 1.0), (6, 8, 6, 1.0, 1.0), (8, 12, 300, 0.8, 0.6),
                                         (5, 16, 2100, 0.5, 0.0), (4, 10, 40, 1.0, 1.0)):
        trees = [random_tree(rng, rng.randint(1, n), vocab) for _ in range(batch)]
        cand = torch.full((batch, n), 0, dtype=torch.long)
        links = torch.full((2, batch, n), NO_NODE, dtype=torch.long)
        logits = torch.randn(batch, n, vocab, generator=g)
        for b, (tokens, parents) in enumerate(trees):
            for i, p in enumerate(parents):  # make the target like the drafts, so that paths get accepted
                if p != NO_NODE:
                    logits[b, p, tokens[i]] += 3.0
        probs = torch.softmax(logits, -1)
        coins, final_coins = torch.rand(batch, n, generator=g), torch.rand(batch, n, generator=g)
        expected, max_depth = [], 1
        for b, (tokens, parents) in enumerate(trees):
            next_token, next_sibling = child_links(parents)
            cand[b, : len(tokens)] = torch.tensor(tokens)
            links[0, b, : len(tokens)] = torch.tensor(next_token)
            links[1, b, : len(tokens)] = torch.tensor(next_sibling)
            expected.append(accept_with_coins(tokens, next_token, next_sibling, probs[b], coins[b].tolist(),
                                              final_coins[b].tolist(), single, acc))
            depth = {0: 0}
            for i, p in enumerate(parents[1:], start=1):
                depth[i] = depth[p] + 1
            max_depth = max(max_depth, max(depth.values()))
        args = [t.to(device) for t in (cand, links[0], links[1], probs, coins, final_coins)]
        for name, fn in (("twin", torch_ops.accept_tree_coins), ("kernel", triton_ops.accept_tree_coins)):
            index, length, bonus = (t.cpu() for t in fn(*args, single, acc, max_depth))
            for b, want in enumerate(expected):
                got = index[b, : int(length[b]) + 1].tolist()
                assert got == want.path, (name, batch, n, b, got, want.path)
                assert bool((index[b, int(length[b]) + 1 :] == -1).all())
                assert int(bonus[b]) == want.tokens[-1], (name, batch, n, b, int(bonus[b]), want.tokens)
        accepted_total += sum(a.num_accepted for a in expected)
    assert accepted_total > 10
    return accepted_total


def check_rope_and_kv_write(device: str, dtype: torch.dtype) -> None:
    """RoPE on strided q/k views (as the model splits its fused qkv), full and partial rotary dims, and the
    fused RoPE + KV-cache write: rotated keys and the values land at their slots, nothing else is touched."""
    g = torch.Generator().manual_seed(7)
    tol = dict(rtol=2**-7, atol=2**-7) if dtype != torch.float32 else dict(rtol=1e-5, atol=1e-5)
    for head_dim, rot_dim in ((128, 128), (64, 32)):
        qkv = torch.randn(5, (8 + 2 + 2) * head_dim, generator=g).to(device, dtype)
        q = qkv[:, : 8 * head_dim].view(5, 8, head_dim)
        k = qkv[:, 8 * head_dim : 10 * head_dim].view(5, 2, head_dim)
        v = qkv[:, 10 * head_dim :].view(5, 2, head_dim)
        freqs = torch.arange(64).float()[:, None] * torch.rand(rot_dim // 2, generator=g)[None]
        cos, sin = freqs.cos().to(device), freqs.sin().to(device)
        positions = torch.tensor([0, 3, 9, 63, 17], device=device)
        for got, want in zip(triton_rope.apply_rope(q, k, cos, sin, positions, rot_dim),
                             torch_ops.apply_rope(q, k, cos, sin, positions, rot_dim)):
            torch.testing.assert_close(got, want, **tol)
        # positions as a top-k draft step of one request gives them: a stride-0 view of one position (reading it as
        # contiguous read past its storage: an illegal memory access in the draft loop's capture at top-k > 1)
        shared = positions[3:4, None].expand(1, 5).reshape(-1)
        assert shared.stride() == (0,)
        for got, want in zip(triton_rope.apply_rope(q, k, cos, sin, shared, rot_dim),
                             torch_ops.apply_rope(q, k, cos, sin, shared, rot_dim)):
            torch.testing.assert_close(got, want, **tol)
        slots = torch.tensor([7, 0, 31, 12, 3], device=device)
        caches = [[torch.zeros(40, 2, head_dim, device=device, dtype=dtype) for _ in range(2)] for _ in range(2)]
        q_fused = triton_rope.rope_and_store(q, k, v, cos, sin, positions, rot_dim, *caches[0], slots)
        q_twin = torch_ops.rope_and_store(q, k, v, cos, sin, positions, rot_dim, *caches[1], slots)
        torch.testing.assert_close(q_fused, q_twin, **tol)
        torch.testing.assert_close(caches[0][0], caches[1][0], **tol)  # rotated keys at their slots
        assert torch.equal(caches[0][1], caches[1][1])  # values copied as they are
        untouched = torch.ones(40, dtype=torch.bool)
        untouched[slots.cpu()] = False
        assert not caches[0][0][untouched.to(device)].any() and not caches[0][1][untouched.to(device)].any()


def check_norms_and_activation(device: str, dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(2)
    for rows, width in ((1, 64), (7, 384), (3, 1000)):
        x, r = (torch.randn(rows, width, generator=g).to(device, dtype) for _ in range(2))
        w = (1 + 0.1 * torch.randn(width, generator=g)).to(device, dtype)
        tol = dict(rtol=2**-7, atol=0) if dtype != torch.float32 else dict(rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(triton_ops.rms_norm(x, w, 1e-5), torch_ops.rms_norm(x, w, 1e-5), **tol)
        got, got_res = triton_ops.add_rms_norm(x, r, w, 1e-5)
        want, want_res = torch_ops.add_rms_norm(x, r, w, 1e-5)
        assert torch.equal(got_res, want_res)
        torch.testing.assert_close(got, want, **tol)
        wide = torch.randn(rows, width + 8, generator=g).to(device, dtype)[:, 4: width + 4]  # rows width + 8 apart
        pair = triton_ops.rms_norm_pair(x, w, wide, w.flip(0), 1e-5)
        assert torch.equal(pair, torch.cat([triton_ops.rms_norm(x, w, 1e-5), triton_ops.rms_norm(wide, w.flip(0), 1e-5)], -1))
        torch.testing.assert_close(pair, torch_ops.rms_norm_pair(x, w, wide, w.flip(0), 1e-5), **tol)
        gate_up = torch.randn(rows, 2 * width, generator=g).to(device, dtype)
        torch.testing.assert_close(triton_ops.silu_and_mul(gate_up), torch_ops.silu_and_mul(gate_up), **tol)


def check_fp8_quantization(device: str, dtype: torch.dtype) -> int:
    """Per-token FP8 activations: the same scales and the same float8 bits (both divide in float32 and round
    to nearest, saturating), for rows wider than one block, an all-zero row, and outliers."""
    g = torch.Generator().manual_seed(5)
    rows = 0
    for count, width in ((1, 64), (5, 4096), (3, 5000)):
        x = (torch.randn(count, width, generator=g) * 3).to(device, dtype)
        x[0, :7] = torch.tensor([0.0, 1e-3, -2.5, 448.0, -1e4, 17.0, 0.5]).to(device, dtype)
        if count > 1:
            x[1] = 0
        got_q, got_s = triton_ops.quantize_fp8_per_token(x)
        want_q, want_s = torch_ops.quantize_fp8_per_token(x)
        assert got_q.dtype == torch.float8_e4m3fn and got_s.shape == (count, 1), (got_q.dtype, got_s.shape)
        assert torch.equal(got_s, want_s), (got_s, want_s)
        got, want = got_q.float(), want_q.float()
        if device == "cpu":
            # Triton's interpreter emulates the float8 cast its own way (it truncates 0.0068 to 0.0059, not 0.0078, and
            # drops the carry into the exponent: 31.7 -> 16, not 32); a GPU rounds to nearest, checked bit for bit
            # there. Here: every element within that emulation's reach of the twin's (scales, rows, strides right)
            assert (got * want >= 0).all() and ((got - want).abs() <= want.abs() / 2 + 2**-9).all()
        else:
            assert torch.equal(got_q.view(torch.uint8), want_q.view(torch.uint8)), (got - want).abs().max()
        rows += count
    return rows


def main(device: str = "cpu") -> int:
    dtypes = (torch.float32, torch.float16) if device == "cpu" else (torch.bfloat16, torch.float32)
    with torch.no_grad():
        for dtype in dtypes:
            moved = check_move_kv_slots(device, dtype)
            check_norms_and_activation(device, dtype)
            check_rope_and_kv_write(device, dtype)
            fp8_rows = check_fp8_quantization(device, dtype)
            merged_rows = check_merge_own_attention(device, dtype)
            paged_rows = check_paged_attention(device, dtype)
        accepted = check_verify_tree_greedy(device)
        drawn = check_gumbel_argmax(device)
        draft_rows = check_draft_topk(device)
        chains = check_chain_acceptance(device)
        shifted = check_shift_paged_inputs(device)
        filtered = check_top_k_top_p(device)
        coin_accepted = check_accept_tree_coins(device)
        mask_bytes = check_tree_mask_bits(device)
    print(f"kernel checks on {device}: {moved} KV moves per dtype, {accepted} accepted tree nodes (greedy), "
          f"{coin_accepted} (threshold rule, with bonus draws), {drawn} keyed Gumbel-max samples, {draft_rows} draft "
          f"top-k rows, {chains} verified chains' acceptance, {shifted} graph batches' shifts, {filtered} top-k/top-p rows, {fp8_rows} per-token FP8 rows, {mask_bytes} packed tree-mask bytes, {merged_rows} draft-node attention rows and {paged_rows} paged-attention rows per dtype, norms, SiLU-and-mul, RoPE and RoPE + KV write in "
          f"{[str(d) for d in dtypes]}: all equal their twins")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else "cpu"))

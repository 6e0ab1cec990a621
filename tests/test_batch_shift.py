"""A step's batch built at each request's upper length and moved back by a shift on the device (runtime.batch_shift)
gives the forward a batch built at the lengths themselves gives: logits, and K/V written at the same slots."""

from __future__ import annotations

import pytest
import torch
from helpers import load_runner, make_hf_model, random_ids, save_checkpoint

from splitspec.runtime.batch import SequenceInput
from splitspec.runtime.kv_cache import BlockTable
from splitspec.runtime.tree import positions, tree_mask

UPPER = 5  # every draft of a 4-node chain accepted: the length moves by 5 at most
NODES = 4
TREES = [(-1, 0, 1, 2), (-1, 0, 0, 1), (-1, 0, 1, 2)]  # two chains and a tree, 4 nodes each


def setup(tmp_path):
    runner = load_runner(save_checkpoint(make_hf_model("llama-gqa-llama3", seed=3), tmp_path / "model"), page_size=4)
    tables = [BlockTable() for _ in TREES]
    for i, table in enumerate(tables):  # prompts of different lengths, prefilled and committed
        prompt = random_ids(7 + 5 * i, runner.config.vocab_size, seed=i)
        runner.forward(runner.batch([SequenceInput(table, prompt, logits="none")]))
        runner.kv_cache.set_length(table, len(prompt))
    # the pool's unwritten slots hold noise: a key read or written at a wrong slot changes the logits
    pool = runner.kv_cache.pool
    written = torch.zeros(pool.shape[2], dtype=torch.bool)
    for table in tables:
        written[table.pages] = True
    noise = torch.randn(pool.shape, generator=torch.Generator().manual_seed(0)).to(pool.dtype).to(pool.device)
    pool[:, :, ~written.to(pool.device)] = noise[:, :, ~written.to(pool.device)]
    return runner, tables


def verify(runner, tables, moved: list[int], shift: bool, applied: bool = True):
    """The verification of TREES at each request's length + moved[i] (its accepted tokens, forwarded first): built there,
    or built at length + UPPER and shifted back by moved[i] - UPPER (applied False: built there and not shifted).
    (logits, each request's length before the verification)."""
    kv = runner.kv_cache
    for i, (table, d) in enumerate(zip(tables, moved)):  # the tokens the last step accepted, in the cache
        runner.forward(runner.batch([SequenceInput(table, random_ids(d, runner.config.vocab_size, seed=10 + i), logits="none")]))
        kv.set_length(table, table.num_tokens + d)
    lengths = [t.num_tokens for t in tables]
    nodes = [random_ids(NODES, runner.config.vocab_size, seed=20 + i) for i in range(len(tables))]
    if shift:  # as the device-fed step builds it: at the upper lengths, their pages reserved
        for table, d in zip(tables, moved):
            kv.reserve(table, table.num_tokens - d + UPPER + NODES)
            table.num_tokens += UPPER - d
    batch = runner.batch([SequenceInput(t, ids, positions(list(p), t.num_tokens), tree_mask(p), "all", p)
                          for t, ids, p in zip(tables, nodes, TREES)])
    if shift and applied:
        batch.shift_back(torch.tensor([d - UPPER for d in moved], device=runner.device))
    logits = runner.forward(batch).logits
    for table, length in zip(tables, lengths):
        table.num_tokens = length
    return logits, lengths


def test_a_batch_moved_back_on_the_device_equals_one_built_at_its_lengths(tmp_path):
    runner, tables = setup(tmp_path)
    kv, pool = runner.kv_cache, runner.kv_cache.pool
    before, start = pool.clone(), [t.num_tokens for t in tables]

    def reset():
        pool.copy_(before)
        for table, length in zip(tables, start):
            kv.set_length(table, length)

    moved = [1, UPPER, 3]  # nothing accepted, everything, some
    want, lengths = verify(runner, tables, moved, shift=False)
    after_want, want_pages = pool.clone(), [t.pages[:] for t in tables]
    reset()
    have, _ = verify(runner, tables, moved, shift=True)
    assert have.shape == want.shape == (len(TREES) * NODES, runner.config.vocab_size)
    torch.testing.assert_close(have, want, rtol=1e-5, atol=1e-5)
    # every request's nodes' K/V at the slots right after its length, as the unshifted batch wrote them
    page_size = runner.kv_cache.page_size
    for table, pages, length in zip(tables, want_pages, lengths):  # (the pages past the start may be others now)
        for slot in range(length, length + NODES):
            have_kv = pool[:, :, table.pages[slot // page_size], slot % page_size]
            torch.testing.assert_close(have_kv, after_want[:, :, pages[slot // page_size], slot % page_size])
    # not moved back, the batch built at the upper lengths attends to the noise past each length: other logits
    reset()
    far, _ = verify(runner, tables, moved, shift=True, applied=False)
    assert not torch.allclose(far[:NODES], want[:NODES], atol=1e-3)
    torch.testing.assert_close(far[NODES : 2 * NODES], want[NODES : 2 * NODES], rtol=1e-5, atol=1e-5)  # its shift was 0


def test_a_shift_that_is_not_one_integer_a_request_is_refused(tmp_path):
    runner, tables = setup(tmp_path)
    batch = runner.batch([SequenceInput(t, [5], logits="all") for t in tables])
    for bad in (torch.zeros(2, dtype=torch.long), torch.zeros(3, dtype=torch.float32), torch.zeros(3, 1, dtype=torch.long)):
        with pytest.raises(ValueError, match="a shift of shape"):
            batch.shift_back(bad.to(runner.device))


def test_a_paged_graphs_inputs_moved_back_equal_those_planned_at_the_lengths():
    """shift_graph_inputs' ops (a captured graph's static inputs, moved on the device; run here on the CPU's tensors):
    the key counts, positions and K/V slots of trees planned at their upper lengths and moved back equal those planned
    at the lengths themselves, and the padding request after them is left as it was."""
    from types import SimpleNamespace

    from splitspec.runtime.attention.flashinfer_replan import Arena, fill
    from splitspec.runtime.batch_shift import shift_graph_inputs
    from splitspec.runtime.kv_cache import slot_list

    page_size, q, bs = 4, NODES, 4  # three requests and a padding one
    tables = [[9, 3, 7, 1, 12], [2, 8, 5, 11, 4, 6], [10, 0, 13, 14]]  # each request's pages, upper lengths' worth
    lengths = [6, 9, 3]  # after acceptance
    moved = [-4, 0, -2]
    upper = [n - m for n, m in zip(lengths, moved)]
    pad = (q + 1, [15, 16], list(range(61, 61 + q)), list(range(1, q + 1)))  # kv_len, pages, slots, positions

    def planned(at: list[int]):
        arena = Arena.make(bs, 64, torch.device("cpu"), mask=False)
        fill(arena, [q] * bs, [n + q for n in at] + [pad[0]], tables + [pad[1]], page_size)
        slots = [s for n, pages in zip(at, tables) for s in slot_list(pages, page_size, n, n + q)] + pad[2]
        depths = [0, 1, 1, 2]
        positions = torch.tensor([n + d for n in at for d in depths] + pad[3])
        state = SimpleNamespace(plan=SimpleNamespace(paged=SimpleNamespace(arena=arena)), out_slots=torch.tensor(slots))
        return state, positions

    want, want_positions = planned(lengths)
    state, positions = planned(upper)
    shift_graph_inputs(state, positions, 3, q, torch.tensor(moved), page_size)
    torch.testing.assert_close(state.plan.paged.arena.view("kv_lens"), want.plan.paged.arena.view("kv_lens"))
    torch.testing.assert_close(positions, want_positions)
    torch.testing.assert_close(state.out_slots, want.out_slots)

"""Verification: a step's trees against the target's logits. Trees of different sizes padded to one captured
graph's shape, every row's target token from one sampling kernel over the batch, the walk that accepts
(by the target's own tokens, or SGLang's coin rule for sampled requests), the KV moves that compact an
accepted path, and the logprobs of emitted tokens."""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from splitspec import kernels
from splitspec.runtime.batch import device_tensor
from splitspec.runtime.penalties import apply_penalties, path_tokens
from splitspec.runtime.runner import ModelRunner
from splitspec.runtime.sampling import FINAL_COIN_SALT, keyed_uniform, process_logits, sample
from splitspec.runtime.sampling_params import SamplingParams
from splitspec.runtime.tree import DraftTree, child_links, depths
from splitspec.verifier_svc.acceptance import Acceptance, accept_target_tokens
from splitspec.verifier_svc.step_types import Chunk, Request, SpecConfig, TokenLogprob

ARGMAX = SamplingParams(temperature=0.0)  # a row sample() argmaxes (its token unused, or a greedy request's)


@dataclass
class Verify:
    request: Request
    tree: DraftTree
    seq_len: int  # committed KV length before the step


def token_logprobs(logits: torch.Tensor, tokens: list[int], params: SamplingParams) -> list[TokenLogprob] | None:
    """logits [k, V]: row j predicts tokens[j]. None when the request did not ask for logprobs."""
    if params.logprobs is None:
        return None
    return batch_token_logprobs(logits, [(list(range(len(tokens))), tokens, params)])[0]


def batch_token_logprobs(logits: torch.Tensor, picks: list[tuple[list[int], list[int], SamplingParams]]) -> list[list[TokenLogprob]]:
    """token_logprobs of each pick (its rows of logits, the tokens they predict, its parameters, which ask for logprobs):
    one log-softmax over every pick's rows, one gather, one top-k at the largest k asked and one read to the host for
    the whole step, not a few kernels and a device sync per request (a batch of 32 asking for logprobs paid 32 syncs
    a step)."""
    rows = [r for request_rows, _, _ in picks for r in request_rows]
    tokens = device_tensor([t for _, tokens, _ in picks for t in tokens], logits.device)
    k = min(max(params.logprobs for _, _, params in picks), logits.shape[-1])
    table = logprob_table(logits, None if rows == list(range(logits.shape[0])) else rows, tokens, k)
    return read_logprobs(table.tolist(), [(len(request_rows), params.logprobs) for request_rows, _, params in picks], k)


def logprob_table(logits: torch.Tensor, rows: list[int] | None, tokens: torch.Tensor, k: int) -> torch.Tensor:
    """[n, 1 + 2k] float64 on the logits' device, nothing read: for each row of logits (rows: which; None: all) the
    log-probability of its token (tokens [n], on the device), then the k largest and their token ids (exact in float64),
    for one copy to the host (read_logprobs reads it)."""
    if rows is not None:
        logits = logits.index_select(0, device_tensor(rows, logits.device))
    logprobs = logits.float().log_softmax(-1)
    chosen = logprobs.gather(1, tokens[:, None]).double()
    if not k:
        return chosen
    values, ids = logprobs.topk(k, dim=-1)
    return torch.cat([chosen, values.double(), ids.double()], dim=1)


def read_logprobs(table: list[list[float]], sizes: list[tuple[int, int]], k: int) -> list[list[TokenLogprob]]:
    """A logprob_table on the host, split into requests: sizes (its rows, the k it asked for) in row order."""
    out, start = [], 0
    for count, asked in sizes:
        top, end = min(asked, k), start + count
        out.append([TokenLogprob(row[0], tuple(zip(map(int, row[1 + k : 1 + k + top]), row[1 : 1 + top]))) if top
                    else TokenLogprob(row[0]) for row in table[start:end]])
        start = end
    return out


def accepted_logprobs(logits: torch.Tensor, accepted: list) -> dict[int, list[TokenLogprob]]:
    """The logprobs of the tokens each accepted path emits (accepted: (Verify, Acceptance, its first logits row, ...)),
    by index in accepted, for the requests that ask (batch_token_logprobs: one transfer for all of them)."""
    picks = {k: ([first + node for node in acceptance.path], acceptance.tokens, v.request.params)
             for k, (v, acceptance, first, *_) in enumerate(accepted) if v.request.params.logprobs is not None}
    return dict(zip(picks, batch_token_logprobs(logits, list(picks.values())))) if picks else {}


def prompt_logprobs(prefills: list[Chunk], cu_logits: list[int], logits: torch.Tensor) -> dict[int, list[TokenLogprob]]:
    """The prompt logprobs of every fresh prompt chunk that asks (by index in prefills): a chunk's logits rows (row j:
    position chunk.start + j) give the logprobs of the prompt tokens they predict (positions chunk.start + 1 ..; the
    last prompt row predicts an output token); all chunks' from one batch_token_logprobs (lm-eval-harness sends many
    such requests at once)."""
    picks = {}
    for i, chunk in enumerate(prefills):
        request = chunk.request
        tokens = request.prompt_ids[chunk.start + 1 : chunk.end + 1] if request.wants_prompt_logprobs else None
        if tokens:
            picks[i] = (list(range(cu_logits[i], cu_logits[i] + len(tokens))), tokens,
                        replace(request.params, logprobs=request.params.prompt_logprobs))
    return dict(zip(picks, batch_token_logprobs(logits, list(picks.values())))) if picks else {}


def usable(tree: DraftTree, request: Request, budget: int, vocab: int) -> bool:
    """A drafter's tree may be verified: rooted at the request's last token, within the budget, every token in the
    vocabulary (tokens past the request's limit are dropped at emit)."""
    return (tree.tokens[0] == request.output_ids[-1] and tree.num_nodes <= budget
            and all(0 <= t < vocab for t in tree.tokens))


def pad_size(runner: ModelRunner, verifies: list[Verify]) -> int:
    """The node count every tree of a decode-only batch is padded to, 0 for none: trees of different sizes
    (NGRAM's fill what its trie knows; a request without a tree this step verifies its root alone) run as
    one replay of the captured verification graph of the smallest size that holds them, not eagerly.
    Filler nodes are children of the root in slots the request's pages already hold (its reservation
    covers its tree budget); only where every request's pages hold the padded tree."""
    if not verifies:
        return 0
    sizes = [v.tree.num_nodes for v in verifies]
    largest = max(sizes)
    if largest == 1 or (min(sizes) == largest and largest in runner.tree_pad_sizes + (
            tuple(runner.graphs.tree_sizes) if runner.graphs is not None else ())):
        return 0  # plain decode, or already graph-shaped
    q = runner.padded_tree_size(len(verifies), largest)
    page = runner.kv_cache.page_size
    if q is None or any(len(v.request.table.pages) * page < v.seq_len + q for v in verifies):
        return 0
    return q


def by_target(spec: SpecConfig, params: SamplingParams) -> bool:
    """Verified by the target's own token at each node of its unmodified logits: its argmax, or its keyed
    sample (lossless); not with penalties (each node's logits differ) or coins."""
    return not params.has_penalties and (params.is_greedy or spec.force_greedy_verify or spec.lossless)


def target_params(spec: SpecConfig, params: SamplingParams) -> SamplingParams:
    """What the target's token at a row of a request that accepts by it is sampled with: its argmax (greedy, or
    SGLANG_NGRAM_FORCE_GREEDY_VERIFY), else the request's own keyed sampling."""
    return ARGMAX if params.is_greedy or spec.force_greedy_verify else params


def target_rows(spec: SpecConfig, logits: torch.Tensor | None, cu_logits: list[int], prefills: list[Chunk],
                verifies: list[Verify]) -> list[int] | None:
    """The target's token at every logits row, on the host, when some request decides by it: each row
    sampled with its request's parameters at its output position (a tree node: the request's output
    length plus the node's depth), exactly as the request's own rows would be, in one `sample` over the
    batch and one transfer. Rows of requests that do not decide by it are argmaxed and never read."""
    ids = target_row_ids(spec, logits, cu_logits, prefills, verifies)
    return None if ids is None else ids.tolist()


def target_row_ids(spec: SpecConfig, logits: torch.Tensor | None, cu_logits: list[int], prefills: list[Chunk],
                   verifies: list[Verify]) -> torch.Tensor | None:
    """target_rows' tokens where the logits are (a device's: not yet on the host), or None."""
    if logits is None:
        return None
    sampled, used = {}, False  # row -> (its parameters, its output position), for the rows that sample
    for i, chunk in enumerate(prefills):
        if chunk.samples and not chunk.request.params.has_penalties:  # a fresh prompt's first token: position 0,
            used = True  # the chunk's last row
            if not chunk.request.params.is_greedy:
                sampled[cu_logits[i + 1] - 1] = (chunk.request.params, 0)
    for i, v in enumerate(verifies, start=len(prefills)):
        request = v.request
        if not by_target(spec, request.params):
            continue
        used = True
        row_params = target_params(spec, request.params)
        if row_params is ARGMAX:
            continue
        base = len(request.output_ids)
        for row, depth in zip(range(cu_logits[i], cu_logits[i + 1]), depths(v.tree.parents)):
            sampled[row] = (row_params, base + depth)
    if not used:
        return None
    if not sampled:  # every row argmaxed: one kernel, no per-row parameter lists
        return logits.argmax(dim=-1)
    params, output_positions = [ARGMAX] * logits.shape[0], [0] * logits.shape[0]
    for row, (row_params, position) in sampled.items():
        params[row], output_positions[row] = row_params, position
    return sample(logits, params, output_positions)


def penalized_targets(spec: SpecConfig, logits: torch.Tensor, verifies: list[Verify], offset: int,
                      cu_logits: list[int]) -> dict[int, list[int]]:
    """The target's token at every node of each tree whose request has penalties (or a logit bias, min_tokens) and
    accepts by the target's own token (greedy, or lossless keyed sampling), by its index from offset (cu_logits'):
    each tree's rows penalised with the drafts on each node's own path counted (lossless, see penalties), then every
    such tree's rows sampled by one `sample` and read with one transfer, not a sync per request (a batch of chat
    requests with a frequency penalty paid one each step). The coin rule's trees are walked one by one (accept_tree)."""
    picks = [(i, v) for i, v in enumerate(verifies, start=offset) if v.request.params.has_penalties and (
        v.request.params.is_greedy or spec.force_greedy_verify or spec.lossless)]
    if not picks:
        return {}
    rows, params, positions = [], [], []
    for i, v in picks:
        request, tree = v.request, v.tree
        rows.append(apply_penalties(logits[cu_logits[i] : cu_logits[i] + tree.num_nodes], request.params, request.prompt_ids,
                                    request.output_ids, path_tokens(list(tree.parents), list(tree.tokens)), request.penalties))
        params += [target_params(spec, request.params)] * tree.num_nodes
        positions += [len(request.output_ids) + d for d in depths(tree.parents)]
    flat = sample(torch.cat(rows) if len(rows) > 1 else rows[0], params, positions).tolist()
    out, start = {}, 0
    for i, v in picks:
        out[i], start = flat[start : start + v.tree.num_nodes], start + v.tree.num_nodes
    return out


def accept_tree(spec: SpecConfig, v: Verify, node_logits: torch.Tensor | None = None,
                targets: list[int] | None = None) -> Acceptance:
    """By targets, the target's token at each node, already on the host (target_rows), when the request accepts by
    them (by_target: the caller decides); else from the nodes' logits."""
    request, tree = v.request, v.tree
    next_token, next_sibling = child_links(tree.parents)
    if targets is not None:
        return accept_target_tokens(list(tree.tokens), next_token, next_sibling, targets)
    node_depths = depths(tree.parents)
    output_positions = [len(request.output_ids) + d for d in node_depths]
    params = request.params
    if params.has_penalties:  # each node with the drafts on its own path counted (lossless, see penalties)
        node_logits = apply_penalties(node_logits, params, request.prompt_ids, request.output_ids,
                                      path_tokens(list(tree.parents), list(tree.tokens)), request.penalties)
    if params.is_greedy or spec.force_greedy_verify or spec.lossless:
        greedy = params.is_greedy or spec.force_greedy_verify
        target = node_logits.argmax(-1) if greedy else sample(node_logits, [params] * tree.num_nodes, output_positions)
        return accept_target_tokens(list(tree.tokens), next_token, next_sibling, target.tolist())
    probs = process_logits(node_logits, torch.full((tree.num_nodes,), params.temperature, device=node_logits.device),
                           torch.full((tree.num_nodes,), params.top_k, device=node_logits.device),
                           torch.full((tree.num_nodes,), params.top_p, device=node_logits.device),
                           torch.full((tree.num_nodes,), params.min_p, device=node_logits.device)
                           if params.min_p else None).softmax(-1)
    coins = keyed_uniform(params.seed, output_positions)  # one walk uses one node, so one coin, per depth
    final_coins = keyed_uniform(params.seed, output_positions, salt=FINAL_COIN_SALT)
    # the walk and the bonus draw in one kernel on a GPU (the host reference: acceptance.accept_with_coins)
    device = node_logits.device
    links = device_tensor([list(tree.tokens), next_token, next_sibling], device, torch.long)
    coin_rows = device_tensor([coins, final_coins], device, torch.float32)
    index, length, bonus = kernels.accept_tree_coins(
        links[0:1], links[1:2], links[2:3], probs[None], coin_rows[0:1], coin_rows[1:2],
        spec.accept_threshold_single, spec.accept_threshold_acc, max(node_depths))
    walk = torch.cat([index[0], length, bonus]).tolist()  # one transfer
    path = walk[: walk[-2] + 1]
    return Acceptance(path, [tree.tokens[i] for i in path[1:]] + [walk[-1]])


def kv_moves(page_size: int, v: Verify, acceptance: Acceptance, src: list[int], dst: list[int]) -> None:
    """The flat slot moves that compact the accepted path's KV to the front of the tree's slots (path
    nodes increase, so moving them down in order never overwrites a later source)."""
    pages, size = v.request.table.pages, page_size
    for j, node in enumerate(acceptance.path):
        if node != j:
            a, b = v.seq_len + node, v.seq_len + j
            src.append(pages[a // size] * size + a % size)
            dst.append(pages[b // size] * size + b % size)

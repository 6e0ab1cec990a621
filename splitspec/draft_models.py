"""Model drafters built from a resolved Speculation (splitspec.speculation: which kind of draft model the flags
name, its tree, what the target must hand it, how it loads), loading it strictly.

Everything here runs at start, before any request: a draft that does not fit the target (vocabulary,
tokenizer, d2t, hidden size, missing or extra tensors) is an error that names the problem.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING

from splitspec.drafter_svc.base import FEED_EVERY
from splitspec.speculation import FINAL_NORMED_STATE, FlagError, Speculation

if TYPE_CHECKING:  # a model drafter imports it as it loads; an NGRAM one never does
    import torch

logger = logging.getLogger(__name__)
# a drafter process's feed rounds (drafting off, FEED_EVERY rows a request) replay captured graphs up to this many rows
# (batch 32): such a graph holds every row's logits, and past it the eager round's launches weigh little against its work
FEED_GRAPH_ROWS = 512


def capture_for(runner, layers: tuple[int, ...]) -> None:
    """Make the target's forward return what a drafter with these hidden_state_layers needs: layer inputs
    are captured; the final normed state (-1) comes with every forward that asks for hidden states."""
    if layers and layers != (FINAL_NORMED_STATE,):
        runner.set_capture_layers(layers)


def build_drafter(speculation: Speculation, max_total_tokens: int | None = None, target=None):
    """The drafter a resolved Speculation names. A model drafter loads its model with the target's dtype, device
    and page size and a KV cache of --max-total-tokens (else max_total_tokens) tokens. EAGLE heads and MTP layers
    share the target's embedding (and, but for EAGLE-3, its lm_head): `target` (a ModelRunner in this process),
    else read from the target's checkpoint. The drafter's `hidden_state_layers` say what the verifier must capture
    for it. With --speculative-replay it is wrapped in the (simulated) replay drafter."""
    drafter = _build_drafter(speculation, max_total_tokens, target)
    if speculation.replay is not None:
        from splitspec.drafter_svc import replay
        from splitspec.runtime.config import ModelConfig

        steps, topk, tokens = speculation.tree
        shape = getattr(drafter, "num_steps", steps), getattr(drafter, "topk", topk), tokens
        vocab = (target.config if target is not None else ModelConfig.from_dir(speculation.checkpoints.target_dir())).vocab_size
        drafter = replay.wrap(drafter, speculation.replay, vocab, shape)
    return drafter


def _build_drafter(speculation: Speculation, max_total_tokens: int | None, target):
    from splitspec.drafter_svc.base import drafter_class

    s, kind = speculation, speculation.kind
    if kind == "ngram":
        drafter = drafter_class("NGRAM")(s.ngram)
        drafter.hidden_state_layers = ()
        return drafter
    from splitspec.runtime.config import ModelConfig
    from splitspec.runtime.runner import ModelRunner, RuntimeConfig

    load = s.draft
    target_cfg = target.config if target is not None else ModelConfig.from_dir(s.checkpoints.target_dir())
    steps, topk, tokens = s.num_steps, s.topk, s.num_draft_tokens
    path = s.checkpoints.draft_dir()
    beside = None  # a draft in its target's process on the same GPU, its cache not sized by a flag: mirror the target's
    if target is not None and not (load.max_total_tokens or max_total_tokens) and target.device.type == "cuda":
        beside = target.kv_cache.num_pages * target.kv_cache.page_size
    runner = ModelRunner.load(RuntimeConfig(
        model_path=str(path), dtype=load.dtype, device=load.device, page_size=load.page_size,
        max_total_tokens=load.max_total_tokens or max_total_tokens, load_format=load.load_format,
        mem_fraction_static=load.mem_fraction_static, attention_backend=load.attention_backend,
        disable_cuda_graph=load.disable_cuda_graph, cuda_graph_max_bs=load.cuda_graph_max_bs,
        torch_compile_max_bs=load.torch_compile_max_bs, family=None if kind == "standalone" else kind,
        quantization=load.quantization, kv_tokens_beside_target=beside))
    # the draft follows its target's sequences, however short its own config's context (EAGLE heads often name 2048):
    # its graphs are made for the target's (SGLang gives a draft model its target's context length too)
    runner.context_length = max(runner.context_length, target.context_length if target is not None
                                else target_cfg.max_position_embeddings)
    check_vocabulary(kind, runner.config, target_cfg, path, target.model_dir if target is not None else s.checkpoints.target_dir())
    layers = s.hidden_state_layers
    check_feature_width(kind, runner, target_cfg, layers, path)
    token_map = None
    if kind == "eagle3":
        if load.token_map:
            logger.warning("--speculative-token-map %s ignored: an EAGLE-3 head maps its own draft vocabulary (d2t)",
                           load.token_map)
        token_map = checked_hot_tokens(runner.model, runner.config.vocab_size, path)
    elif load.token_map:
        from splitspec.runtime.token_map import load_token_map

        token_map = load_token_map(load.token_map, target_cfg.vocab_size if target_cfg else runner.config.vocab_size)
    if token_map is not None and len(token_map) < topk:
        raise FlagError(f"the draft vocabulary has {len(token_map)} ids, fewer than --speculative-eagle-topk {topk}")
    if kind == "standalone" and token_map is not None:
        runner.model.set_hot_tokens(token_map)
    if kind != "standalone":
        embed, head = _target_embed_and_head(s, target, runner, kind)
        if kind in ("eagle", "mtp") and token_map is not None:
            head = head[token_map.to(head.device)].contiguous()
        runner.model.share_target(embed, head)
    if s.multi_layer:
        from splitspec.drafter_svc.multi_layer_mtp import MultiLayerMtpDrafter

        drafter = MultiLayerMtpDrafter(runner, steps, token_map)
    else:
        cls = drafter_class("STANDALONE" if kind == "standalone" else "EAGLE")
        drafter = cls(runner, topk=topk, num_steps=steps, num_draft_tokens=tokens, token_map=token_map)
    drafter.name = s.algorithm
    drafter.hidden_state_layers = layers
    loop = getattr(drafter, "loop", None)
    if loop is not None and runner.cuda_graph_max_bs:
        _capture_graphs(loop, runner, head=kind != "standalone", steps=steps,
                        feeds=target is None and s.adaptive)
    logger.info("%s drafter (%s from %s): %d steps, top-%d, %d tree nodes%s", s.algorithm, kind, path,
                steps, topk, tokens, f", captures {list(drafter.hidden_state_layers)}" if drafter.hidden_state_layers else "")
    return drafter


def _capture_graphs(loop, runner, head: bool, steps: int, feeds: bool) -> None:
    """A drafter's CUDA graphs: the whole draft per batch size; for a head (fed features) its catch-ups (the target's
    features) and bets (its own) of up to S+1 tokens, and with feeds (a drafter process, load-adaptive: drafting off,
    it catches the verifier's feeds up as they come) those of FEED_EVERY rows a request. A capture that fails costs
    speed, not service: what it would have replayed runs eagerly."""
    try:
        loop.capture(runner.cuda_graph_max_bs)
    except Exception:  # noqa: BLE001
        logger.exception("capturing the draft's CUDA graphs failed; its steps run eagerly")
        loop.graphs = {}
    if not head:
        return
    fed = getattr(runner.model, "fc_input_size", runner.config.hidden_size)  # the target's features' width
    try:
        runner.capture_feature_graphs(range(1, steps + 2), sorted({runner.config.hidden_size, fed}))
    except Exception:  # noqa: BLE001
        logger.exception("capturing the head's catch-up CUDA graphs failed; its catch-ups run eagerly")
        runner.graphs = None
    # a head beside its target never forwards its feeds: they wait for its next draft
    if runner.graphs is not None and feeds and FEED_EVERY > steps + 1:
        try:
            runner.capture_feature_graphs([FEED_EVERY], [fed], max_rows=FEED_GRAPH_ROWS)
        except Exception:  # noqa: BLE001 (the catch-ups' graphs stay)
            logger.exception("capturing the head's feed CUDA graphs failed; its feeds run eagerly")
            runner.graphs.forget(FEED_EVERY, fed)


def _target_embed_and_head(s: Speculation, target, runner, kind):
    import torch

    if target is not None:
        return target.model.model.embed_tokens.weight, target.model.lm_head_weight
    from splitspec.runtime.config import ModelConfig
    from splitspec.runtime.loader import read_embed_and_head

    with_head = kind != "eagle3" or runner.model.needs_target_head  # EAGLE-3 heads mostly have their own
    if s.draft.target_load_format in ("dummy", "dummy-decisive"):  # a dummy target (benchmarks): random weights
        config = ModelConfig.from_dir(s.checkpoints.target_dir())
        generator = torch.Generator().manual_seed(s.draft.random_seed)
        embed = (torch.randn(config.vocab_size, config.hidden_size, generator=generator) * 0.02).to(runner.device, runner.dtype)
        return embed, (embed if with_head else None)
    return read_embed_and_head(s.checkpoints.target_dir(), runner.dtype, runner.device, with_head=with_head)


def check_vocabulary(kind: str, draft, target, draft_path: Path, target_path: Path) -> None:
    """The draft must speak the target's token ids: the same vocabulary size and, where both ship one,
    the same tokenizer."""
    from splitspec.runtime.config import ConfigError

    if draft.vocab_size != target.vocab_size:
        raise ConfigError(f"the draft's vocabulary ({draft.vocab_size} tokens, vocab_size in {draft_path / 'config.json'}) "
                          f"does not match the target's ({target.vocab_size}); a draft must use the target's tokenizer")
    if Path(draft_path).resolve() != Path(target_path).resolve():
        check_tokenizers(Path(draft_path), Path(target_path))


def check_feature_width(kind: str, runner, target, layers: tuple[int, ...], path: Path) -> None:
    """The head must take what the verifier will send: EAGLE/MTP the target's hidden size; EAGLE-3 one
    target-sized state per captured layer into fc."""
    from splitspec.runtime.config import ConfigError

    if kind == "eagle3":
        want = len(layers) * target.hidden_size
        if runner.model.fc_input_size != want:
            raise ConfigError(f"{path}: the EAGLE-3 head's fc takes {runner.model.fc_input_size} features, the target sends "
                              f"{want} ({len(layers)} captured layers {list(layers)} x hidden size {target.hidden_size})")
    elif kind in ("eagle", "mtp") and runner.config.hidden_size != target.hidden_size:
        raise ConfigError(f"{path}: the head's hidden size {runner.config.hidden_size} is not the target's {target.hidden_size}")


def check_tokenizers(draft_path: Path, target_path: Path) -> None:
    from splitspec.runtime.config import ConfigError

    files = [p / "tokenizer.json" for p in (draft_path, target_path)]
    if not all(f.is_file() for f in files):
        return
    from tokenizers import Tokenizer

    draft, target = (Tokenizer.from_file(str(f)).get_vocab(with_added_tokens=True) for f in files)
    differ = sorted(t for t in set(draft) | set(target) if draft.get(t) != target.get(t))
    if differ:
        token = differ[0]
        raise ConfigError(f"the draft's tokenizer ({files[0]}) does not match the target's ({files[1]}): {len(differ)} "
                          f"tokens differ, e.g. {token!r} is id {draft.get(token)} in the draft and {target.get(token)} "
                          "in the target")


def checked_hot_tokens(head, vocab_size: int, path: Path) -> torch.Tensor | None:
    """EAGLE-3's draft id -> target id map (d + d2t[d]), each id in the target's vocabulary and none twice."""
    from splitspec.runtime.loader import CheckpointError

    ids = head.hot_token_ids()
    if ids is None:
        return None
    ids = ids.cpu()
    bad = ((ids < 0) | (ids >= vocab_size)).nonzero().flatten()
    if len(bad):
        d = int(bad[0])
        raise CheckpointError(f"{path}: d2t maps draft id {d} to target id {int(ids[d])}, outside the target's "
                              f"vocabulary of {vocab_size} ({len(bad)} draft ids out of range)")
    order = ids.argsort(stable=True)
    repeated = (ids[order][1:] == ids[order][:-1]).nonzero().flatten()
    if len(repeated):
        a, b = int(order[repeated[0]]), int(order[repeated[0] + 1])
        raise CheckpointError(f"{path}: d2t maps draft ids {a} and {b} to the same target id {int(ids[a])}")
    return ids

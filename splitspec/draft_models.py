"""Model drafters from the --speculative-* flags: which kind of draft model the flags name, what the
target must hand it, and loading it strictly.

    kind         flags                                                    draft weights
    standalone   STANDALONE + --speculative-draft-model-path              a small causal LM
    eagle        EAGLE + a head path                                      an EAGLE-1/2 head (REFERENCES §1)
    eagle3       EAGLE3 + a head path                                     an EAGLE-3 head (§2)
    mtp          NEXTN (= EAGLE) without a draft path, or a draft path    the target's MTP layers (§2b)
                 naming a checkpoint that ships MTP layers

Everything here runs at start, before any request: a draft that does not fit the target (vocabulary,
tokenizer, d2t, hidden size, missing or extra tensors) is an error that names the problem.
"""

from __future__ import annotations

import argparse
import functools
import logging
from pathlib import Path

import torch

from splitspec.spec_flags import MODEL_ALGORITHMS, FlagError, ngram_config, tree_shape
from splitspec.model_flags import torch_compile_max_bs

logger = logging.getLogger(__name__)

FINAL_NORMED_STATE = -1  # a hidden_state_layers entry: the target's final normed hidden state (the lm_head input)


@functools.lru_cache(maxsize=16)
def _resolve(path: str, revision: str | None, flag: str = "--model-path") -> Path:
    from splitspec.runtime.hub import resolve_model_dir

    return resolve_model_dir(path, revision, flag)


def target_dir(args: argparse.Namespace) -> Path:
    """--model-path (the demo target when none is given: generate and verifier default to it; a drafter
    process asks for it)."""
    if not getattr(args, "model_path", None):
        from splitspec.model_flags import resolve_model

        return resolve_model(args)
    return _resolve(args.model_path, getattr(args, "revision", None))


def target_config(args: argparse.Namespace):
    from splitspec.runtime.config import ModelConfig

    return ModelConfig.from_dir(target_dir(args))


def draft_dir(args: argparse.Namespace) -> Path:
    """The draft checkpoint: --speculative-draft-model-path at --speculative-draft-model-revision (main by
    default); MTP without a draft path: the target's own checkpoint."""
    if args.speculative_draft_model_path:
        return _resolve(args.speculative_draft_model_path, args.speculative_draft_model_revision or "main",
                        "--speculative-draft-model-path")
    if args.speculative_algorithm == "EAGLE":
        return target_dir(args)
    raise FlagError(f"--speculative-algorithm {args.speculative_algorithm} needs --speculative-draft-model-path")


def draft_kind(args: argparse.Namespace) -> str:
    """ngram, standalone, eagle, eagle3 or mtp (see the module docstring)."""
    algorithm = args.speculative_algorithm
    if algorithm in ("NGRAM", "STANDALONE", "EAGLE3"):
        return algorithm.lower()
    # EAGLE / NEXTN with no head, or the target itself as the draft (SGLang's NEXTN sets the draft path to
    # the model path): the target's MTP layers. Decided from the flags alone, so a verifier needs no draft files.
    draft, target = args.speculative_draft_model_path, getattr(args, "model_path", None)
    if not draft or draft == target or (target and Path(draft).is_dir() and Path(target).is_dir()
                                        and Path(draft).resolve() == Path(target).resolve()):
        return "mtp"
    return "eagle"


def multi_layer(args: argparse.Namespace) -> bool:
    return draft_kind(args) == "mtp" and getattr(args, "enable_multi_layer_eagle", False)


def auto_tree(args: argparse.Namespace, target) -> tuple[int, int, int]:
    """SGLang's automatic (num_steps, topk, num_draft_tokens), as its speculative-decoding documentation
    gives them: 5/4/8 for Llama targets, 3/1/4 for the others; multi-layer MTP: one step per MTP layer,
    a chain."""
    if multi_layer(args):
        n = target.num_nextn_predict_layers
        return (n, 1, n + 1)
    if target.architecture == "LlamaForCausalLM":
        return (5, 4, 8)
    return (3, 1, 4)


def draft_tree_shape(args: argparse.Namespace) -> tuple[int, int, int]:
    """tree_shape with the automatic choice resolved against the target (read only when all three flags
    are unset); multi-layer MTP must be a chain; MTP needs a target that ships MTP layers."""
    if args.speculative_algorithm == "STANDALONE":
        return tree_shape(args, (3, 1, 4))
    target = None
    if draft_kind(args) == "mtp":
        target = target_config(args)
        from splitspec.runtime.models.mtp import MtpHead

        MtpHead.runtime_config(target)  # raises when it ships no MTP layers
    unset = None in (args.speculative_num_steps, args.speculative_eagle_topk, args.speculative_num_draft_tokens)
    auto = auto_tree(args, target or target_config(args)) if unset else (0, 0, 0)
    shape = tree_shape(args, auto)
    if multi_layer(args) and shape[1] != 1:
        raise FlagError(f"--enable-multi-layer-eagle drafts a chain (one MTP layer per step): --speculative-eagle-topk "
                        f"must be 1, not {shape[1]}")
    return shape


def num_draft_tokens(args: argparse.Namespace) -> int:
    """The tree budget: a model drafter's (its automatic shape resolved against the target), or the NGRAM
    window's."""
    if args.speculative_algorithm in MODEL_ALGORITHMS:
        return draft_tree_shape(args)[2]
    return args.speculative_num_draft_tokens or args.speculative_ngram_max_match_window_size


def hidden_state_layers(args: argparse.Namespace, target) -> tuple[int, ...]:
    """What the verifier captures for the drafter each step: () nothing; (-1,) the final normed state
    (EAGLE; MTP as SGLang's EAGLE worker hands it); else the inputs of these target layers, concatenated
    in this order (EAGLE-3: three of them; multi-layer MTP: (L,), the last layer's output before the
    final norm, as SGLang's multi-layer worker asks with return_hidden_states_before_norm)."""
    kind = draft_kind(args)
    if multi_layer(args):
        return (target.num_hidden_layers,)
    if kind in ("eagle", "mtp"):
        return (FINAL_NORMED_STATE,)
    if kind == "eagle3":
        from splitspec.runtime.config import ModelConfig
        from splitspec.runtime.models.eagle3 import capture_layers

        return capture_layers(ModelConfig.from_dir(draft_dir(args)), target)
    return ()


def capture_for(runner, layers: tuple[int, ...]) -> None:
    """Make the target's forward return what a drafter with these hidden_state_layers needs: layer inputs
    are captured; the final normed state (-1) comes with every forward that asks for hidden states."""
    if layers and layers != (FINAL_NORMED_STATE,):
        runner.set_capture_layers(layers)


def draft_attention_backend(args: argparse.Namespace) -> str:
    """--speculative-draft-attention-backend, else --attention-backend; a name whose kernels are not
    implemented yet (SGLang's) is served by auto (flashinfer on CUDA, torch on CPU), logged."""
    from splitspec.runtime.attention import ATTENTION_BACKENDS

    name = getattr(args, "speculative_draft_attention_backend", None) or getattr(args, "attention_backend", "auto")
    if name not in ("auto", *ATTENTION_BACKENDS):
        logger.warning("draft attention backend %s is not implemented yet; the draft model runs with auto", name)
        return "auto"
    return name


def validate_draft_options(args: argparse.Namespace) -> None:
    """SGLang's draft loading flags: what this build honours, refuses or ignores (logged).
    --speculative-draft-model-quantization: fp8 quantizes the draft's linear layers (a STANDALONE draft's
    decoder, a head's fc and layers; never embeddings or lm_head), unquant keeps it unquantized whatever
    the target's --quantization, and unset loads it as its checkpoint is (FP8 checkpoints detected)."""
    from splitspec.runtime.quantization import check_method

    try:
        check_method(getattr(args, "speculative_draft_model_quantization", None), "--speculative-draft-model-quantization")
    except ValueError as exc:
        raise FlagError(str(exc)) from None
    for flag in ("speculative_moe_runner_backend", "speculative_moe_a2a_backend"):
        value = getattr(args, flag, None)
        if value is not None:
            logger.info("--%s %s: the draft has no MoE layers, nothing to do", flag.replace("_", "-"), value)


def build_drafter(args: argparse.Namespace, max_total_tokens: int | None = None, target=None):
    """The drafter --speculative-algorithm names, configured by the flags. A model drafter loads its
    model with the same --dtype, --device and --page-size and a KV cache of --max-total-tokens (else
    max_total_tokens) tokens. EAGLE heads and MTP layers share the target's embedding (and, but for
    EAGLE-3, its lm_head): `target` (a ModelRunner in this process), else read from --model-path. The
    drafter's `hidden_state_layers` say what the verifier must capture for it. With --speculative-replay
    it is wrapped in the (simulated) replay drafter."""
    drafter = _build_drafter(args, max_total_tokens, target)
    if getattr(args, "speculative_replay", None):
        from splitspec.drafter_svc import replay

        tokens = num_draft_tokens(args)  # NGRAM: a chain as deep as its budget
        shape = getattr(drafter, "num_steps", tokens - 1), getattr(drafter, "topk", 1), tokens
        vocab = target.config.vocab_size if target is not None else target_config(args).vocab_size
        drafter = replay.wrap(drafter, args, vocab, shape)
    return drafter


def _build_drafter(args: argparse.Namespace, max_total_tokens: int | None, target):
    from splitspec.drafter_svc.base import drafter_class

    kind = draft_kind(args)
    if kind == "ngram":
        drafter = drafter_class("NGRAM")(ngram_config(args))
        drafter.hidden_state_layers = ()
        return drafter
    from splitspec.runtime.runner import ModelRunner, RuntimeConfig

    validate_draft_options(args)
    target_cfg = target.config if target is not None else target_config(args)
    steps, topk, tokens = draft_tree_shape(args) if kind != "standalone" else tree_shape(args, (3, 1, 4))
    path = draft_dir(args)
    # a decisive dummy target's draft is a plain dummy one (decisiveness is about the target's greedy outputs)
    load_format = getattr(args, "speculative_draft_load_format", None) or getattr(args, "load_format", "auto")
    load_format = "dummy" if load_format == "dummy-decisive" else load_format
    beside = None  # a draft in its target's process on the same GPU, its cache not sized by a flag: mirror the target's
    if target is not None and not (args.max_total_tokens or max_total_tokens) and target.device.type == "cuda":
        beside = target.kv_cache.num_pages * target.kv_cache.page_size
    runner = ModelRunner.load(RuntimeConfig(
        model_path=str(path), dtype=args.dtype, device=args.device, page_size=args.page_size,
        max_total_tokens=args.max_total_tokens or max_total_tokens, load_format=load_format,
        mem_fraction_static=getattr(args, "mem_fraction_static", None), attention_backend=draft_attention_backend(args),
        # the draft's steps replay CUDA graphs (captured below: runtime.draft_loop), its catch-up runs eagerly
        disable_cuda_graph=(multi_layer(args) or getattr(args, "disable_cuda_graph", False)
                            or getattr(args, "speculative_draft_disable_cuda_graph", False)),
        cuda_graph_max_bs=getattr(args, "cuda_graph_max_bs", None),
        torch_compile_max_bs=torch_compile_max_bs(args),
        family=None if kind == "standalone" else kind,
        quantization=getattr(args, "speculative_draft_model_quantization", None), kv_tokens_beside_target=beside))
    check_vocabulary(kind, runner.config, target_cfg, path, target.model_dir if target is not None else target_dir(args))
    layers = hidden_state_layers(args, target_cfg) if kind != "standalone" else ()
    check_feature_width(kind, runner, target_cfg, layers, path)
    token_map = None
    if kind == "eagle3":
        if getattr(args, "speculative_token_map", None):
            logger.warning("--speculative-token-map %s ignored: an EAGLE-3 head maps its own draft vocabulary (d2t)",
                           args.speculative_token_map)
        token_map = checked_hot_tokens(runner.model, runner.config.vocab_size, path)
    elif getattr(args, "speculative_token_map", None):
        from splitspec.runtime.token_map import load_token_map

        token_map = load_token_map(args.speculative_token_map, target_cfg.vocab_size if target_cfg else runner.config.vocab_size)
    if token_map is not None and len(token_map) < topk:
        raise FlagError(f"the draft vocabulary has {len(token_map)} ids, fewer than --speculative-eagle-topk {topk}")
    if kind == "standalone" and token_map is not None:
        runner.model.set_hot_tokens(token_map)
    if kind != "standalone":
        embed, head = _target_embed_and_head(args, target, runner, kind)
        if kind in ("eagle", "mtp") and token_map is not None:
            head = head[token_map.to(head.device)].contiguous()
        runner.model.share_target(embed, head)
    if multi_layer(args):
        from splitspec.drafter_svc.multi_layer_mtp import MultiLayerMtpDrafter

        drafter = MultiLayerMtpDrafter(runner, steps, token_map)
    else:
        cls = drafter_class("STANDALONE" if kind == "standalone" else "EAGLE")
        drafter = cls(runner, topk=topk, num_steps=steps, num_draft_tokens=tokens, token_map=token_map)
    drafter.name = args.speculative_algorithm
    drafter.hidden_state_layers = layers
    loop = getattr(drafter, "loop", None)
    if loop is not None and runner.cuda_graph_max_bs:
        try:  # every step of the draft in one graph per batch size
            loop.capture(runner.cuda_graph_max_bs)
        except Exception:  # noqa: BLE001 (a capture failure costs speed, not service)
            logger.exception("capturing the draft's CUDA graphs failed; its steps run eagerly")
            loop.graphs = {}
        if kind != "standalone":  # a head's catch-ups (the target's features) and bets (its own) of up to S+1 tokens
            widths = sorted({runner.config.hidden_size, getattr(runner.model, "fc_input_size", runner.config.hidden_size)})
            try:
                runner.capture_feature_graphs(range(1, steps + 2), widths)
            except Exception:  # noqa: BLE001
                logger.exception("capturing the head's catch-up CUDA graphs failed; its catch-ups run eagerly")
                runner.graphs = None
    logger.info("%s drafter (%s from %s): %d steps, top-%d, %d tree nodes%s", args.speculative_algorithm, kind, path,
                steps, topk, tokens, f", captures {list(drafter.hidden_state_layers)}" if drafter.hidden_state_layers else "")
    return drafter


def _target_embed_and_head(args, target, runner, kind):
    if target is not None:
        return target.model.model.embed_tokens.weight, target.model.lm_head_weight
    from splitspec.runtime.loader import read_embed_and_head

    with_head = kind != "eagle3" or runner.model.needs_target_head  # EAGLE-3 heads mostly have their own
    if getattr(args, "load_format", "auto") in ("dummy", "dummy-decisive"):  # a dummy target (benchmarks): random weights
        import torch

        config = target_config(args)
        generator = torch.Generator().manual_seed(getattr(args, "random_seed", 0) or 0)
        embed = (torch.randn(config.vocab_size, config.hidden_size, generator=generator) * 0.02).to(runner.device, runner.dtype)
        return embed, (embed if with_head else None)
    return read_embed_and_head(target_dir(args), runner.dtype, runner.device, with_head=with_head)


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

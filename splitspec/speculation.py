"""The --speculative-* flags resolved once, into one frozen `Speculation` (issue 32's configuration layer): which
drafter they name, its tree (SGLang's automatic shape included), what the verifier captures for it, how its model
loads, the overlap, and the verifier's acceptance policy. Every default and derived value is decided here, by
functions of the flags (reading the target's and the draft's config.json where SGLang's rules do); the command lines
call `resolve` once, and what they build takes the Speculation, never the flags:

    flags --resolve()--> Speculation --draft_models.build_drafter()--> the drafter
                                     --spec_config()-->                the verifier's SpecConfig

    kind         flags                                                    draft weights
    ngram        NGRAM                                                    none (a trie of the request's tokens)
    standalone   STANDALONE + --speculative-draft-model-path              a small causal LM
    eagle        EAGLE + a head path                                      an EAGLE-1/2 head (REFERENCES §1)
    eagle3       EAGLE3 + a head path                                     an EAGLE-3 head (§2)
    mtp          NEXTN (= EAGLE) without a draft path, or a draft path    the target's MTP layers (§2b)
                 naming the target itself
"""

from __future__ import annotations

import argparse
import functools
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from splitspec.model_flags import on_gpu, torch_compile_max_bs

if TYPE_CHECKING:
    from splitspec.drafter_svc.ngram import NgramConfig
    from splitspec.runtime.config import ModelConfig
    from splitspec.verifier_svc.step_types import SpecConfig

logger = logging.getLogger(__name__)

MODEL_ALGORITHMS = ("STANDALONE", "EAGLE", "EAGLE3")
HIDDEN_STATE_ALGORITHMS = ("EAGLE", "EAGLE3")
FINAL_NORMED_STATE = -1  # a hidden_state_layers entry: the target's final normed hidden state (the lm_head input)
NGRAM_BETS = 4  # overlap bets per request for NGRAM (no steps to count them by)


class FlagError(ValueError):
    """Flags that do not go together; the message says how to fix them."""


@dataclass(frozen=True)
class Checkpoints:
    """The target's and the draft's checkpoints as the flags name them, resolved (a hub download) only where a
    model loads: a verifier whose drafters run elsewhere needs no draft files."""
    model_path: str | None  # --model-path (None: the default model, the demo target)
    revision: str | None
    draft_model_path: str | None  # --speculative-draft-model-path (MTP without one: the target's checkpoint)
    draft_revision: str | None

    def target_dir(self) -> Path:
        if not self.model_path:
            from splitspec.default_model import default_model

            return default_model()
        return _resolve(self.model_path, self.revision)

    def draft_dir(self) -> Path:
        """--speculative-draft-model-path at --speculative-draft-model-revision (main by default, SGLang's)."""
        if self.draft_model_path:
            return _resolve(self.draft_model_path, self.draft_revision or "main", "--speculative-draft-model-path")
        return self.target_dir()


@dataclass(frozen=True)
class DraftLoad:
    """How a model drafter loads: the runtime settings it takes from the target's flags and its own."""
    load_format: str  # the draft's (a decisive dummy target's draft is a plain dummy one)
    target_load_format: str
    dtype: str
    device: str
    page_size: int
    max_total_tokens: int | None
    mem_fraction_static: float | None
    attention_backend: str
    disable_cuda_graph: bool
    cuda_graph_max_bs: int | None
    torch_compile_max_bs: int
    quantization: str | None
    token_map: str | None  # --speculative-token-map (EAGLE-3 heads map their own: ignored, logged)
    random_seed: int  # a dummy target's embedding


@dataclass(frozen=True)
class Replay:
    """--speculative-replay*: simulated acceptance (drafter_svc.replay)."""
    references: str
    profile: str
    seed: int
    guess_rate: float | None


@dataclass(frozen=True)
class Speculation:
    algorithm: str  # NGRAM, STANDALONE, EAGLE or EAGLE3 (NEXTN is EAGLE)
    kind: str  # ngram, standalone, eagle, eagle3 or mtp (the module docstring)
    num_steps: int
    topk: int  # 0 for NGRAM (its trees are not beams)
    num_draft_tokens: int  # the tree budget (NGRAM: its window)
    multi_layer: bool  # --enable-multi-layer-eagle on an MTP target: one layer per step, a chain
    hidden_state_layers: tuple[int, ...]  # what the verifier captures for the drafter (see hidden_state_layers)
    draft_model: str  # --speculative-draft-model-path as given ("" for NGRAM), a label for pools and metrics
    checkpoints: Checkpoints
    ngram: NgramConfig | None
    draft: DraftLoad | None  # the model drafters'
    replay: Replay | None
    overlap: str  # on, off or auto
    num_bets: int
    overlap_max_bs: int
    accept_threshold_single: float
    accept_threshold_acc: float
    force_greedy_verify: bool
    adaptive: bool
    adaptive_hysteresis: float
    adaptive_probe_interval: int

    @property
    def tree(self) -> tuple[int, int, int]:
        """(num_steps, topk, num_draft_tokens); NGRAM's as a chain as deep as its budget."""
        if self.kind == "ngram":
            return (self.num_draft_tokens - 1, 1, self.num_draft_tokens)
        return (self.num_steps, self.topk, self.num_draft_tokens)


def resolve(args: argparse.Namespace, target: ModelConfig | None = None) -> Speculation | None:
    """The Speculation the flags describe, None without --speculative-algorithm. target: the target's config when
    the caller has it (else read from --model-path where a rule needs it: the automatic tree, MTP, the captured
    layers). Raises FlagError (or the checkpoint's error) for flags that do not go together."""
    algorithm = getattr(args, "speculative_algorithm", None)
    if algorithm is None:
        return None
    kind = draft_kind(args)
    multi = kind == "mtp" and bool(getattr(args, "enable_multi_layer_eagle", False))
    _check_ranges(args)
    checkpoints = checkpoints_of(args)
    ngram = draft = None
    if kind == "ngram":
        ngram = ngram_config(args)
        tokens = args.speculative_num_draft_tokens or args.speculative_ngram_max_match_window_size
        steps, topk, layers = tokens - 1, 0, ()
    else:
        if kind in ("standalone", "eagle3") and not args.speculative_draft_model_path:
            raise FlagError(f"--speculative-algorithm {algorithm} needs --speculative-draft-model-path")
        validate_draft_options(args)
        draft = draft_load(args, multi)
        target_config = _target_reader(checkpoints, target)
        steps, topk, tokens = draft_tree_shape(args, kind, multi, target_config)
        layers = hidden_state_layers(kind, multi, target_config, checkpoints.draft_dir)
    bets = getattr(args, "speculative_num_bets", None)
    return Speculation(
        algorithm=algorithm, kind=kind, num_steps=steps, topk=topk, num_draft_tokens=tokens, multi_layer=multi,
        hidden_state_layers=layers, draft_model=(args.speculative_draft_model_path or "") if kind != "ngram" else "",
        checkpoints=checkpoints,
        ngram=ngram, draft=draft, replay=replay_of(args), overlap=overlap_mode(getattr(args, "speculative_overlap", None)),
        num_bets=bets if bets is not None else (NGRAM_BETS if kind == "ngram" else steps + 1),
        overlap_max_bs=getattr(args, "speculative_overlap_max_bs", 8),
        accept_threshold_single=getattr(args, "speculative_accept_threshold_single", 1.0),
        accept_threshold_acc=getattr(args, "speculative_accept_threshold_acc", 1.0),
        force_greedy_verify=kind == "ngram" and bool(getattr(args, "speculative_ngram_force_greedy_verify", False)),
        adaptive=adaptive_enabled(getattr(args, "speculative_adaptive", "auto"), getattr(args, "device", None)),
        adaptive_hysteresis=getattr(args, "speculative_adaptive_hysteresis", 0.015),
        adaptive_probe_interval=getattr(args, "speculative_adaptive_probe_interval", 200))


def spec_config(speculation: Speculation | None) -> SpecConfig:
    """The verifier's SpecConfig (acceptance, the adaptive policy, the tree it verifies); the defaults when off."""
    from splitspec.verifier_svc.step_types import SpecConfig

    if speculation is None:
        return SpecConfig()
    s = speculation
    return SpecConfig(num_draft_tokens=s.num_draft_tokens, accept_threshold_single=s.accept_threshold_single,
                      accept_threshold_acc=s.accept_threshold_acc, force_greedy_verify=s.force_greedy_verify,
                      adaptive=s.adaptive, num_steps=s.num_steps, topk=s.topk, adaptive_hysteresis=s.adaptive_hysteresis,
                      adaptive_probe_interval=s.adaptive_probe_interval)


def _check_ranges(args: argparse.Namespace) -> None:
    if getattr(args, "speculative_adaptive_hysteresis", 0.015) < 0:
        raise FlagError(f"--speculative-adaptive-hysteresis {args.speculative_adaptive_hysteresis}: must be >= 0")
    if getattr(args, "speculative_adaptive_probe_interval", 200) < 1:
        raise FlagError(f"--speculative-adaptive-probe-interval {args.speculative_adaptive_probe_interval}: must be >= 1")
    bets = getattr(args, "speculative_num_bets", None)
    if bets is not None and bets < 0:
        raise FlagError(f"--speculative-num-bets {bets}: must be >= 0")


def _target_reader(checkpoints: Checkpoints, target: ModelConfig | None):
    """A function giving the target's config, read from --model-path at most once and only when asked."""
    if target is not None:
        return lambda: target
    from splitspec.runtime.config import ModelConfig

    return functools.cache(lambda: ModelConfig.from_dir(checkpoints.target_dir()))


# --- the rules, each a function of the flags ---------------------------------------------------------------------

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


def tree_shape(args: argparse.Namespace, auto: tuple[int, int, int]) -> tuple[int, int, int]:
    """(num_steps, topk, num_draft_tokens) of a model drafter's tree, SGLang's rules: all three flags
    or none (`auto`, which auto_tree chooses for the target); topk 1 makes the tree a chain
    of num_steps + 1 nodes."""
    given = {"--speculative-num-steps": args.speculative_num_steps, "--speculative-eagle-topk": args.speculative_eagle_topk,
             "--speculative-num-draft-tokens": args.speculative_num_draft_tokens}
    unset = [flag for flag, value in given.items() if value is None]
    if len(unset) == 3:
        steps, topk, tokens = auto
    elif unset:
        raise FlagError(f"set all of --speculative-num-steps, --speculative-eagle-topk and --speculative-num-draft-tokens, "
                        f"or none of them for the automatic choice ({', '.join(unset)} missing)")
    else:
        steps, topk, tokens = args.speculative_num_steps, args.speculative_eagle_topk, args.speculative_num_draft_tokens
    if steps < 1 or topk < 1 or tokens < 2:
        raise FlagError(f"--speculative-num-steps {steps}, --speculative-eagle-topk {topk}, --speculative-num-draft-tokens "
                        f"{tokens}: need at least 1, 1 and 2")
    if topk == 1:
        tokens = steps + 1
    return steps, topk, tokens


def auto_tree(multi_layer: bool, target: ModelConfig) -> tuple[int, int, int]:
    """SGLang's automatic (num_steps, topk, num_draft_tokens), as its speculative-decoding documentation
    gives them: 5/4/8 for Llama targets, 3/1/4 for the others; multi-layer MTP: one step per MTP layer,
    a chain."""
    if multi_layer:
        n = target.num_nextn_predict_layers
        return (n, 1, n + 1)
    if target.architecture == "LlamaForCausalLM":
        return (5, 4, 8)
    return (3, 1, 4)


def draft_tree_shape(args: argparse.Namespace, kind: str, multi_layer: bool, target) -> tuple[int, int, int]:
    """tree_shape with the automatic choice resolved against the target (target(): its config, read only when
    all three flags are unset or the draft is MTP); STANDALONE's automatic tree is 3/1/4; multi-layer MTP must be
    a chain; MTP needs a target that ships MTP layers."""
    if kind == "standalone":
        return tree_shape(args, (3, 1, 4))
    if kind == "mtp":
        from splitspec.runtime.models.mtp import MtpHead

        MtpHead.runtime_config(target())  # raises when it ships no MTP layers
    unset = None in (args.speculative_num_steps, args.speculative_eagle_topk, args.speculative_num_draft_tokens)
    shape = tree_shape(args, auto_tree(multi_layer, target()) if unset else (0, 0, 0))
    if multi_layer and shape[1] != 1:
        raise FlagError(f"--enable-multi-layer-eagle drafts a chain (one MTP layer per step): --speculative-eagle-topk "
                        f"must be 1, not {shape[1]}")
    return shape


def hidden_state_layers(kind: str, multi_layer: bool, target, draft_dir) -> tuple[int, ...]:
    """What the verifier captures for the drafter each step: () nothing; (-1,) the final normed state
    (EAGLE; MTP as SGLang's EAGLE worker hands it); else the inputs of these target layers, concatenated
    in this order (EAGLE-3: three of them, as its head's config asks; multi-layer MTP: (L,), the last layer's output
    before the final norm, as SGLang's multi-layer worker asks with return_hidden_states_before_norm). target():
    the target's config; draft_dir(): the draft's checkpoint (read for EAGLE-3 only)."""
    if multi_layer:
        return (target().num_hidden_layers,)
    if kind in ("eagle", "mtp"):
        return (FINAL_NORMED_STATE,)
    if kind == "eagle3":
        from splitspec.runtime.config import ModelConfig
        from splitspec.runtime.models.eagle3 import capture_layers

        return capture_layers(ModelConfig.from_dir(draft_dir()), target())
    return ()


def ngram_config(args: argparse.Namespace) -> NgramConfig:
    from splitspec.drafter_svc.ngram import NgramConfig

    return NgramConfig(
        min_match_window_size=args.speculative_ngram_min_match_window_size,
        max_match_window_size=args.speculative_ngram_max_match_window_size,
        min_bfs_breadth=args.speculative_ngram_min_bfs_breadth,
        max_bfs_breadth=args.speculative_ngram_max_bfs_breadth,
        match_type=args.speculative_ngram_match_type,
        branch_length=args.speculative_ngram_branch_length,
        capacity=args.speculative_ngram_capacity,
    )


def overlap_mode(flag: str | None, environ=os.environ) -> str:
    """--speculative-overlap, else SGLang's SGLANG_ENABLE_SPEC_V2, else auto."""
    if flag:
        return flag
    env = environ.get("SGLANG_ENABLE_SPEC_V2", "").strip().lower()
    if env in ("1", "true", "yes", "on"):
        return "on"
    if env in ("0", "false", "no", "off"):
        return "off"
    return "auto"


def adaptive_enabled(mode: str | None, device: str | None) -> bool:
    """--speculative-adaptive: on, off, or auto (on when the target runs on a GPU)."""
    mode = mode or "auto"
    if mode != "auto":
        return mode == "on"
    return on_gpu(device)


def checkpoints_of(args: argparse.Namespace) -> Checkpoints:
    return Checkpoints(model_path=getattr(args, "model_path", None), revision=getattr(args, "revision", None),
                       draft_model_path=args.speculative_draft_model_path,
                       draft_revision=args.speculative_draft_model_revision)


def replay_of(args: argparse.Namespace) -> Replay | None:
    if not getattr(args, "speculative_replay", None):
        return None
    return Replay(references=args.speculative_replay, profile=args.speculative_replay_profile,
                  seed=args.speculative_replay_seed, guess_rate=getattr(args, "speculative_replay_guess_rate", None))


# --- where the draft model comes from and how it loads -----------------------------------------------------------

@functools.lru_cache(maxsize=16)
def _resolve(path: str, revision: str | None, flag: str = "--model-path") -> Path:
    from splitspec.runtime.hub import resolve_model_dir

    return resolve_model_dir(path, revision, flag)


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


def draft_load(args: argparse.Namespace, multi_layer: bool) -> DraftLoad:
    load_format = getattr(args, "speculative_draft_load_format", None) or getattr(args, "load_format", "auto")
    return DraftLoad(
        load_format="dummy" if load_format == "dummy-decisive" else load_format,
        target_load_format=getattr(args, "load_format", "auto") or "auto",
        dtype=args.dtype, device=args.device, page_size=args.page_size, max_total_tokens=args.max_total_tokens,
        mem_fraction_static=getattr(args, "mem_fraction_static", None), attention_backend=draft_attention_backend(args),
        # the draft's steps replay CUDA graphs (captured by draft_models: runtime.draft_loop), its catch-up runs eagerly
        disable_cuda_graph=(multi_layer or getattr(args, "disable_cuda_graph", False)
                            or getattr(args, "speculative_draft_disable_cuda_graph", False)),
        cuda_graph_max_bs=getattr(args, "cuda_graph_max_bs", None), torch_compile_max_bs=torch_compile_max_bs(args),
        quantization=getattr(args, "speculative_draft_model_quantization", None),
        token_map=getattr(args, "speculative_token_map", None), random_seed=getattr(args, "random_seed", 0) or 0)

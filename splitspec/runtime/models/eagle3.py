"""The EAGLE-3 draft head in its published format (REFERENCES §2; SGLang's algorithm "EAGLE3").

    h      = fc(h)  when h is the target's features (k captured layers, k*H_target wide); the head's
             own output (H wide) is fed back as is
    x      = h + attn(cat([input_layernorm(embed(token)), hidden_norm(h)]))   EMBEDDING FIRST, q/k/v from 2H
    x      = x + mlp(post_attention_layernorm(x))
    x      = layer_i(x)  for the plain Llama decoder layers i = 1..num_hidden_layers-1 (as vLLM)
    logits = lm_head(norm(x))   [T, draft_vocab]; draft id d is target id d + d2t[d]
    the next step's feature is x (before the norm)

The embedding is the target's (`share_target`); the lm_head is the head's own, over `draft_vocab_size`
ids. RoPE comes from the head's config (base 10000 when it names none). Checkpoint keys: fc.weight,
midlayer.* (or layers.0.*, as "speculators" write it), layers.{i}.* for later layers, norm.weight,
lm_head.weight, d2t (int64, when the draft vocabulary is cut); t2d (a training mask) and an embedding
copy are ignored.
"""

from __future__ import annotations

import torch
from torch import nn

from splitspec import kernels
from splitspec.runtime.attention.base import AttentionBackend
from splitspec.runtime.config import ConfigError, ModelConfig
from splitspec.runtime.layers import RMSNorm
from splitspec.runtime.models.llama import DecoderLayer, ForwardContext
from splitspec.runtime.rope import RotaryEmbedding


def draft_vocab_size(config: ModelConfig) -> int:
    return int(config.raw.get("draft_vocab_size") or config.vocab_size)


def aux_layer_ids(config: ModelConfig) -> list[int] | None:
    """eagle_config.eagle_aux_hidden_state_layer_ids, as the head's config gives them (None: the default)."""
    ids = (config.raw.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    return None if ids is None else [int(i) for i in ids]


def capture_layers(head: ModelConfig, target: ModelConfig) -> tuple[int, ...]:
    """The target layers whose inputs feed the head, in fc's order (ascending). Default: the inputs of
    layers 2, L//2, L-3. Explicit eagle_aux_hidden_state_layer_ids are read as SGLang reads them: id i is
    the output of layer i, i.e. the input of layer i + 1 (vLLM would take them as-is; REFERENCES §2.3)."""
    ids = aux_layer_ids(head)
    if ids is None:
        return target.eagle3_capture_layers()
    # SGLang and vLLM append the captured states in layer order, whatever order the config lists
    ids = sorted(ids)
    bad = [i for i in ids if not 0 <= i < target.num_hidden_layers]
    if bad or len(set(ids)) != len(ids) or not ids:
        raise ConfigError(f"eagle_config.eagle_aux_hidden_state_layer_ids {ids}: need distinct layer ids of the "
                          f"{target.num_hidden_layers}-layer target (0..{target.num_hidden_layers - 1})")
    return tuple(i + 1 for i in ids)


class Eagle3FirstLayer(DecoderLayer):
    """The head's first layer: attention over [input_layernorm(embedding), hidden_norm(h)] (2H wide), the
    residual being h itself."""

    def __init__(self, config: ModelConfig):
        super().__init__(config, 0, attn_input_size=2 * config.hidden_size)
        self.hidden_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, positions: torch.Tensor, embeds: torch.Tensor, h: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        # [input_layernorm(embeds), hidden_norm(h)]: one kernel on a GPU, not two norms and a concatenation
        x = kernels.rms_norm_pair(embeds, self.input_layernorm.weight, h, self.hidden_norm.weight, self.hidden_norm.eps)
        normed, x = self.post_attention_layernorm(self.self_attn(positions, x, ctx), h)  # x = h + attention, fused
        return x + self.mlp(normed)


class Eagle3Head(nn.Module):
    """forward(tokens, features) -> (pre-norm output x [T, H], []); logits(x) -> [T, draft_vocab]."""

    ignored_checkpoint_keys = ("t2d", "embed_tokens.weight")

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        hidden = config.hidden_size
        num_aux = len(aux_layer_ids(config) or (0, 0, 0))
        self.fc_input_size = num_aux * int(config.raw.get("target_hidden_size") or hidden)
        if self.fc_input_size == hidden:
            raise ConfigError(f"an EAGLE-3 head whose fc input ({self.fc_input_size}) is as wide as its hidden size "
                              "cannot tell the target's features from its own")
        self.fc = nn.Linear(self.fc_input_size, hidden, bias=bool(config.raw.get("bias", False)))
        self.layers = nn.ModuleList([Eagle3FirstLayer(config)] +
                                    [DecoderLayer(config, i) for i in range(1, config.num_hidden_layers)])
        self.norm = RMSNorm(hidden, config.rms_norm_eps)
        self.draft_vocab_size = draft_vocab_size(config)
        if self.draft_vocab_size > config.vocab_size:
            raise ConfigError(f"draft_vocab_size {self.draft_vocab_size} is larger than vocab_size {config.vocab_size}")
        self.lm_head = nn.Linear(hidden, self.draft_vocab_size, bias=False)
        if "draft_vocab_size" not in config.raw:  # no draft vocabulary: SGLang takes the target's head if absent
            self.optional_checkpoint_keys = ("lm_head.weight",)
        if self.draft_vocab_size < config.vocab_size:  # a full draft vocabulary needs no map (EAGLE drops it)
            self.register_buffer("d2t", torch.zeros(self.draft_vocab_size, dtype=torch.long))
        else:
            self.ignored_checkpoint_keys = (*self.ignored_checkpoint_keys, "d2t")
        self.rotary_emb = RotaryEmbedding(config.rope, config.head_dim, config.max_position_embeddings)
        self.embed_weight: torch.Tensor | None = None  # the target's, set by share_target

    @staticmethod
    def checkpoint_name(key: str) -> str:
        return "layers.0." + key.removeprefix("midlayer.") if key.startswith("midlayer.") else key

    def hot_token_ids(self) -> torch.Tensor | None:
        """Draft id -> target id (d + d2t[d]); None when the draft vocabulary is the target's."""
        if not hasattr(self, "d2t"):
            return None
        return self.d2t + torch.arange(self.draft_vocab_size, device=self.d2t.device)

    @property
    def needs_target_head(self) -> bool:
        """The checkpoint had no lm_head (and names no draft vocabulary): the target's is used."""
        return "lm_head.weight" in getattr(self, "absent_checkpoint_keys", ())

    def share_target(self, embed_weight: torch.Tensor, lm_head_weight: torch.Tensor | None = None) -> None:
        """The target's embedding; its lm_head only when the head has none of its own."""
        if embed_weight.shape[1] != self.config.hidden_size:
            raise ValueError(f"the target's hidden size {embed_weight.shape[1]} is not the head's {self.config.hidden_size}")
        self.embed_weight = embed_weight
        if self.needs_target_head:
            if lm_head_weight is None or tuple(lm_head_weight.shape) != tuple(self.lm_head.weight.shape):
                raise ValueError(f"the head has no lm_head of its own and the target's is "
                                 f"{None if lm_head_weight is None else list(lm_head_weight.shape)}, "
                                 f"expected {list(self.lm_head.weight.shape)}")
            self.lm_head.weight = nn.Parameter(lm_head_weight, requires_grad=False)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, backend: AttentionBackend, plan: object,
                capture_layers: tuple[int, ...] = (), features: torch.Tensor | None = None):
        if features is None or self.embed_weight is None:
            raise ValueError("an EAGLE-3 head needs the target's embedding (share_target) and a feature per token")
        ctx = ForwardContext(backend, plan, self.rotary_emb, positions)
        dtype = self.norm.weight.dtype  # the head's dtype (fc may hold FP8 weights)
        h = features.to(dtype)
        if h.shape[-1] == self.fc_input_size:
            h = self.fc(h)
        elif h.shape[-1] != self.config.hidden_size:
            raise ValueError(f"features of width {h.shape[-1]}: expected {self.fc_input_size} (target) or "
                             f"{self.config.hidden_size} (the head's own)")
        embeds = nn.functional.embedding(input_ids, self.embed_weight).to(dtype)
        x = self.layers[0](positions, embeds, h, ctx)
        for layer in self.layers[1:]:
            x = layer(positions, x, ctx)
        return x, []

    def logits(self, hidden: torch.Tensor, upcast: bool = True) -> torch.Tensor:
        """[N, H] -> [N, draft vocabulary] logits, fp32 (upcast) or in the head's dtype (a reader that upcasts itself)."""
        logits = self.lm_head(self.norm(hidden.to(self.lm_head.weight.dtype)))
        return logits.float() if upcast else logits

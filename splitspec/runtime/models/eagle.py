"""The EAGLE-1/EAGLE-2 draft head in its published format (REFERENCES §1; SGLang's algorithm "EAGLE").

    x      = fc(cat([embed(token), feature]))   embedding first; fc has a bias when config "bias" (default true)
    x      = layer0(x)                          a Llama decoder layer WITHOUT its input RMSNorm
    logits = target_lm_head(x)                  no final norm; the target's head

The embedding and the head are the target's (`share_target`); the checkpoint's copy of the embedding,
if any, is ignored. Row p of a request pairs token t[p+1] with the target's final normed hidden state
h[p] at RoPE position p; a draft step feeds the head's own output x back as the next feature.
Checkpoint keys have no `model.` prefix: fc.weight [H, 2H], fc.bias [H], layers.0.self_attn.*,
layers.0.mlp.*, layers.0.post_attention_layernorm.weight.
"""

from __future__ import annotations

import torch
from torch import nn

from splitspec.runtime.attention.base import AttentionBackend
from splitspec.runtime.config import ModelConfig
from splitspec.runtime.models.llama import ForwardContext, LlamaDecoderLayerBase
from splitspec.runtime.rope import RotaryEmbedding

# checkpoint tensors the head does not own (it shares the target's)
SHARED_KEYS = ("embed_tokens.weight", "lm_head.weight")


def fc_bias(config: ModelConfig) -> bool:
    """EAGLE's reference reads config["bias"], defaulting to True (REFERENCES §1.1)."""
    return bool(config.raw.get("bias", True))


class EagleDecoderLayer(LlamaDecoderLayerBase):
    """Layer 0 of an EAGLE head: attention and MLP with residuals, no input RMSNorm."""

    def forward(self, positions: torch.Tensor, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        x = x + self.self_attn(positions, x, ctx)
        return x + self.mlp(self.post_attention_layernorm(x))


class EagleHead(nn.Module):
    """forward(tokens, features) -> (head output x [T, H], []); logits(x) uses the target's head."""

    ignored_checkpoint_keys = SHARED_KEYS

    def __init__(self, config: ModelConfig):
        super().__init__()
        if config.num_hidden_layers != 1:
            raise ValueError(f"an EAGLE head has one decoder layer, the config says {config.num_hidden_layers}")
        self.config = config
        self.fc = nn.Linear(2 * config.hidden_size, config.hidden_size, bias=fc_bias(config))
        self.layers = nn.ModuleList([EagleDecoderLayer(config, 0, input_norm=False)])
        self.rotary_emb = RotaryEmbedding(config.rope, config.head_dim, config.max_position_embeddings)
        self.embed_weight: torch.Tensor | None = None  # the target's, set by share_target
        self.lm_head_weight: torch.Tensor | None = None

    def share_target(self, embed_weight: torch.Tensor, lm_head_weight: torch.Tensor) -> None:
        hidden = self.config.hidden_size
        if embed_weight.shape[1] != hidden or lm_head_weight.shape[1] != hidden:
            raise ValueError(f"the target's hidden size {embed_weight.shape[1]} is not the head's {hidden}")
        self.embed_weight, self.lm_head_weight = embed_weight, lm_head_weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, backend: AttentionBackend, plan: object,
                capture_layers: tuple[int, ...] = (), features: torch.Tensor | None = None):
        if features is None or self.embed_weight is None:
            raise ValueError("an EAGLE head needs the target's embedding (share_target) and a feature per token")
        ctx = ForwardContext(backend, plan, self.rotary_emb, positions)
        dtype = self.layers[0].post_attention_layernorm.weight.dtype  # the head's dtype (fc may hold FP8 weights)
        embeds = nn.functional.embedding(input_ids, self.embed_weight).to(dtype)
        x = self.fc(torch.cat([embeds, features.to(dtype)], dim=-1))
        x = self.layers[0](positions, x, ctx)
        return x, []

    def logits(self, hidden: torch.Tensor, upcast: bool = True) -> torch.Tensor:
        logits = nn.functional.linear(hidden.to(self.lm_head_weight.dtype), self.lm_head_weight)
        return logits.float() if upcast else logits

"""MTP layers inside a target checkpoint, MiMo's layout (REFERENCES §2b; SGLang's NEXTN, `mimo_mtp.py`).

For MTP layer i (checkpoint prefix model.mtp_layers.{i}.):

    e      = embed(token); e[position == 0] = 0                       position 0 masked
    x      = input_proj(cat([hidden_layernorm(h), token_layernorm(e)]))   HIDDEN FIRST, no bias
    x      = a Qwen2 decoder layer (q/k/v biases) over x, residuals inside as usual
    x      = final_layernorm(x)
    logits = target_lm_head(x); the next step's feature is x (after final_layernorm, as SGLang)

h is the target's final normed hidden state (the lm_head input), as SGLang's EAGLE worker hands it to
MiMo's MTP (vLLM hands the pre-norm state; REFERENCES §2b). The embedding and lm_head are the
target's. The head is built from the *target's* config: its KV cache has one layer per MTP layer.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from splitspec import kernels
from splitspec.runtime.attention.base import AttentionBackend
from splitspec.runtime.config import ConfigError, ModelConfig
from splitspec.runtime.layers import RMSNorm
from splitspec.runtime.models.llama import MTP_PREFIX, DecoderLayer, ForwardContext
from splitspec.runtime.rope import RotaryEmbedding


class MtpLayer(DecoderLayer):
    def __init__(self, config: ModelConfig, layer_id: int):
        super().__init__(config, layer_id)
        hidden = config.hidden_size
        self.token_layernorm = RMSNorm(hidden, config.rms_norm_eps)
        self.hidden_layernorm = RMSNorm(hidden, config.rms_norm_eps)
        self.input_proj = nn.Linear(2 * hidden, hidden, bias=False)
        self.final_layernorm = RMSNorm(hidden, config.rms_norm_eps)

    def forward(self, positions: torch.Tensor, embeds: torch.Tensor, h: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        x = self.input_proj(kernels.rms_norm_pair(h, self.hidden_layernorm.weight, embeds, self.token_layernorm.weight,
                                                  self.token_layernorm.eps))
        return self.final_layernorm(super().forward(positions, x, ctx))


class MtpHead(nn.Module):
    """forward(tokens, features, draft_layer=i) -> (MTP layer i's output [T, H], []); logits() uses the
    target's head."""

    @staticmethod
    def runtime_config(config: ModelConfig) -> ModelConfig:
        """The target's config narrowed to its MTP layers (what the KV cache and layer ids follow)."""
        if config.num_nextn_predict_layers < 1:
            raise ConfigError(f"{config.architecture} declares no MTP layers (num_nextn_predict_layers); "
                              "NEXTN needs a target that ships them, or give --speculative-draft-model-path")
        n = config.num_nextn_predict_layers
        return dataclasses.replace(config, family="mtp", num_hidden_layers=n, sliding_windows=(None,) * n)

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.model = nn.Module()  # parameter names are the checkpoint's: model.mtp_layers.{i}.*
        self.model.mtp_layers = nn.ModuleList(MtpLayer(config, i) for i in range(config.num_hidden_layers))
        self.rotary_emb = RotaryEmbedding(config.rope, config.head_dim, config.max_position_embeddings)
        self.embed_weight: torch.Tensor | None = None  # the target's, set by share_target
        self.lm_head_weight: torch.Tensor | None = None

    @staticmethod
    def checkpoint_name(key: str) -> str | None:
        """Only the MTP layers are ours; the target's own tensors around them are not."""
        return key if key.startswith(MTP_PREFIX) else None

    def share_target(self, embed_weight: torch.Tensor, lm_head_weight: torch.Tensor) -> None:
        hidden = self.config.hidden_size
        if embed_weight.shape[1] != hidden or lm_head_weight.shape[1] != hidden:
            raise ValueError(f"the target's hidden size {embed_weight.shape[1]} is not the MTP layers' {hidden}")
        self.embed_weight, self.lm_head_weight = embed_weight, lm_head_weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, backend: AttentionBackend, plan: object,
                capture_layers: tuple[int, ...] = (), features: torch.Tensor | None = None, draft_layer: int = 0):
        if features is None or self.embed_weight is None:
            raise ValueError("MTP layers need the target's embedding (share_target) and a feature per token")
        ctx = ForwardContext(backend, plan, self.rotary_emb, positions)
        layer = self.model.mtp_layers[draft_layer]
        dtype = layer.final_layernorm.weight.dtype  # the head's dtype (input_proj may hold FP8 weights)
        embeds = nn.functional.embedding(input_ids, self.embed_weight).to(dtype)
        embeds = embeds.masked_fill((positions == 0)[:, None], 0.0)
        return layer(positions, embeds, features.to(dtype), ctx), []

    def logits(self, hidden: torch.Tensor, upcast: bool = True) -> torch.Tensor:
        logits = nn.functional.linear(hidden.to(self.lm_head_weight.dtype), self.lm_head_weight)
        return logits.float() if upcast else logits


"""The Llama family: Llama 2/3/3.1, Mistral, Qwen2/2.5 (q/k/v bias), Qwen3 (q/k RMSNorm), MiMo (a Qwen2
whose checkpoint also carries MTP layers, served by runtime.models.mtp).

One decoder, switched by ModelConfig flags. Module names follow the HF checkpoints, except that
q/k/v and gate/up are fused (`packed_modules` tells the loader how checkpoint tensors map in).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from splitspec.runtime.attention.base import AttentionBackend
from splitspec.runtime.config import ModelConfig
from splitspec.runtime.layers import GatedMLP, RMSNorm
from splitspec.runtime.rope import RotaryEmbedding


@dataclass
class ForwardContext:
    """What every layer needs for one batch: the attention backend and its plan, RoPE and the
    batch's positions."""

    backend: AttentionBackend
    plan: object
    rope: RotaryEmbedding
    positions: torch.Tensor  # [T]


class Attention(nn.Module):
    packed = {"qkv_proj": ("q_proj", "k_proj", "v_proj")}

    def __init__(self, config: ModelConfig, layer_id: int, input_size: int | None = None):
        """input_size: the width q/k/v project from (EAGLE-3's first layer: 2H), default hidden_size."""
        super().__init__()
        self.layer_id = layer_id
        self.num_heads, self.num_kv_heads, self.head_dim = (
            config.num_attention_heads,
            config.num_key_value_heads,
            config.head_dim,
        )
        self.split_sizes = (config.q_size, config.kv_size, config.kv_size)
        self.qkv_proj = nn.Linear(input_size or config.hidden_size, sum(self.split_sizes), bias=config.qkv_bias)
        self.o_proj = nn.Linear(config.q_size, config.hidden_size, bias=config.o_bias)
        self.has_qk_norm = config.qk_norm
        if config.qk_norm:
            self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        num_tokens = x.shape[0]
        q, k, v = self.qkv_proj(x).split(self.split_sizes, dim=-1)
        q = q.view(num_tokens, self.num_heads, self.head_dim)  # [T, Hq, D]
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)  # [T, Hkv, D]
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        if self.has_qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        out = ctx.backend.run_rope(self.layer_id, q, k, v, ctx.plan, ctx.rope, ctx.positions)  # [T, Hq, D]
        return self.o_proj(out.reshape(num_tokens, -1))


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_id: int, input_norm: bool = True, attn_input_size: int | None = None):
        super().__init__()
        self.self_attn = Attention(config, layer_id, attn_input_size)
        self.mlp = GatedMLP(config.hidden_size, config.intermediate_size, config.mlp_bias)
        if input_norm:  # EAGLE heads' layer 0 has none
            self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        x = x + self.self_attn(positions, self.input_layernorm(x), ctx)
        return x + self.mlp(self.post_attention_layernorm(x))

    def forward_fused(self, positions: torch.Tensor, h: torch.Tensor, residual: torch.Tensor | None,
                      ctx: ForwardContext) -> tuple[torch.Tensor, torch.Tensor]:
        """forward() with the residual stream carried apart: the layer's input is residual + h (h alone
        for the first layer); returns (this layer's MLP output, its attention output's residual), whose
        sum is forward()'s result. Each residual add is fused into the next RMSNorm (one kernel on a
        GPU), and rounds as forward()'s add does."""
        if residual is None:
            residual, x = h, self.input_layernorm(h)
        else:
            x, residual = self.input_layernorm(h, residual)
        x = self.self_attn(positions, x, ctx)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


LlamaDecoderLayerBase = DecoderLayer
MTP_PREFIX = "model.mtp_layers."  # MTP layers inside a target checkpoint (REFERENCES §2b)


class LlamaModel(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        # built uninitialised (the loader fills it): nn.Embedding's own normal_ init on the meta device
        # runs through torch's reference ops, whose first use imports torch._dynamo (about 3 CPU seconds)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size,
                                         _weight=torch.empty(config.vocab_size, config.hidden_size))
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class LlamaForCausalLM(nn.Module):
    """forward() -> (final normed hidden [T, H], captured layer inputs); logits() applies lm_head."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.model = LlamaModel(config)
        if not config.tie_word_embeddings:
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.rotary_emb = RotaryEmbedding(config.rope, config.head_dim, config.max_position_embeddings)

    def checkpoint_name(self, key: str) -> str | None:
        """A target shipping MTP layers (MiMo: model.mtp_layers.*) keeps them for its MTP drafter."""
        if key.startswith(MTP_PREFIX) and self.config.num_nextn_predict_layers:
            return None
        return key

    @property
    def lm_head_weight(self) -> torch.Tensor:
        return self.model.embed_tokens.weight if self.config.tie_word_embeddings else self.lm_head.weight

    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        backend: AttentionBackend,
        plan: object,
        capture_layers: tuple[int, ...] = (),
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Returns the final normed hidden state [T, H] and, for each i in capture_layers, the input of
        decoder layer i [T, H] (i == num_layers: the last layer's output before the final norm)."""
        ctx = ForwardContext(backend, plan, self.rotary_emb, positions)
        h, residual = self.model.embed_tokens(input_ids), None
        captured: dict[int, torch.Tensor] = {}
        for i, layer in enumerate(self.model.layers):
            if i in capture_layers:
                captured[i] = h if residual is None else residual + h
            h, residual = layer.forward_fused(positions, h, residual, ctx)
        if len(self.model.layers) in capture_layers:
            captured[len(self.model.layers)] = residual + h
        return self.model.norm(h, residual)[0], [captured[i] for i in capture_layers]

    def set_hot_tokens(self, token_ids: torch.Tensor) -> None:
        """FR-Spec: logits() gives only these ids' logits, in this order (a draft model's cut head)."""
        self.hot_head = self.lm_head_weight[token_ids.to(self.lm_head_weight.device)].contiguous()

    def logits(self, hidden: torch.Tensor, upcast: bool = True) -> torch.Tensor:
        """[N, H] -> [N, V] logits ([N, R] after set_hot_tokens): fp32, or in the model's dtype with upcast False (for a
        reader that upcasts as it reads: a draft loop's top-k kernel, spared a copy a step)."""
        weight = getattr(self, "hot_head", None)
        logits = torch.nn.functional.linear(hidden, self.lm_head_weight if weight is None else weight)
        return logits.float() if upcast else logits

"""Model families, by ModelConfig.family. Each family is one compact module on the shared layers."""

from __future__ import annotations

from torch import nn

from splitspec.registry import load_entry

from splitspec.runtime.config import ModelConfig

# family -> "module:Class"
MODEL_FAMILIES: dict[str, str] = {
    "llama": "splitspec.runtime.models.llama:LlamaForCausalLM",
    # draft heads: chosen by --speculative-algorithm, not by config.json
    "eagle": "splitspec.runtime.models.eagle:EagleHead",
    "eagle3": "splitspec.runtime.models.eagle3:Eagle3Head",
    "mtp": "splitspec.runtime.models.mtp:MtpHead",  # a target's own MTP layers (NEXTN)
}


def model_class(config: ModelConfig) -> type[nn.Module]:
    return load_entry(MODEL_FAMILIES, config.family, "model family")


def packed_modules(model: nn.Module) -> dict[str, tuple[str, ...]]:
    """Fused module name -> the checkpoint modules stacked in it (rows along dim 0, in order)."""
    packed: dict[str, tuple[str, ...]] = {}
    for module in model.modules():
        packed.update(getattr(module, "packed", {}))
    return packed

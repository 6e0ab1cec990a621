"""Model shapes that benchmarks build as dummy (random-weight) checkpoints from a config alone."""

from __future__ import annotations

import atexit
import json
import shutil
import tempfile
from pathlib import Path

SMALL_LLAMA = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 512, "intermediate_size": 1408,
    "num_hidden_layers": 8, "num_attention_heads": 8, "num_key_value_heads": 4, "vocab_size": 32000,
    "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": False,
}
PRESETS = {
    "small": SMALL_LLAMA,
    "quick": {**SMALL_LLAMA, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 500},
    # Llama-3.1-8B's shape (REFERENCES: 32 layers, GQA 32/8, 128256 vocab, llama3 rope)
    "llama-3.1-8b": {**SMALL_LLAMA, "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
                     "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256,
                     "max_position_embeddings": 131072, "rope_theta": 500000.0,
                     "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                      "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}},
}



def eagle3_head(target: dict, draft_vocab_size: int = 32000) -> dict:
    """An EAGLE-3 head for a target of this shape, as published for Llama-3.1-8B (one decoder layer of the
    target's width, a draft vocabulary of 32000 ids, three captured layers: the inputs of 2, L//2, L-3)."""
    layers = target["num_hidden_layers"]
    aux = [1, layers // 2 - 1, layers - 4] if layers >= 7 else sorted({0, layers // 2, layers - 1})
    return {**target, "num_hidden_layers": 1, "draft_vocab_size": min(draft_vocab_size, target["vocab_size"]),
            "eagle_config": {"eagle_aux_hidden_state_layer_ids": aux, "use_aux_hidden_state": True},
            "target_hidden_size": target["hidden_size"]}


PRESETS.update({f"eagle3-{name}": eagle3_head(shape) for name, shape in list(PRESETS.items())})


def dummy_model_dir(preset: str, directory: str | Path | None = None) -> Path:
    """A directory (new, unless given) holding only the preset's config.json: load it with load_format "dummy". A new
    one is removed when this process exits (what loads it reads the config at its start)."""
    if directory is None:
        path = Path(tempfile.mkdtemp(prefix=f"splitspec-{preset}-"))
        atexit.register(shutil.rmtree, path, True)
    else:
        path = Path(directory)
    (path / "config.json").write_text(json.dumps(PRESETS[preset]))
    return path

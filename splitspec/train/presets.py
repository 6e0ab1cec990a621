"""Named model shapes and training settings: the demo target and draft, and a CI smoke size."""

from __future__ import annotations

from splitspec.train.configs import HeadTrainConfig, LMShape, TrainConfig

DEMO_VOCAB_SIZE = 4096

PRESETS: dict[str, tuple[LMShape, TrainConfig]] = {
    # ~15.7M parameters: a forward clearly dearer than a ZeroMQ round trip on CPU
    "demo-target": (
        LMShape(hidden_size=384, num_hidden_layers=8, num_attention_heads=6, num_key_value_heads=2, intermediate_size=1024),
        TrainConfig(steps=700, batch_size=64, seq_len=512, lr=2e-3, warmup_steps=70, eval_every=50,
                    eval_tokens=131072, save_every=200, seed=0, save_dtype="bfloat16"),
    ),
    # ~2.8M parameters: several times smaller than the target, same tokenizer
    "demo-draft": (
        LMShape(hidden_size=192, num_hidden_layers=3, num_attention_heads=3, num_key_value_heads=1, intermediate_size=512),
        TrainConfig(steps=1000, batch_size=64, seq_len=512, lr=3e-3, warmup_steps=100, eval_every=50,
                    eval_tokens=131072, save_every=200, seed=1, save_dtype="bfloat16"),
    ),
    # seconds on a CPU: for CI
    "smoke": (
        LMShape(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128),
        TrainConfig(steps=200, batch_size=8, seq_len=64, lr=3e-3, warmup_steps=10, eval_every=50,
                    eval_tokens=8192, save_every=50, seed=0),
    ),
}

# draft heads for the demo target (`splitspec demo-models`), trained on its own dataset; the smoke sizes
# are for tests (seconds on a CPU)
_DEMO_HEAD = dict(steps=3000, batch_size=32, seq_len=512, lr=1e-3, warmup_steps=100, eval_every=100, eval_windows=64,
                  save_every=500, accept_prompts=16, accept_new_tokens=128, save_dtype="bfloat16", seed=0)
_SMOKE_HEAD = dict(steps=6, batch_size=2, seq_len=48, eval_every=3, eval_windows=2, save_every=1000, accept_prompts=2,
                   accept_new_tokens=8, save_dtype="float32", seed=0)
HEAD_PRESETS: dict[str, HeadTrainConfig] = {
    "demo-eagle": HeadTrainConfig(kind="eagle", **_DEMO_HEAD),
    "demo-eagle3": HeadTrainConfig(kind="eagle3", ttt_steps=3, draft_vocab_size=2048, **_DEMO_HEAD),
    "smoke-eagle": HeadTrainConfig(kind="eagle", **_SMOKE_HEAD),
    "smoke-eagle3": HeadTrainConfig(kind="eagle3", ttt_steps=2, draft_vocab_size=256, **_SMOKE_HEAD),
}

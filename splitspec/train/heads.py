"""Training EAGLE-2 and EAGLE-3 draft heads for any HF target (`splitspec train eagle|eagle3`).

The head trained is the runtime's own module (runtime.models.eagle / eagle3), so what is trained is
exactly what serves; it is written in the published layout (REFERENCES §1 and §2) that the runtime,
SGLang and vLLM load. Each step reads a batch of text windows, runs the target on them (no grad) for
its hidden states and next-token distributions, and trains the head on them:

    row p: token t[p+1] with the target's state h[p] (EAGLE: the final normed state; EAGLE-3: the inputs
           of the captured layers), target = the target's distribution at p+1 (which predicts t[p+2])
    EAGLE-2  one step: smooth-L1 of the head's output against h[p+1] + 0.1 * cross-entropy (EAGLE's losses)
    EAGLE-3  the training-time test: step k's row p takes token t[p+1+k] and the head's own output of step
             k-1 at row p, sits at position p+k, and attends to step 0's rows j <= p plus its own earlier
             steps at row p (what a draft node at depth k sees at inference); cross-entropy over the draft
             vocabulary at every step, weighted 0.8^k

With --regenerate the windows are the target's own continuations of prompts of the text (train.regenerate).
Batches depend only on (seed, step), so a run resumed from its last checkpoint sees what an
uninterrupted one would. The weights kept are those of the best held-out loss. At the end the saved
head drafts for the target on held-out prompts through the real engine (the verifier's step loop with
the drafter in process), and the mean accept length is reported.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from dataclasses import asdict
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from torch import nn
from tqdm import tqdm

from splitspec.train.configs import HeadTrainConfig  # noqa: F401  (defined there, torch-free; callers import it here too)
from splitspec.train.lm import learning_rate  # the same warm-up + cosine schedule (reads lr, warmup_steps, steps)
from splitspec.train.regenerate import Regeneration, forget, regenerated
from splitspec.train.resume import clear_state, load_state, save_state

logger = logging.getLogger(__name__)

REPORT_FILE = "training.json"
EAGLE3_STEP_WEIGHT = 0.8


def head_config(target: dict, cfg: HeadTrainConfig, capture: tuple[int, ...]) -> dict:
    """The head's config.json: the target's attention shape, one layer, the published fields."""
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": target["hidden_size"],
              "intermediate_size": cfg.intermediate_size or target["intermediate_size"], "num_hidden_layers": 1,
              "num_attention_heads": target["num_attention_heads"],
              "num_key_value_heads": target.get("num_key_value_heads") or target["num_attention_heads"],
              "head_dim": target.get("head_dim") or target["hidden_size"] // target["num_attention_heads"],
              "vocab_size": target["vocab_size"], "rms_norm_eps": target.get("rms_norm_eps", 1e-6),
              "max_position_embeddings": target.get("max_position_embeddings", 2048), "tie_word_embeddings": False,
              "torch_dtype": cfg.save_dtype}
    rope = target.get("rope_parameters") or {}
    theta = target.get("rope_theta", rope.get("rope_theta"))
    if theta is not None:
        config["rope_theta"] = theta
    if cfg.kind == "eagle":
        config["bias"] = True
    else:
        config["draft_vocab_size"] = min(cfg.draft_vocab_size, target["vocab_size"])
        # the layers captured, as eagle_aux_hidden_state_layer_ids (SGLang's reading: the output of layer i)
        config["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": [i - 1 for i in capture], "use_aux_hidden_state": True}
    return config


class Target:
    """The target, run by transformers for its hidden states and next-token distributions (no grad)."""

    def __init__(self, model_dir: Path, device: torch.device, capture: tuple[int, ...]):
        from transformers import AutoModelForCausalLM

        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device).eval()
        self.capture, self.device = capture, device

    @torch.no_grad()
    def __call__(self, windows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
        """windows [B, T] -> final normed states [B, T, H], captured layer inputs [B, T, k*H] (EAGLE-3),
        logits [B, T, V] (fp32)."""
        out = self.model.model(windows.to(self.device), output_hidden_states=bool(self.capture))
        final = out.last_hidden_state
        aux = torch.cat([out.hidden_states[i] for i in self.capture], -1) if self.capture else None
        return final, aux, self.model.lm_head(final).float()


def hot_tokens(tokens: torch.Tensor, vocab_size: int, draft_vocab: int) -> torch.Tensor:
    """EAGLE-3's draft vocabulary: the draft_vocab most frequent ids of the training tokens, ascending."""
    counts = torch.bincount(tokens.flatten(), minlength=vocab_size)
    return counts.argsort(descending=True, stable=True)[:draft_vocab].sort().values


class HeadTrainer:
    def __init__(self, target_dir: Path, out_dir: Path, train_tokens: torch.Tensor, held_out_tokens: torch.Tensor,
                 cfg: HeadTrainConfig):
        from splitspec.runtime.config import ModelConfig

        self.target_dir, self.out_dir, self.cfg = Path(target_dir), Path(out_dir), cfg
        self.device = torch.device(cfg.device)
        self.train_tokens, self.held_out_tokens = train_tokens, held_out_tokens
        for name, tokens in (("training", train_tokens), ("held-out", held_out_tokens)):
            if tokens.numel() < cfg.seq_len + 2:
                raise ValueError(f"the {name} data has {tokens.numel()} tokens, fewer than one window of --seq-len {cfg.seq_len}")
        self.windows = self.held_out_windows = None  # [N, seq_len + 1] the target wrote (--regenerate), else None
        if cfg.regenerate:
            plan = Regeneration(cfg.regenerate, cfg.seq_len, cfg.regenerate_prompt_len, cfg.regenerate_temperature, cfg.seed)
            self.windows, self.held_out_windows = regenerated(self.out_dir, self.target_dir, train_tokens, held_out_tokens,
                                                              plan, cfg.eval_windows, cfg.device)
        target_raw = json.loads((self.target_dir / "config.json").read_text())
        self.target_config = ModelConfig.from_dict(target_raw)
        self.capture = self.target_config.eagle3_capture_layers() if cfg.kind == "eagle3" else ()
        self.config = head_config(target_raw, cfg, self.capture)
        self.target = Target(self.target_dir, self.device, self.capture)
        torch.manual_seed(cfg.seed)
        self.head = self._build_head()
        self.optimizer = torch.optim.AdamW([p for p in self.head.parameters() if p.requires_grad], lr=cfg.lr,
                                           betas=(0.9, 0.95), weight_decay=0.0)
        self.step, self.best_loss, self.best_state, self.history = 0, float("inf"), None, []

    def _build_head(self) -> nn.Module:
        from splitspec.runtime.config import ModelConfig
        from splitspec.runtime.loader import _init_dummy
        from splitspec.runtime.models import model_class

        config = dataclasses.replace(ModelConfig.from_dict(self.config), family=self.cfg.kind)
        head = model_class(config)(config).to(self.device)
        _init_dummy(head, self.cfg.seed)
        head.rotary_emb.reserve(self.cfg.seq_len + self.cfg.ttt_steps + 1, self.device)
        embed = self.target.model.get_input_embeddings().weight.detach().float()
        lm_head = self.target.model.lm_head.weight.detach().float()
        if self.cfg.kind == "eagle3":
            text = self.train_tokens if self.windows is None else self.windows  # the draft vocabulary: what it drafts
            self.hot = hot_tokens(text, config.vocab_size, head.draft_vocab_size).to(self.device)
            if hasattr(head, "d2t"):
                head.d2t.copy_(self.hot - torch.arange(len(self.hot), device=self.device))
            with torch.no_grad():
                head.lm_head.weight.copy_(lm_head[self.hot])  # start from the target's rows
            head.share_target(embed)
        else:
            self.hot = None
            head.share_target(embed, lm_head)
        return head.float().train()

    # -- the forward with the training-time test ------------------------------------------------

    def _layer(self, layer, attn_input: torch.Tensor, residual: torch.Tensor, positions: torch.Tensor,
               cache: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """One decoder layer over a whole step [B, T, *]: attention as a draft node at this depth sees it
        (step 0: causal over step 0; step k: step 0's rows j <= p and its own earlier steps' row p)."""
        attn = layer.self_attn
        b, t, _ = attn_input.shape
        q, k, v = attn.qkv_proj(attn_input).split(attn.split_sizes, dim=-1)
        q = q.reshape(b * t, attn.num_heads, attn.head_dim)
        k = k.reshape(b * t, attn.num_kv_heads, attn.head_dim)
        v = v.reshape(b, t, attn.num_kv_heads, attn.head_dim)
        if attn.has_qk_norm:
            q, k = attn.q_norm(q), attn.k_norm(k)
        cos, sin = self.head.rotary_emb.cos_sin(positions.flatten())
        q, k = self.head.rotary_emb.apply(q, k, cos, sin)
        q = q.view(b, t, attn.num_heads, attn.head_dim).transpose(1, 2)  # [B, Hq, T, D]
        k = k.view(b, t, attn.num_kv_heads, attn.head_dim)
        cache.append((k, v))
        group = attn.num_heads // attn.num_kv_heads
        k0, v0 = (x.transpose(1, 2).repeat_interleave(group, 1) for x in cache[0])  # [B, Hq, T, D]
        scale = attn.head_dim ** -0.5
        scores = (q @ k0.transpose(-1, -2)) * scale  # [B, Hq, T, T] over step 0's rows
        scores = scores.masked_fill(torch.ones(t, t, dtype=torch.bool, device=q.device).triu(1), float("-inf"))
        diagonals = [((q * kk.transpose(1, 2).repeat_interleave(group, 1)).sum(-1) * scale)[..., None]
                     for kk, _ in cache[1:]]  # [B, Hq, T, 1] each: its own earlier steps at row p
        probs = torch.softmax(torch.cat([scores, *diagonals], -1).float(), -1).to(q.dtype)
        out = probs[..., :t] @ v0
        for m, (_, vv) in enumerate(cache[1:]):
            out = out + probs[..., t + m : t + m + 1] * vv.transpose(1, 2).repeat_interleave(group, 1)
        out = attn.o_proj(out.transpose(1, 2).reshape(b, t, -1))
        x = residual + out
        return x + layer.mlp(layer.post_attention_layernorm(x))

    def loss(self, windows: torch.Tensor) -> tuple[torch.Tensor, list[float]]:
        """windows [B, T + 1] -> the head's loss and the per-step top-1 agreement with the target."""
        final, aux, logits = self.target(windows)
        tokens = windows.to(self.device)
        t = windows.shape[1] - 2  # rows p = 0 .. T-2 have a token t[p+1] and a target at p+1
        embed = self.head.embed_weight
        positions = torch.arange(t, device=self.device).expand(windows.shape[0], t)
        head = self.head
        cache: list = []
        steps = self.cfg.ttt_steps if self.cfg.kind == "eagle3" else 1
        total, agreement = 0.0, []
        feature = (head.fc(aux[:, :t].float()) if self.cfg.kind == "eagle3" else
                   head.fc(torch.cat([embed[tokens[:, 1 : t + 1]], final[:, :t].float()], -1)))
        length = windows.shape[1] - 1  # the window's last position
        for k in range(steps):
            valid = min(t, length - k)  # rows p whose token t[p+1+k] and target at p+1+k exist
            token_ids = tokens[:, 1 + k : 1 + k + valid]
            if valid < t:  # rows past the window's end: any token (no row before them attends to them)
                token_ids = torch.cat([token_ids, token_ids[:, -1:].expand(-1, t - valid)], 1)
            layer = head.layers[0]
            if self.cfg.kind == "eagle3":
                x_in = torch.cat([layer.input_layernorm(embed[token_ids]), layer.hidden_norm(feature)], -1)
                x = self._layer(layer, x_in, feature, positions + k, cache)
                draft_logits = head.lm_head(head.norm(x))[:, :valid]
                target_probs = torch.softmax(logits[:, 1 + k : 1 + k + valid], -1)[..., self.hot]
                target_probs = target_probs / target_probs.sum(-1, keepdim=True)
                ce = -(target_probs * torch.log_softmax(draft_logits.float(), -1)).sum(-1).mean()
                total = total + EAGLE3_STEP_WEIGHT ** k * ce
                agreement.append((draft_logits.argmax(-1) == target_probs.argmax(-1)).float().mean().item())
            else:
                x = self._layer(layer, feature, feature, positions, cache)
                regression = F.smooth_l1_loss(x.float(), final[:, 1 : t + 1].float())
                draft_logits = F.linear(x, head.lm_head_weight)
                target_probs = torch.softmax(logits[:, 1 : t + 1], -1)
                ce = -(target_probs * torch.log_softmax(draft_logits.float(), -1)).sum(-1).mean()
                total = total + regression + 0.1 * ce
                agreement.append((draft_logits.argmax(-1) == target_probs.argmax(-1)).float().mean().item())
            feature = x
        return total, agreement

    # -- the loop, checkpoints, the report -----------------------------------------------------------

    def batch(self, step: int) -> torch.Tensor:
        generator = torch.Generator().manual_seed(self.cfg.seed * 1_000_003 + step)
        if self.windows is not None:
            return self.windows[torch.randint(0, len(self.windows), (self.cfg.batch_size,), generator=generator)]
        starts = torch.randint(0, self.train_tokens.numel() - self.cfg.seq_len - 1, (self.cfg.batch_size,), generator=generator)
        return torch.stack([self.train_tokens[s : s + self.cfg.seq_len + 1] for s in starts.tolist()])

    def _autocast(self):
        return torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.device.type == "cuda")

    @torch.no_grad()
    def held_out(self) -> tuple[float, list[float]]:
        n = self.cfg.seq_len + 1
        windows = list(self.held_out_windows) if self.held_out_windows is not None else [
            self.held_out_tokens[i * n : (i + 1) * n]
            for i in range(min(self.cfg.eval_windows, (self.held_out_tokens.numel() - 1) // n))]
        losses, agreements = [], []
        for chunk in torch.stack(windows).split(self.cfg.batch_size):
            with self._autocast():
                loss, agreement = self.loss(chunk)
            losses.append(loss.item() * len(chunk))
            agreements.append([a * len(chunk) for a in agreement])
        count = len(windows)
        return sum(losses) / count, [sum(col) / count for col in zip(*agreements)]

    def _evaluate(self) -> None:
        self.head.eval()
        loss, agreement = self.held_out()
        self.head.train()
        self.history.append({"step": self.step, "held_out_loss": round(loss, 5),
                             "top1_agreement_per_step": [round(a, 4) for a in agreement]})
        if loss < self.best_loss:
            self.best_loss = loss
            self.best_state = {k: v.detach().to("cpu", copy=True) for k, v in self.head.state_dict().items()}

    def _save_state(self) -> None:
        state = {"head": self.head.state_dict(), "optimizer": self.optimizer.state_dict(), "step": self.step,
                 "best_loss": self.best_loss, "best_state": self.best_state, "history": self.history, "cfg": asdict(self.cfg)}
        save_state(self.out_dir, state)

    def _load_state(self) -> bool:
        state = load_state(self.out_dir, self.device)
        if state is None:
            return False
        self.head.load_state_dict(state["head"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.step, self.best_loss, self.history, self.best_state = (state["step"], state["best_loss"], state["history"],
                                                                    state["best_state"])
        logger.info("resumed %s at step %d (best held-out loss %.4f)", self.out_dir, self.step, self.best_loss)
        return True

    def train(self) -> dict:
        self.out_dir.mkdir(parents=True, exist_ok=True)
        if not self._load_state():
            self._evaluate()
        start, train_loss, stopped_early = time.perf_counter(), float("nan"), False
        bar = tqdm(total=self.cfg.steps, initial=self.step, desc=f"train {self.cfg.kind} head", unit="step", disable=None)
        while self.step < self.cfg.steps:
            if self.cfg.time_budget_s and time.perf_counter() - start > self.cfg.time_budget_s:
                logger.warning("time budget of %.0fs reached at step %d of %d", self.cfg.time_budget_s, self.step, self.cfg.steps)
                self._evaluate()
                stopped_early = True
                break
            for group in self.optimizer.param_groups:
                group["lr"] = learning_rate(self.step, self.cfg)
            with self._autocast():
                loss, _ = self.loss(self.batch(self.step))
            loss.backward()
            torch.nn.utils.clip_grad_norm_(self.head.parameters(), self.cfg.grad_clip)
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
            self.step += 1
            train_loss = loss.item()
            bar.update()
            bar.set_postfix(loss=f"{train_loss:.3f}", best=f"{self.best_loss:.3f}")
            if self.step % self.cfg.eval_every == 0 or self.step == self.cfg.steps:
                self._evaluate()
                logger.info("step %d: train loss %.4f, held-out %.4f, top-1 agreement %s", self.step, train_loss,
                            self.history[-1]["held_out_loss"], self.history[-1]["top1_agreement_per_step"])
            if self.step % self.cfg.save_every == 0 and self.step < self.cfg.steps:
                self._save_state()
        bar.close()
        seconds = time.perf_counter() - start
        self.head.load_state_dict(self.best_state)
        self.save()
        report = {"kind": self.cfg.kind, "target": str(self.target_dir), "config": self.config, "train": asdict(self.cfg),
                  "parameters": sum(p.numel() for n, p in self.head.named_parameters()),
                  "steps": self.step, "final_train_loss": round(train_loss, 5), "best_held_out_loss": round(self.best_loss, 5),
                  "history": self.history, "seconds_this_run": round(seconds, 1), "stopped_by_time_budget": stopped_early,
                  "train_tokens": self.train_tokens.numel(), "held_out_tokens": self.held_out_tokens.numel(),
                  "regenerated_windows": 0 if self.windows is None else len(self.windows),
                  "device": torch.cuda.get_device_name(self.device) if self.device.type == "cuda" else "cpu"}
        if self.cfg.accept_prompts:
            report["held_out_accept"] = self.accept_estimate()
            logger.info("held-out mean accept length %.3f", report["held_out_accept"]["mean_accept_length"])
        (self.out_dir / REPORT_FILE).write_text(json.dumps(report, indent=1) + "\n")
        clear_state(self.out_dir)
        forget(self.out_dir)
        return report

    def export_state(self) -> dict[str, torch.Tensor]:
        """The head's tensors under the published checkpoint names (fused q/k/v and gate/up split back)."""
        from splitspec.runtime.loader import checkpoint_spec

        dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[self.cfg.save_dtype]
        params = {**dict(self.head.named_parameters()), **dict(self.head.named_buffers())}
        out = {}
        for key, target in checkpoint_spec(self.head).items():
            tensor = params[target.param].detach()[target.row_start : target.row_start + target.shape[0]]
            tensor = tensor.to("cpu", dtype) if tensor.is_floating_point() else tensor.to("cpu")
            if self.cfg.kind == "eagle3" and key.startswith("layers.0."):
                key = "midlayer." + key.removeprefix("layers.0.")
            out[key] = tensor.contiguous().clone()
        if self.cfg.kind == "eagle3" and self.hot is not None:
            out["t2d"] = torch.zeros(self.config["vocab_size"], dtype=torch.bool).index_fill_(0, self.hot.cpu(), True)
        return out

    def save(self) -> None:
        save_file(self.export_state(), str(self.out_dir / "model.safetensors"), metadata={"format": "pt"})
        (self.out_dir / "config.json").write_text(json.dumps(self.config, indent=1) + "\n")
        logger.info("saved the %s head to %s", self.cfg.kind, self.out_dir)

    def accept_estimate(self) -> dict:
        """The saved head drafting for the target on held-out prompts, through the real engine (the
        verifier's step loop with the drafter in this process), greedy."""
        from splitspec.drafter_svc.eagle import EagleDrafter
        from splitspec.generate import generate_ids
        from splitspec.runtime.runner import ModelRunner, RuntimeConfig
        from splitspec.runtime.sampling_params import SamplingParams
        from splitspec.verifier_svc.drafter_client import InProcessDrafterClient
        from splitspec.verifier_svc.step_types import SpecConfig

        device, dtype = str(self.device), "bfloat16" if self.device.type == "cuda" else "float32"
        target = ModelRunner.load(RuntimeConfig(model_path=str(self.target_dir), dtype=dtype, device=device, max_total_tokens=65536))
        head = ModelRunner.load(RuntimeConfig(model_path=str(self.out_dir), dtype=dtype, device=device, max_total_tokens=65536,
                                              family=self.cfg.kind))
        token_map = None
        if self.cfg.kind == "eagle3":
            head.model.share_target(target.model.model.embed_tokens.weight)
            token_map = head.model.hot_token_ids()
            token_map = None if token_map is None else token_map.cpu()
            target.set_capture_layers(self.capture)
        else:
            head.model.share_target(target.model.model.embed_tokens.weight, target.model.lm_head_weight)
        steps, topk, tokens = (5, 4, 8) if self.target_config.architecture == "LlamaForCausalLM" else (3, 1, 4)
        drafter = EagleDrafter(head, topk=topk, num_steps=steps, num_draft_tokens=tokens, token_map=token_map)
        prompt_len = 64
        stride = max(prompt_len + self.cfg.accept_new_tokens, self.held_out_tokens.numel() // max(1, self.cfg.accept_prompts))
        prompts = [self.held_out_tokens[i * stride : i * stride + prompt_len].tolist() for i in range(self.cfg.accept_prompts)
                   if i * stride + prompt_len <= self.held_out_tokens.numel()]
        params = [SamplingParams(temperature=0.0, max_new_tokens=self.cfg.accept_new_tokens, ignore_eos=True)] * len(prompts)
        out = generate_ids(target, prompts, params, set(), drafter=InProcessDrafterClient(drafter),
                           spec=SpecConfig(num_draft_tokens=tokens))
        steps_done = sum(o.stats.verify_steps for o in out)
        accepted = sum(o.stats.accepted_tokens for o in out)
        return {"prompts": len(prompts), "prompt_tokens": prompt_len, "new_tokens": self.cfg.accept_new_tokens,
                "tree": {"num_steps": steps, "topk": topk, "num_draft_tokens": tokens},
                "mean_accept_length": round(1 + accepted / max(1, steps_done), 4), "verify_steps": steps_done,
                "accepted_tokens": accepted, "fallbacks": sum(o.stats.fallbacks for o in out)}

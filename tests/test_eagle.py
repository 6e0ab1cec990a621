"""EAGLE across the engine: the verifier hands a hidden-state drafter exactly the target's final normed
state of the position before every token (through chunked prefill, tree verification and
preemption), and an EAGLE head drafting from them keeps greedy output equal to plain."""

from __future__ import annotations

import json

import torch
from helpers import assert_greedy_match, hf_model
from test_eagle_head import head_state
from test_speculative import PROMPTS, run

from splitspec.demo import demo_model_dirs
from splitspec.drafter_svc.base import Drafter
from splitspec.drafter_svc.eagle import EagleDrafter
from splitspec.drafter_svc.ngram import NgramConfig, NgramDrafter
from splitspec.runtime.runner import ModelRunner, RuntimeConfig
from splitspec.runtime.sampling_params import SamplingParams
from splitspec.verifier_svc.drafter_client import InProcessDrafterClient
from splitspec.verifier_svc.engine import Engine, SchedulerConfig, SpecConfig


class RecordingDrafter(Drafter):
    """NGRAM's drafts, plus a record of every (token, hidden state) the engine pairs for it."""

    name = "RECORDING"
    needs_hidden_states = True

    def __init__(self):
        self.ngram = NgramDrafter(NgramConfig())
        self.tokens: dict[str, list[int]] = {}
        self.hidden: dict[str, list[torch.Tensor]] = {}

    def open(self, request_id, prompt_ids):
        assert len(prompt_ids) == 1
        self.tokens[request_id], self.hidden[request_id] = list(prompt_ids), []
        self.ngram.open(request_id, prompt_ids)

    def extend(self, request_id, tokens, hidden=None):
        assert hidden is not None and hidden.shape[0] == len(tokens)
        self.tokens[request_id] += tokens
        self.hidden[request_id].append(hidden.float().cpu())
        self.ngram.extend(request_id, tokens)

    def draft(self, request_ids, max_nodes):
        return self.ngram.draft(request_ids, max_nodes)

    def release(self, request_id):
        self.ngram.release(request_id)


def test_a_hidden_state_drafter_gets_the_targets_state_before_every_token():
    """Chunked prefill (24 tokens per step, trees first), trees, and preemption on a small KV pool: the drafter's
    record is prompt + output with, for token p+1, the target's normed final state at p, equal to an
    HF forward of the whole sequence."""
    target_dir = demo_model_dirs()["target"]
    runner = ModelRunner.load(RuntimeConfig(model_path=str(target_dir), dtype="float32", device="cpu", max_total_tokens=160))
    drafter = RecordingDrafter()
    engine = Engine(runner, InProcessDrafterClient(drafter), SpecConfig(num_draft_tokens=8), set(),
                    SchedulerConfig(chunked_prefill_size=24))
    prompts = [[13, 290, 350 + i, 13, 290, 350 + i, 13, 700 + i, 5, 9, 11, 13, 290, 350 + i] for i in range(8)]
    requests = engine.run(prompts, [SamplingParams(temperature=0.0, max_new_tokens=40, ignore_eos=True)] * 8)
    assert sum(r.num_preemptions for r in requests) > 0 and sum(r.stats.accepted_tokens for r in requests) > 0
    reference = hf_model(target_dir)
    for request in requests:
        sequence = request.prompt_ids + request.output_ids
        recorded = drafter.tokens[request.request_id]
        # the last token reaches the drafter with the next ask, which never comes after the finish
        unsent = len(request.unsent)
        assert recorded == sequence[: len(sequence) - unsent]
        states = torch.cat(drafter.hidden[request.request_id])
        with torch.no_grad():
            want = reference.model(torch.tensor([sequence])).last_hidden_state[0]
        assert states.shape[0] == len(recorded) - 1
        assert torch.allclose(states, want[: states.shape[0]], atol=2e-4, rtol=1e-3), (states - want[: states.shape[0]]).abs().max()


def eagle_head_dir(tmp_path) -> str:
    """A random EAGLE head shaped for the demo target (its hidden size, heads, vocabulary)."""
    import test_eagle_head as th

    target = json.loads((demo_model_dirs()["target"] / "config.json").read_text())
    th.H, th.HEADS, th.KV_HEADS, th.INTER, th.VOCAB = (target["hidden_size"], target["num_attention_heads"],
                                                       target["num_key_value_heads"], 512, target["vocab_size"])
    config = th.head_config(None)
    config["max_position_embeddings"] = target["max_position_embeddings"]
    return str(th.write_head(tmp_path / "eagle", config, head_state(seed=1, with_bias=True), "bin"))


def test_eagle_drafting_keeps_greedy_output_at_batch_1_and_8(tmp_path):
    from transformers import AutoTokenizer

    target_dir = demo_model_dirs()["target"]
    head_dir = eagle_head_dir(tmp_path)
    target = ModelRunner.load(RuntimeConfig(model_path=str(target_dir), dtype="float32", device="cpu", max_total_tokens=8192))
    head = ModelRunner.load(RuntimeConfig(model_path=head_dir, dtype="float32", device="cpu", max_total_tokens=8192, family="eagle"))
    head.model.share_target(target.model.model.embed_tokens.weight, target.model.lm_head_weight)
    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    prompts = [tokenizer.encode(p) for p in PROMPTS[:8]]
    params = [SamplingParams(temperature=0.0, max_new_tokens=24, ignore_eos=True)] * 8
    plain = run(target, prompts, params, batch=1)
    reference = hf_model(target_dir)
    for batch in (1, 8):
        client = InProcessDrafterClient(EagleDrafter(head, topk=2, num_steps=3, num_draft_tokens=6))
        spec = run(target, prompts, params, client, SpecConfig(num_draft_tokens=6), batch=batch)
        for i, (p, s) in enumerate(zip(plain, spec)):
            assert_greedy_match(s.output_ids, p.output_ids, reference, prompts[i], f"eagle prompt {i} batch {batch}")
            assert s.stats.fallbacks == 0
        assert sum(s.stats.draft_tokens for s in spec) > 0
        assert head.kv_cache.allocator.num_used == 0


def test_eagle_drafter_process_over_tcp_gets_hidden_states_and_keeps_output(tmp_path):
    """verifier + a `splitspec drafter` EAGLE process: the target's states cross as raw frames (counted),
    greedy output equals plain at batch 1 and 8, no fallbacks."""
    import socket
    import subprocess
    import sys

    from test_verifier_service import collect, scrape, start_verifier, stop, submit

    from splitspec.generate import generate_ids
    from splitspec.protos import verifier_pb2 as pb

    target_dir = demo_model_dirs()["target"]
    head_dir = eagle_head_dir(tmp_path)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        address = f"tcp://127.0.0.1:{s.getsockname()[1]}"
    shape = ["--speculative-num-steps", "3", "--speculative-eagle-topk", "2", "--speculative-num-draft-tokens", "6"]
    drafter = subprocess.Popen([sys.executable, "-P", "-m", "splitspec", "drafter", "--verifier-drafter-addr", address,
                                "--drafter-name", "eagle-1", "--speculative-algorithm", "EAGLE", "--dtype", "float32",
                                "--model-path", str(target_dir), "--speculative-draft-model-path", head_dir, *shape,
                                "--log-level", "warning"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    process, stub = start_verifier("--max-total-tokens", "8192", "--drafter-bind-addr", address, "--wait-for-drafters", "1",
                                   "--drafter-timeout-ms", "10000", "--speculative-algorithm", "EAGLE",
                                   "--speculative-draft-model-path", head_dir, *shape)
    try:
        prompts = [[13, 290, 350 + i, 13, 290, 350 + i, 13, 900 + i] for i in range(8)]
        target = ModelRunner.load(RuntimeConfig(model_path=str(target_dir), dtype="float32", device="cpu", max_total_tokens=4096))
        plain = generate_ids(target, prompts, [SamplingParams(temperature=0.0, max_new_tokens=24)] * 8, set())
        reference = hf_model(target_dir)
        for batch in (1, 8):
            results = {}
            for start in range(0, 8, batch):
                results.update(collect(stub, [submit(f"e{batch}-{i}", prompts[i], max_new_tokens=24)
                                              for i in range(start, start + batch)], batch))
            for i in range(8):
                r = results[f"e{batch}-{i}"]
                assert r["finish"] == pb.FINISH_REASON_LENGTH and r["spec"].fallbacks == 0, r
                assert_greedy_match(r["tokens"], plain[i].output_ids, reference, prompts[i], f"tcp eagle b{batch} {i}")
            assert sum(r["spec"].draft_tokens for r in results.values()) > 0
        metrics = scrape(stub.metrics_url)
        hidden_bytes = metrics[("splitspec:drafter_hidden_state_bytes_total", (("drafter", "eagle-1"),))]
        # every token but each request's first crossed with a 384-float state (fp32 here)
        assert hidden_bytes >= 16 * (len(prompts[0]) - 1 + 23) * 384 * 4
        print(f"EAGLE over tcp: {hidden_bytes / 1e6:.2f} MB of hidden states for 16 requests")
    finally:
        stop(process, stub)
        drafter.kill()
        drafter.wait(timeout=30)

"""EAGLE across the engine: the verifier hands a hidden-state drafter exactly the target's final normed
state of the position before every token (through chunked prefill, tree verification and
preemption), and an EAGLE head drafting from them keeps greedy output equal to plain."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import assert_greedy_match, hf_model, spawn_service
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


@pytest.mark.parametrize("prompt_pads", [(), (16, 32)], ids=["as_is", "prompts_padded"])
def test_a_hidden_state_drafter_gets_the_targets_state_before_every_token(prompt_pads):
    """Chunked prefill (24 tokens per step, trees first), trees, and preemption on a small KV pool: the drafter's
    record is prompt + output with, for token p+1, the target's normed final state at p, equal to an
    HF forward of the whole sequence. prompts_padded: steps that only prefill have their chunks padded with filler
    tokens to 16 or 32 (a captured prompt graph's shape on a GPU; runtime.prompt_graph), which no state shows."""
    target_dir = demo_model_dirs()["target"]
    runner = ModelRunner.load(RuntimeConfig(model_path=str(target_dir), dtype="float32", device="cpu", max_total_tokens=160))
    runner.prompt_pad_sizes = prompt_pads
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
        # the last step's tokens would go with the next ask, which never comes after the finish
        assert recorded == sequence[: len(recorded)] and len(recorded) >= len(sequence) - 8
        states = torch.cat(drafter.hidden[request.request_id])
        with torch.no_grad():
            want = reference.model(torch.tensor([sequence])).last_hidden_state[0]
        assert states.shape[0] == len(recorded) - 1
        assert torch.allclose(states, want[: states.shape[0]], atol=2e-4, rtol=1e-3), (states - want[: states.shape[0]]).abs().max()
    assert (runner.padded_prompt_steps > 0) == bool(prompt_pads)


def test_unsent_states_cut_every_requests_rows_out_together():
    """The engine keeps unsent states as rows of their steps' tensors and cuts every asked request's out at once:
    each request gets its rows in order across sources, a request without any gets None, a kept prefix is kept."""
    from splitspec.verifier_svc.draft_features import StateRows, unsent_states

    a, b = torch.arange(12.0).view(6, 2), torch.arange(100.0, 108.0).view(4, 2)
    out = unsent_states([[StateRows(a, 1, 2), StateRows(b, 0, 1)], [], [StateRows(a, 4, 2).first(1), StateRows(b, 2, 2)]])
    assert torch.equal(out[0], torch.cat([a[1:3], b[0:1]])) and out[1] is None
    assert torch.equal(out[2], torch.cat([a[4:5], b[2:4]]))
    assert unsent_states([[], []]) == [None, None]
    assert torch.equal(unsent_states([[StateRows(b, 1, 3)]])[0], b[1:4])
    # every row of one step's states, in order (each request fed its accepted path): views of it, no gather
    whole = unsent_states([[StateRows(b, 0, 1)], [], [StateRows(b, 1, 3)]])
    assert torch.equal(whole[0], b[0:1]) and whole[1] is None and torch.equal(whole[2], b[1:4])
    assert whole[0].data_ptr() == b.data_ptr()
    reordered = unsent_states([[StateRows(b, 2, 2)], [StateRows(b, 0, 2)]])  # all rows, not in order: gathered
    assert torch.equal(reordered[0], b[2:4]) and torch.equal(reordered[1], b[0:2])


def test_an_overlapped_runs_states_reach_each_request_in_step_order():
    """RunStates (drafting off, overlapped steps): each landed step's [B, W] states, row i request i's; a flush hands
    every request still running its rows of the whole run, oldest step first, after what it held before; a request
    that ended during the run gets none; the feed of a whole flushed run cuts views of one tensor, no gather."""
    from splitspec.runtime.sampling_params import SamplingParams
    from splitspec.verifier_svc.draft_features import RunStates, StateRows, unsent_states
    from splitspec.verifier_svc.step_types import Request

    requests = [Request(f"r{i}", [1, 2], SamplingParams(), True) for i in range(3)]
    plain = Request("p", [1, 2], SamplingParams(), False)
    steps = [torch.arange(8.0).view(4, 2) + 100 * t for t in range(3)]  # rows: r0, r1, plain, r2
    earlier = torch.full((1, 2), -1.0)
    requests[1].unsent_hidden.append(StateRows(earlier, 0, 1))  # its accepted path's state from the step before
    run = RunStates()
    order = [requests[0], requests[1], plain, requests[2]]
    for t, features in enumerate(steps):
        run.add(features, order)
        if t == 1:
            requests[2].finish_reason = "stop"  # ended at the run's second step
    run.flush()
    assert run.steps == [] and plain.unsent_hidden == [] and requests[2].unsent_hidden == []
    fed = unsent_states([r.unsent_hidden for r in requests])
    assert torch.equal(fed[0], torch.stack([s[0] for s in steps]))
    assert torch.equal(fed[1], torch.cat([earlier, torch.stack([s[1] for s in steps])]))
    assert fed[2] is None
    run.add(steps[0], requests[:2])  # a run of one step, fed whole: views of its own tensor
    run.flush()
    requests[0].unsent_hidden, requests[1].unsent_hidden = requests[0].unsent_hidden[-1:], requests[1].unsent_hidden[-1:]
    alone = unsent_states([requests[0].unsent_hidden, requests[1].unsent_hidden])
    assert torch.equal(alone[0], steps[0][0:1]) and torch.equal(alone[1], steps[0][1:2])
    assert alone[0].data_ptr() == steps[0].data_ptr()


def eagle_head_dir(tmp_path) -> str:
    """A random EAGLE head shaped for the demo target (its hidden size, heads, vocabulary)."""
    import test_eagle_head as th

    target = json.loads((demo_model_dirs()["target"] / "config.json").read_text())
    th.H, th.HEADS, th.KV_HEADS, th.INTER, th.VOCAB = (target["hidden_size"], target["num_attention_heads"],
                                                       target["num_key_value_heads"], 512, target["vocab_size"])
    config = th.head_config(None)
    config["max_position_embeddings"] = target["max_position_embeddings"]
    return str(th.write_head(tmp_path / "eagle", config, head_state(seed=1, with_bias=True), "bin"))


@pytest.fixture(scope="module")
def trained_head(tmp_path_factory):
    """An EAGLE head for the demo target, trained here in a minute on the target's own greedy
    continuations of the code prompts (rows: token t[p+1] with state h[p]; targets: the target's
    distribution at p+1 and its state h[p+1], EAGLE's two losses), saved in the published layout."""
    import test_eagle_head as th
    from transformers import AutoTokenizer, LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

    target_dir = demo_model_dirs()["target"]
    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    runner = ModelRunner.load(RuntimeConfig(model_path=str(target_dir), dtype="float32", device="cpu", max_total_tokens=16384))
    prompts = [tokenizer.encode(p) for p in PROMPTS]
    outs = run(runner, prompts, [SamplingParams(temperature=0.0, max_new_tokens=96, ignore_eos=True)] * len(prompts))
    reference = hf_model(target_dir)
    sequences = [torch.tensor(p + o.output_ids) for p, o in zip(prompts, outs)]
    with torch.no_grad():
        states = [reference.model(seq[None]).last_hidden_state[0] for seq in sequences]
    embed, head_w = reference.model.embed_tokens.weight.detach(), reference.lm_head.weight.detach()
    config = json.loads((target_dir / "config.json").read_text())
    hf = LlamaConfig(hidden_size=config["hidden_size"], intermediate_size=512, num_hidden_layers=1,
                     num_attention_heads=config["num_attention_heads"], num_key_value_heads=config["num_key_value_heads"],
                     vocab_size=config["vocab_size"], rms_norm_eps=1e-5, max_position_embeddings=config["max_position_embeddings"])
    hf._attn_implementation = "eager"
    torch.manual_seed(0)
    layer = LlamaDecoderLayer(hf, layer_idx=0)
    layer.input_layernorm = torch.nn.Identity()
    fc = torch.nn.Linear(2 * hf.hidden_size, hf.hidden_size)
    rope = LlamaRotaryEmbedding(hf)
    optimizer = torch.optim.AdamW([*layer.parameters(), *fc.parameters()], lr=2e-3)
    for step in range(120):
        loss = 0.0
        for seq, h in zip(sequences[step % 4 :: 4], states[step % 4 :: 4]):
            n = len(seq) - 2
            x = fc(torch.cat([embed[seq[1 : n + 1]], h[:n]], -1))[None]
            positions = torch.arange(n)[None]
            mask = torch.full((n, n), float("-inf")).triu(1)[None, None]
            out = layer(x, attention_mask=mask, position_ids=positions, position_embeddings=rope(x, positions))
            out = (out[0] if isinstance(out, tuple) else out)[0]
            regression = torch.nn.functional.smooth_l1_loss(out, h[1 : n + 1])
            target_probs = torch.softmax(h[1 : n + 1] @ head_w.T, -1)
            classification = -(target_probs * torch.log_softmax(out @ head_w.T, -1)).sum(-1).mean()
            loss = loss + regression + 0.1 * classification
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    state = {"embed_tokens.weight": embed.clone(), "fc.weight": fc.weight.detach(), "fc.bias": fc.bias.detach()}
    state.update({f"layers.0.{k}": v.detach() for k, v in layer.state_dict().items()})
    head_config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": hf.hidden_size,
                   "intermediate_size": 512, "num_hidden_layers": 1, "num_attention_heads": hf.num_attention_heads,
                   "num_key_value_heads": hf.num_key_value_heads, "vocab_size": hf.vocab_size, "rms_norm_eps": 1e-5,
                   "max_position_embeddings": hf.max_position_embeddings, "torch_dtype": "float32"}
    return str(th.write_head(tmp_path_factory.mktemp("trained") / "eagle", head_config, state, "bin"))


def greedy_setup(head_dir: str):
    """(target, head sharing its embeddings and LM head, 8 code prompts, greedy params for 24 tokens, plain decoding's
    outputs, the HF reference) for the lossless tests of a trained head."""
    from transformers import AutoTokenizer

    target_dir = demo_model_dirs()["target"]
    target = ModelRunner.load(RuntimeConfig(model_path=str(target_dir), dtype="float32", device="cpu", max_total_tokens=8192))
    head = ModelRunner.load(RuntimeConfig(model_path=head_dir, dtype="float32", device="cpu", max_total_tokens=8192, family="eagle"))
    head.model.share_target(target.model.model.embed_tokens.weight, target.model.lm_head_weight)
    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    prompts = [tokenizer.encode(p) for p in PROMPTS[:8]]
    params = [SamplingParams(temperature=0.0, max_new_tokens=24, ignore_eos=True)] * 8
    return target, head, prompts, params, run(target, prompts, params, batch=1), hf_model(target_dir)


def test_eagle_drafting_keeps_greedy_output_at_batch_1_and_8(trained_head):
    target, head, prompts, params, plain, reference = greedy_setup(trained_head)
    for batch in (1, 8):
        eagle = EagleDrafter(head, topk=2, num_steps=3, num_draft_tokens=6)
        eagle.max_catch_up = 5 if batch == 8 else eagle.max_catch_up  # prompts caught up over several forwards
        client = InProcessDrafterClient(eagle)
        spec = run(target, prompts, params, client, SpecConfig(num_draft_tokens=6), batch=batch)
        for i, (p, s) in enumerate(zip(plain, spec)):
            assert_greedy_match(s.output_ids, p.output_ids, reference, prompts[i], f"eagle prompt {i} batch {batch}")
            assert s.stats.fallbacks == 0
        accepted, steps = sum(s.stats.accepted_tokens for s in spec), sum(s.stats.verify_steps for s in spec)
        assert accepted > 0
        print(f"EAGLE (head trained here) batch {batch}: accept length {1 + accepted / steps:.2f}")
        assert head.kv_cache.allocator.num_used == 0


def _accept_length(results) -> float:
    accepted = sum(r["spec"].accepted_tokens for r in results.values())
    return 1 + accepted / max(1, sum(r["spec"].verify_steps for r in results.values()))


def test_eagle_drafters_over_tcp_get_hidden_states_keep_output_and_survive_a_repin(trained_head):
    """verifier + two `splitspec drafter` EAGLE processes: the target's states cross as raw frames
    (counted), greedy output equals plain at batch 1 and 8 with drafts accepted on both drafters and
    no fallbacks; killing one mid-generation re-pins its requests with their state history, and the
    accept length stays that of the fault-free run of the same requests."""
    import socket
    import sys
    import threading

    from test_verifier_service import collect, scrape, start_verifier, stop, submit

    from splitspec.generate import generate_ids
    from splitspec.protos import verifier_pb2 as pb

    target_dir = demo_model_dirs()["target"]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        address = f"tcp://127.0.0.1:{s.getsockname()[1]}"
    shape = ["--speculative-num-steps", "3", "--speculative-eagle-topk", "2", "--speculative-num-draft-tokens", "6"]

    def drafter(name):
        return spawn_service([sys.executable, "-P", "-m", "splitspec", "drafter", "--verifier-drafter-addr", address,
                                 "--drafter-name", name, "--speculative-algorithm", "EAGLE", "--dtype", "float32",
                                 "--heartbeat-interval", "0.1", "--model-path", str(target_dir),
                                 "--speculative-draft-model-path", trained_head, *shape, "--log-level", "warning"])

    drafters = {name: drafter(name) for name in ("e1", "e2")}
    # overlap on (auto leaves it off for CPU drafters beside a CPU verifier) for steps of one request per drafter
    # (batch 1): the heads' bets go through the pool too; at batch 8 two CPU drafters on a busy 2-core machine
    # could not bet within the deadline
    process, stub = start_verifier("--max-total-tokens", "16384", "--drafter-bind-addr", address, "--wait-for-drafters", "2",
                                   "--drafter-timeout-ms", "3000", "--drafter-heartbeat-timeout", "1.0",
                                   "--speculative-overlap", "on", "--speculative-overlap-max-bs", "1",
                                   "--speculative-algorithm", "EAGLE", "--speculative-draft-model-path", trained_head, *shape)
    try:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(target_dir)
        prompts = [tokenizer.encode(p) for p in PROMPTS[:8]]
        target = ModelRunner.load(RuntimeConfig(model_path=str(target_dir), dtype="float32", device="cpu", max_total_tokens=8192))
        reference = hf_model(target_dir)
        plain = generate_ids(target, prompts, [SamplingParams(temperature=0.0, max_new_tokens=96, ignore_eos=True)] * 8, set())
        for batch in (1, 8):
            results = {}
            for start in range(0, 8, batch):
                results.update(collect(stub, [submit(f"e{batch}-{i}", prompts[i], max_new_tokens=24, ignore_eos=True)
                                              for i in range(start, start + batch)], batch))
            for i in range(8):
                r = results[f"e{batch}-{i}"]
                assert r["finish"] == pb.FINISH_REASON_LENGTH and r["spec"].fallbacks == 0, r
                assert_greedy_match(r["tokens"], plain[i].output_ids[:24], reference, prompts[i], f"tcp eagle b{batch} {i}")
            assert sum(r["spec"].accepted_tokens for r in results.values()) > 0
            print(f"EAGLE over tcp, batch {batch}: accept length {_accept_length(results):.2f}")
        metrics = scrape(stub.metrics_url)
        for name in ("e1", "e2"):
            assert metrics[("splitspec:drafter_accepted_tokens_total", (("drafter", name),))] > 0, name
        bets = {o: sum(metrics.get(("splitspec:drafter_bets_total", (("drafter", n), ("outcome", o))), 0) for n in ("e1", "e2"))
                for o in ("hit", "miss", "late")}
        print(f"EAGLE over tcp with overlap: {bets}")
        assert bets["hit"] > 0, bets  # the heads' bets came true and their trees were verified, output unchanged
        hidden_bytes = sum(metrics[("splitspec:drafter_hidden_state_bytes_total", (("drafter", n),))] for n in ("e1", "e2"))
        # every token after each request's first crossed with a 384-float fp32 state, except those of the
        # last step (at most a tree's worth: they would go with the next ask, which never comes)
        rows = hidden_bytes / (384 * 4)
        most = 2 * sum(len(p) - 1 + 24 - 1 for p in prompts)
        assert most - 16 * 6 <= rows <= most, (rows, most)
        steps = sum(metrics[("splitspec:drafter_hidden_state_bytes_per_step_count", (("drafter", n),))] for n in ("e1", "e2"))
        assert steps > 0
        print(f"EAGLE over tcp: {hidden_bytes / 1e6:.2f} MB of hidden states for 16 requests, "
              f"{hidden_bytes / steps / 1e3:.1f} kB per draft request")

        long = [submit(f"c{i}", prompts[i], max_new_tokens=96, ignore_eos=True) for i in range(8)]
        clean = collect(stub, long, 8)
        killed = threading.Timer(1.5, drafters["e1"].kill)
        killed.start()
        faulty = collect(stub, [submit(f"k{i}", prompts[i], max_new_tokens=96, ignore_eos=True) for i in range(8)], 8)
        killed.join()
        for i in range(8):
            assert clean[f"c{i}"]["tokens"] == faulty[f"k{i}"]["tokens"], f"request {i} changed when its drafter died"
            assert_greedy_match(faulty[f"k{i}"]["tokens"], plain[i].output_ids, reference, prompts[i], f"re-pinned {i}")
        assert scrape(stub.metrics_url)[("splitspec:drafter_repins_total", ())] > 0
        clean_length, faulty_length = _accept_length(clean), _accept_length(faulty)
        print(f"EAGLE accept length: fault-free {clean_length:.2f}, with a drafter killed and re-pins {faulty_length:.2f}")
        assert faulty_length >= clean_length - 0.3
    finally:
        stop(process, stub)
        for p in drafters.values():
            p.kill()
            p.wait(timeout=30)


def test_a_prefix_cache_hit_keeps_the_accept_length(trained_head):
    """The same long prompt twice with the radix cache on: the second request's accept length equals the
    cold one's. A hidden-state drafter needs the prompt's states, which cached pages do not keep, so the
    verifier recomputes that prompt (no cached tokens for it) instead of starving the drafter; a
    STANDALONE request in the same engine setup reuses the pages (tests/test_standalone.py)."""
    from transformers import AutoTokenizer

    from splitspec.verifier_svc.prefix_cache import PrefixCache

    target_dir = demo_model_dirs()["target"]
    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    target = ModelRunner.load(RuntimeConfig(model_path=str(target_dir), dtype="float32", device="cpu", max_total_tokens=4096))
    head = ModelRunner.load(RuntimeConfig(model_path=trained_head, dtype="float32", device="cpu", max_total_tokens=4096, family="eagle"))
    head.model.share_target(target.model.model.embed_tokens.weight, target.model.lm_head_weight)
    engine = Engine(target, InProcessDrafterClient(EagleDrafter(head, topk=2, num_steps=3, num_draft_tokens=6)),
                    SpecConfig(num_draft_tokens=6), set(), prefix_cache=PrefixCache(target.kv_cache.allocator, 16))
    prompt = tokenizer.encode(PROMPTS[13] + PROMPTS[3])
    params = SamplingParams(temperature=0.0, max_new_tokens=64, ignore_eos=True)
    cold = engine.run([prompt], [params])[0]
    warm = engine.run([prompt], [params])[0]
    assert warm.output_ids == cold.output_ids and warm.cached_tokens == 0
    assert cold.stats.accepted_tokens > 0 and warm.stats.mean_accept_length == cold.stats.mean_accept_length


def test_prompt_states_reach_the_drafter_chunk_by_chunk():
    """A 100-token prompt prefilled 24 tokens per step: after the first step the hidden-state drafter
    already holds that chunk's pairs (it catches up alongside chunked prefill)."""
    target_dir = demo_model_dirs()["target"]
    runner = ModelRunner.load(RuntimeConfig(model_path=str(target_dir), dtype="float32", device="cpu", max_total_tokens=1024))
    drafter = RecordingDrafter()
    engine = Engine(runner, InProcessDrafterClient(drafter), SpecConfig(num_draft_tokens=8), set(),
                    SchedulerConfig(chunked_prefill_size=24))
    prompt = list(range(100, 200))
    request = engine.add_request(prompt, SamplingParams(temperature=0.0, max_new_tokens=4, ignore_eos=True))
    engine.step()
    assert not request.decoding and drafter.tokens[request.request_id] == prompt[:25]
    engine.step()
    assert drafter.tokens[request.request_id] == prompt[:49]
    while engine.has_work:
        engine.step()
    assert drafter.tokens[request.request_id][:100] == prompt


@pytest.mark.skipif(torch.cuda.is_available(), reason="the capture fails at once only where torch has no CUDA")
def test_a_shape_whose_graphs_failed_to_capture_is_forgotten_and_the_others_still_replay(tmp_path):
    """A head's graphs are captured shape by shape; the feeds' shape (16 rows a request, capped by rows) is captured
    after the catch-ups', and when its capture fails part-way (here at once: a CPU has no CUDA) it is forgotten: its
    batches run eagerly, the catch-ups' shapes still replay, each up to its own largest batch."""
    from splitspec.drafter_svc.base import FEED_EVERY
    from splitspec.runtime.cuda_graph import StepGraphs

    head = ModelRunner.load(RuntimeConfig(model_path=eagle_head_dir(tmp_path), dtype="float32", device="cpu",
                                          max_total_tokens=2048, family="eagle"))
    graphs = StepGraphs(head, 32)
    width = head.config.hidden_size
    graphs.feature_seconds[(4, width)] = 0.1  # a catch-up shape as capture() leaves it, every batch size captured
    with pytest.raises(AssertionError, match="CUDA"):  # torch's own: "Torch not compiled with CUDA enabled"
        graphs.capture(FEED_EVERY, width, max_rows=128)
    assert graphs.max_bs_of[(FEED_EVERY, width)] == 8  # batches of at most 128 rows: 1, 2, 4, 8
    assert not graphs.has(FEED_EVERY, width)  # never captured whole
    graphs.forget(FEED_EVERY, width)
    assert (FEED_EVERY, width) not in graphs.max_bs_of and (FEED_EVERY, width) not in graphs.inputs
    assert graphs.has(4, width, 32) and not graphs.has(4, width, 33) and not graphs.has(4, 2 * width)


def test_catch_ups_of_unequal_lengths_padded_to_one_shape_draft_the_same_trees(tmp_path):
    """A catch-up round whose requests add unequal numbers of rows is padded to the longest (so that on a GPU it
    replays one captured graph): each shorter request repeats its last row past its length. The padding path
    (forced here on a CPU) drafts the trees the unpadded rounds draft, the padded rounds happen, the outputs equal
    plain decoding's, and no page is left held."""
    target = ModelRunner.load(RuntimeConfig(model_path=str(demo_model_dirs()["target"]), dtype="float32", device="cpu",
                                            max_total_tokens=8192))
    prompts = [list(range(40 + 3 * i, 60 + 5 * i)) for i in range(4)]
    params = [SamplingParams(temperature=0.0, max_new_tokens=20, ignore_eos=True)] * len(prompts)
    plain = run(target, prompts, params, batch=4)
    results, padded = {}, []
    for mode in ("never", "always"):
        head = ModelRunner.load(RuntimeConfig(model_path=eagle_head_dir(tmp_path / mode), dtype="float32", device="cpu",
                                              max_total_tokens=8192, family="eagle"))
        head.model.share_target(target.model.model.embed_tokens.weight, target.model.lm_head_weight)
        eagle = EagleDrafter(head, topk=2, num_steps=3, num_draft_tokens=6)
        eagle.pad_catch_ups = mode
        launched = []  # the client launches drafts (Drafter.launch); their trees are read once the run is over
        launch, pad = eagle.launch, eagle._padded_round
        eagle.launch = lambda ids, nodes: launched.append(launch(ids, nodes)) or launched[-1]
        eagle._padded_round = lambda taken, width: (padded.append((mode, taken)) if len(set(taken)) > 1 else None,
                                                     pad(taken, width))[1]
        spec = run(target, prompts, params, InProcessDrafterClient(eagle), SpecConfig(num_draft_tokens=6), batch=4)
        assert [s.output_ids for s in spec] == [p.output_ids for p in plain]
        assert all(s.stats.fallbacks == 0 for s in spec) and sum(s.stats.draft_tokens for s in spec) > 0
        assert head.kv_cache.allocator.num_used == 0
        results[mode] = [[(t.tokens, t.parents) if t is not None else None for t in step.trees()] for step in launched]
        assert len(results[mode]) > 5 and all(any(t is not None for t in step) for step in results[mode])
    assert any(mode == "always" for mode, _ in padded), padded  # unequal rounds met, and padded
    assert results["always"] == results["never"]


def test_states_fed_without_drafts_are_caught_up_past_a_bound_and_draft_the_same_trees(tmp_path):
    """With drafting off the engine feeds a head rows (tokens and the target's states) and asks no draft, so the rows
    wait, on the device, for the next draft's catch-up. Past max_pending_bytes in all they are caught up as they come:
    a long run without drafts holds bounded memory, and the trees drafted after it are those drafted from the whole
    backlog at once; releasing the requests leaves no byte counted and no page held."""
    target = ModelRunner.load(RuntimeConfig(model_path=str(demo_model_dirs()["target"]), dtype="float32", device="cpu",
                                            max_total_tokens=4096))
    drafters = {}
    for name in ("bounded", "lazy"):
        head = ModelRunner.load(RuntimeConfig(model_path=eagle_head_dir(tmp_path / name), dtype="float32", device="cpu",
                                              max_total_tokens=4096, family="eagle"))
        head.model.share_target(target.model.model.embed_tokens.weight, target.model.lm_head_weight)
        drafters[name] = EagleDrafter(head, topk=2, num_steps=3, num_draft_tokens=6)
    width, vocab = target.config.hidden_size, target.config.vocab_size
    row_bytes = width * 4
    drafters["bounded"].max_pending_bytes = 20 * row_bytes  # a catch-up every 20 rows fed, across the requests
    generator = torch.Generator().manual_seed(0)
    feeds = [(f"r{i}", [(5 + 7 * i + 3 * k + j) % vocab for j in range(4)], torch.randn(4, width, generator=generator))
             for k in range(12) for i in range(3)]
    trees = {}
    for name, drafter in drafters.items():
        ids = ["r0", "r1", "r2"]
        for i, request_id in enumerate(ids):
            drafter.open(request_id, [11 + i])
        for request_id, tokens, hidden in feeds:
            drafter.extend(request_id, tokens, hidden)
        pending = sum(len(drafter.states[r].pending_tokens) for r in ids)
        assert drafter.pending_bytes == pending * row_bytes
        if name == "bounded":
            assert pending < 20 and all(drafter.states[r].table.num_tokens >= 40 for r in ids)
        else:
            assert pending == 3 * 48 and all(drafter.states[r].table.num_tokens == 0 for r in ids)
        trees[name] = [(t.tokens, t.parents) for t in drafter.draft(ids, [6, 6, 6])]
        assert drafter.pending_bytes == 0
        for request_id in ids:
            drafter.release(request_id)
        assert drafter.pending_bytes == 0 and drafter.runner.kv_cache.allocator.num_used == 0
    assert trees["bounded"] == trees["lazy"] and all(len(tokens) == 6 for tokens, _ in trees["lazy"])


def test_eager_catch_up_rounds_padded_to_a_ladder_size_draft_the_same_trees(tmp_path):
    """On a GPU an eager catch-up round (prompts, a drafting-off run's backlog: any number of rows) is padded to the
    next size of a fixed ladder, so that its GEMMs run in shapes cuBLAS has met before (a new row count cost 0.1-2.5 ms
    per GEMM of host time on an H200). The padding is one more sequence on a scratch table, whose rows nobody reads: the
    trees drafted are those of the unpadded rounds (forced here on a CPU), the rounds were padded, and releasing the
    requests leaves no page held (the scratch's pages go back after each round)."""
    target = ModelRunner.load(RuntimeConfig(model_path=str(demo_model_dirs()["target"]), dtype="float32", device="cpu",
                                            max_total_tokens=4096))
    width, vocab = target.config.hidden_size, target.config.vocab_size
    generator = torch.Generator().manual_seed(1)
    ids = ["r0", "r1", "r2"]
    feeds = [[(f"r{i}", [(9 + 5 * i + 3 * k + j) % vocab for j in range(n)], torch.randn(n, width, generator=generator))
              for i, n in enumerate(counts)] for k, counts in enumerate([(23, 40, 7), (3, 1, 2), (17, 9, 30)])]
    trees, sizes = {}, {}
    for bucketed in (False, True):
        head = ModelRunner.load(RuntimeConfig(model_path=eagle_head_dir(tmp_path / str(bucketed)), dtype="float32",
                                              device="cpu", max_total_tokens=4096, family="eagle"))
        head.model.share_target(target.model.model.embed_tokens.weight, target.model.lm_head_weight)
        drafter = EagleDrafter(head, topk=2, num_steps=3, num_draft_tokens=6)
        assert head.pad_eager is False  # a CPU's default: nothing to gain there
        head.pad_eager = bucketed
        forward = head.forward
        sizes[bucketed] = []
        head.forward = lambda batch, **kw: sizes[bucketed].append(batch.input_ids.shape[0]) or forward(batch, **kw)
        for i, request_id in enumerate(ids):
            drafter.open(request_id, [11 + i])
        trees[bucketed], fed = [], dict.fromkeys(ids, 0)
        for round_feeds in feeds:  # each round's rows of unequal counts: a round no graph holds
            for request_id, tokens, hidden in round_feeds:
                drafter.extend(request_id, tokens, hidden)
                fed[request_id] += len(tokens)
            trees[bucketed] += [(t.tokens, t.parents) for t in drafter.draft(ids, [6, 6, 6])]
            assert {r: drafter.states[r].table.num_tokens for r in ids} == fed  # the scratch's rows are no one's
        for request_id in ids:
            drafter.release(request_id)
        assert head.kv_cache.allocator.num_used == 0
    assert sizes == {False: [70, 6, 56], True: [96, 16, 64]}  # each draft's catch-up forward, by its rows
    assert trees[True] == trees[False] and len(trees[False]) == 9


def test_top1_chains_are_verified_before_they_reach_the_host_and_launched_when_asked(trained_head, monkeypatch):
    """EAGLE at top-1 in the verifier's process: the drafter launches its draft (Drafter.launch) and the engine builds
    the verification batch around PendingChains, writes the drafts into it on the device (write_chains) and reads
    them only at acceptance; a drafter that queues its draft on the device (Drafter.launches_on_device) launches it in
    the client's request(), as the step that asked ends, so that the engine's hand-over, schedule and next batch run on
    the host while the device drafts. At batch 1 every draft was launched early and every verified draft went through
    write_chains. Then requests arrive
    while the others decode with drafts launched (their first asks come at the next collect, beside the early ones,
    which then finish on the host before the new launch overwrites the loop's outputs), and one is aborted with its
    draft launched. Greedy outputs equal plain decoding's, drafts are accepted, no fallbacks, both launch sites are
    met, and every page is back."""
    import splitspec.verifier_svc.engine as engine_module

    written, write = [], engine_module.write_chains
    monkeypatch.setattr(engine_module, "write_chains",
                        lambda ids, starts, chains, vocab: (written.append(len(chains)), write(ids, starts, chains, vocab))[1])
    target, head, prompts, params, plain, reference = greedy_setup(trained_head)
    eagle = EagleDrafter(head, topk=1, num_steps=4, num_draft_tokens=5)
    sites, inside = [], []  # where each launch happened: inside request() or collect()
    launch = eagle.launch
    eagle.launch = lambda ids, nodes: (sites.append(inside[-1] if inside else None), launch(ids, nodes))[1]

    def client() -> InProcessDrafterClient:
        made = InProcessDrafterClient(eagle)
        for name in ("request", "collect"):
            def wrapped(*args, _call=getattr(made, name), _name=name):
                inside.append(_name)
                try:
                    return _call(*args)
                finally:
                    inside.pop()
            setattr(made, name, wrapped)
        return made

    spec = run(target, prompts[:2], params[:2], client(), SpecConfig(num_draft_tokens=5), batch=1)
    for i, (p, s) in enumerate(zip(plain, spec)):
        assert_greedy_match(s.output_ids, p.output_ids, reference, prompts[i], f"eagle top-1 prompt {i} batch 1")
        assert s.stats.fallbacks == 0
    assert sum(written) == sum(s.stats.verify_steps for s in spec) > 0, (written, [s.stats.verify_steps for s in spec])
    assert sites and set(sites) == {"request"}, sites  # one request at a time: every draft launched as it was asked

    sites.clear()
    drafter = client()
    engine = Engine(target, drafter, SpecConfig(num_draft_tokens=5), set())
    requests, aborted = [], None
    for step in range(10_000):
        if step % 3 == 0 and len(requests) < len(prompts):  # arrivals while the others decode with drafts launched
            requests.append(engine.add_request(prompts[len(requests)], params[len(requests)]))
        if aborted is None and len(requests) == 4 and requests[0].request_id in drafter._launched:
            aborted = requests[0]
            assert engine.abort(aborted)
        if not engine.has_work and len(requests) == len(prompts):
            break
        engine.step()
    assert aborted is not None and aborted.finish_reason == "abort"
    for i, (p, s) in enumerate(zip(plain, requests)):
        if s is not aborted:
            assert_greedy_match(s.output_ids, p.output_ids, reference, prompts[i], f"early launch prompt {i}")
            assert s.stats.fallbacks == 0
    assert sum(s.stats.accepted_tokens for s in requests) > 0
    assert sites.count("request") > sites.count("collect") > 0, sites
    assert target.kv_cache.allocator.num_used == 0 and head.kv_cache.allocator.num_used == 0

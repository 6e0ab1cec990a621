"""The split (ARCHITECTURE §4): a `splitspec verifier` process drafting with `splitspec drafter`
processes over ZeroMQ (tcp). Fault-free, outputs equal plain generation and both drafters' drafts are
accepted with no fallbacks; a drafter killed (-9) or stalled (SIGSTOP) mid-generation changes no
output and its requests move; a returning or new drafter gets work; a hostile peer's garbage,
truncations, replays, wrong ids and invalid trees are dropped and counted while requests run on."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time

import pytest
from helpers import assert_greedy_match, hf_model, spawn_service
from test_verifier_service import collect, free_port, scrape, start_verifier, stop, submit

from splitspec.demo import demo_model_dirs
from splitspec.generate import generate_ids
from splitspec.protos import step_pb2
from splitspec.protos import verifier_pb2 as pb
from splitspec.runtime.runner import ModelRunner, RuntimeConfig
from splitspec.runtime.sampling_params import SamplingParams

PROMPTS = [[13, 290, 350 + i, 13, 290, 350 + i, 13, 600 + i] for i in range(8)]


def start_drafter(address: str, name: str, *flags: str) -> subprocess.Popen:
    return spawn_service(
        [sys.executable, "-P", "-m", "splitspec", "drafter", "--verifier-drafter-addr", address, "--drafter-name", name,
         "--speculative-algorithm", "NGRAM", "--heartbeat-interval", "0.1", "--log-level", "warning", *flags])


class Split:
    """A verifier bound for drafters, and its drafter processes by name."""

    def __init__(self, *verifier_flags: str, drafters=("d1", "d2")):
        self.address = f"tcp://127.0.0.1:{free_port()}"
        self.drafters = {name: start_drafter(self.address, name) for name in drafters}
        self.process, self.stub = start_verifier("--max-total-tokens", "8192", "--drafter-bind-addr", self.address,
                                                 "--wait-for-drafters", str(len(drafters)), *verifier_flags)

    def add(self, name: str) -> None:
        self.drafters[name] = start_drafter(self.address, name)

    def metric(self, name: str, **labels) -> float:
        key = (name, tuple(sorted(labels.items())))
        return scrape(self.stub.metrics_url).get(key, 0.0)

    def metric_sum(self, name: str, **labels) -> float:
        return sum(v for (n, ls), v in scrape(self.stub.metrics_url).items()
                   if n == name and all(dict(ls).get(k) == w for k, w in labels.items()))

    def wait_metric(self, name: str, predicate, timeout: float = 30.0, **labels) -> float:
        deadline, value = time.time() + timeout, None
        while time.time() < deadline:
            value = self.metric(name, **labels)
            if predicate(value):
                return value
            time.sleep(0.1)
        raise AssertionError(f"{name}{labels} stayed at {value}")

    def close(self) -> None:
        for process in self.drafters.values():
            if process.poll() is None:
                process.send_signal(signal.SIGCONT)
                process.kill()
            process.wait(timeout=30)
        stop(self.process, self.stub)


def plain_outputs(prompts, params) -> list[list[int]]:
    target = demo_model_dirs()["target"]
    runner = ModelRunner.load(RuntimeConfig(model_path=str(target), dtype="float32", device="cpu", max_total_tokens=8192))
    return [r.output_ids for r in generate_ids(runner, prompts, params, set())]


def check_outputs(results, prompts, params, label: str) -> None:
    reference = hf_model(demo_model_dirs()["target"])
    for i, (prompt, want) in enumerate(zip(prompts, plain_outputs(prompts, params))):
        r = results[f"{label}{i}"]
        assert r["finish"] == pb.FINISH_REASON_LENGTH and r["error"] == "", r
        if params[i].is_greedy:
            assert_greedy_match(r["tokens"], want, reference, prompt, f"{label}{i}")
        else:
            assert r["tokens"] == want, f"seeded {label}{i} changed"


def test_two_drafters_over_tcp_equal_plain_and_both_speculate():
    # generous deadline: a busy CI machine must not turn into fallbacks; overlap on (auto leaves it off for CPU
    # drafters beside a CPU verifier, which share its cores)
    split = Split("--drafter-timeout-ms", "5000", "--speculative-overlap", "on")
    try:
        params = [SamplingParams(temperature=0.0, max_new_tokens=32)] * len(PROMPTS)
        results = collect(split.stub, [submit(f"q{i}", p) for i, p in enumerate(PROMPTS)], len(PROMPTS))
        check_outputs(results, PROMPTS, params, "q")
        assert all(r["spec"].fallbacks == 0 for r in results.values())
        for name in ("d1", "d2"):
            assert split.metric("splitspec:drafter_accepted_tokens_total", drafter=name) > 0, name
        assert split.metric("splitspec:drafters_alive") == 2
        assert split.metric_sum("splitspec:drafter_drafts_dropped_total") == 0
        assert split.metric("splitspec:drafter_round_trip_seconds_count", drafter="d1") > 0
        assert split.metric("splitspec:drafter_bytes_total", drafter="d1", direction="received") > 0
        # overlap: bets came true and were verified
        hits, misses = (split.metric_sum("splitspec:drafter_bets_total", outcome=o) for o in ("hit", "miss"))
        print(f"overlap: {hits:.0f} bets came true, {misses:.0f} asks drafted afresh")
        assert hits > 0 and split.metric_sum("splitspec:drafter_bets_total", outcome="late") == 0
    finally:
        split.close()


def long_requests(label: str, n: int = 8, tokens: int = 160):
    prompts = [[13, 290, 350 + i, 13, 290, 350 + i, 13, 700 + i] for i in range(n)]
    params = [SamplingParams(temperature=0.0, max_new_tokens=tokens, ignore_eos=True) if i % 2 else
              SamplingParams(temperature=0.9, seed=7 + i, max_new_tokens=tokens, ignore_eos=True) for i in range(n)]
    messages = [submit(f"{label}{i}", p, max_new_tokens=tokens, ignore_eos=True,
                       **({"temperature": 0.9, "seed": 7 + i} if i % 2 == 0 else {}))
                for i, p in enumerate(prompts)]
    return prompts, params, messages


def run_with_fault(split: Split, label: str, fault) -> dict:
    """Submit long requests; once tokens flow, call fault(); gather everything to the end."""
    prompts, params, messages = long_requests(label)
    flowing = threading.Event()

    def watch():
        flowing.wait(120)
        fault()

    watcher = threading.Thread(target=watch)
    watcher.start()
    results: dict[str, dict] = {}
    stream = split.stub.Generate(iter(messages), timeout=300)
    for response in stream:
        for d in response.deltas:
            r = results.setdefault(d.request_id, {"tokens": [], "finish": None, "error": "", "spec": None})
            r["tokens"] += list(d.token_ids)
            r["spec"] = d.speculation
            if d.finish_reason:
                r["finish"], r["error"] = d.finish_reason, d.error
        if sum(len(r["tokens"]) for r in results.values()) >= 8 * 20:
            flowing.set()
        if sum(r["finish"] is not None for r in results.values()) == len(messages):
            stream.cancel()
            break
    flowing.set()
    watcher.join()
    check_outputs(results, prompts, params, label)
    return results


def test_kill_and_stall_of_a_drafter_change_no_output_and_drafters_return():
    split = Split("--drafter-timeout-ms", "300", "--drafter-heartbeat-timeout", "1.0")
    try:
        # kill -9 mid-generation: every request finishes unchanged; d1's requests are re-pinned
        run_with_fault(split, "k", lambda: split.drafters["d1"].kill())
        assert split.metric("splitspec:drafter_repins_total") > 0
        assert split.metric("splitspec:drafters_alive") == 1
        # a drafter started afterwards registers and receives new work
        split.add("d3")
        split.wait_metric("splitspec:drafters_alive", lambda v: v == 2)
        results = collect(split.stub, [submit(f"n{i}", p) for i, p in enumerate(PROMPTS)], len(PROMPTS))
        assert all(r["finish"] == pb.FINISH_REASON_LENGTH for r in results.values())
        assert split.metric("splitspec:drafter_accepted_tokens_total", drafter="d3") > 0

        # SIGSTOP (a stall): requests go on within the deadline; after SIGCONT the drafter is used again
        d2 = split.drafters["d2"]
        repins = split.metric("splitspec:drafter_repins_total")
        run_with_fault(split, "s", lambda: d2.send_signal(signal.SIGSTOP))
        assert split.metric("splitspec:drafter_repins_total") > repins
        registrations = split.metric("splitspec:drafter_registrations_total", outcome="accepted")
        d2.send_signal(signal.SIGCONT)
        split.wait_metric("splitspec:drafter_registrations_total", lambda v: v > registrations, outcome="accepted")
        split.wait_metric("splitspec:drafters_alive", lambda v: v == 2)
        before = split.metric("splitspec:drafter_accepted_tokens_total", drafter="d2")
        results = collect(split.stub, [submit(f"c{i}", p) for i, p in enumerate(PROMPTS)], len(PROMPTS))
        assert all(r["finish"] == pb.FINISH_REASON_LENGTH for r in results.values())
        assert split.metric("splitspec:drafter_accepted_tokens_total", drafter="d2") > before
    finally:
        split.close()


def test_a_mismatched_drafter_is_refused_with_a_clear_error():
    """Only NGRAM exists as a drafter process so far, so the mismatched peer is a raw DEALER socket
    registering as an EAGLE3 drafter."""
    import zmq

    split = Split(drafters=("d1",))
    try:
        socket = zmq.Context.instance().socket(zmq.DEALER)
        socket.connect(split.address)
        hello = step_pb2.DrafterMessage(sender=step_pb2.DrafterIdentity(name="eagle-ish", instance_epoch=5),
                                        register=step_pb2.Register(algorithm="EAGLE3", capacity=4, max_tree_nodes=8))
        socket.send(hello.SerializeToString())
        assert socket.poll(10_000)
        reply = step_pb2.VerifierMessage.FromString(socket.recv())
        assert not reply.register_reply.accepted and "NGRAM" in reply.register_reply.reason
        assert "EAGLE3" in reply.register_reply.reason
        socket.close(linger=0)
        assert split.metric("splitspec:drafter_registrations_total", outcome="refused") == 1
    finally:
        split.close()


class HostileDrafter(threading.Thread):
    """Registers as an NGRAM drafter, then answers every draft request with something wrong, and
    sprays garbage: undecodable bytes, an empty envelope, a frame-truncated message, replays of old
    replies, replies to steps never asked, trees with a cycle, an out-of-vocabulary token, or for a
    request it was not asked about. Heartbeats properly, so it stays in the pool."""

    def __init__(self, address: str):
        super().__init__(daemon=True)
        import zmq

        self.zmq = zmq
        self.address = address
        self.stopping = threading.Event()
        self.sent: dict[str, int] = {}

    def run(self) -> None:
        zmq = self.zmq
        socket = zmq.Context.instance().socket(zmq.DEALER)
        socket.connect(self.address)
        identity = step_pb2.DrafterIdentity(name="hostile", instance_epoch=99)
        register = step_pb2.DrafterMessage(sender=identity, register=step_pb2.Register(algorithm="NGRAM", capacity=64, max_tree_nodes=8))
        socket.send(register.SerializeToString())
        session, last_reply, n, last_beat = 0, None, 0, 0.0
        while not self.stopping.is_set():
            if session and time.time() - last_beat > 0.1:
                identity.session = session
                socket.send(step_pb2.DrafterMessage(sender=identity, heartbeat=step_pb2.Heartbeat()).SerializeToString())
                last_beat = time.time()
            if not socket.poll(50):
                continue
            message = step_pb2.VerifierMessage.FromString(socket.recv_multipart()[0])
            kind = message.WhichOneof("kind")
            if kind == "register_reply":
                session = message.register_reply.session
                identity.session = session
                continue
            if kind != "draft":
                continue
            step, asks = message.draft.step_id, list(message.draft.asks)
            n += 1
            bad = n % 8
            request_id = asks[0].request_id
            if bad == 0:
                socket.send(b"\xff\x00garbage\x13\x37")
                self._count("garbage")
            elif bad == 1:
                socket.send_multipart([b""])  # an empty envelope
                self._count("empty")
            elif bad == 2:  # a reply claiming a tensor frame that never comes
                reply = step_pb2.DrafterMessage(sender=identity, draft_reply=step_pb2.DraftReply(step_id=step),
                                                tensors=[step_pb2.TensorMeta(name="x", dtype="float32", shape=[4], frame=0)])
                socket.send(reply.SerializeToString()[:-3])  # truncated too
                self._count("truncated")
            elif bad == 3:  # a cycle (node 1's parent is node 2)
                self._reply(socket, identity, step, request_id, [1, 2, 3], [-1, 2, 1])
                self._count("cycle")
            elif bad == 4:  # out-of-vocabulary token
                self._reply(socket, identity, step, request_id, [1, 10**6], [-1, 0])
                self._count("oov")
            elif bad == 5:  # a request it was not asked about
                self._reply(socket, identity, step, "r-not-asked", [1, 2], [-1, 0])
                self._count("wrong_request")
            elif bad == 6 and last_reply is not None:  # replay an old reply
                socket.send(last_reply)
                self._count("replay")
            else:  # a step that was never asked
                self._reply(socket, identity, step + 10_000, request_id, [1, 2], [-1, 0])
                self._count("unknown_step")
            last_reply = step_pb2.DrafterMessage(sender=identity, draft_reply=step_pb2.DraftReply(step_id=step)).SerializeToString()
        socket.close(linger=0)

    def _reply(self, socket, identity, step, request_id, tokens, parents) -> None:
        tree = step_pb2.WireTree(request_id=request_id, tokens=tokens, parents=parents)
        socket.send(step_pb2.DrafterMessage(sender=identity, draft_reply=step_pb2.DraftReply(step_id=step, trees=[tree]))
                    .SerializeToString())

    def _count(self, what: str) -> None:
        self.sent[what] = self.sent.get(what, 0) + 1


def test_a_hostile_drafter_is_dropped_and_counted_while_requests_run_unchanged():
    split = Split("--drafter-timeout-ms", "300", drafters=("d1",))
    hostile = HostileDrafter(split.address)
    hostile.start()
    try:
        split.wait_metric("splitspec:drafters_alive", lambda v: v == 2)
        prompts = [[13, 290, 350 + i, 13, 290, 350 + i, 13, 800 + i] for i in range(8)]
        params = [SamplingParams(temperature=0.0, max_new_tokens=48)] * 8
        results = collect(split.stub, [submit(f"h{i}", p, max_new_tokens=48) for i, p in enumerate(prompts)], 8)
        check_outputs(results, prompts, params, "h")
        assert split.metric("splitspec:drafter_accepted_tokens_total", drafter="d1") > 0
        dropped = {reason: split.metric_sum("splitspec:drafter_drafts_dropped_total", reason=reason)
                   for reason in ("malformed", "invalid_tree", "wrong_request", "stale", "late", "timeout")}
        assert hostile.sent.get("garbage", 0) > 0 and hostile.sent.get("cycle", 0) > 0, hostile.sent
        assert dropped["malformed"] > 0 and dropped["invalid_tree"] > 0 and dropped["wrong_request"] > 0, dropped
        assert dropped["stale"] + dropped["late"] > 0, dropped
        # the hostile drafter's requests fell back to plain tokens; d1's did not
        assert sum(r["spec"].fallbacks for r in results.values()) > 0
        assert split.metric("splitspec:drafters_alive") == 2
    finally:
        hostile.stopping.set()
        hostile.join(timeout=10)
        split.close()


def test_a_drafter_held_by_a_silent_peer_finds_the_verifier_that_binds_its_address():
    """The drafter's address was held by another process that accepted its connection and never answers (it stopped
    listening but kept the connection, as a process going away may); a verifier then binds the address. Registrations
    that go unanswered for --verifier-timeout make the drafter connect again, so it registers within seconds, not
    after ZeroMQ's 30 s handshake timeout (a CI run once waited 10 minutes for a drafter that connected while its
    verifier's first bind failed, the port held by another process)."""
    import socket

    from splitspec.verifier_svc.drafter_pool import DrafterPool

    port = free_port()
    silent = socket.socket()
    silent.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    silent.bind(("127.0.0.1", port))
    silent.listen()
    address = f"tcp://127.0.0.1:{port}"
    process = start_drafter(address, "held", "--verifier-timeout", "2")
    held = None
    pool = None
    try:
        silent.settimeout(60)
        held, _ = silent.accept()  # the drafter's connection: its greeting is never answered
        silent.close()
        pool = DrafterPool(address, "NGRAM", 1000, timeout=5.0, heartbeat_timeout=30.0)
        assert pool.wait_for_drafters(1, 20.0), "the drafter stayed on the silent connection"
    finally:
        if pool is not None:
            pool.close()
        if held is not None:
            held.close()
        silent.close()
        process.kill()
        process.wait(timeout=30)


def test_a_drafter_reregisters_after_a_verifier_restart():
    """The verifier goes away and a new one binds the same address: the drafter notices (unknown
    session, new epoch), drops the old requests and registers again, and the new verifier drafts with it."""
    address = f"tcp://127.0.0.1:{free_port()}"
    drafter = start_drafter(address, "survivor")
    try:
        for round_ in range(2):
            process, stub = start_verifier("--max-total-tokens", "4096", "--drafter-bind-addr", address,
                                           "--wait-for-drafters", "1", "--drafter-timeout-ms", "5000")
            try:
                results = collect(stub, [submit(f"v{round_}-{i}", p) for i, p in enumerate(PROMPTS[:4])], 4)
                assert all(r["finish"] == pb.FINISH_REASON_LENGTH for r in results.values())
                assert sum(r["spec"].accepted_tokens for r in results.values()) > 0, f"round {round_}"
                assert all(r["spec"].fallbacks == 0 for r in results.values())
                assert scrape(stub.metrics_url)[("splitspec:drafter_accepted_tokens_total", (("drafter", "survivor"),))] > 0
            finally:
                stop(process, stub)
        assert drafter.poll() is None, "the drafter should outlive verifier restarts"
    finally:
        drafter.kill()
        drafter.wait(timeout=30)


def test_the_tensor_plane_round_trips_and_rejects_bad_frames():
    import torch

    from splitspec.runtime.tensor_plane import FramePlane, TensorError, TensorInfo

    plane = FramePlane()
    hidden = torch.randn(3, 16, dtype=torch.bfloat16)
    ids = torch.arange(5, dtype=torch.int64)
    infos, frames = plane.pack([("hidden_states", "r1", hidden), ("ids", "", ids), ("none", "", torch.empty(0, 4))])
    back = plane.unpack(infos, [bytes(f) for f in frames])
    assert [(n, r) for n, r, _ in back] == [("hidden_states", "r1"), ("ids", ""), ("none", "")]
    assert torch.equal(back[0][2], hidden) and torch.equal(back[1][2], ids) and back[2][2].shape == (0, 4)
    with pytest.raises(TensorError, match="bytes"):
        plane.unpack(infos[:1], [bytes(frames[0])[:-2]])
    with pytest.raises(TensorError, match="missing"):
        plane.unpack(infos, [bytes(frames[0])])
    with pytest.raises(TensorError, match="unknown dtype"):
        plane.unpack([TensorInfo("x", "complex128", (1,), 0)], [b"\0" * 16])

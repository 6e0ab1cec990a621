"""Hostile frames at the services' own endpoints, between real processes.

- A drafter process (`splitspec drafter`, NGRAM) connected to a fake verifier that speaks the step
  channel and sprays it: undecodable bytes, empty and truncated envelopes, an oversized frame, a
  message of no kind, wrong sessions and epochs, drafts for requests never opened, out-of-range token
  ids, absurd budgets, replays. The drafter stays registered, drops and counts what it cannot use,
  and still answers a proper draft with a proper tree.
- The verifier's gRPC endpoint fed raw bytes on every method: undecodable, truncated, another message's
  bytes, oversized, wrong and replayed ids. Each call gets a gRPC status (the stream that sent garbage
  ends; nobody else's), the malformed ones are counted, and the verifier keeps serving.
(The verifier's side of the step channel is fuzzed by test_drafter_pool's hostile drafter.)
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from helpers import spawn_service
from test_verifier_service import collect, free_port, scrape, start_verifier, stop, submit

from splitspec.protos import step_pb2
from splitspec.protos import verifier_pb2 as pb

EPOCH = 4242


def _metric(url: str, name: str) -> float:
    return sum(v for (n, _), v in scrape(url).items() if n == name)


class FakeVerifier:
    """A ROUTER socket that registers one drafter and then says whatever the test wants."""

    def __init__(self):
        import zmq

        self.zmq = zmq
        self.socket = zmq.Context.instance().socket(zmq.ROUTER)
        self.socket.setsockopt(zmq.LINGER, 0)
        port = free_port()
        self.address = f"tcp://127.0.0.1:{port}"
        self.socket.bind(self.address)
        self.peer, self.session = None, 0
        self.heartbeats = 0
        self.answered_register = False  # a register_reply sent that the drafter has not yet shown it took

    def recv(self, timeout: float = 10.0) -> step_pb2.DrafterMessage | None:
        """The drafter's next message other than a heartbeat (heartbeats are answered and counted) or a register
        retry that crossed our reply (sent before the reply reached the drafter)."""
        deadline = time.time() + timeout
        while time.time() < deadline:
            if not self.socket.poll(100):
                continue
            peer, data, *_ = self.socket.recv_multipart()
            self.peer = peer
            message = step_pb2.DrafterMessage.FromString(data)
            if message.WhichOneof("kind") == "heartbeat":
                self.heartbeats += 1
                self.answered_register = False  # a heartbeat comes only with a session: the reply was taken
                self.send(step_pb2.VerifierMessage(verifier_epoch=EPOCH, session=self.session,
                                                   heartbeat_reply=step_pb2.HeartbeatReply(known=True)))
                continue
            if message.WhichOneof("kind") == "register" and self.answered_register:
                continue  # a retry the drafter sent (once a second) before our reply reached it: already answered
            self.answered_register = False  # anything else comes after the reply was taken: a register is new
            return message
        return None

    def send(self, message: step_pb2.VerifierMessage) -> None:
        if message.WhichOneof("kind") == "register_reply":
            self.answered_register = True
        self.raw(message.SerializeToString())

    def raw(self, *frames: bytes) -> None:
        self.socket.send_multipart([self.peer, *frames])

    def message(self, **fields) -> step_pb2.VerifierMessage:
        return step_pb2.VerifierMessage(**{"verifier_epoch": EPOCH, "session": self.session, **fields})

    def draft(self, step: int, request_id: str, new_tokens=(), max_nodes: int = 8, num_bets: int = 0):
        ask = step_pb2.DraftAsk(request_id=request_id, new_token_ids=list(new_tokens), max_nodes=max_nodes,
                                num_bets=num_bets)
        return self.message(draft=step_pb2.DraftRequest(step_id=step, asks=[ask]))

    def close(self) -> None:
        self.socket.close(linger=0)


def learned(fake, request_id: str, history: list[int], step: int = 1):
    """Open a request with history[:-1] and ask with its last token: NGRAM inserts no prompt (SGLang's semantics),
    the window of that ask reaches its trie before the next draft, so the second ask (step + 1, returned) drafts
    from the history. Each reply is awaited up to 120 s (it comes in milliseconds; a 2-core machine running the suite
    on four workers has kept a fresh drafter's first reply past 10 s)."""
    fake.send(fake.message(open=step_pb2.OpenRequest(request_id=request_id, token_ids=history[:-1])))
    fake.send(fake.draft(step, request_id, new_tokens=history[-1:]))
    first = fake.recv(timeout=120)
    if first is None or first.WhichOneof("kind") != "draft_reply":
        return first
    fake.send(fake.draft(step + 1, request_id))
    return fake.recv(timeout=120)


def test_a_hostile_verifier_cannot_take_a_drafter_down():
    fake = FakeVerifier()
    metrics_port = free_port()
    drafter = spawn_service(  # the fake answers heartbeats only while the test reads: a busy machine must not look silent
        [sys.executable, "-P", "-m", "splitspec", "drafter", "--verifier-drafter-addr", fake.address, "--drafter-name", "d",
         "--speculative-algorithm", "NGRAM", "--speculative-num-draft-tokens", "8", "--heartbeat-interval", "0.1",
         "--verifier-timeout", "600", "--metrics-port", str(metrics_port), "--log-level", "warning"])
    metrics_url = f"http://127.0.0.1:{metrics_port}/metrics"
    try:
        hello = fake.recv(timeout=120)
        assert hello is not None and hello.WhichOneof("kind") == "register", drafter.poll()
        fake.session = 7
        fake.send(fake.message(register_reply=step_pb2.RegisterReply(accepted=True, session=7, heartbeat_timeout_seconds=30)))
        # a proper request first: the drafter works
        history = [5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7]
        reply = learned(fake, "r1", history)
        assert reply.WhichOneof("kind") == "draft_reply" and reply.draft_reply.step_id == 2
        assert reply.draft_reply.trees and reply.draft_reply.trees[0].tokens[:2] == [7, 8]  # root 7, NGRAM: 5 6 7 -> 8
        dropped_before = _metric(metrics_url, "splitspec:drafter_dropped_messages_total")
        proper = fake.draft(3, "r1").SerializeToString()
        hostile = {
            "undecodable": [b"\xff\x00garbage\x13\x37"],
            "empty": [b""],
            "truncated": [proper[:-3]],
            "no kind": [fake.message().SerializeToString()],
            "oversized": [os.urandom(32 << 20)],
            "extra frames": [b"\x08\x01", b"x" * 1000, b"y"],
        }
        for frames in hostile.values():
            fake.raw(*frames)
        quiet = {  # answered as a verifier would want, or ignored: never a crash
            "wrong session": fake.message(open=step_pb2.OpenRequest(request_id="r9", token_ids=[1, 2]), session=999),
            "never opened": fake.draft(4, "r-unknown"),
            "out of range tokens": fake.message(open=step_pb2.OpenRequest(request_id="r2", token_ids=[-5, 2**31 - 1, 0])),
            "absurd budget": fake.draft(5, "r1", new_tokens=[8], max_nodes=2**32 - 1, num_bets=2**32 - 1),
            "replay": fake.draft(5, "r1"),
            "release unknown": fake.message(release=step_pb2.ReleaseRequest(request_ids=["nobody", ""])),
        }
        for message in quiet.values():
            fake.send(message)
        answers = {}
        while (message := fake.recv(timeout=5)) is not None:
            if message.WhichOneof("kind") == "draft_reply":
                answers[message.draft_reply.step_id] = message.draft_reply
        assert "r-unknown" in answers[4].unknown_request_ids  # asked about what it never heard of: says so
        assert len(answers[5].trees) <= 1 and all(len(t.tokens) <= 8 for t in answers[5].trees)  # its own cap
        assert drafter.poll() is None
        dropped = _metric(metrics_url, "splitspec:drafter_dropped_messages_total") - dropped_before
        assert dropped >= len(hostile) - 1, dropped  # every unusable frame counted (an empty one may read as no kind)
        # still registered, still heartbeating, still drafting
        beats = fake.heartbeats
        fake.send(fake.message(open=step_pb2.OpenRequest(request_id="r3", token_ids=history)))  # what r1 taught
        fake.send(fake.draft(6, "r3"))
        reply = fake.recv()
        assert reply.WhichOneof("kind") == "draft_reply" and reply.draft_reply.step_id == 6
        assert reply.draft_reply.trees[0].tokens[:2] == [7, 8]
        deadline = time.time() + 60
        while fake.heartbeats <= beats:  # and heartbeating (however busy the machine, within a minute)
            assert time.time() < deadline, "no heartbeat since the hostile frames"
            fake.recv(timeout=1)
        assert _metric(metrics_url, "splitspec:drafter_registered") == 1
        print(f"a hostile verifier: {len(hostile)} unusable frames and {len(quiet)} wrong messages, "
              f"{dropped:.0f} drops counted, the drafter alive and drafting")
    finally:
        drafter.kill()
        drafter.wait(timeout=30)
        fake.close()


def peak_rss_bytes(pid: int) -> int:
    """The process's peak resident memory so far (VmHWM)."""
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))


def test_frames_over_the_step_channel_limit_are_cut_off_before_they_are_allocated():
    """MAXMSGSIZE on both ends of the step channel (protos.step_limits): a frame larger than the largest legal one
    costs the receiver no memory (its peak RSS does not grow by it), the connection is dropped, and the receiver
    works on: the drafter, hearing nothing more, registers again after --verifier-timeout and drafts; the verifier
    serves."""
    from splitspec.protos.step_limits import drafter_receive_limit

    oversized = b"\0" * (drafter_receive_limit(0, 0) + (64 << 20))  # an NGRAM drafter's limit, and 64 MiB more
    fake = FakeVerifier()
    drafter = _start_drafter(fake, free_port(), verifier_timeout=2)

    def drafted(step: int, request_id: str):
        """The drafter's reply to an open and a draft ask. The fake answers heartbeats only while it reads, so a
        test process starved of CPU for 2 s looks silent and the drafter registers again: it is taken back
        (a new session) and asked again, however often a busy machine makes that happen."""
        for _ in range(20):
            reply = learned(fake, request_id, history, step)
            if reply is None or reply.WhichOneof("kind") != "register":
                return reply
            fake.session += 1
            fake.send(fake.message(register_reply=step_pb2.RegisterReply(accepted=True, session=fake.session,
                                                                         heartbeat_timeout_seconds=30)))
        raise AssertionError("the drafter registered again 20 times in a row")

    try:
        history = [5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7]
        assert drafted(1, "r1").WhichOneof("kind") == "draft_reply"
        before = peak_rss_bytes(drafter.pid)
        fake.raw(oversized)
        again = fake.recv(timeout=120)  # over a new connection (a new peer id)
        assert again is not None and again.WhichOneof("kind") == "register", (again, drafter.poll())
        fake.session += 1
        fake.send(fake.message(register_reply=step_pb2.RegisterReply(accepted=True, session=fake.session,
                                                                     heartbeat_timeout_seconds=30)))
        grown = peak_rss_bytes(drafter.pid) - before
        assert grown < 32 << 20, f"the drafter's peak RSS grew by {grown >> 20} MiB"
        reply = drafted(2, "r2")
        assert reply.WhichOneof("kind") == "draft_reply" and reply.draft_reply.trees[0].tokens[:2] == [7, 8]
    finally:
        drafter.kill()
        drafter.wait(timeout=30)
        fake.close()

    import zmq

    address = f"tcp://127.0.0.1:{free_port()}"
    process, stub = start_verifier("--max-total-tokens", "8192", "--drafter-bind-addr", address)
    peer = zmq.Context.instance().socket(zmq.DEALER)
    peer.setsockopt(zmq.LINGER, 0)
    try:
        peer.connect(address)
        before = peak_rss_bytes(process.pid)
        peer.send(oversized)
        time.sleep(2.0)
        grown = peak_rss_bytes(process.pid) - before
        assert grown < 32 << 20, f"the verifier's peak RSS grew by {grown >> 20} MiB"
        results = collect(stub, [submit("after", [5, 6, 7, 8, 5, 6, 7], max_new_tokens=8)], 1)
        assert len(results["after"]["tokens"]) == 8 and not results["after"]["error"], results
    finally:
        peer.close(linger=0)
        stop(process, stub)


def _start_drafter(fake: FakeVerifier, metrics_port: int, verifier_timeout: float = 30) -> subprocess.Popen:
    drafter = spawn_service(
        [sys.executable, "-P", "-m", "splitspec", "drafter", "--verifier-drafter-addr", fake.address, "--drafter-name", "d",
         "--speculative-algorithm", "NGRAM", "--speculative-num-draft-tokens", "8", "--heartbeat-interval", "0.1",
         "--verifier-timeout", str(verifier_timeout), "--metrics-port", str(metrics_port), "--log-level", "warning"])
    hello = fake.recv(timeout=120)
    assert hello is not None and hello.WhichOneof("kind") == "register", drafter.poll()
    fake.session = 7
    fake.send(fake.message(register_reply=step_pb2.RegisterReply(accepted=True, session=7, heartbeat_timeout_seconds=30)))
    return drafter


def test_a_drafter_that_fell_behind_drafts_only_the_newest_ask_and_a_lost_session_costs_no_drafting():
    """A stalled drafter (SIGSTOP) finds a backlog of asks when it resumes, as one sharing its cores with a
    busy verifier does. Every ask's tokens are taken and every step is answered, but only the newest ask of
    each request gets a tree: the verifier had stopped waiting for the others. And when the verifier says it
    no longer knows the session (a heartbeat reply queued behind a backlog), the drafter registers again at
    once instead of drafting the dead session's backlog first."""
    fake = FakeVerifier()
    metrics_port = free_port()
    drafter = _start_drafter(fake, metrics_port)
    metrics_url = f"http://127.0.0.1:{metrics_port}/metrics"
    pattern = [5, 6, 7, 8]
    try:
        history = pattern * 3  # ends in 8: NGRAM proposes 5 6 7 8 ... after it
        assert learned(fake, "r1", history).draft_reply.trees  # working
        fake.send(fake.message(open=step_pb2.OpenRequest(request_id="r2", token_ids=history)))
        os.kill(drafter.pid, signal.SIGSTOP)
        steps = range(10, 30)
        tokens = list(history)
        for step in steps:  # r1 grows by one token a step; r2 is asked once, in the first
            new = [pattern[len(tokens) % 4]]
            tokens += new
            asks = [step_pb2.DraftAsk(request_id="r1", new_token_ids=new, max_nodes=8)]
            if step == steps[0]:
                asks.append(step_pb2.DraftAsk(request_id="r2", max_nodes=8))
            fake.send(fake.message(draft=step_pb2.DraftRequest(step_id=step, asks=asks)))
        time.sleep(0.5)
        os.kill(drafter.pid, signal.SIGCONT)
        replies = {}
        while len(replies) < len(steps) and (message := fake.recv(timeout=20)) is not None:
            if message.WhichOneof("kind") == "draft_reply":
                replies[message.draft_reply.step_id] = message.draft_reply
        assert sorted(replies) == list(steps)  # every step answered
        r1_trees = {s: r.trees[0] for s, r in replies.items() for t in r.trees if t.request_id == "r1"}
        assert [t.request_id for t in replies[steps[0]].trees][-1:] == ["r2"]  # r2's only ask is its newest
        newest = r1_trees[steps[-1]]
        assert newest.tokens[:2] == [tokens[-1], pattern[len(tokens) % 4]]  # every ask's tokens were taken
        superseded = _metric(metrics_url, "splitspec:drafter_superseded_asks_total")
        assert superseded == len(steps) - len(r1_trees), (superseded, sorted(r1_trees))
        assert len(r1_trees) <= 3, sorted(r1_trees)  # the backlog arrives in one or a few reads, not 20 drafts
        # a lost session behind a backlog: the drafter registers again before drafting any of it
        os.kill(drafter.pid, signal.SIGSTOP)
        for step in range(40, 60):
            fake.send(fake.draft(step, "r1", new_tokens=[pattern[len(tokens) % 4]]))
            tokens.append(pattern[len(tokens) % 4])
        fake.send(fake.message(heartbeat_reply=step_pb2.HeartbeatReply(known=False)))
        time.sleep(0.5)
        os.kill(drafter.pid, signal.SIGCONT)
        drafted = []
        while (message := fake.recv(timeout=20)) is not None and message.WhichOneof("kind") != "register":
            if message.WhichOneof("kind") == "draft_reply" and message.draft_reply.trees:
                drafted.append(message.draft_reply.step_id)
        assert message is not None and message.WhichOneof("kind") == "register"
        assert len(drafted) <= 1, drafted  # the backlog was dropped as stale, not drafted
        print(f"a drafter behind by {len(steps)} asks: all answered, {len(r1_trees)} drafted, {superseded:.0f} superseded; "
              f"a lost session behind 20 asks: {len(drafted)} drafted before registering again")
    finally:
        os.kill(drafter.pid, signal.SIGCONT)
        drafter.kill()
        drafter.wait(timeout=30)
        fake.close()


SERVICE = "/splitspec.v1.Verifier/"


@pytest.fixture(scope="module")
def verifier():
    process, stub = start_verifier("--max-total-tokens", "8192")
    yield stub
    stop(process, stub)


def _raw(channel: grpc.Channel, method: str, kind: str):
    make = channel.unary_unary if kind == "unary" else channel.stream_stream
    return make(SERVICE + method)  # no serializers: bytes go as they are


def _outcome(call, kind: str, data: bytes) -> str:
    """A raw call's end: its gRPC status, or the error its stream carried back."""
    try:
        if kind == "unary":
            call(data, timeout=30)
            return "OK"
        errors = [d.error for response in call(iter([data]), timeout=30)
                  for d in pb.GenerateServerMessage.FromString(response).deltas if d.error]
        return f"refused: {errors[0]}" if errors else "OK"
    except grpc.RpcError as exc:
        return exc.code().name


def test_malformed_grpc_frames_are_refused_counted_and_the_verifier_serves_on(verifier):
    channel = grpc.insecure_channel(f"127.0.0.1:{verifier.port}",
                                    options=[("grpc.max_send_message_length", 128 << 20)])
    url = verifier.metrics_url
    before = _metric(url, "splitspec:grpc_malformed_messages_total")
    refused_before = _metric(url, "splitspec:grpc_refused_requests_total")
    good = pb.GenerateClientMessage(submit=pb.SubmitRequest(request_id="g", prompt_ids=[1, 2, 3],
                                    sampling=pb.SamplingParams(max_new_tokens=4))).SerializeToString()
    # a neighbour's stream, running all the while: garbage on other streams must not touch it
    pool = ThreadPoolExecutor(1)
    neighbour = pool.submit(collect, verifier, [submit("n", [5, 6, 7, 8], max_new_tokens=200, ignore_eos=True)], 1)
    cases = {
        "undecodable unary": ("GetModelInfo", "unary", b"\xff\xff\xff\xff"),
        "undecodable abort": ("Abort", "unary", b"\x0a\xff\x01"),
        "truncated submit": ("Generate", "stream", good[:-2]),
        "undecodable stream": ("Generate", "stream", b"\x0a\x05\xff\xff\xff\xff\xff"),
        "another message's bytes": ("Generate", "stream", pb.ModelInfo(model_id="x" * 50, vocab_size=3).SerializeToString()),
        "oversized": ("Generate", "stream", b"\x0a" + os.urandom(80 << 20)),
        "no such method": ("Nothing", "unary", b""),
    }
    outcomes = {name: _outcome(_raw(channel, method, kind), kind, data) for name, (method, kind, data) in cases.items()}
    assert outcomes["no such method"] == "UNIMPLEMENTED", outcomes
    assert outcomes["oversized"] == "RESOURCE_EXHAUSTED", outcomes
    for name in ("undecodable unary", "undecodable abort", "truncated submit", "undecodable stream"):
        assert outcomes[name] == "INVALID_ARGUMENT", outcomes
    assert outcomes["another message's bytes"] != "OK", outcomes  # it reads as a submit; refused by name
    # proper messages with wrong ids: a clear refusal per request, the stream serves on
    wrong = [submit("", [1, 2]), submit("dup", [1, 2], max_new_tokens=200, ignore_eos=True), submit("dup", [1, 2]),
             submit("oov", [10**6]), submit("empty", []), submit("ok", [1, 2, 3], max_new_tokens=4)]
    results = collect(verifier, wrong, len(wrong) - 1)
    assert results["ok"]["finish"] == pb.FINISH_REASON_LENGTH and results["ok"]["error"] == ""
    assert "already running" in results["dup"]["error"] and "empty" in results[""]["error"]
    assert "vocabulary" in results["oov"]["error"] and "empty" in results["empty"]["error"]
    assert verifier.Abort(pb.AbortRequest(request_id="nobody"), timeout=10).found is False
    malformed = _metric(url, "splitspec:grpc_malformed_messages_total") - before
    refused = _metric(url, "splitspec:grpc_refused_requests_total") - refused_before
    assert malformed >= 4, malformed  # the four undecodable ones (gRPC itself refuses the oversized one)
    assert refused >= 5, refused  # another message's bytes, no id, the duplicate, out of vocabulary, empty
    done = neighbour.result(timeout=120)
    pool.shutdown()
    assert done["n"]["finish"] == pb.FINISH_REASON_LENGTH and len(done["n"]["tokens"]) == 200, done
    print(f"malformed gRPC: {outcomes}; {malformed:.0f} malformed and {refused:.0f} refused counted; "
          "a neighbour's stream ran through")

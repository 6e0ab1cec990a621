"""Faults under concurrent streaming load, against one real `splitspec up` deployment (the demo target, NGRAM, two
drafter processes) through real HTTP: every drafter killed with SIGKILL at once; the step channel of a drafter
cut and restored through a TCP proxy (connections reset, and a black hole that holds them silent); the verifier
killed with SIGKILL. Speculation is lossless, so greedy and seeded streams must come out exactly as in the
fault-free run; a drafter fault must fail no request and the drafters must come back and draft again; a verifier
fault must end every stream with a terminal error event, answer 503 while it lasts, and leave a deployment that
serves the same text once `up` has restarted it. After every fault the verifier's KV pages, and the services'
open file descriptors and memory, return to their warmed-up level.

What each fault costs while it lasts (inter-chunk gaps, recovery times) and the resource figures are printed:
run with -s to see them."""

from __future__ import annotations

import asyncio
import json
import os
import select
import signal
import socket
import statistics
import struct
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from test_drafter_pool import start_drafter
from test_gateway import _held_pages
from test_launcher import Up
from test_verifier_service import scrape

from splitspec.launcher import DEMO_NAME

HANG = 180.0  # seconds: any wait longer than this is a hang, never a slow machine (nor one shared with other tests)
FD_SLACK = 8  # open file descriptors a service may hold above its warmed-up count after a fault and recovery
RSS_SLACK = 0.25  # ... and resident memory above its warmed-up size, as a fraction of it
# the step channel stays cut until the verifier has given up on the drafter (a reset is seen at once, a black hole
# by the missing heartbeats: --drafter-heartbeat-timeout, 2 s), then this much longer (tokens must flow without it)
CUT_AFTER_DEATH = 1.5
MIN_CUT = 2.0


def bodies(max_tokens: int) -> list[dict]:
    """8 streams: even ones greedy, odd ones sampled (temperature 0.8) with a fixed seed."""
    return [{"model": DEMO_NAME, "prompt": f"def job_{i}(items):\n    for item in items:\n", "max_tokens": max_tokens,
             "ignore_eos": True, "stream": True,
             **({"temperature": 0} if i % 2 == 0 else {"temperature": 0.8, "seed": 40 + i})} for i in range(8)]


BODIES = bodies(96)
LONG_BODIES = bodies(400)  # streams that outlast a cut of the step channel (an unresponsive drafter is not waited for)


# streams ------------------------------------------------------------------------------------------------
@dataclass
class Stream:
    """One streamed completion as the client saw it."""
    status: int = 0
    text: str = ""
    chunk_times: list[float] = field(default_factory=list)  # arrival of every chunk with a choice
    finish: str | None = None
    error: dict | None = None
    done: bool = False
    ended: float = 0.0


async def read_stream(http: httpx.AsyncClient, url: str, body: dict, out: Stream) -> Stream:
    try:
        async with http.stream("POST", url + "/v1/completions", json=body) as response:
            out.status = response.status_code
            if response.status_code != 200:
                await response.aread()
                out.error = response.json().get("error")
                return out
            async for line in response.aiter_lines():
                if not line:
                    continue
                assert line.startswith("data: ") and not out.done, line
                if line == "data: [DONE]":
                    out.done = True
                    continue
                event = json.loads(line[len("data: "):])
                if "error" in event:
                    assert out.error is None, event
                    out.error = event["error"]
                    continue
                assert out.error is None, f"a chunk after the error event: {event}"
                for choice in event["choices"]:
                    out.chunk_times.append(time.time())
                    out.text += choice["text"]
                    out.finish = choice["finish_reason"] or out.finish
    finally:
        out.ended = time.time()
    return out


@dataclass
class Load:
    streams: list[Stream]
    fault_at: float = 0.0  # when the fault began
    fault_result: object = None

    @property
    def texts(self) -> list[str]:
        return [s.text for s in self.streams]


def run_load(url: str, bodies=BODIES, fault=None, after_chunks: int = 3) -> Load:
    """Stream every body at once; once each stream has `after_chunks` chunks (or ended), call fault() in a
    thread while the streams go on; return when all ended (a hang fails the test)."""

    async def main() -> Load:
        load = Load([Stream() for _ in bodies])
        async with httpx.AsyncClient(timeout=httpx.Timeout(HANG), limits=httpx.Limits(max_connections=None)) as http:
            tasks = [asyncio.ensure_future(read_stream(http, url, b, s)) for b, s in zip(bodies, load.streams)]
            if fault is not None:
                deadline = time.time() + HANG
                while not all(len(s.chunk_times) >= after_chunks or t.done() for s, t in zip(load.streams, tasks)):
                    assert time.time() < deadline, "the streams never got going"
                    await asyncio.sleep(0.005)
                load.fault_at = time.time()
                load.fault_result = await asyncio.to_thread(fault)
            done, pending = await asyncio.wait(tasks, timeout=HANG)
            assert not pending, f"{len(pending)} streams hung ({HANG:.0f} s)"
            for task in done:
                task.result()
        return load

    return asyncio.run(main())


def completed(load: Load) -> None:
    for i, s in enumerate(load.streams):
        assert s.status == 200 and s.error is None and s.done and s.finish == "length", (i, s.status, s.error, s.finish)


def seconds(load: Load) -> float:
    """From the first chunk to the end of the last stream."""
    return max(s.ended for s in load.streams) - min(s.chunk_times[0] for s in load.streams if s.chunk_times)


def gaps(load: Load, start: float, end: float) -> list[float]:
    """Gaps between consecutive chunks of a stream whose later chunk arrived in [start, end)."""
    return [b - a for s in load.streams for a, b in zip(s.chunk_times, s.chunk_times[1:]) if start <= b < end]


def gap_line(load: Load, during_end: float | None = None) -> str:
    """Inter-chunk gaps before the fault and from its start to during_end (default: the end of the load)."""
    before = gaps(load, 0.0, load.fault_at)
    during = gaps(load, load.fault_at, during_end or float("inf"))

    def fmt(values):
        return (f"max {max(values) * 1000:.0f} ms, median {statistics.median(values) * 1000:.0f} ms (n={len(values)})"
                if values else "none")

    return f"inter-chunk gap before the fault: {fmt(before)}; during it: {fmt(during)}"


# the deployment ---------------------------------------------------------------------------------------------
@dataclass
class Sample:
    fds: int
    rss_mb: float


def sample(pid: int) -> Sample | None:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
        rss = next(int(line.split()[1]) for line in status.splitlines() if line.startswith("VmRSS:")) / 1024
        return Sample(len(os.listdir(f"/proc/{pid}/fd")), round(rss, 1))
    except (OSError, StopIteration):
        return None


class Deployment:
    """A `splitspec up` and what the tests read from it."""

    def __init__(self, up: Up):
        self.up = up
        self.url = up.url
        self.metrics_url = f"http://127.0.0.1:{up.port + 2}/metrics"
        self.drafter_port = up.port + 3
        self.reference: list[str] = []  # the texts of BODIES and LONG_BODIES without a fault
        self.long_reference: list[str] = []
        self.warm: dict[str, Sample] = {}
        self.extra: dict[str, int] = {}  # name -> pid of processes the tests started (their drafters)

    def services(self) -> dict[str, int]:
        """Service name (gateway, verifier, drafter-N) -> pid, from the launcher's children."""
        found = {}
        for task in Path(f"/proc/{self.up.process.pid}/task").glob("*"):
            try:
                children = [int(c) for c in (task / "children").read_text().split()]
            except OSError:
                continue
            for pid in children:
                try:
                    argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")
                except OSError:
                    continue
                if "--drafter-name" in argv:
                    found[argv[argv.index("--drafter-name") + 1]] = pid
                elif "gateway" in argv or "verifier" in argv:
                    found["gateway" if "gateway" in argv else "verifier"] = pid
        return found

    def metric(self, name: str, **labels) -> float:
        """The sum of the samples of `name` whose labels include `labels`."""
        return sum(v for (n, ls), v in scrape(self.metrics_url).items()
                   if n == name and all(dict(ls).get(k) == w for k, w in labels.items()))

    def wait_metric(self, name: str, predicate, timeout: float = HANG, poll: float = 0.1, **labels) -> float:
        deadline, value = time.time() + timeout, None
        while time.time() < deadline:
            try:
                value = self.metric(name, **labels)
                if predicate(value):
                    return value
            except OSError:  # the verifier is (re)starting
                pass
            time.sleep(poll)
        raise AssertionError(f"{name}{labels} stayed at {value}")

    def resources(self) -> dict[str, Sample]:
        pids = {**self.services(), **self.extra}
        return {name: s for name, s in ((n, sample(p)) for n, p in pids.items()) if s is not None}

    def leftovers(self) -> dict[str, float]:
        """What must be zero once no request runs: KV pages held for requests, requests running or waiting in the
        verifier, requests pinned to drafters, requests in flight in the gateway, requests held by `up`'s drafters."""
        verifier = scrape(self.metrics_url)

        def total(values, name):
            return sum(v for (n, _), v in values.items() if n == name)

        out = {"kv_pages_held": _held_pages(self.metrics_url),
               "running": total(verifier, "splitspec:num_requests_running"),
               "waiting": total(verifier, "splitspec:num_requests_waiting"),
               "pinned": total(verifier, "splitspec:drafter_requests_pinned"),
               "gateway_in_flight": total(scrape(self.url + "/metrics"), "splitspec:gateway_requests_in_flight")}
        for group in httpx.get(f"http://127.0.0.1:{self.up.port + 2}/sd/drafters", timeout=10).json():
            name = group["labels"]["__meta_splitspec_drafter"]
            drafter = scrape(f"http://{group['targets'][0]}/metrics")
            out[f"{name}_held"] = total(drafter, "splitspec:drafter_held_requests")
        return out

    def settle(self) -> float:
        """Wait until nothing is left of the requests (leftovers() all zero); the seconds it took."""
        start, deadline = time.time(), time.time() + HANG
        while any((left := self.leftovers()).values()):
            assert time.time() < deadline, f"requests left behind with nothing running: {left}"
            time.sleep(0.1)
        return time.time() - start

    def check_resources(self, label: str) -> None:
        """Nothing left of the requests (KV pages back to none held); every service's fds within FD_SLACK and RSS
        within RSS_SLACK of its warmed-up figures (a restarted service: those of the process it replaced; the verifier
        holds one more descriptor per connected drafter)."""
        settled = self.settle()
        time.sleep(0.5)
        now = self.resources()
        used, cached = self.metric("splitspec:kv_pages_used"), self.metric("splitspec:prefix_cache_pages")
        print(f"[{label}] KV pages held for requests: {_held_pages(self.metrics_url):.0f} (warm: 0), nothing running, "
              f"pinned, in flight or held by a drafter (settled {settled:.1f} s after the load); kv_pages_used "
              f"{used:.0f} of which prefix cache {cached:.0f}")
        for name in sorted(self.warm):
            warm, cur = self.warm[name], now.get(name)
            assert cur is not None, f"{name} is not running"
            print(f"[{label}] {name:<10} fds {warm.fds} -> {cur.fds} ({cur.fds - warm.fds:+d}), "
                  f"RSS {warm.rss_mb:.0f} -> {cur.rss_mb:.0f} MB ({(cur.rss_mb / warm.rss_mb - 1) * 100:+.1f}%)")
        for name in sorted(self.warm):
            warm, cur = self.warm[name], now[name]
            assert cur.fds <= warm.fds + FD_SLACK, (label, name, warm, cur)
            assert cur.rss_mb <= warm.rss_mb * (1 + RSS_SLACK), (label, name, warm, cur)

    def speculation(self) -> tuple[float, float]:
        return (self.metric("splitspec:spec_decode_num_draft_tokens_total"),
                self.metric("splitspec:spec_decode_num_accepted_tokens_total"))


@pytest.fixture(scope="module")
def deployment():
    """One `splitspec up --drafters 2` for the module (default deadlines: --drafter-timeout-ms 500,
    --drafter-heartbeat-timeout 2), warmed up by the fault-free runs whose texts are the references."""
    up = Up("--drafters", "2", "--log-level", "warning")
    try:
        up.wait_for_line(r"serving splitspec-demo at ")
        d = Deployment(up)
        first = run_load(d.url)
        completed(first)
        d.reference = first.texts
        long = run_load(d.url, LONG_BODIES)
        completed(long)
        d.long_reference = long.texts
        print(f"fault-free loads: {seconds(first):.1f} s for 8 x {BODIES[0]['max_tokens']} tokens, {seconds(long):.1f} s "
              f"for 8 x {LONG_BODIES[0]['max_tokens']} tokens (from the first chunk)")
        assert d.speculation()[1] > 0, "the fault-free run accepted no draft token: nothing would be tested"
        d.settle()
        time.sleep(0.5)
        d.warm = d.resources()
        assert sorted(d.warm) == ["drafter-1", "drafter-2", "gateway", "verifier"], d.warm
        print(f"warm: {d.warm}")
        yield d
    finally:
        up.stop()


def wait_restarted(d: Deployment, name: str, after: int) -> None:
    """`up` reported `name` exited and started it again (log lines after index `after`)."""
    deadline = time.time() + HANG
    while True:
        lines = d.up.lines[after:]
        if any(l.startswith("up") and f"{name} exited with code -9" in l and "restarting it" in l for l in lines) and \
                any(l.startswith("up") and f"started {name} (pid" in l for l in lines):
            return
        assert time.time() < deadline, f"{name} was not restarted:\n" + "\n".join(d.up.lines[-30:])
        time.sleep(0.1)


def drop_reasons(d: Deployment) -> dict[str, float]:
    """Drafts the verifier dropped, summed over drafters, by reason."""
    out: dict[str, float] = {}
    for (name, labels), value in scrape(d.metrics_url).items():
        if name == "splitspec:drafter_drafts_dropped_total":
            reason = dict(labels)["reason"]
            out[reason] = out.get(reason, 0.0) + value
    return out


def delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {k: v - before.get(k, 0.0) for k, v in after.items() if v > before.get(k, 0.0)}


def resumes_speculating(d: Deployment, label: str, drafters: tuple[str, ...]) -> None:
    """A fault-free load keeps the reference texts, and drafts are proposed and accepted again, those drafters
    proposing some."""
    proposed, accepted = d.speculation()
    mine = {name: d.metric("splitspec:drafter_draft_tokens_total", drafter=name) for name in drafters}
    load = run_load(d.url)
    completed(load)
    assert load.texts == d.reference, label
    proposed2, accepted2 = d.speculation()
    print(f"[{label}] after recovery: {proposed2 - proposed:.0f} draft tokens proposed, {accepted2 - accepted:.0f} accepted")
    assert proposed2 > proposed and accepted2 > accepted, (label, proposed, proposed2, accepted, accepted2)
    for name, before in mine.items():
        assert d.metric("splitspec:drafter_draft_tokens_total", drafter=name) > before, f"{label}: {name} drafted nothing"


# 1. every drafter killed --------------------------------------------------------------------------------
def test_killing_every_drafter_mid_stream_changes_no_output_and_speculation_resumes(deployment):
    """kill -9 of both drafters mid-stream: the verifier decodes plainly while none is alive, every stream ends
    with the fault-free text, `up` restarts the drafters and they draft again."""
    d = deployment
    mark = len(d.up.lines)
    proposed_before, _ = d.speculation()
    drops = drop_reasons(d)
    victims = {name: pid for name, pid in d.services().items() if name.startswith("drafter-")}
    assert len(victims) == 2

    def kill_all():
        for pid in victims.values():
            os.kill(pid, signal.SIGKILL)
        return d.speculation()[0]

    load = run_load(d.url, fault=kill_all)
    completed(load)
    assert load.texts == d.reference  # lossless: plain decoding carried the streams while no drafter was alive
    proposed_at_kill = load.fault_result
    for name in victims:
        wait_restarted(d, name, mark)
    d.wait_metric("splitspec:drafters_alive", lambda v: v == 2)
    back = time.time() - load.fault_at
    last = max(s.ended for s in load.streams)
    print(f"[drafters killed] {gap_line(load)}; streams ended {last - load.fault_at:.1f} s after the kill; both drafters "
          f"registered again {back:.1f} s after it; {d.speculation()[0] - proposed_at_kill:.0f} draft tokens proposed "
          f"after the kill signals ({proposed_at_kill - proposed_before:.0f} before them, this load); drafts dropped by "
          f"reason: {delta(drops, drop_reasons(d))}")
    resumes_speculating(d, "drafters killed", ("drafter-1", "drafter-2"))
    d.check_resources("drafters killed")


# 2. the step channel cut and restored -----------------------------------------------------------------------
class StepChannelProxy(threading.Thread):
    """A TCP relay between drafters and the verifier's step channel. cut("reset") closes every relayed
    connection with a reset and resets new ones at once; cut("blackhole") stops relaying without closing anything
    (bytes wait in the kernels' buffers, new connections wait in the listen backlog), as a network partition does;
    restore() relays again (a black hole's held bytes then arrive late)."""

    def __init__(self, upstream_port: int):
        super().__init__(daemon=True)
        self.upstream = ("127.0.0.1", upstream_port)
        self.listener = socket.create_server(("127.0.0.1", 0), backlog=64)
        self.port = self.listener.getsockname()[1]
        self.mode = "relay"
        self.peers: dict[socket.socket, socket.socket] = {}
        self.connections = 0
        self.stopping = False

    def cut(self, how: str) -> None:
        assert how in ("reset", "blackhole")
        self.mode = how

    def restore(self) -> None:
        self.mode = "relay"

    @staticmethod
    def _reset(sock: socket.socket) -> None:
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # close = RST
        except OSError:
            pass
        sock.close()

    def _drop(self, sock: socket.socket) -> None:
        peer = self.peers.pop(sock, None)
        self._reset(sock)
        if peer is not None:
            self.peers.pop(peer, None)
            self._reset(peer)

    def run(self) -> None:
        while not self.stopping:
            mode = self.mode
            if mode == "reset":
                for sock in list(self.peers):
                    self._drop(sock)
            watched = [] if mode == "blackhole" else [self.listener, *self.peers]
            if not watched:
                time.sleep(0.02)
                continue
            readable, _, _ = select.select(watched, [], [], 0.05)
            for sock in readable:
                if self.mode != mode:
                    break
                if sock is self.listener:
                    client, _ = self.listener.accept()
                    if mode == "reset":
                        self._reset(client)
                        continue
                    upstream = socket.create_connection(self.upstream)
                    self.peers[client], self.peers[upstream] = upstream, client
                    self.connections += 1
                    continue
                if sock not in self.peers:
                    continue
                try:
                    data = sock.recv(1 << 16)
                    if data:
                        self.peers[sock].sendall(data)
                except OSError:
                    data = b""
                if not data:
                    self._drop(sock)

    def close(self) -> None:
        self.stopping = True
        self.join(timeout=5)
        for sock in list(self.peers):
            self._drop(sock)
        self.listener.close()


def drafts_answered(d: Deployment, drafter: str) -> float:
    """Draft requests the drafter answered: replies filed in time, and late ones (a slow machine)."""
    return (d.metric("splitspec:drafter_round_trip_seconds_count", drafter=drafter)
            + d.metric("splitspec:drafter_drafts_dropped_total", drafter=drafter, reason="late"))


def cut_mid_stream(d: Deployment, proxy: StepChannelProxy, how: str) -> None:
    """Long streams; once they flow, the proxied drafter's channel is cut until the verifier gives up on the drafter
    and CUT_AFTER_DEATH longer, then restored. No stream fails or changes, tokens keep flowing while it is down, and
    the drafter registers again by itself."""
    registrations = d.metric("splitspec:drafter_registrations_total", outcome="accepted")
    repins = d.metric("splitspec:drafter_repins_total")
    answered = drafts_answered(d, "proxied")
    drops = drop_reasons(d)
    seen = {}
    proxy_drafter_pid = d.extra["proxied"]

    def cut_and_restore():
        seen["pinned"] = d.metric("splitspec:drafter_requests_pinned", drafter="proxied")
        seen["answered"] = drafts_answered(d, "proxied") - answered
        d.warm.setdefault("proxied", sample(proxy_drafter_pid))  # its resources once it has served (the first cut)
        start = time.time()
        proxy.cut(how)
        d.wait_metric("splitspec:drafters_alive", lambda v: v == 2, timeout=HANG, poll=0.02)
        seen["declared_dead"] = time.time() - start
        time.sleep(max(CUT_AFTER_DEATH, start + MIN_CUT - time.time()))
        proxy.restore()
        restored = time.time()
        seen["cut"] = restored - start
        d.wait_metric("splitspec:drafter_registrations_total", lambda v: v > registrations, outcome="accepted")
        seen["rejoined"] = time.time() - restored

    load = run_load(d.url, LONG_BODIES, fault=cut_and_restore)
    completed(load)
    assert load.texts == d.long_reference, how
    # the drafter served this load's streams when the channel went down (after an earlier cut: it drafts again)
    assert seen["pinned"] > 0 and seen["answered"] > 0, (how, seen)
    assert d.metric("splitspec:drafter_repins_total") > repins  # its streams moved to the other drafters
    # tokens kept coming while the channel was down (the verifier stopped waiting for the dead drafter)
    cut_end = load.fault_at + seen["cut"]
    running = [s for s in load.streams if s.ended > cut_end]
    assert running, "every stream ended before the channel came back: make LONG_BODIES longer"
    assert all(any(load.fault_at + seen["declared_dead"] < t < cut_end for t in s.chunk_times) for s in running), \
        f"a stream made no progress while the channel was down ({how})"
    d.wait_metric("splitspec:drafters_alive", lambda v: v == 3)
    print(f"[channel cut: {how}] {gap_line(load, cut_end)}; {seen['pinned']:.0f} streams were pinned to the drafter; "
          f"the verifier declared it dead {seen['declared_dead']:.2f} s into the {seen['cut']:.1f} s cut; "
          f"{len(running)} of {len(load.streams)} streams outlasted the cut; the drafter registered again "
          f"{seen['rejoined']:.2f} s after the restore; drafts dropped meanwhile by reason: "
          f"{delta(drops, drop_reasons(d))}; TCP connections the proxy relayed so far: {proxy.connections}")


def test_a_cut_step_channel_stalls_no_stream_and_its_drafter_returns(deployment):
    """A third drafter reaches the verifier through a TCP proxy. Mid-stream the proxy resets its connections
    (and refuses new ones) for a while, then, in a second load, black-holes them: the streams pinned to it move to
    the other drafters once the verifier gives up on it, none fails or changes, tokens keep flowing while the
    channel is down, and after each restore the drafter registers again by itself and drafts."""
    d = deployment
    proxy = StepChannelProxy(d.drafter_port)
    proxy.start()
    drafter = start_drafter(f"tcp://127.0.0.1:{proxy.port}", "proxied")
    try:
        d.wait_metric("splitspec:drafters_alive", lambda v: v == 3)
        d.extra["proxied"] = drafter.pid
        for how in ("reset", "blackhole"):
            cut_mid_stream(d, proxy, how)
            assert drafter.poll() is None, "the drafter should outlive a cut channel"
        resumes_speculating(d, "channel cut", ("proxied",))
        d.check_resources("channel cut")
    finally:
        d.extra.pop("proxied", None)
        d.warm.pop("proxied", None)
        drafter.kill()
        drafter.wait(timeout=30)
        proxy.close()
        d.wait_metric("splitspec:drafters_alive", lambda v: v == 2)


# 3. the verifier killed -----------------------------------------------------------------------------------
def serving_now(health) -> bool:
    try:
        reply = health.Check(health_pb2.HealthCheckRequest(service="splitspec.v1.Verifier"), timeout=1)
    except grpc.RpcError:
        return False
    return reply.status == health_pb2.HealthCheckResponse.SERVING


def test_a_killed_verifier_ends_streams_with_an_error_and_up_brings_it_back(deployment):
    """kill -9 of the verifier mid-stream: every stream ends with a terminal error event and [DONE] at once,
    requests sent meanwhile get 503 (a stream: its error event), `up` restarts the verifier, the drafters
    register with it, and the same texts come out, speculated."""
    d = deployment
    mark = len(d.up.lines)
    verifier = d.services()["verifier"]
    meanwhile: dict[str, object] = {}

    def kill_verifier():
        os.kill(verifier, signal.SIGKILL)
        killed = time.time()
        r = httpx.post(d.url + "/v1/completions", json={**BODIES[0], "stream": False}, timeout=HANG)
        meanwhile["plain"] = (r.status_code, r.json(), time.time() - killed)
        streamed = run_load(d.url, [BODIES[0]]).streams[0]
        meanwhile["stream"] = streamed
        return killed

    # long streams: a busy machine may take a second from the streams' third chunk to the kill, and 96 tokens can
    # all be out by then (CI saw a stream finish before the kill landed)
    load = run_load(d.url, LONG_BODIES, fault=kill_verifier)
    killed = load.fault_result
    for i, s in enumerate(load.streams):  # a terminal error event, then [DONE]; never a hang
        assert s.status == 200 and s.done and s.error is not None and s.finish is None, (i, s.error, s.finish, s.done)
        assert s.error["code"] == "verifier_unavailable" and s.chunk_times, s.error
        assert s.text == d.long_reference[i][: len(s.text)]  # what came before the fault was right
    ended = [s.ended - killed for s in load.streams]
    status, body, after = meanwhile["plain"]
    assert status == 503 and body["error"]["code"] == "verifier_unavailable", (status, body)
    late = meanwhile["stream"]  # a stream sent while it is down: 503 up front, or a terminal error event
    assert late.error is not None and (late.status == 503 or (late.status == 200 and late.done)), late
    wait_restarted(d, "verifier", mark)
    channel = grpc.insecure_channel(f"127.0.0.1:{d.up.port + 1}")
    health = health_pb2_grpc.HealthStub(channel)
    verifier_serving = None
    deadline = time.time() + HANG
    while True:  # the launcher restarted it: the gateway serves again on a new connection
        if verifier_serving is None and serving_now(health):  # a fresh gRPC channel: when it is back
            verifier_serving = time.time() - killed
        r = httpx.post(d.url + "/v1/completions", json={**BODIES[0], "stream": False}, timeout=HANG)
        if r.status_code == 200:
            break
        assert r.status_code == 503 and time.time() < deadline, r.text
        time.sleep(0.2)
    serving = time.time() - killed
    channel.close()
    assert r.json()["choices"][0]["text"] == d.reference[0]
    print(f"[verifier killed] in-flight streams ended with an error event {min(ended):.2f} to {max(ended):.2f} s after "
          f"the kill; a request sent then got {status} after {after:.2f} s, a stream got HTTP {late.status} with "
          f"{late.error.get('code')!r}; the new verifier served (gRPC health) {verifier_serving or serving:.1f} s and the "
          f"gateway again {serving:.1f} s after the kill")
    d.wait_metric("splitspec:drafters_alive", lambda v: v == 2)
    load = run_load(d.url)
    completed(load)
    assert load.texts == d.reference  # the same greedy and seeded texts as before the fault
    assert d.speculation()[1] > 0, "the restarted verifier accepted no draft token"
    d.check_resources("verifier killed")  # the new verifier is held to the warm figures of the one it replaced

"""`splitspec up` as a user runs it: the demo models, three drafter processes, the printed example
answered; under concurrent load a drafter killed with SIGKILL fails no request and changes no output,
the launcher restarts it and it drafts again; SIGINT stops every service."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import openai

from splitspec import lifeline

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class Up:
    def __init__(self, *flags: str, port: int | None = None):
        self.port = port or free_port_block(4)  # gateway, verifier, metrics, drafters: port .. port + 3
        # in a clone's root, as `bash scripts/run.sh up` runs there: the services it starts (`python -m splitspec ...`)
        # then begin with that root on sys.path
        self.process = lifeline.spawn([sys.executable, "-P", "-m", "splitspec", "up", "--port", str(self.port), *flags],
                                        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1,
                                        start_new_session=True, cwd=REPO)
        self.lines: list[str] = []
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()
        self.url = f"http://127.0.0.1:{self.port}"

    def _read(self):
        for line in self.process.stdout:
            self.lines.append(line.rstrip("\n"))

    def wait_for_line(self, pattern: str, timeout: float = 240) -> re.Match:
        deadline = time.time() + timeout
        while time.time() < deadline:
            for line in list(self.lines):
                match = re.search(pattern, line)
                if match:
                    return match
            assert self.process.poll() is None, "\n".join(self.lines[-40:])
            time.sleep(0.2)
        raise AssertionError(f"no line matching {pattern!r}:\n" + "\n".join(self.lines[-40:]))

    def children(self) -> list[int]:
        out = lifeline.run(["pgrep", "-f", f"--verifier 127.0.0.1:{self.port + 1}|--port {self.port + 1} |"
                              f"tcp://127.0.0.1:{self.port + 3}"], capture_output=True, text=True).stdout
        return [int(pid) for pid in out.split()]

    def service_pids(self) -> dict[str, int]:
        """Every service process the launcher started (restarts included): pid -> service name."""
        return {int(m.group(2)): m.group(1) for line in list(self.lines)
                if (m := re.search(r"\| started (\S+) \(pid (\d+)\)", line))}

    def stop(self) -> int:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGINT)
        try:
            return self.process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            raise


def alive(pid: int) -> bool:
    """The process exists and is not a zombie (an ended child its new parent has not reaped yet)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


def _busy(port: int) -> bool:
    """Someone listens on the port, or it cannot be bound (an outgoing connection holds it)."""
    import socket

    with socket.socket() as s:
        if s.connect_ex(("127.0.0.1", port)) == 0:
            return True
    with socket.socket() as s:
        try:
            s.bind(("0.0.0.0", port))
        except OSError:
            return True
    return False


def free_port_block(count: int) -> int:
    """A base port whose `count` consecutive ports are free, drawn below the kernel's ephemeral range
    (32768 and up on Linux), where other processes' outgoing connections take ports at any moment: a block
    from there could be taken between this check and the services binding it."""
    import random

    rng = random.Random()
    for _ in range(500):
        base = rng.randrange(20000, 32700 - count)
        if not any(_busy(base + i) for i in range(count)):
            return base
    raise RuntimeError(f"no {count} consecutive free ports between 20000 and 32700")


def stream_in_background(url: str) -> list[str]:
    """A long streamed completion on a thread, once its first chunks arrived: the lines read, growing."""
    lines: list[str] = []

    def read() -> None:
        try:
            with httpx.stream("POST", url + "/v1/completions", timeout=120, json={
                    "model": "splitspec-demo", "prompt": "def fibonacci(n):", "max_tokens": 1500, "temperature": 0,
                    "ignore_eos": True, "stream": True}) as response:
                lines.extend(response.iter_lines())
        except httpx.HTTPError:  # the stop cut it
            pass

    threading.Thread(target=read, daemon=True).start()
    deadline = time.time() + 60
    while len(lines) < 3 and time.time() < deadline:
        time.sleep(0.05)
    return lines


def drafter_tokens(metrics_url: str, name: str) -> float:
    text = httpx.get(metrics_url, timeout=10).text
    values = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
              if line.startswith("splitspec:drafter_draft_tokens_total{") and f'drafter="{name}"' in line]
    return sum(values)


def test_up_serves_survives_a_killed_drafter_and_stops_on_sigint():
    up = Up("--drafters", "3", "--log-level", "warning")
    try:
        up.wait_for_line(r"serving splitspec-demo at ")
        # the launcher parses flags and supervises: it never imports torch (which cost ~3 CPU-s a launch)
        assert "libtorch" not in Path(f"/proc/{up.process.pid}/maps").read_text(), "splitspec up imported torch"
        # the printed curl example, sent as printed
        body = json.loads(up.wait_for_line(r"-d '(\{.*\})'").group(1))
        answer = httpx.post(up.url + "/v1/chat/completions", json=body, timeout=120).json()
        assert answer["choices"][0]["message"]["content"] and answer["speculative"]["algorithm"] == "NGRAM"
        # a drafter of no model never imports torch (~3 CPU-s and ~190 MB a process): checked once all three have
        # registered, which they do after every import of their start (a grammar's compile imports it later)
        sd = f"http://127.0.0.1:{up.port + 2}/sd/drafters"
        deadline = time.time() + 120
        while len(httpx.get(sd, timeout=10).json()) < 3:
            assert time.time() < deadline, "three NGRAM drafters never registered"
            time.sleep(0.5)
        drafters = [pid for pid, name in up.service_pids().items() if name.startswith("drafter-")]
        assert len(drafters) == 3
        for pid in drafters:
            assert "libtorch" not in Path(f"/proc/{pid}/maps").read_text(), f"NGRAM drafter {pid} imported torch"
        # structured outputs load the tokenizer through transformers, which imports Hugging Face's `kernels`: the
        # clone's kernels/ folder on a service's sys.path shadowed it and every response_format was refused
        client = openai.OpenAI(base_url=up.url + "/v1", api_key="none")
        shaped = client.chat.completions.create(
            model="splitspec-demo", messages=[{"role": "user", "content": "A JSON object with a number:"}],
            response_format={"type": "json_schema", "json_schema": {"name": "n", "schema": {
                "type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}}},
            max_tokens=32, temperature=0)
        assert isinstance(json.loads(shaped.choices[0].message.content)["n"], int)
        prompts = [f"def job_{i}(items):\n    for item in items:\n" for i in range(24)]

        async def load(kill_after: float | None):
            async with httpx.AsyncClient(timeout=300) as http:
                async def one(prompt):
                    r = await http.post(up.url + "/v1/completions", json={
                        "model": "splitspec-demo", "prompt": prompt, "max_tokens": 48, "temperature": 0, "ignore_eos": True})
                    assert r.status_code == 200, r.text
                    return r.json()["choices"][0]["text"]

                tasks = [asyncio.ensure_future(one(p)) for p in prompts]
                if kill_after is not None:
                    await asyncio.sleep(kill_after)
                    victim = int(lifeline.run(["pgrep", "-f", f"127.0.0.1:{up.port + 3} --drafter-name drafter-2"],
                                                capture_output=True, text=True).stdout.split()[0])
                    os.kill(victim, signal.SIGKILL)
                return await asyncio.gather(*tasks)

        reference = asyncio.run(load(None))
        during = asyncio.run(load(1.0))
        assert during == reference  # no request failed (each answered 200) and no output changed
        up.wait_for_line(r"drafter-2 exited with code -9 .*restarting it")
        up.wait_for_line(r"started drafter-2 \(pid \d+\)")
        metrics_url = f"http://127.0.0.1:{up.port + 2}/metrics"
        deadline = time.time() + 60
        before = drafter_tokens(metrics_url, "drafter-2")
        while drafter_tokens(metrics_url, "drafter-2") <= before:  # the restarted drafter gets work again
            assert time.time() < deadline, "the restarted drafter-2 never drafted"
            asyncio.run(load(None))
        # the verifier's service discovery lists the three drafters' own endpoints, the restarted one's too
        groups = httpx.get(f"http://127.0.0.1:{up.port + 2}/sd/drafters", timeout=10).json()
        assert sorted(g["labels"]["__meta_splitspec_drafter"] for g in groups) == ["drafter-1", "drafter-2", "drafter-3"]
        for group in groups:
            (target,) = group["targets"]
            own = httpx.get(f"http://{target}/metrics", timeout=10).text
            name = group["labels"]["__meta_splitspec_drafter"]
            assert f'splitspec:drafter_registered{{algorithm="NGRAM",drafter="{name}"}} 1.0' in own
            steps = [float(line.rsplit(" ", 1)[1]) for line in own.splitlines()
                     if line.startswith("splitspec:drafter_steps_total{")]
            assert steps and steps[0] > 0, own
        assert any(line.startswith("verifier  | ") for line in up.lines)  # service logs come prefixed
    finally:
        code = up.stop()
    assert code == 0 and up.lines[-1].endswith("all services stopped")
    time.sleep(1)
    assert up.children() == []


def test_up_killed_with_sigkill_under_load_leaves_no_process_and_starts_again():
    """However the launcher ends (here SIGKILL, as an OOM kill or `docker kill` ends it), its services end with
    it within 5 s, and a new launch on the same ports serves; SIGINT then stops that one cleanly."""
    up = Up("--drafters", "2", "--log-level", "warning")
    try:
        up.wait_for_line(r"serving splitspec-demo at ")
        services = up.service_pids()
        assert sorted(services.values()) == ["drafter-1", "drafter-2", "gateway", "verifier"]
        streaming = threading.Event()

        def stream(i: int) -> None:  # streams until the gateway goes away under it
            try:
                with httpx.stream("POST", up.url + "/v1/completions", timeout=120, json={
                        "model": "splitspec-demo", "prompt": f"def load_{i}(rows):\n", "max_tokens": 2000,
                        "temperature": 0, "ignore_eos": True, "stream": True}) as response:
                    for _ in response.iter_lines():
                        streaming.set()
            except httpx.HTTPError:
                pass

        clients = [threading.Thread(target=stream, args=(i,), daemon=True) for i in range(8)]
        for client in clients:
            client.start()
        assert streaming.wait(120), "no stream started"
        time.sleep(1.0)
        up.process.kill()  # SIGKILL: the launcher runs no handler, stops nothing itself
        up.process.wait(timeout=10)
        deadline = time.monotonic() + 5
        while any(alive(pid) for pid in services) and time.monotonic() < deadline:
            time.sleep(0.1)
        left = {pid: name for pid, name in services.items() if alive(pid)}
        assert not left and up.children() == [], f"still running 5 s after the launcher's SIGKILL: {left}"
        for client in clients:
            client.join(timeout=30)
    finally:
        if up.process.poll() is None:
            up.process.kill()
        for pid in up.service_pids():  # the test's own clean-up, should the assertion above have failed
            if alive(pid):
                os.kill(pid, signal.SIGKILL)

    # the same four ports; the verifier's own --speculative-* flags stay with it (a drafter refused them once)
    again = Up("--drafters", "1", "--log-level", "warning", "--speculative-overlap", "on", "--speculative-num-bets", "2",
               port=up.port)
    try:
        again.wait_for_line(r"serving splitspec-demo at ")
        answer = httpx.post(again.url + "/v1/completions", timeout=120, json={
            "model": "splitspec-demo", "prompt": "def fibonacci(n):", "max_tokens": 16, "temperature": 0}).json()
        assert answer["choices"][0]["text"] and answer["speculative"]["algorithm"] == "NGRAM", answer
        assert answer["speculative"]["verify_steps"] > 0, answer
        chunks = stream_in_background(again.url)  # and it stops while an answer streams
    finally:
        code = again.stop()
    assert code == 0 and again.lines[-1].endswith("all services stopped")
    assert len(chunks) > 2  # it was streaming
    # every service ended as a stop ends it (0, or SIGTERM's), none killed for hanging or dead of a signal of its own
    assert not [line for line in again.lines if "stopped with exit code" in line or "did not stop within" in line]
    assert not any(alive(pid) for pid in again.service_pids()) and again.children() == []


def refused(up: Up, timeout: float) -> str:
    """Everything a launch said once it exited with code 2 (a usage error), stopped whatever the outcome."""
    try:
        assert up.process.wait(timeout=timeout) == 2, "\n".join(up.lines[-30:])
    finally:
        up.stop()
    up.reader.join(timeout=10)
    return "\n".join(up.lines)


def test_a_service_refused_at_start_stops_the_launch_with_its_reason():
    """A flag combination a service refuses (EAGLE3 with no draft path beside an explicit target) is not a crash to
    restart ten times: up stops at once with the service's reason and exit code 2, leaving nothing running."""
    from splitspec.demo import demo_model_dirs

    up = Up("--model-path", str(demo_model_dirs()["target"]), "--speculative-algorithm", "EAGLE3")
    said = refused(up, timeout=180)
    assert "refused to start" in said and "--speculative-draft-model-path" in said, said[-3000:]
    assert "restarting" not in said, said[-3000:]
    assert not [pid for pid in up.service_pids() if alive(pid)]


def test_a_launch_whose_ports_are_taken_stops_before_starting_anything():
    """A second `splitspec up` on the first one's ports (a verifier's gRPC port listening there) is refused at once
    with exit code 2, naming the port, before any service starts: none restarts against the other launch's."""
    import socket

    port = free_port_block(4)
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", port + 1))
        holder.listen()
        up = Up("--drafters", "1", port=port)
        said = refused(up, timeout=120)
    assert f"port {port + 1} (the verifier's gRPC) is in use" in said, said[-3000:]
    assert not up.service_pids(), said[-3000:]


def test_the_cpu_thread_plan_leaves_a_core_to_the_other_services():
    """On a CPU verifier with OMP_NUM_THREADS unset, `up` gives the verifier every core but one and the gateway and
    drafters one thread each; a GPU verifier, or a user's OMP_NUM_THREADS, gets no plan (on a GPU the model's own
    process takes one thread: the next test)."""
    from splitspec.launcher import _flag_value, _thread_env, _wide_forwards, cpu_thread_plan

    assert cpu_thread_plan("cpu", 2, {}) == {"verifier": 1, "other": 1, "wide": 2}
    assert cpu_thread_plan("cpu", 16, {"PATH": "/bin"}) == {"verifier": 15, "other": 1, "wide": 16}
    assert cpu_thread_plan("cpu", 1, {}) == {"verifier": 1, "other": 1, "wide": 1}
    two = cpu_thread_plan("cpu", 2, {})  # the verifier's forwards take both cores
    assert _wide_forwards(two, "verifier", ["verifier", "--port", "1"], []) == ["verifier", "--port", "1",
                                                                               "--cpu-wide-forward-threads", "2"]
    assert _wide_forwards(two, "gateway", ["gateway"], []) == ["gateway"]
    assert _wide_forwards(two, "verifier", ["verifier"], ["--cpu-wide-forward-threads", "1"]) == ["verifier"]
    assert _wide_forwards(cpu_thread_plan("cpu", 1, {}), "verifier", ["verifier"], []) == ["verifier"]
    assert _wide_forwards({}, "verifier", ["verifier"], []) == ["verifier"]
    assert cpu_thread_plan("cpu", 16, {"OMP_NUM_THREADS": "4"}) == {}
    assert cpu_thread_plan("cuda:1", 16, {}) == {}
    assert _thread_env(cpu_thread_plan("cpu", 8, {}), "verifier") == {"OMP_NUM_THREADS": "7"}
    assert _thread_env(cpu_thread_plan("cpu", 8, {}), "drafter-2") == {"OMP_NUM_THREADS": "1"}
    assert _thread_env({}, "verifier") is None
    assert _flag_value(["--dtype", "float32", "--device", "cpu"], "--device") == "cpu"
    assert _flag_value(["--device=cuda:0", "--max-total-tokens", "64"], "--device") == "cuda:0"
    assert _flag_value(["--devices", "x"], "--device") is None


def test_a_cpu_model_computes_wide_forwards_on_more_threads():
    """--cpu-wide-forward-threads (up sets it to the machine's cores): a CPU model's forward (WIDE_FORWARD_TOKENS, one
    token, or more) runs on that many torch threads, the rest on the process's count, restored after; a real
    ModelRunner's prompt chunk and decode step both see the wide count inside the model."""
    import torch

    from splitspec.demo import demo_model_dirs
    from splitspec.runtime.batch import SequenceInput
    from splitspec.runtime.host_threads import WIDE_FORWARD_TOKENS, wide_forwards
    from splitspec.runtime.kv_cache import BlockTable
    from splitspec.runtime.runner import ModelRunner, RuntimeConfig

    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        wide = wide_forwards(torch.device("cpu"), 2)
        seen = []
        for tokens in (WIDE_FORWARD_TOKENS + 63, WIDE_FORWARD_TOKENS, WIDE_FORWARD_TOKENS - 1):
            with wide.around(tokens):
                seen.append(torch.get_num_threads())
        assert seen == [2, 2, 1] and torch.get_num_threads() == 1
        assert wide_forwards(torch.device("cuda", 0), 2) is None and wide_forwards(torch.device("cpu"), 0) is None
        runner = ModelRunner.load(RuntimeConfig(model_path=str(demo_model_dirs()["target"]), dtype="float32", device="cpu",
                                                max_total_tokens=512, cpu_wide_forward_threads=2))
        inside, call = [], runner.model_call

        def counting(*args, **kwargs):
            inside.append(torch.get_num_threads())
            return call(*args, **kwargs)

        runner.model_call = counting
        for length in (72, 1):  # a prompt chunk, a decode step's one token
            table = BlockTable()
            runner.forward(runner.batch([SequenceInput(table, list(range(3, 3 + length)))]))
            runner.kv_cache.release(table)
        assert inside == [2, 2] and torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


def test_a_model_on_a_gpu_computes_on_one_host_thread_unless_the_user_chose():
    """ModelRunner.load's rule (runtime/host_threads.py): a CUDA model's process sets torch to one host thread,
    a CPU model's keeps its threads, and a user's OMP_NUM_THREADS is kept."""
    import torch

    from splitspec.runtime.host_threads import one_thread_for_gpu

    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        assert not one_thread_for_gpu(torch.device("cpu"), {}) and torch.get_num_threads() == 2
        assert not one_thread_for_gpu(torch.device("cuda", 0), {"OMP_NUM_THREADS": "2"}) and torch.get_num_threads() == 2
        assert one_thread_for_gpu(torch.device("cuda", 0), {}) and torch.get_num_threads() == 1
        assert not one_thread_for_gpu(torch.device("cuda"), {})  # already one
    finally:
        torch.set_num_threads(before)


def test_ngram_drafts_in_the_verifiers_process_unless_drafters_are_asked_for():
    """`up`'s default topology: NGRAM (no model to place) in the verifier's process, a model drafter in a process
    of its own on a CPU verifier and in the verifier's process on a GPU (it would share the GPU); --drafters
    overrides either."""
    from splitspec.launcher import Launcher, build_parser

    def services(*flags: str) -> list[str]:
        args, extra = build_parser().parse_known_args(list(flags))
        return [service.name for service in Launcher(args, extra).services]

    assert services() == ["verifier", "gateway"]  # the demo's default algorithm, NGRAM
    assert services("--speculative-algorithm", "ngram") == ["verifier", "gateway"]
    assert services("--speculative-algorithm", "NGRAM", "--drafters", "2") == ["verifier", "drafter-1", "drafter-2", "gateway"]
    assert services("--speculative-algorithm", "EAGLE3") == ["verifier", "drafter-1", "gateway"]
    assert services("--speculative-algorithm", "EAGLE3", "--drafters", "0") == ["verifier", "gateway"]
    assert services("--speculative-algorithm", "EAGLE3", "--device", "cpu") == ["verifier", "drafter-1", "gateway"]
    assert services("--speculative-algorithm", "EAGLE3", "--device", "cuda:0") == ["verifier", "gateway"]
    assert services("--speculative-algorithm", "EAGLE3", "--device=cuda") == ["verifier", "gateway"]
    assert services("--speculative-algorithm", "EAGLE3", "--device", "cuda", "--drafters", "1") == [
        "verifier", "drafter-1", "gateway"]

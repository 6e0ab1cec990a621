"""Soak: open-loop load on real `splitspec up` deployments for a chosen time, with drafters killed on a schedule.

    python benchmarks/soak.py --duration 600 --rate 2 --algorithms NGRAM,EAGLE3 --kill-every 30 --out soak.json

One `splitspec up` per algorithm runs (the demo target, --drafters drafter processes each); requests arrive as a
Poisson process at --rate per second (open loop: an arrival never waits for an earlier answer), each sent to a
random deployment with a random held-out prompt, max_tokens, greedy or seeded sampling, streamed or not. Every
--kill-every seconds one drafter of one deployment is killed with SIGKILL (its launcher restarts it).

Each request ends as exactly one of:
  completed     200 with finish_reason stop or length (a stream: its chunks, then [DONE])
  failed_clear  an OpenAI error object: 429 or 503 with a body, or a stream's terminal error event then [DONE]
  lost          anything else: a timeout, a broken connection, a 5xx other than 503, a malformed answer
Greedy and seeded requests repeat (prompt, max_tokens, temperature, seed) keys on purpose, across deployments
too: every completion of a key must have the same text (speculation is lossless, faults or not), and a key's
texts that differ are counted as mismatches. Memory (RSS) and open file descriptors of every service are
sampled through the run; the report gives them at warm-up (after the first --warmup seconds), at the end of the
load and after it drains, and the KV pages the verifiers still hold once the load is gone.

Latency is reported overall and for requests that arrived within --fault-window seconds after a kill (what a
fault costs while it lasts). Exit status: 0 when nothing was lost and nothing mismatched, else 1.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import shlex
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

from splitspec import lifeline

ROLES = (("gateway", " gateway "), ("verifier", " verifier "), ("drafter", " drafter "))


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--duration", type=float, default=180.0, help="Seconds of load.")
    parser.add_argument("--rate", type=float, default=1.5, help="Mean arrivals per second (Poisson), all deployments.")
    parser.add_argument("--algorithms", default="NGRAM,EAGLE3", help="One `splitspec up` per algorithm, side by side.")
    parser.add_argument("--drafters", type=int, default=2, help="Drafter processes per deployment.")
    parser.add_argument("--kill-every", type=float, default=30.0, help="Seconds between drafter kills (0: none).")
    parser.add_argument("--fault-window", type=float, default=10.0, help="Seconds after a kill counted as its window.")
    parser.add_argument("--warmup", type=float, default=20.0, help="Seconds of load before the warm resource sample.")
    parser.add_argument("--max-tokens", default="8,32,64,128", help="max_tokens values drawn from.")
    parser.add_argument("--prompts", type=int, default=24, help="Distinct prompts (fewer: more repeated keys).")
    parser.add_argument("--timeout", type=float, default=180.0, help="Seconds a request may take before it counts lost.")
    parser.add_argument("--seed", type=int, default=0, help="Seed of arrivals, prompts and faults.")
    parser.add_argument("--up-args", default="", help="More `splitspec up` flags for every deployment, one string "
                        "(e.g. '--async-scheduling --speculative-adaptive on': a CPU verifier then schedules as a GPU one does).")
    parser.add_argument("--out", default=None, help="Write the JSON report here as well as to stdout.")
    return parser.parse_args(argv)


def prompt_pool(count: int, seed: int) -> list[str]:
    """Held-out standard-library code (the demo models never trained on it), cut at 200..1200 characters."""
    from splitspec.train import corpus

    rng = random.Random(seed)
    texts = [t for t in corpus.read_texts([f for f in corpus.select_files() if f.held_out], held_out=True) if len(t) > 1300]
    rng.shuffle(texts)
    return [t[: rng.randrange(200, 1200)] for t in texts[:count]]


def free_port_block(count: int) -> int:
    rng = random.Random()
    for _ in range(200):
        base = rng.randrange(20000, 32000)
        socks = []
        try:
            for port in range(base, base + count):
                s = socket.socket()
                s.bind(("127.0.0.1", port))
                socks.append(s)
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError("no free block of ports")


class Deployment:
    """One `splitspec up` (gateway, verifier, drafters), its log kept in memory."""

    def __init__(self, algorithm: str, drafters: int, up_args: list[str] = ()):
        self.algorithm = algorithm
        self.port = free_port_block(4)
        self.url = f"http://127.0.0.1:{self.port}"
        self.metrics_url = f"http://127.0.0.1:{self.port + 2}/metrics"
        self.process = lifeline.spawn(
            [sys.executable, "-P", "-m", "splitspec", "up", "--port", str(self.port), "--drafters", str(drafters),
             "--speculative-algorithm", algorithm, "--log-level", "warning", "--max-restarts", "3",
             "--max-total-tokens", "65536", *up_args],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1, start_new_session=True)
        self.lines: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self):
        for line in self.process.stdout:
            self.lines.append(line.rstrip("\n"))

    async def ready(self, timeout: float = 600) -> None:
        deadline = time.time() + timeout
        async with httpx.AsyncClient(timeout=5) as http:
            while time.time() < deadline:
                if self.process.poll() is not None:
                    raise RuntimeError(f"splitspec up ({self.algorithm}) exited:\n" + "\n".join(self.lines[-30:]))
                try:
                    if (await http.get(self.url + "/health")).status_code == 200:
                        return
                except httpx.HTTPError:
                    pass
                await asyncio.sleep(0.5)
        raise RuntimeError(f"splitspec up ({self.algorithm}) did not serve in {timeout} s")

    def services(self) -> dict[str, list[int]]:
        """role -> pids of the launcher's children."""
        found = {role: [] for role, _ in ROLES}
        for pid in _children(self.process.pid):
            try:
                cmdline = " " + Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode() + " "
            except OSError:
                continue
            for role, marker in ROLES:
                if marker in cmdline:
                    found[role].append(pid)
        return found

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGINT)
            try:
                self.process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)


def _children(pid: int) -> list[int]:
    out = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            out += [int(c) for c in (task / "children").read_text().split()]
        except OSError:
            pass
    return out


def _process_sample(pid: int) -> tuple[int, int] | None:
    """(RSS bytes, open fds) of a process, or None when it is gone."""
    try:
        rss = next(int(line.split()[1]) * 1024 for line in Path(f"/proc/{pid}/status").read_text().splitlines()
                   if line.startswith("VmRSS:"))
        return rss, len(os.listdir(f"/proc/{pid}/fd"))
    except (OSError, StopIteration):
        return None


def resources(deployments: list[Deployment]) -> dict:
    """Per deployment and role: summed RSS (MB) and open fds of its live processes, and their count."""
    sample = {}
    for d in deployments:
        for role, pids in d.services().items():
            values = [v for v in map(_process_sample, pids) if v is not None]
            sample[f"{d.algorithm}/{role}"] = {"rss_mb": round(sum(v[0] for v in values) / 2**20, 1),
                                               "fds": sum(v[1] for v in values), "processes": len(values)}
    return sample


def verifier_metrics(deployment: Deployment, names: tuple[str, ...]) -> dict[str, float]:
    """The verifier's metrics of these names (without splitspec:), each summed over its labels."""
    text = httpx.get(deployment.metrics_url, timeout=10).text
    values = dict.fromkeys(names, 0.0)
    for line in text.splitlines():
        match = re.match(r"splitspec:(\w+)(?:\{[^}]*\})? (\S+)", line)
        if match and match.group(1) in values:
            values[match.group(1)] += float(match.group(2))
    return values


def held_kv_pages(deployment: Deployment) -> float:
    """KV pages the verifier holds for requests (its prefix cache's pages left out)."""
    values = verifier_metrics(deployment, ("kv_pages_used", "prefix_cache_pages"))
    return values["kv_pages_used"] - values["prefix_cache_pages"]


# what the verifier speculated through the run: verify steps with drafts, draft tokens proposed and accepted,
# unusable drafts (a killed drafter's), the load-adaptive policy's budget changes and probes, and the steps the
# overlap schedule launched before the last one landed
SPECULATION = {"verify_steps_with_drafts": "spec_decode_num_drafts_total", "draft_tokens": "spec_decode_num_draft_tokens_total",
               "accepted_tokens": "spec_decode_num_accepted_tokens_total", "fallbacks": "spec_decode_fallbacks_total",
               "adaptive_switches": "spec_adaptive_switches_total", "adaptive_probes": "spec_adaptive_probes_total",
               "overlapped_steps": "overlap_deferred_steps_total"}


def speculation(deployment: Deployment) -> dict[str, int]:
    values = verifier_metrics(deployment, tuple(SPECULATION.values()))
    return {key: int(values[name]) for key, name in SPECULATION.items()}


async def one_request(http: httpx.AsyncClient, deployment: Deployment, body: dict, timeout: float) -> dict:
    """Send one request; classify how it ended."""
    start = time.time()
    result = {"algorithm": deployment.algorithm, "stream": body["stream"], "arrival": start}
    try:
        async with asyncio.timeout(timeout):
            if body["stream"]:
                texts, finish, error, done = [], None, None, False
                async with http.stream("POST", deployment.url + "/v1/completions", json=body) as response:
                    if response.status_code != 200:
                        await response.aread()
                        return {**result, **_failed_or_lost(response), "latency": time.time() - start}
                    async for line in response.aiter_lines():
                        if not line:
                            continue
                        if line == "data: [DONE]":
                            done = True
                            continue
                        event = json.loads(line.removeprefix("data: "))
                        if "error" in event:
                            error = event["error"]
                            continue
                        for choice in event.get("choices", []):
                            texts.append(choice.get("text") or "")
                            finish = choice.get("finish_reason") or finish
                latency = time.time() - start
                if error is not None and done:
                    return {**result, "outcome": "failed_clear", "reason": f"stream error: {error.get('code')}",
                            "latency": latency}
                if done and finish in ("stop", "length"):
                    return {**result, "outcome": "completed", "text": "".join(texts), "latency": latency}
                return {**result, "outcome": "lost", "reason": f"stream ended without a finish ({finish}, done={done})",
                        "latency": latency}
            response = await http.post(deployment.url + "/v1/completions", json=body)
            latency = time.time() - start
            if response.status_code != 200:
                return {**result, **_failed_or_lost(response), "latency": latency}
            choice = response.json()["choices"][0]
            if choice.get("finish_reason") in ("stop", "length"):
                return {**result, "outcome": "completed", "text": choice["text"], "latency": latency}
            return {**result, "outcome": "lost", "reason": f"finish_reason {choice.get('finish_reason')}", "latency": latency}
    except (httpx.HTTPError, TimeoutError, json.JSONDecodeError, KeyError, IndexError) as exc:
        return {**result, "outcome": "lost", "reason": f"{type(exc).__name__}: {exc}"[:200], "latency": time.time() - start}


def _failed_or_lost(response: httpx.Response) -> dict:
    try:
        error = response.json().get("error") or {}
    except (json.JSONDecodeError, AttributeError):
        error = {}
    if response.status_code in (429, 503) and error.get("message"):
        return {"outcome": "failed_clear", "reason": f"{response.status_code} {error.get('code')}"}
    return {"outcome": "lost", "reason": f"HTTP {response.status_code}: {response.text[:200]}"}


def percentiles(values: list[float]) -> dict | None:
    if not values:
        return None
    ordered = sorted(values)
    pick = lambda q: ordered[min(len(ordered) - 1, int(q * len(ordered)))]  # noqa: E731
    return {"count": len(ordered), "mean": round(statistics.fmean(ordered), 3), "p50": round(pick(0.5), 3),
            "p90": round(pick(0.9), 3), "p99": round(pick(0.99), 3)}


async def soak(args: argparse.Namespace) -> dict:
    rng = random.Random(args.seed)
    prompts = prompt_pool(args.prompts, args.seed)
    max_tokens = [int(m) for m in args.max_tokens.split(",")]
    deployments = [Deployment(a.strip(), args.drafters, shlex.split(args.up_args)) for a in args.algorithms.split(",") if a.strip()]
    try:
        await asyncio.gather(*(d.ready() for d in deployments))
        for d in deployments:
            d.model = httpx.get(d.url + "/v1/models", timeout=10).json()["data"][0]["id"]
        print(f"soak: {len(deployments)} deployment(s) serving: "
              + ", ".join(f"{d.algorithm} at {d.url}" for d in deployments), file=sys.stderr)
        results, kills, samples, tasks = [], [], [], []
        warm = None
        start = time.time()
        async with httpx.AsyncClient(timeout=httpx.Timeout(args.timeout), limits=httpx.Limits(max_connections=None)) as http:
            next_arrival, next_kill, next_sample = start, start + (args.kill_every or float("inf")), start
            while time.time() - start < args.duration:
                now = time.time()
                if now >= next_sample:
                    samples.append({"t": round(now - start, 1), **resources(deployments)})
                    next_sample += 5.0
                    if warm is None and now - start >= args.warmup:
                        warm = samples[-1]
                if now >= next_kill:
                    target = rng.choice(deployments)
                    drafters = target.services()["drafter"]
                    if drafters:
                        pid = rng.choice(drafters)
                        os.kill(pid, signal.SIGKILL)
                        kills.append({"t": round(now - start, 1), "algorithm": target.algorithm, "pid": pid})
                    next_kill += args.kill_every
                if now >= next_arrival:
                    greedy = rng.random() < 0.6
                    d = rng.choice(deployments)
                    body = {"model": d.model, "prompt": rng.choice(prompts), "max_tokens": rng.choice(max_tokens),
                            "temperature": 0.0 if greedy else 0.8, "seed": None if greedy else rng.randrange(4),
                            "stream": rng.random() < 0.5}
                    if body["seed"] is None:
                        del body["seed"]
                    task = asyncio.ensure_future(one_request(http, d, body, args.timeout))
                    task.key = json.dumps({k: body.get(k) for k in ("prompt", "max_tokens", "temperature", "seed")})
                    tasks.append(task)
                    next_arrival += rng.expovariate(args.rate)
                await asyncio.sleep(max(0.0, min(next_arrival, next_kill, next_sample) - time.time()))
            load_end = time.time()
            loaded = resources(deployments)
            for task in tasks:
                result = await task
                result["key"] = task.key
                results.append(result)
        drained_at = time.time()
        deadline = time.time() + 30
        held = {d.algorithm: held_kv_pages(d) for d in deployments}
        while any(held.values()) and time.time() < deadline:
            await asyncio.sleep(0.5)
            held = {d.algorithm: held_kv_pages(d) for d in deployments}
        await asyncio.sleep(2.0)
        drained = resources(deployments)
        speculated = {d.algorithm: speculation(d) for d in deployments}
        restarted = {d.algorithm: sum("restarting it" in line for line in d.lines) for d in deployments}
        alive = {d.algorithm: len(d.services()["drafter"]) for d in deployments}
    finally:
        for d in deployments:
            d.stop()
    report = _report(args, results, kills, start, load_end, drained_at, held, restarted, alive,
                     {"warm": warm, "end_of_load": loaded, "drained": drained, "series": samples})
    return {**report, "speculation": speculated}

def _report(args: argparse.Namespace, results: list[dict], kills: list[dict], start: float, load_end: float,
            drained_at: float, held: dict, restarted: dict, alive: dict, resources_seen: dict) -> dict:
    """The soak's JSON: outcomes and their reasons, texts that changed between repeats, latency in and out of
    the fault windows, the faults, the services' resources and the KV pages held after the drain."""
    texts: dict[str, set] = {}
    for r in results:
        if r["outcome"] == "completed":
            texts.setdefault(r["key"], set()).add(r["text"])
    repeated = {k: v for k, v in texts.items() if sum(1 for r in results if r.get("key") == k and r["outcome"] == "completed") > 1}
    mismatched = [json.loads(k) for k, v in texts.items() if len(v) > 1]

    def in_fault_window(r):
        return any(0 <= r["arrival"] - start - k["t"] <= args.fault_window for k in kills)

    outcomes = {o: sum(1 for r in results if r["outcome"] == o) for o in ("completed", "failed_clear", "lost")}
    reasons: dict[str, int] = {}
    for r in results:
        if r["outcome"] != "completed":
            reasons[f"{r['outcome']}: {r['reason']}"] = reasons.get(f"{r['outcome']}: {r['reason']}", 0) + 1
    completed = [r for r in results if r["outcome"] == "completed"]
    return {
        "benchmark": "soak: open-loop load on `splitspec up` deployments with drafters killed on a schedule",
        "command": shlex.join(["python", "benchmarks/soak.py", *sys.argv[1:]]),
        "settings": {k: getattr(args, k) for k in ("duration", "rate", "algorithms", "drafters", "kill_every",
                                                  "fault_window", "warmup", "max_tokens", "prompts", "timeout", "seed", "up_args")},
        "sent": len(results), **outcomes, "reasons": reasons,
        "peak_in_flight": _peak_in_flight(results),
        "repeated_keys": len(repeated), "mismatched_keys": len(mismatched), "mismatches": mismatched[:5],
        "faults": {"drafter_kills": len(kills), "kills": kills, "launcher_restart_lines": restarted,
                   "drafters_alive_at_end": alive},
        "latency_s": {"all": percentiles([r["latency"] for r in completed]),
                      "in_fault_windows": percentiles([r["latency"] for r in completed if in_fault_window(r)]),
                      "outside_fault_windows": percentiles([r["latency"] for r in completed if not in_fault_window(r)])},
        "output_tokens_per_s_note": "not measured: the soak counts outcomes, not throughput",
        "resources": resources_seen,
        "kv_pages_held_after_drain": held,
        "seconds": {"load": round(load_end - start, 1), "drain": round(drained_at - load_end, 1)},
    }


def _peak_in_flight(results: list[dict]) -> int:
    events = sorted([(r["arrival"], 1) for r in results] + [(r["arrival"] + r["latency"], -1) for r in results])
    peak = level = 0
    for _, step in events:
        level += step
        peak = max(peak, level)
    return peak


def main(argv=None) -> int:
    args = parse_args(argv)
    report = asyncio.run(soak(args))
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    print(f"soak: sent {report['sent']}, completed {report['completed']}, failed with a clear error "
          f"{report['failed_clear']}, lost {report['lost']}, mismatched keys {report['mismatched_keys']} of "
          f"{report['repeated_keys']} repeated; {report['faults']['drafter_kills']} drafter kills; accepted draft tokens "
          + ", ".join(f"{a} {s['accepted_tokens']} of {s['draft_tokens']}" for a, s in report["speculation"].items()),
          file=sys.stderr)
    return 0 if report["lost"] == 0 and report["mismatched_keys"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())

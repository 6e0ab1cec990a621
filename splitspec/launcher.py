"""`splitspec up`: the whole topology as local processes, the way docker compose runs it: a verifier, N
drafters and the gateway, each exec'd as `splitspec <service> ...`.

- With no `--model-path` it serves the demo models and maps the algorithm to its demo draft
  (STANDALONE: the demo draft LLM; EAGLE / EAGLE3: the demo heads; NGRAM needs none).
- Flags it does not know go to the verifier (SGLang's server flags); the `--speculative-*` flags,
  the model and the dtype/device go to the drafters too.
- It waits until the gateway answers /health (the verifier serving behind it), then prints the URL
  and examples to paste; every service's log lines are prefixed with its name.
- `--zmq-curve-keys DIR` turns CURVE on for the step channel, with certificates made in DIR if missing.
- A service that exits is reported and restarted (compose's `restart: unless-stopped`), with a short
  back-off; Ctrl-C (SIGINT) or SIGTERM stops them all, gateway and drafters first. However the launcher
  ends (SIGKILL, an OOM kill, a closed terminal), its services end with it (splitspec.lifeline).
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from splitspec.lifeline import spawn

PASS_THROUGH = True  # cli.main hands unknown flags over as args.passthrough
DEMO_DRAFT = {"STANDALONE": "draft", "EAGLE": "eagle", "EAGLE3": "eagle3"}
# The demo algorithm that decodes fastest here, from benchmarks/results/algorithms_cpu.json (split, batch 1:
# NGRAM 1.62x plain; STANDALONE, EAGLE, EAGLE3 0.60-0.63x on two CPU cores).
DEFAULT_ALGORITHM = "NGRAM"
DEMO_NAME = "splitspec-demo"  # the served model name of the demo target
DEMO_MAX_TOTAL_TOKENS = "32768"  # KV tokens for the demo target when none are given (8 KiB each in fp32)
MODEL_FLAGS = ("--dtype", "--device", "--revision", "--load-format")
PREFIX_WIDTH = 10


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="splitspec up",
        description="Start the gateway, the verifier and --drafters drafters as local processes (the compose "
        "topology), wait until they serve, and keep them running. Unknown flags (SGLang's server flags) go to "
        "the verifier; --speculative-* flags and the model go to the drafters too. On a CPU verifier, with "
        "OMP_NUM_THREADS unset, the verifier gets every core but one as torch threads and the gateway and drafters "
        "one each.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--host", default="127.0.0.1", help="Address the gateway listens on (0.0.0.0: every interface).")
    parser.add_argument("--port", type=int, default=30000,
                        help="Gateway HTTP port; the verifier takes port+1 (gRPC), port+2 (metrics), port+3 (drafters).")
    parser.add_argument("--drafters", type=int, default=None,
                        help="Drafter processes (0: the verifier drafts in its own process). Default: 0 for NGRAM (no "
                        "model to place on a GPU; its trie costs microseconds per request in the verifier's process, "
                        "where a drafter process would add a round trip to every step), and for the model drafters on a GPU verifier "
                        "(a drafter process would share its GPU; docs/performance.md); 1 for the model drafters on a CPU "
                        "verifier (a core of its own). Drafters on GPUs of their own: docs/deploy.md.")
    parser.add_argument("--model-path", "--model", dest="model_path", default=None,
                        help="Target model directory or hub id (default: the demo target, with its demo drafts).")
    parser.add_argument("--speculative-algorithm", default=None,
                        help=f"NGRAM, STANDALONE, EAGLE, EAGLE3, NEXTN, or none (default: {DEFAULT_ALGORITHM} on the demo "
                        "models, where it is the fastest; off for another model unless given).")
    parser.add_argument("--speculative-draft-model-path", default=None,
                        help="Draft model or head (default with the demo target: the algorithm's demo draft).")
    parser.add_argument("--served-model-name", default=None, help="The model name clients use.")
    parser.add_argument("--api-key", default=None, help="Passed to the gateway: required as 'Authorization: Bearer KEY'.")
    parser.add_argument("--tokenizer-worker-num", "--api-server-count", type=int, default=1,
                        help="Gateway processes on the port (passed to the gateway: SGLang's flag, vLLM's "
                        "--api-server-count); more than one when a single gateway process is the queue under bursts "
                        "of requests (docs/deploy.md).")
    parser.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"),
                        help="Log level of every service.")
    parser.add_argument("--log-requests", action="store_true",
                        help="Passed to the gateway: a log line for each request answered (SGLang's flag).")
    parser.add_argument("--log-requests-level", type=int, default=None, choices=(0, 1, 2, 3),
                        help="Passed to the gateway: what --log-requests logs (0 the outcome ... 3 the whole texts; the "
                        "gateway's default 2).")
    parser.add_argument("--health-timeout", type=float, default=600.0,
                        help="Seconds to wait for the services to serve before giving up.")
    parser.add_argument("--max-restarts", type=int, default=10,
                        help="Restarts of one service in a row, each within 30 s of its start (a crash loop), before the "
                        "launcher gives up on it; a service that ran longer starts its count again.")
    parser.add_argument("--zmq-curve-keys", default=None, metavar="DIR",
                        help="Encrypt and authenticate the verifier-drafter step channel with ZeroMQ CURVE, with the "
                        "certificates in DIR (made there if missing, as `splitspec zmq-keys` makes them: "
                        "verifier.key[_secret], and drafters/drafter.key[_secret] shared by the drafters); "
                        "nothing to do without drafter processes.")
    parser.add_argument("--prometheus-config", default=None, metavar="FILE",
                        help="Write a Prometheus configuration that scrapes this launch (the gateway, the verifier, and "
                        "every drafter through the verifier's service discovery) to FILE; run "
                        "`prometheus --config.file=FILE`. deploy/compose/prometheus.yml is the same for compose.")
    return parser


@dataclass
class Service:
    name: str
    argv: list[str]
    process: subprocess.Popen | None = None
    restarts: int = 0
    started: float = 0.0
    last_error: str = ""  # its latest output line that names an error, repeated when it exits
    pump: threading.Thread | None = None  # copies its output to ours
    env: dict[str, str] | None = None  # added to ours (the CPU thread plan)


class Launcher:
    def __init__(self, args: argparse.Namespace, extra: list[str]):
        self.args = args
        self.lock = threading.Lock()
        self.stopping = False
        self.services = self._plan(args, extra)

    def _plan(self, args, extra: list[str]) -> list[Service]:
        from splitspec.demo import demo_model_dirs

        if args.tokenizer_worker_num < 1:
            raise SystemExit(f"splitspec up: error: --tokenizer-worker-num must be >= 1, not {args.tokenizer_worker_num}")
        algorithm = args.speculative_algorithm
        if algorithm is not None and algorithm.lower() == "none":
            algorithm = None
        elif algorithm is None and args.model_path is None:
            algorithm = DEFAULT_ALGORITHM
        model, draft = args.model_path, args.speculative_draft_model_path
        served = args.served_model_name
        if model is None:
            dirs = demo_model_dirs(heads=algorithm in ("EAGLE", "EAGLE3"))
            model = str(dirs["target"])
            if draft is None and algorithm in DEMO_DRAFT:
                draft = str(dirs[DEMO_DRAFT[algorithm]])
            served = served or DEMO_NAME
            if not any(f.split("=", 1)[0] == "--max-total-tokens" for f in extra):
                extra = [*extra, "--max-total-tokens", DEMO_MAX_TOTAL_TOKENS]
        self.url = f"http://{'127.0.0.1' if args.host in ('0.0.0.0', '::') else args.host}:{args.port}"
        self.model_name = served or model
        drafters = default_drafters(algorithm, _flag_value(extra, "--device")) if args.drafters is None else args.drafters
        if args.zmq_curve_keys and algorithm and drafters > 0:
            try:
                make_curve_keys(args.zmq_curve_keys)
            except (ValueError, OSError) as exc:
                raise SystemExit(f"splitspec up: error: --zmq-curve-keys {args.zmq_curve_keys}: {exc}") from None
        self.ports = [(args.host, args.port, "the gateway"), ("127.0.0.1", args.port + 1, "the verifier's gRPC"),
                      ("127.0.0.1", args.port + 2, "the verifier's metrics")]
        if algorithm and drafters > 0:
            self.ports.append(("127.0.0.1", args.port + 3, "the drafters' endpoint"))
        commands = service_commands(model, draft, algorithm, served, extra, drafters, args.port, args.host,
                                    args.log_level, args.api_key, curve_keys=args.zmq_curve_keys,
                                    gateway_workers=args.tokenizer_worker_num,
                                    gateway_flags=gateway_log_flags(args))
        python = [sys.executable, "-m", "splitspec"]
        if args.prometheus_config:
            with open(args.prometheus_config, "w") as f:
                f.write(prometheus_config("local", args.port, self.url.split("//", 1)[1].rsplit(":", 1)[0]))
        plan = cpu_thread_plan(_flag_value(extra, "--device"), os.cpu_count() or 1, os.environ)
        if plan:
            self.say(f"the verifier computes on the CPU: {plan['verifier']} torch thread(s) ({plan['wide']} for prompt "
                     "chunks), one core left to the gateway and the drafters (one thread each); set OMP_NUM_THREADS to choose")
        return [Service(name, python + _wide_forwards(plan, name, argv[1:], extra), env=_thread_env(plan, name))
                for name, argv in commands]

    # processes ---------------------------------------------------------------------------------------
    def start(self, service: Service) -> None:
        service.process = spawn(service.argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1,
                                errors="replace", start_new_session=True,
                                env={**os.environ, **service.env} if service.env else None)
        service.started = time.monotonic()
        service.pump = threading.Thread(target=self._pump, args=(service, service.process), daemon=True)
        service.pump.start()
        self.say(f"started {service.name} (pid {service.process.pid})")

    def _pump(self, service: Service, process: subprocess.Popen) -> None:
        prefix = f"{service.name:<{PREFIX_WIDTH}}| "
        for line in process.stdout:
            if "error" in line.lower():
                service.last_error = line.strip()
            with self.lock:
                sys.stdout.write(prefix + line if line.endswith("\n") else prefix + line + "\n")
                sys.stdout.flush()

    def say(self, message: str) -> None:
        with self.lock:
            sys.stdout.write(f"{'up':<{PREFIX_WIDTH}}| {message}\n")
            sys.stdout.flush()

    def healthy(self) -> bool:
        try:
            with urllib.request.urlopen(self.url + "/health", timeout=2) as response:
                return response.status == 200
        except OSError:
            return False

    def run(self) -> int:
        busy = [(host, port, what) for host, port, what in self.ports if port_in_use(host, port)]
        if busy:  # another launch holds them: its services would answer, and ours restart against them forever
            host, port, what = busy[0]
            self.say(f"port {port} ({what}) is in use on {host}: another `splitspec up`? Give --port another block of "
                     f"four (this launch uses {self.args.port}-{self.args.port + 3}); stopping")
            return USAGE_ERROR
        for service in self.services:
            self.start(service)
        deadline = time.monotonic() + self.args.health_timeout
        while not self.healthy():
            if self.stopping:
                return self.stop_all()
            refused = next((s for s in self.services if s.restarts == 0 and s.process.poll() == USAGE_ERROR), None)
            if refused is not None:  # its flags or files are wrong: starting it again cannot help
                refused.pump.join(timeout=5)  # its last lines (the error) read
                self.say(f"{refused.name} refused to start (exit code {USAGE_ERROR}"
                         + (f": {refused.last_error}" if refused.last_error else "") + "); stopping")
                self.stop_all()
                return USAGE_ERROR
            if self.supervise() is False:
                self.stop_all()
                return 1
            if time.monotonic() > deadline:
                self.say(f"the services did not serve within {self.args.health_timeout:.0f} s; stopping")
                self.stop_all()
                return 1
            time.sleep(0.5)
        self.say(self.ready_message())
        while not self.stopping:
            if self.supervise() is False:
                self.stop_all()
                return 1
            time.sleep(0.25)
        return self.stop_all()

    def supervise(self) -> bool:
        """Restart services that exited; False once one has exceeded --max-restarts."""
        for service in self.services:
            code = service.process.poll()
            if code is None or self.stopping:
                continue
            lived = time.monotonic() - service.started
            if lived > 30:  # it served a while: not a crash loop, so its count starts again
                service.restarts = 0
            service.restarts += 1
            why = f" ({service.last_error})" if service.last_error else ""
            service.last_error = ""
            if service.restarts > self.args.max_restarts:
                self.say(f"{service.name} exited with code {code}{why}; it was restarted {self.args.max_restarts} times in a "
                         "row, each within 30 s of its start, giving up")
                return False
            delay = 0.0 if lived > 30 else min(0.5 * 2 ** (service.restarts - 1), 10.0)
            self.say(f"{service.name} exited with code {code} after {lived:.1f} s{why}; restarting it"
                     + (f" in {delay:.1f} s" if delay else "") + f" (restart {service.restarts})")
            time.sleep(delay)
            self.start(service)
        return True

    def stop_all(self) -> int:
        self.stopping = True
        self.say("stopping")
        for group in (["gateway"], [s.name for s in self.services if s.name.startswith("drafter")], ["verifier"]):
            chosen = [s for s in self.services if s.name in group and s.process is not None and s.process.poll() is None]
            for service in chosen:
                service.process.terminate()
            for service in chosen:
                try:
                    service.process.wait(timeout=15)
                except subprocess.TimeoutExpired:
                    self.say(f"{service.name} did not stop within 15 s of SIGTERM; killing it")
                    service.process.kill()
                    service.process.wait()
                    continue
                code = service.process.returncode
                if code not in (0, -signal.SIGTERM, 128 + signal.SIGTERM):  # what a clean stop ends with
                    self.say(f"{service.name} stopped with exit code {code}"
                             + (f" ({signal.Signals(-code).name})" if code < 0 else ""))
        self.say("all services stopped")
        return 0

    def ready_message(self) -> str:
        drafters = sum(s.name.startswith("drafter") for s in self.services)
        key = f" -H 'Authorization: Bearer {self.args.api_key}'" if self.args.api_key else ""
        return (f"serving {self.model_name} at {self.url}/v1 ({drafters} drafter process(es))\n"
                f"  curl {self.url}/v1/chat/completions -H 'Content-Type: application/json'{key} \\\n"
                f"    -d '{{\"model\": \"{self.model_name}\", \"messages\": [{{\"role\": \"user\", \"content\": "
                f"\"def fibonacci(n):\"}}], \"max_tokens\": 64, \"temperature\": 0}}'\n"
                f"  python -c \"from openai import OpenAI; c = OpenAI(base_url='{self.url}/v1', "
                f"api_key='{self.args.api_key or 'none'}'); print(c.completions.create(model='{self.model_name}', "
                f"prompt='def fibonacci(n):', max_tokens=64, temperature=0).choices[0].text)\"\n"
                f"  metrics: {self.url}/metrics (gateway), http://127.0.0.1:{self.args.port + 2}/metrics (verifier), "
                f"drafters listed at http://127.0.0.1:{self.args.port + 2}/sd/drafters"
                + (f"; prometheus --config.file={self.args.prometheus_config}" if self.args.prometheus_config else "")
                + "\n  Ctrl-C stops everything")


USAGE_ERROR = 2  # a service's exit code for flags, files or ports it cannot use (argparse's too)


def curve_flags(keys_dir: str) -> tuple[list[str], list[str]]:
    """(verifier flags, drafter flags) for CURVE with the certificates of `up --zmq-curve-keys DIR`."""
    root = Path(keys_dir)
    return (["--zmq-curve-secret-key", str(root / "verifier.key_secret"), "--zmq-curve-authorized-keys", str(root / "drafters")],
            ["--zmq-curve-server-key", str(root / "verifier.key"),
             "--zmq-curve-secret-key", str(root / "drafters" / "drafter.key_secret")])


def make_curve_keys(keys_dir: str) -> None:
    """The certificates curve_flags names, each pair made unless one of its files exists."""
    from splitspec.runtime.curve import write_certificates

    root = Path(keys_dir)
    for directory, name in ((root, "verifier"), (root / "drafters", "drafter")):
        if not any((directory / f"{name}{suffix}").exists() for suffix in (".key", ".key_secret")):
            write_certificates(directory, name)


def cpu_thread_plan(device: str | None, cpus: int, environ) -> dict[str, int]:
    """Torch threads per service when the verifier computes on this machine's CPU and the user has not set
    OMP_NUM_THREADS: the verifier takes every core but one, the gateway and each drafter one thread (as vLLM's
    CPU backend keeps a core for its API server), and the verifier's forwards every core ("wide": its
    --cpu-wide-forward-threads). torch's default, a thread per core in every process,
    oversubscribes the cores: on 2 cores the served demo target ran at 0.40-0.61 of in process, 0.86-1.0 with
    this plan. Empty (nothing set) on a GPU or when OMP_NUM_THREADS is set. device: the --device flag (None or
    auto: CPU when this machine shows no NVIDIA device)."""
    if environ.get("OMP_NUM_THREADS"):
        return {}
    if device in (None, "auto"):
        import glob

        on_cpu = not glob.glob("/dev/nvidia[0-9]*")
    else:
        on_cpu = device == "cpu"
    return {"verifier": max(1, cpus - 1), "other": 1, "wide": cpus} if on_cpu else {}


def _thread_env(plan: dict[str, int], service: str) -> dict[str, str] | None:
    if not plan:
        return None
    return {"OMP_NUM_THREADS": str(plan["verifier"] if service == "verifier" else plan["other"])}


def _wide_forwards(plan: dict[str, int], service: str, argv: list[str], extra: list[str]) -> list[str]:
    """The verifier's argv with --cpu-wide-forward-threads from the plan (unless the user gave it, or it adds nothing)."""
    if service != "verifier" or not plan or plan["wide"] <= plan["verifier"] \
            or _flag_value(extra, "--cpu-wide-forward-threads") is not None:
        return argv
    return [*argv, "--cpu-wide-forward-threads", str(plan["wide"])]


def _flag_value(flags: list[str], name: str) -> str | None:
    """The value of --name in a pass-through argv (`--name v` or `--name=v`; the last one wins)."""
    value = None
    for i, flag in enumerate(flags):
        if flag == name and i + 1 < len(flags):
            value = flags[i + 1]
        elif flag.startswith(name + "="):
            value = flag.split("=", 1)[1]
    return value


def port_in_use(host: str, port: int) -> bool:
    """Whether a server could not bind host:port: a socket listens there (SO_REUSEADDR, as the services bind: a
    recent connection's TIME_WAIT is no obstacle). A gRPC server's SO_REUSEPORT would share a port with another
    one silently, so the launcher asks before its services start."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError:
            return True
    return False


def default_drafters(algorithm: str | None, device: str | None = None) -> int:
    """`up`'s drafter processes when --drafters is not given: NGRAM drafts in the verifier's process; a model
    drafter too when the verifier runs on a GPU (`up`'s processes share its device, and a drafter process on the
    verifier's GPU only adds a round trip to every step: an 8B-shaped target with an EAGLE-3 head served 0.53-0.74x
    of the in-process speed from a drafter process against 0.82-1.11x drafted in the verifier's, H200, 0712a25),
    else (a CPU verifier) in one process of its own, on a core of its own."""
    from splitspec.model_flags import on_gpu

    if algorithm is None or algorithm.upper() == "NGRAM":
        return 0
    return 0 if on_gpu(device) else 1


def gateway_log_flags(args: argparse.Namespace) -> list[str]:
    """--log-requests and --log-requests-level as `up` passes them to the gateway."""
    flags = ["--log-requests"] if args.log_requests else []
    return flags + (["--log-requests-level", str(args.log_requests_level)] if args.log_requests_level is not None else [])


def service_commands(model: str, draft: str | None, algorithm: str | None, served: str | None, extra: list[str],
                     drafters: int, port: int, host: str, log_level: str, api_key: str | None = None,
                     topology: str = "local", curve_keys: str | None = None,
                     gateway_workers: int = 1, gateway_flags: list[str] = ()) -> list[tuple[str, list[str]]]:
    """(service name, `splitspec ...` argv) of every service. topology "local": processes on this machine
    (verifier on 127.0.0.1, drafters named drafter-i); "compose": containers (every service binds
    0.0.0.0 and finds the verifier by its service name; one drafter service, scaled, names its replicas
    by hostname). curve_keys: a directory of certificates as make_curve_keys writes them (CURVE on).
    gateway_workers: the gateway's processes (--tokenizer-worker-num); gateway_flags: more of the gateway's flags."""
    compose = topology == "compose"
    verifier_host = "verifier" if compose else "127.0.0.1"
    spec = ["--speculative-algorithm", algorithm] if algorithm else []
    if draft:
        spec += ["--speculative-draft-model-path", draft]
    verifier = ["splitspec", "verifier", "--model-path", model, *(["--host", "0.0.0.0"] if compose else []),
                "--port", str(port + 1), "--metrics-port", str(port + 2), "--log-level", log_level, *spec, *extra]
    if served:
        verifier += ["--served-model-name", served]
    drafter_addr = f"tcp://{verifier_host}:{port + 3}"
    verifier_curve, drafter_curve = curve_flags(curve_keys) if curve_keys else ([], [])
    if algorithm and drafters > 0:
        bind = f"tcp://0.0.0.0:{port + 3}" if compose else drafter_addr
        verifier += ["--drafter-bind-addr", bind, "--wait-for-drafters", "1", *verifier_curve]
    commands = [("verifier", verifier)]
    # drafters serve their own /metrics (the verifier advertises them at /sd/drafters): in a container
    # on a fixed port, on every interface; as local processes on a free port each
    metrics = ["--metrics-host", "0.0.0.0", "--metrics-port", str(port + 4)] if compose else ["--metrics-port", "0"]
    drafter = ["splitspec", "drafter", "--verifier-drafter-addr", drafter_addr, "--model-path", model,
               "--log-level", log_level, *metrics, *drafter_curve, *spec, *_speculative_and_model_flags(extra)]
    if algorithm and compose and drafters > 0:
        commands.append(("drafter", drafter))
    elif algorithm:
        commands += [(f"drafter-{i + 1}", [*drafter[:4], "--drafter-name", f"drafter-{i + 1}", *drafter[4:]])
                     for i in range(drafters)]
    gateway = ["splitspec", "gateway", "--host", "0.0.0.0" if compose else host, "--port", str(port),
               "--verifier", f"{verifier_host}:{port + 1}", "--log-level", log_level]
    if api_key:
        gateway += ["--api-key", api_key]
    if gateway_workers != 1:
        gateway += ["--tokenizer-worker-num", str(gateway_workers)]
    gateway += list(gateway_flags)
    commands.append(("gateway", gateway))
    return commands


def prometheus_config(topology: str, port: int, host: str = "127.0.0.1", scrape_interval: str = "5s") -> str:
    """The Prometheus configuration for a launch: the gateway and the verifier by address, the drafters
    by the verifier's HTTP service discovery (they come, go and move; the verifier knows which are
    registered and where their /metrics are). topology "compose" addresses services by name."""
    gateway, verifier = (("gateway", "verifier") if topology == "compose" else (host, "127.0.0.1"))
    return f"""# Prometheus for splitspec ({topology}): written by `splitspec up --prometheus-config` and
# scripts/gen_dashboards.py. The gateway and the verifier are scraped by address; the drafters through the
# verifier's HTTP service discovery (GET /sd/drafters), which lists every registered drafter's /metrics.
global:
  scrape_interval: {scrape_interval}
  evaluation_interval: {scrape_interval}
scrape_configs:
  - job_name: splitspec-gateway
    static_configs:
      - targets: ["{gateway}:{port}"]
  - job_name: splitspec-verifier
    static_configs:
      - targets: ["{verifier}:{port + 2}"]
  - job_name: splitspec-drafters
    http_sd_configs:
      - url: http://{verifier}:{port + 2}/sd/drafters
        refresh_interval: {scrape_interval}
"""


def _drafter_flags() -> set[str]:
    from splitspec.drafter_svc.flags import build_parser

    return {option for action in build_parser()._actions for option in action.option_strings}


def _speculative_and_model_flags(extra: list[str]) -> list[str]:
    """The pass-through flags the drafters need as well: the --speculative-* flags a drafter takes (the
    verifier's own, such as --speculative-overlap, stay with it) and the model's dtype, device and load format."""
    out, i = [], 0
    drafter = _drafter_flags() if extra else set()
    while i < len(extra):
        flag = extra[i]
        name = flag.split("=", 1)[0]
        takes_value = "=" not in flag and i + 1 < len(extra) and not extra[i + 1].startswith("--")
        if (name.startswith("--speculative-") or name in MODEL_FLAGS or name == "--enable-multi-layer-eagle") and name in drafter:
            out.append(flag)
            if takes_value:
                out.append(extra[i + 1])
        i += 2 if takes_value else 1
    return out


def run(args: argparse.Namespace) -> int:
    launcher = Launcher(args, getattr(args, "passthrough", []))

    def on_signal(signum, frame):
        launcher.stopping = True

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    return launcher.run()

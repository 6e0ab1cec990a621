"""Several gateway processes on one port (`--tokenizer-worker-num N`, SGLang's flag; vLLM's `--api-server-count`).

One gateway process parses HTTP, renders and tokenizes, and writes every stream on one event loop: a burst of
requests queues behind it (at batch 32, ~0.3 ms each on an H200's host: the burst reaches the engine over ~10 ms, in
several steps instead of one). With N processes the kernel spreads connections over them and each serves its share
on its own loop, with its own tokenizer and its own gRPC stream to the verifier.

This process is their supervisor:
1. It binds N listening sockets to the address, each with SO_REUSEPORT: the kernel hashes every new connection to one
   of them (by its addresses and ports), so the load spreads without a shared accept queue.
2. It starts one worker per socket (`python -m splitspec.gateway.worker --fd FD ...`, the gateway's own flags), each
   dying with it (splitspec.lifeline), and keeps the sockets: a worker that dies is started again on the same socket,
   whose pending connections wait for it instead of being refused (it accepts once it serves: none gets a 503).
3. Health: a worker marks itself in a private directory once it serves, and /health (whichever worker answers)
   is 200 only while every worker has its mark (a dead one's is removed): `splitspec up` waits for all of them.
4. Metrics: the workers write prometheus_client's multiprocess files into one private directory
   (PROMETHEUS_MULTIPROC_DIR), and whichever worker answers /metrics sums every worker's (counters and histograms
   over all of them, dead ones included; the in-flight gauge over live ones: a dead worker's is dropped).
5. SIGTERM or SIGINT: every worker gets SIGTERM (uvicorn's graceful stop, 5 s), then SIGKILL; the directory goes.
   A supervisor killed outright cannot remove it: its name holds the supervisor's pid, and the next gateway to start
   removes the directories of supervisors no longer alive.

Per worker: --max-queued-requests is shared out (each takes its ceiling share), and /get_server_info's accept
length is the answering worker's own requests'.
"""

from __future__ import annotations

import logging
import math
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

from splitspec import lifeline

logger = logging.getLogger("splitspec.gateway")

RESTARTS_IN_A_ROW = 5  # workers dying this many times within FAST_EXIT_S of their start: the gateway gives up
FAST_EXIT_S = 10.0


def listening_socket(host: str, port: int) -> socket.socket:
    """A listening TCP socket on host:port that other sockets may share (SO_REUSEPORT), inheritable by a worker."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((host, port))
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def worker_argv(flags: list[str], fd: int, workers: int, max_queued_requests: int, directory: str) -> list[str]:
    """A worker's command: the gateway's flags (server.worker_flags) with its share of the queue limit."""
    share = math.ceil(max_queued_requests / workers)
    return [sys.executable, "-m", "splitspec.gateway.worker", "--fd", str(fd), "--workers-dir", directory,
            "--workers", str(workers), *flags, "--max-queued-requests", str(share)]


METRICS_DIR_PREFIX = "splitspec-gateway-metrics-"


def remove_orphaned_metrics_dirs(directory: str | None = None) -> list[str]:
    """Remove the metrics directories (in the temporary directory) that a supervisor no longer alive left: its pid is in
    the name (METRICS_DIR_PREFIX + pid + "-"), and only this user's are touched; the paths removed."""
    directory = directory or tempfile.gettempdir()
    removed = []
    for entry in os.scandir(directory):
        if not entry.name.startswith(METRICS_DIR_PREFIX) or not entry.is_dir(follow_symlinks=False):
            continue
        pid = entry.name[len(METRICS_DIR_PREFIX):].partition("-")[0]
        if not pid.isdigit() or entry.stat(follow_symlinks=False).st_uid != os.getuid() or _alive(int(pid)):
            continue
        shutil.rmtree(entry.path, ignore_errors=True)
        removed.append(entry.path)
    if removed:
        logger.info("removed %d metrics director%s of gateways no longer running", len(removed),
                    "y" if len(removed) == 1 else "ies")
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process holds the pid now
        return True
    return True


class Supervisor:
    def __init__(self, flags: list[str], host: str, port: int, workers: int, max_queued_requests: int):
        self.sockets = [listening_socket(host, port)]
        port = self.sockets[0].getsockname()[1]  # --port 0: the port the first one got
        self.sockets += [listening_socket(host, port) for _ in range(workers - 1)]
        remove_orphaned_metrics_dirs()
        self.metrics_dir = tempfile.mkdtemp(prefix=f"{METRICS_DIR_PREFIX}{os.getpid()}-")
        self.workers_dir = os.path.join(self.metrics_dir, "workers")  # each worker's mark once it serves
        os.mkdir(self.workers_dir)
        self.commands = [worker_argv(flags, s.fileno(), workers, max_queued_requests, self.workers_dir)
                         for s in self.sockets]
        self.env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": self.metrics_dir}
        self.processes: list[subprocess.Popen | None] = [None] * workers
        self.started = [0.0] * workers
        self.stopping = False

    def _start(self, i: int, again: bool = False) -> None:
        """again: beside serving siblings, the worker accepts only once it serves (no 503 for its socket's queue)."""
        command = [*self.commands[i], *(["--serve-when-ready"] if again else [])]
        self.processes[i] = lifeline.spawn(command, env=self.env, pass_fds=(self.sockets[i].fileno(),))
        self.started[i] = time.monotonic()
        logger.info("gateway worker %d started (pid %d)", i, self.processes[i].pid)

    def run(self) -> int:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: setattr(self, "stopping", True))
        fast_exits = 0
        try:
            for i in range(len(self.processes)):
                self._start(i)
            while not self.stopping:
                time.sleep(0.2)
                for i, process in enumerate(self.processes):
                    code = process.poll()
                    if code is None or self.stopping:
                        continue
                    self._forget(process.pid)
                    fast_exits = fast_exits + 1 if time.monotonic() - self.started[i] < FAST_EXIT_S else 0
                    if fast_exits >= RESTARTS_IN_A_ROW:
                        logger.error("gateway workers exited %d times in a row within %.0f s of starting (last: "
                                     "worker %d, code %s); the gateway stops", fast_exits, FAST_EXIT_S, i, code)
                        return 1
                    logger.warning("gateway worker %d (pid %d) exited with code %s; starting it again on its socket",
                                   i, process.pid, code)
                    self._start(i, again=True)
            return 0
        finally:
            self._stop()

    def _forget(self, pid: int) -> None:
        """A dead worker's live gauges (requests in flight) leave the sums; its counters stay in them."""
        from prometheus_client import multiprocess

        multiprocess.mark_process_dead(pid, self.metrics_dir)
        try:
            os.remove(os.path.join(self.workers_dir, f"ready-{pid}"))
        except FileNotFoundError:
            pass

    def _stop(self) -> None:
        live = [p for p in self.processes if p is not None and p.poll() is None]
        for process in live:
            process.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 10.0
        for process in live:
            try:
                process.wait(timeout=max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        for sock in self.sockets:
            sock.close()
        shutil.rmtree(self.metrics_dir, ignore_errors=True)

"""splitspec.lifeline: a child started with spawn() or run() ends when the process that started it is SIGKILLed
(it gets no chance to stop anything), and one started with plain subprocess does not (the control)."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import pytest
from test_launcher import alive

from splitspec import lifeline

PARENT = """
import subprocess, sys, time
from splitspec import lifeline
how = sys.argv[1]
sleeper = [sys.executable, "-c", "import time; time.sleep(120)"]
if how == "spawn":
    child = lifeline.spawn(sleeper)
elif how == "plain":
    child = subprocess.Popen(sleeper)
if how == "run":
    import threading
    threading.Thread(target=lifeline.run, args=(sleeper,), daemon=False).start()
    time.sleep(0.5)
    print(subprocess.run(["pgrep", "-P", str(__import__("os").getpid())], capture_output=True, text=True).stdout.split()[0], flush=True)
else:
    print(child.pid, flush=True)
time.sleep(120)
"""


@pytest.mark.skipif(not lifeline.supported(), reason="PR_SET_PDEATHSIG is Linux's")
@pytest.mark.parametrize("how", ["spawn", "run", "plain"])
def test_children_end_with_their_parent_however_it_ends(how):
    parent = subprocess.Popen([sys.executable, "-c", PARENT, how], stdout=subprocess.PIPE, text=True)
    child = int(parent.stdout.readline())
    try:
        assert alive(child)
        parent.send_signal(signal.SIGKILL)
        parent.wait(timeout=10)
        deadline = time.monotonic() + 5
        while alive(child) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert alive(child) == (how == "plain"), f"{how}: child {child} alive {alive(child)}"
    finally:
        if alive(child):
            subprocess.run(["kill", "-9", str(child)])


FORKING_PARENT = """
import concurrent.futures, os, sys
import grpc
from splitspec import lifeline
handlers = []
os.register_at_fork(before=lambda: handlers.append("before"))
server = grpc.server(concurrent.futures.ThreadPoolExecutor(4))  # gRPC's event engine polls in its own threads
server.add_insecure_port("127.0.0.1:0")
server.start()
codes = [lifeline.run([sys.executable, "-c", "pass"], capture_output=True).returncode for _ in range(40)]
print(len(handlers), sum(code != 0 for code in codes), flush=True)
"""


@pytest.mark.skipif(not lifeline.supported(), reason="PR_SET_PDEATHSIG is Linux's")
def test_starting_children_runs_no_fork_handler_beside_a_grpc_server():
    """A preexec_fn would fork the whole parent, running every library's fork handlers: gRPC's restart its
    poller threads in the half-made child, which abort on the descriptor closed before exec (a few in a
    hundred). The children start without a fork handler run, and every one of them exits 0."""
    result = subprocess.run([sys.executable, "-c", FORKING_PARENT], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    handlers, failed = map(int, result.stdout.split())
    assert (handlers, failed) == (0, 0), result.stderr

"""Child processes that end with the process that started them, however it ends (SIGKILL included).

`spawn` is `subprocess.Popen` whose child asks Linux to SIGKILL it when its parent dies
(`prctl(PR_SET_PDEATHSIG)`) and then becomes the command; a parent that died before that request is caught
by comparing `getppid()` with the parent's pid. `splitspec up`, `splitspec bench` and the tests start every
service with it, so an OOM kill, `docker kill` or a closed terminal cannot leave a verifier holding its ports
and its GPU's memory. SIGKILL, not SIGTERM: with the launcher gone nobody waits for a graceful stop, and a
service must never linger (uvicorn's graceful shutdown waits on open streams).

The request is made by a small first program (`python -I -S -c _SET_DEATH_SIGNAL`) that then execs the
command, never by a `preexec_fn`: a `preexec_fn` makes Python fork() the whole process, which runs the
fork handlers of every library loaded in it, and gRPC's restart its event engine's poller threads in the
half-made child, whose epoll descriptor the child then closes before its exec: the child aborts
("epoll_wait error: Bad file descriptor"). Without one, Python starts the child with vfork, and no fork
handler runs. The death signal survives exec.

The death signal follows the *thread* that started the child: spawn from a thread that lives as long as the
children (the main thread, or the launcher's supervising thread), never from a short-lived worker.
Elsewhere than Linux the children are started plainly (the launcher's SIGINT/SIGTERM stop still holds).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

# argv: [parent pid, command...]. Syscalls and exec only: it runs before the command, on every start.
_SET_DEATH_SIGNAL = """\
import ctypes, os, signal, sys
prctl = ctypes.CDLL(None, use_errno=True).prctl
if prctl(1, signal.SIGKILL, 0, 0, 0) != 0:  # PR_SET_PDEATHSIG
    sys.exit(f"splitspec.lifeline: prctl(PR_SET_PDEATHSIG) failed: {os.strerror(ctypes.get_errno())}")
if os.getppid() != int(sys.argv[1]):  # the parent died before the request took effect
    os.kill(os.getpid(), signal.SIGKILL)
try:
    os.execvp(sys.argv[2], sys.argv[2:])
except OSError as error:
    sys.exit(f"splitspec.lifeline: cannot run {sys.argv[2]!r}: {error}")
"""


def supported() -> bool:
    """Whether children started by spawn() die with their parent on this platform."""
    return sys.platform.startswith("linux")


def _dying_with_this_process(argv: list[str], kwargs: dict) -> list[str]:
    if not supported():
        return list(argv)
    for refused in ("preexec_fn", "shell", "executable"):
        if kwargs.get(refused):
            raise TypeError(f"splitspec.lifeline does not take {refused}")
    argv = [os.fspath(arg) for arg in argv]
    program = argv[0]
    if os.sep not in program:  # the error Popen gives for a missing program, not the first program's exit 1
        path = (kwargs.get("env") or os.environ).get("PATH", os.defpath)
        if shutil.which(program, path=path) is None:
            raise FileNotFoundError(2, "No such file or directory", program)
    return [sys.executable, "-I", "-S", "-c", _SET_DEATH_SIGNAL, str(os.getpid()), *argv]


def spawn(argv: list[str], **popen_kwargs) -> subprocess.Popen:
    """subprocess.Popen(argv, **popen_kwargs), the child SIGKILLed when this process dies."""
    process = subprocess.Popen(_dying_with_this_process(argv, popen_kwargs), **popen_kwargs)
    process.args = argv
    return process


def run(argv: list[str], **run_kwargs) -> subprocess.CompletedProcess:
    """subprocess.run(argv, **run_kwargs), the child SIGKILLed when this process dies."""
    result = subprocess.run(_dying_with_this_process(argv, run_kwargs), **run_kwargs)
    result.args = argv
    return result

"""Child processes that end with the process that started them, however it ends (SIGKILL included).

`spawn` is `subprocess.Popen` whose child asks Linux to SIGKILL it when its parent dies
(`prctl(PR_SET_PDEATHSIG)`); a parent that died between the fork and that request is caught by comparing
`getppid()` with the parent's pid. `splitspec up`, `splitspec bench` and the tests start every service with
it, so an OOM kill, `docker kill` or a closed terminal cannot leave a verifier holding its ports and its
GPU's memory. SIGKILL, not SIGTERM: with the launcher gone nobody waits for a graceful stop, and a service
must never linger (uvicorn's graceful shutdown waits on open streams).

The death signal follows the *thread* that forked the child: spawn from a thread that lives as long as the
children (the main thread, or the launcher's supervising thread), never from a short-lived worker.
Elsewhere than Linux the children are started plainly (the launcher's SIGINT/SIGTERM stop still holds).
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def _libc_prctl():
    if not sys.platform.startswith("linux"):
        return None
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
    prctl.restype = ctypes.c_int
    return prctl


_PRCTL = _libc_prctl()  # resolved once in the parent: the child, between fork and exec, only calls it


def _die_with(parent_pid: int):
    def set_death_signal() -> None:  # runs in the child between fork and exec: syscalls only
        _PRCTL(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        if os.getppid() != parent_pid:  # the parent died before the request took effect
            os.kill(os.getpid(), signal.SIGKILL)

    return set_death_signal


def supported() -> bool:
    """Whether children started by spawn() die with their parent on this platform."""
    return _PRCTL is not None


def _dying_with_this_process(kwargs: dict) -> dict:
    if _PRCTL is not None:
        if "preexec_fn" in kwargs:
            raise TypeError("splitspec.lifeline sets preexec_fn itself")
        kwargs["preexec_fn"] = _die_with(os.getpid())
    return kwargs


def spawn(argv: list[str], **popen_kwargs) -> subprocess.Popen:
    """subprocess.Popen(argv, **popen_kwargs), the child SIGKILLed when this process dies."""
    return subprocess.Popen(argv, **_dying_with_this_process(popen_kwargs))


def run(argv: list[str], **run_kwargs) -> subprocess.CompletedProcess:
    """subprocess.run(argv, **run_kwargs), the child SIGKILLed when this process dies."""
    return subprocess.run(argv, **_dying_with_this_process(run_kwargs))

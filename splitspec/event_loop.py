"""The services' asyncio event loop: uvloop where it is installed (a dependency on Linux and macOS), as uvicorn's
"auto" picks it, vLLM's API server and SGLang's servers run theirs; asyncio's own loop elsewhere. The gateway and
the verifier's gRPC front spend their time in the loop's socket and callback machinery (one request's HTTP
exchange, its gRPC submission, each step's fan-out to the streams), which uvloop runs in C."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine


def factory() -> Callable[[], asyncio.AbstractEventLoop] | None:
    """uvloop's loop factory, or None (asyncio's default loop)."""
    try:
        import uvloop
    except ImportError:
        return None
    return uvloop.new_event_loop


def name() -> str:
    return "uvloop" if factory() is not None else "asyncio"


def http_parser() -> str:
    """uvicorn's "auto" choice: httptools' C parser where installed (a dependency), else h11's pure-Python one."""
    try:
        import httptools  # noqa: F401
    except ImportError:
        return "h11"
    return "httptools"


def run(main: Coroutine):
    """asyncio.run(main) on the services' loop."""
    with asyncio.Runner(loop_factory=factory()) as runner:
        return runner.run(main)


def task_lines(task: asyncio.Task) -> list[str]:
    """A task and the chain of awaits it waits in, innermost last (Task.print_stack shows one frame of a coroutine
    task and fails on a frame without a line number)."""
    lines = [repr(task)]
    awaited, depth = task.get_coro(), 0
    while awaited is not None and depth < 32:
        frame = getattr(awaited, "cr_frame", None) or getattr(awaited, "gi_frame", None) or getattr(awaited, "ag_frame", None)
        if frame is None:
            lines.append(f"    awaits {awaited!r}")
            break
        lines.append(f"    {frame.f_code.co_filename}:{frame.f_lineno} in {frame.f_code.co_name}")
        awaited = getattr(awaited, "cr_await", None) or getattr(awaited, "gi_yieldfrom", None) or getattr(awaited, "ag_await", None)
        depth += 1
    return lines


def print_tasks_on_sigusr2(state: Callable[[], list[str]] | None = None) -> None:
    """In a running loop: `kill -USR2 <pid>` prints every task and where it waits (SIGUSR1's faulthandler shows
    only the threads, and an event loop's thread waits in its selector whatever its tasks wait for), then the
    lines `state` gives (what the service holds open)."""
    import signal
    import sys

    def dump() -> None:
        tasks = asyncio.all_tasks()
        lines = [f"{len(tasks)} asyncio tasks:"]
        for task in tasks:
            lines += task_lines(task)
        if state is not None:
            try:
                lines += state()
            except Exception as exc:  # noqa: BLE001 (a diagnostic: say so and go on serving)
                lines.append(f"state unavailable: {exc!r}")
        print("\n".join(lines), file=sys.stderr, flush=True)

    if hasattr(signal, "SIGUSR2"):
        try:
            asyncio.get_running_loop().add_signal_handler(signal.SIGUSR2, dump)
        except (RuntimeError, ValueError):  # not the main thread's loop (an app under a test client): no dump
            pass

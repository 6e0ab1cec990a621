"""The engine process's end of its front process (front_process.py): it binds two local ZeroMQ endpoints
in a private directory, starts the front on them, and from then on

- publishes: the worker's publish, on the engine thread: a step's deliveries go into one message as columns
  (step_columns.py: a few list appends per request, no message per request; one serialisation, one non-blocking
  send; the engine never waits for the front), which the front turns into each stream's TokenDeltas;
- takes commands: a thread reads the front's submissions, aborts and counts and hands them to the worker
  (submissions and aborts join its inbox; nothing blocks on the engine).

The front dies with this process (splitspec.lifeline); `run()` returns when the front exits, and the
verifier ends with it (a supervisor such as `splitspec up` restarts both). The sockets' directory goes as soon as both
links are connected (connections outlive their socket files): however the verifier ends, it leaves none behind.
"""

from __future__ import annotations

import logging
import shutil
import subprocess
import sys
import tempfile
import threading
import time

import zmq

from splitspec import lifeline
from splitspec.protos import channel
from splitspec.protos import engine_link_pb2 as link
from splitspec.protos import verifier_pb2 as pb
from splitspec.verifier_svc import convert, step_columns
from splitspec.verifier_svc.grpc_front import Limits
from splitspec.verifier_svc.worker import Delivery, EngineWorker, Submission

logger = logging.getLogger("splitspec.verifier")
BEAT_SECONDS = 1.0


class FrontLink:
    def __init__(self, address: str, log_level: str, stream_interval: int = 1):
        self.stream_interval = stream_interval  # tokens per delta unless a submission asks its own (Submission.due)
        self.directory = tempfile.mkdtemp(prefix="splitspec-verifier-")  # 0700: only this user reaches the sockets
        self.context = zmq.Context()
        self.out = self.context.socket(zmq.PUSH)
        self.out.setsockopt(zmq.SNDHWM, 0)  # never block the engine, never drop a step
        self.out.setsockopt(zmq.LINGER, 0)
        self.out.bind(f"ipc://{self.directory}/steps")
        self.commands = self.context.socket(zmq.PULL)
        self.commands.setsockopt(zmq.MAXMSGSIZE, channel.MAX_MESSAGE_BYTES + (1 << 16))  # gRPC's own bound, framed
        self.commands.setsockopt(zmq.LINGER, 0)
        self.commands.bind(f"ipc://{self.directory}/commands")
        self.send_lock = threading.Lock()  # the engine thread's steps and the main thread's hello / serving
        self.started = threading.Event()
        self.start_error = ""
        self.worker: EngineWorker | None = None
        self.metrics = None
        self.submissions: dict[str, Submission] = {}  # live request id -> its submission
        self.front = lifeline.spawn(  # from the main thread: PR_SET_PDEATHSIG follows the thread that spawns
            [sys.executable, "-m", "splitspec.verifier_svc.front_process", "--engine", f"ipc://{self.directory}/steps",
             "--commands", f"ipc://{self.directory}/commands", "--address", address, "--log-level", log_level])

    def _send(self, message: link.EngineMessage) -> None:
        data = message.SerializeToString()
        with self.send_lock:
            self.out.send(data)

    # the engine thread ----------------------------------------------------------------------------

    def publish(self, deliveries: list[Delivery]) -> None:
        message = link.EngineMessage()
        # a step whose tokens are all held sends nothing (the front hears the engine's beat meanwhile)
        for submission in step_columns.write(deliveries, message.step):
            self.submissions.pop(submission.client_id, None)
        if message.step.request_ids:
            self._send(message)

    # the main thread ------------------------------------------------------------------------------

    def start(self, worker: EngineWorker, metrics, info: pb.ModelInfo, limits: Limits, timeout: float = 120.0) -> None:
        """Hello to the front, then commands flow to the worker; raises OSError when the front cannot serve."""
        self.worker, self.metrics = worker, metrics
        threading.Thread(target=self._take_commands, name="front-commands", daemon=True).start()
        self._send(link.EngineMessage(hello=link.EngineHello(info=info, kv_pages=limits.kv_pages, page_size=limits.page_size,
                                                             tree_tokens=limits.tree_tokens)))
        deadline = time.monotonic() + timeout
        while not self.started.wait(0.1):
            if self.front.poll() is not None:
                raise OSError(f"the gRPC front process exited with code {self.front.returncode} before serving")
            if time.monotonic() > deadline:
                raise OSError(f"the gRPC front process did not start in {timeout:.0f} s")
        if self.start_error:
            raise OSError(self.start_error)
        # both links are connected now (the front read the hello on one and said it started on the other): their socket
        # files are no longer needed, and a verifier killed outright (SIGKILL, its launcher's death) leaves nothing in /tmp
        shutil.rmtree(self.directory, ignore_errors=True)
        threading.Thread(target=self._beat, name="front-beat", daemon=True).start()

    def serving(self) -> None:
        self._send(link.EngineMessage(serving=True))

    def _beat(self) -> None:
        """A stopped or wedged process sends nothing, so the front can tell it from an idle one. It beats from the
        front's start: while the verifier waits for its drafters (--wait-for-drafters) or warms up it is alive too."""
        while True:
            time.sleep(BEAT_SECONDS)
            self._send(link.EngineMessage(alive=True))

    def run(self) -> int:
        """Until the front exits (its exit code); the directory of sockets is removed."""
        try:
            code = self.front.wait()
            logger.error("the gRPC front process exited with code %s; the verifier stops", code)
            return 1
        finally:
            shutil.rmtree(self.directory, ignore_errors=True)

    def close(self) -> None:
        if self.front.poll() is None:
            self.front.kill()
            try:
                self.front.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        shutil.rmtree(self.directory, ignore_errors=True)

    # the command thread ---------------------------------------------------------------------------

    def _take_commands(self) -> None:
        while True:
            try:
                data = self.commands.recv()
            except zmq.ZMQError:  # the context closed: the process is ending
                return
            try:
                command = link.FrontCommand.FromString(data)
                self._handle(command)
            except Exception:  # noqa: BLE001 (one bad command is logged and dropped; the rest keep flowing)
                logger.exception("dropped a command from the gRPC front (%d bytes)", len(data))

    def _handle(self, command: link.FrontCommand) -> None:
        kind = command.WhichOneof("kind")
        if kind == "submit":
            submit = command.submit
            params = convert.sampling_params(submit.sampling)  # the front checked it; this cannot fail
            submission = Submission(submit.request_id, list(submit.prompt_ids), params, submit.speculate,
                                    interval=submit.stream_interval or self.stream_interval)
            self.submissions[submit.request_id] = submission
            self.worker.submit(submission)
        elif kind == "abort":
            submission = self.submissions.get(command.abort.request_id)
            if submission is not None:
                self.worker.abort_later(submission)
        elif kind == "refused" and self.metrics is not None:
            self.metrics.refused(command.refused)
        elif kind == "malformed" and self.metrics is not None:
            self.metrics.malformed(command.malformed)
        elif kind == "started":
            self.start_error = command.started.error
            self.started.set()

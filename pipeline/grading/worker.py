"""Run a function in a persistent child process, with a deadline on every call.

Math-Verify's own timeouts use ``signal.alarm``, which only works in the main thread of the
main interpreter. The grader is called from worker threads, DataLoader workers and
multiprocessing pools, so it instead sends its sympy work here: one long-lived child
Python process that imports the target function once and runs jobs one after another.
When a job overruns its deadline the parent kills the child (the only way to stop sympy
mid-computation) and starts a fresh one; the job's outcome is ``"timeout"``.

Why ``subprocess`` rather than ``multiprocessing``: a daemonic multiprocessing worker may
not start children, and the 'spawn'/'forkserver' start methods re-import the caller's
``__main__``. A plain child interpreter that talks JSON lines over its stdin/stdout has
neither problem. POSIX only (the deadline uses ``select`` on a pipe).

Protocol: the child writes ``{"ready": true}`` once its target is imported and warmed up;
the parent writes one line ``{"jobs": [[arg, ...], ...]}``; the child answers every job,
in order, with one line ``{"i": k, "value": ...}`` or ``{"i": k, "error": "..."}``. The
child exits when its stdin closes, so it never outlives its parent for long.
"""

from __future__ import annotations

import atexit
import importlib
import json
import os
import select
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# The child imports this module by name; this is the directory that holds the top-level package.
_IMPORT_ROOT = str(Path(__file__).resolve().parents[len(__name__.split(".")) - 1])
_BOOTSTRAP = (
    "import sys; sys.path.insert(0, sys.argv[1]); "
    "import importlib; importlib.import_module(sys.argv[2])._serve(sys.argv[3], sys.argv[4])"
)


@dataclass(frozen=True)
class JobOutcome:
    """What became of one job.

    status: "ok" (value holds the function's JSON-able result), "error" (the function raised;
            value holds "ExceptionType: message"), "timeout" (it overran its deadline and the
            child was killed), "crashed" (the child died while running it) or "unavailable"
            (no child could be started; value says why).
    """

    status: str
    value: Any = None

    @property
    def ok(self) -> bool:
        return self.status == "ok"


class _WorkerDied(Exception):
    pass


class PersistentWorker:
    """One child process running ``target`` ("package.module:function") on jobs.

    run_many(jobs, timeout_s) runs each job (a tuple of JSON-able arguments) with a deadline of
    timeout_s seconds counted from the moment the child can start on it; the time to start
    and warm up a child (importing sympy takes seconds) is bounded separately by
    startup_timeout_s. warmup_args, if given, are run once in every fresh child before it
    reports ready, so that lazy imports inside the target do not eat a job's deadline.

    Thread-safe: callers are serialised on one lock. Fork-safe: a forked copy of the parent
    does not reuse the original's child but starts its own.
    """

    def __init__(
        self,
        target: str,
        warmup_args: Sequence[Sequence[Any]] = (),
        startup_timeout_s: float = 120.0,
    ) -> None:
        if ":" not in target:
            raise ValueError(f"target must look like 'package.module:function', got {target!r}")
        self.target = target
        self.warmup_args = [list(args) for args in warmup_args]
        self.startup_timeout_s = startup_timeout_s
        self._lock = threading.Lock()
        self._proc: subprocess.Popen | None = None
        self._owner_pid = os.getpid()
        self._ready = False
        self._buffer = bytearray()
        self.restarts = 0  # children killed after a timeout or crash; for tests and logs

    # -- public -------------------------------------------------------------------------------

    def run_many(self, jobs: Sequence[Sequence[Any]], timeout_s: float) -> list[JobOutcome]:
        """Run every job in order; one JobOutcome per job. Never raises for a job's sake."""
        outcomes: list[JobOutcome | None] = [None] * len(jobs)
        with self._lock:
            pending = list(range(len(jobs)))
            while pending:
                try:
                    self._ensure_ready()
                    self._send({"jobs": [list(jobs[i]) for i in pending]})
                except (_WorkerDied, OSError, ValueError) as error:
                    self._kill()
                    for i in pending:
                        outcomes[i] = JobOutcome("unavailable", f"grading worker: {error}")
                    break
                pending = self._collect(pending, outcomes, timeout_s)
        return [outcome or JobOutcome("unavailable") for outcome in outcomes]

    def run(self, args: Sequence[Any], timeout_s: float) -> JobOutcome:
        """One job; see run_many."""
        return self.run_many([args], timeout_s)[0]

    def start(self) -> None:
        """Start the child now (it warms up in the background) instead of on first use."""
        with self._lock:
            if self._proc is None or os.getpid() != self._owner_pid:
                self._spawn()

    def close(self) -> None:
        """Kill the child, if any. The worker starts a new one if it is used again."""
        with self._lock:
            self._kill()

    # -- internals ----------------------------------------------------------------------------

    def _spawn(self) -> None:
        self._owner_pid = os.getpid()
        self._buffer = bytearray()
        self._ready = False
        module_name = __name__
        self._proc = subprocess.Popen(
            [sys.executable, "-c", _BOOTSTRAP, _IMPORT_ROOT, module_name, self.target, json.dumps(self.warmup_args)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            # Own session: a Ctrl-C meant for the parent should not print a traceback here.
            start_new_session=True,
            close_fds=True,
        )

    def _ensure_ready(self) -> None:
        if os.getpid() != self._owner_pid:
            # Forked copy: the pipes belong to the parent's conversation; leave them alone.
            self._proc = None
            self._ready = False
        if self._proc is None or self._proc.poll() is not None:
            self._kill()
            self._spawn()
        if self._ready:
            return
        message = self._read(time.monotonic() + self.startup_timeout_s)
        if message is None:
            raise _WorkerDied(f"not ready after {self.startup_timeout_s:.0f} s")
        if not message.get("ready"):
            raise _WorkerDied(f"failed to start: {message.get('error', message)}")
        self._ready = True

    def _collect(self, pending: list[int], outcomes: list, timeout_s: float) -> list[int]:
        """Read one answer per pending job; return the jobs still to run after a kill."""
        deadline = time.monotonic() + timeout_s
        for position, index in enumerate(pending):
            try:
                message = self._read(deadline)
            except _WorkerDied:
                outcomes[index] = JobOutcome("crashed")
                self._restart()
                return pending[position + 1 :]
            if message is None:
                outcomes[index] = JobOutcome("timeout")
                self._restart()
                return pending[position + 1 :]
            if "error" in message:
                outcomes[index] = JobOutcome("error", message["error"])
            else:
                outcomes[index] = JobOutcome("ok", message.get("value"))
            # The child starts the next job the moment it has answered this one.
            deadline = time.monotonic() + timeout_s
        return []

    def _restart(self) -> None:
        self._kill()
        self.restarts += 1
        # Start the replacement now so its warm-up overlaps with the caller's other work.
        try:
            self._spawn()
        except OSError:
            self._proc = None

    def _kill(self) -> None:
        proc, self._proc, self._ready = self._proc, None, False
        self._buffer = bytearray()
        if proc is None or os.getpid() != self._owner_pid:
            return
        try:
            proc.kill()
            proc.wait(timeout=5)
        except (OSError, subprocess.TimeoutExpired):
            pass
        for stream in (proc.stdin, proc.stdout):
            try:
                stream.close()
            except OSError:
                pass

    def _send(self, message: dict) -> None:
        assert self._proc is not None and self._proc.stdin is not None
        data = json.dumps(message, ensure_ascii=True).encode("ascii") + b"\n"
        try:
            self._proc.stdin.write(data)
            self._proc.stdin.flush()
        except (BrokenPipeError, ValueError) as error:
            raise _WorkerDied(f"cannot send jobs: {error}") from error

    def _read(self, deadline: float) -> dict | None:
        """Next message from the child, or None if the deadline passes first."""
        assert self._proc is not None and self._proc.stdout is not None
        fd = self._proc.stdout.fileno()
        while True:
            newline = self._buffer.find(b"\n")
            if newline >= 0:
                line = bytes(self._buffer[:newline])
                del self._buffer[: newline + 1]
                try:
                    return json.loads(line)
                except ValueError:
                    continue  # not ours (the child's stdout is redirected, but be lenient)
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return None
            readable, _, _ = select.select([fd], [], [], remaining)
            if not readable:
                continue
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                raise _WorkerDied("the child process exited")
            self._buffer += chunk


def _serve(target: str, warmup_json: str) -> None:
    """Child side: import target, warm up, then answer job batches until stdin closes."""
    # Keep the protocol channel private: anything the target prints goes to stderr.
    channel = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    sys.stdout = sys.stderr

    def write(message: dict) -> None:
        channel.write(json.dumps(message, ensure_ascii=True).encode("ascii") + b"\n")
        channel.flush()

    try:
        module_name, function_name = target.split(":", 1)
        function = getattr(importlib.import_module(module_name), function_name)
        for args in json.loads(warmup_json):
            function(*args)
    except Exception as error:  # report why, then give up: the parent marks jobs unavailable
        write({"ready": False, "error": f"{type(error).__name__}: {error}"})
        return
    write({"ready": True})

    for line in sys.stdin.buffer:
        jobs = json.loads(line)["jobs"]
        for index, args in enumerate(jobs):
            try:
                write({"i": index, "value": function(*args)})
            except Exception as error:
                write({"i": index, "error": f"{type(error).__name__}: {error}"[:500]})


_live_workers: list[PersistentWorker] = []


def register_for_exit(worker: PersistentWorker) -> PersistentWorker:
    """Kill worker's child at interpreter exit (it would also exit on its own when stdin closes)."""
    _live_workers.append(worker)
    return worker


@atexit.register
def _close_all() -> None:
    for worker in _live_workers:
        worker.close()

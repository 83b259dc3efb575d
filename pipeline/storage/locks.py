"""Stage locks: one writer per run folder and stage.

``acquire_stage_lock(<stage folder>/.lock, what)`` takes an exclusive ``flock`` on the lock file,
which then names the holder (PID, host, launch, start time); a second process stops at once with
LockError naming it. ``held_locks`` tells a stage whether the stage before it is still writing.
"""

from __future__ import annotations

import atexit
import fcntl
import json
import logging
import os
import socket
import time
from pathlib import Path

log = logging.getLogger("stepflow.locks")


class LockError(RuntimeError):
    """Another process holds the lock of this run folder and stage."""


def launch_id() -> tuple[int, int]:
    """(rank, launch): under ``accelerate launch`` / torchrun (WORLD_SIZE > 1) every process of one
    launch has the launcher as its parent, so the parent's PID names the launch; a lone process
    is its own launch."""
    world = int(os.environ.get("WORLD_SIZE", "1") or 1)
    if world > 1:
        return int(os.environ.get("RANK", "0") or 0), os.getppid()
    return 0, os.getpid()


class StageLock:
    """One writer per run folder and stage: an exclusive ``flock`` on ``path``, which holds the
    holder's PID, host and launch.

    A second process (a user starting the same ``make`` twice) gets LockError at once, naming the
    holder. The kernel drops the lock when its process dies however it dies, so a lock left by a
    dead process is simply taken over (the log says so: the file still names it). Under a
    multi-process launch only rank 0 takes the lock; every other rank waits until the file names
    its own launch (its parent PID on this host) and refuses to go on when it names another
    launch. Locks are re-entrant within a process (``acquire_stage_lock``): the demo runs every
    stage in one process, and tests call a stage's main twice.
    """

    WAIT_FOR_RANK0_S = 60.0

    def __init__(self, path: str | Path, what: str):
        self.path, self.what = Path(path), what
        self.fd: int | None = None

    def _holder(self) -> dict:
        try:
            text = self.path.read_text(encoding="utf-8")
            holder = json.loads(text) if text.strip() else {}
            return holder if isinstance(holder, dict) else {}
        except (OSError, ValueError):
            return {}

    def acquire(self) -> StageLock:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        rank, launch = launch_id()
        if rank != 0:
            return self._wait_for_launch(launch)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            holder = self._holder()
            raise LockError(
                f"{self.what}: another process is writing this stage of this run: {self.path} is held by process "
                f"{holder.get('pid', '?')} on host {holder.get('host', '?')} (since {holder.get('started', '?')}). "
                f"Wait for it to finish or stop it; a lock whose process has died is taken over automatically"
            ) from None
        previous = self._holder()
        if previous.get("pid") not in (None, os.getpid()):
            log.warning(
                "%s: took over %s from process %s on host %s, which ended without releasing it (killed, or crashed)",
                self.what,
                self.path,
                previous.get("pid"),
                previous.get("host"),
            )
        os.ftruncate(fd, 0)
        holder = {
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "launch": launch,
            "started": time.strftime("%Y-%m-%d %H:%M:%S"),
        }
        os.pwrite(fd, (json.dumps(holder) + "\n").encode(), 0)
        os.fsync(fd)
        self.fd = fd
        return self

    def _wait_for_launch(self, launch: int) -> StageLock:
        host = socket.gethostname()
        start = time.monotonic()
        while True:
            holder = self._holder()
            if holder.get("launch") == launch and holder.get("host") == host:
                return self
            waited = time.monotonic() - start
            if holder.get("host") not in (None, host) and waited > 10:
                log.warning(
                    "%s: %s is held on host %s: a multi-node launch, not checked from this node",
                    self.what,
                    self.path,
                    holder.get("host"),
                )
                return self
            if waited > self.WAIT_FOR_RANK0_S:
                raise LockError(
                    f"{self.what}: {self.path} names process {holder.get('pid', '?')} of launch "
                    f"{holder.get('launch', '?')} on {holder.get('host', '?')}, not this launch ({launch}): another run "
                    "of this stage holds the run folder"
                )
            time.sleep(0.1)

    def release(self) -> None:
        """Release (a clean end: the file is emptied, so the next holder has nothing to take over)."""
        if self.fd is not None:
            os.ftruncate(self.fd, 0)
            fcntl.flock(self.fd, fcntl.LOCK_UN)
            os.close(self.fd)
            self.fd = None


_HELD: dict[Path, StageLock] = {}
_AT_EXIT: list = []


def acquire_stage_lock(path: str | Path, what: str) -> StageLock:
    """The lock at ``path`` for this process (taken once, then returned again: re-entrant); held
    until release_stage_locks() or the process ends."""
    key = Path(path).resolve()
    if key not in _HELD:
        if not _AT_EXIT:
            _AT_EXIT.append(
                atexit.register(release_stage_locks)
            )  # a clean exit (errors included) leaves nothing to take over
        _HELD[key] = StageLock(key, what).acquire()
    return _HELD[key]


def release_stage_locks() -> None:
    """Release every lock this process holds (a stage main that returns normally)."""
    while _HELD:
        _HELD.popitem()[1].release()


def held_locks(directory: str | Path, pattern: str) -> list[dict]:
    """The holders of the locks matching ``pattern`` in ``directory`` that some live process holds
    right now (probed with a non-blocking shared flock)."""
    held = []
    for path in sorted(Path(directory).glob(pattern)):
        if Path(path).resolve() in _HELD:
            continue
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            fcntl.flock(fd, fcntl.LOCK_UN)
        except OSError:
            holder = StageLock(path, "")._holder()
            held.append({**holder, "path": str(path)})
        finally:
            os.close(fd)
    return held

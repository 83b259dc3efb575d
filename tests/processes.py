"""Running a command the way tests must: in its own process group, bounded in time, and the whole
process tree killed whatever happens (a timeout, a failed assertion, the test interrupted)."""

from __future__ import annotations

import os
import signal
import subprocess
import tempfile
import time
from pathlib import Path

import psutil  # accelerate's own dependency

REPO = Path(__file__).resolve().parent.parent


def run_bounded(
    command: list[str],
    *,
    timeout: float,
    env: dict | None = None,
    cwd: Path = REPO,
    kill_when: Path | None = None,
) -> tuple[int, str] | None:
    """(exit status, stdout and stderr together) of ``command``; subprocess.TimeoutExpired after
    ``timeout`` seconds, its process tree killed first. With ``kill_when``, the whole tree is
    killed (SIGKILL, kill_tree) as soon as that path exists and None is returned; AssertionError, with the
    output's end, if the command ends before. The output goes to a file, which nobody needs to
    read while waiting (a pipe could fill and stall the command)."""
    with tempfile.TemporaryFile(mode="w+", encoding="utf-8", errors="replace") as output:
        process = subprocess.Popen(
            command, cwd=cwd, env=env, stdout=output, stderr=subprocess.STDOUT, text=True, start_new_session=True
        )

        def out() -> str:
            output.seek(0)
            return output.read()

        try:
            if kill_when is None:
                process.wait(timeout=timeout)
                return process.returncode, out()
            deadline = time.monotonic() + timeout
            while not kill_when.exists():
                if process.poll() is not None:
                    raise AssertionError(f"the run ended before the point where it was to be killed:\n{out()[-4000:]}")
                if time.monotonic() > deadline:
                    raise subprocess.TimeoutExpired(command, timeout, out())
                time.sleep(0.05)
            kill_tree(process)
            return None
        finally:
            if process.poll() is None:
                kill_tree(process)


def kill_tree(process: subprocess.Popen) -> None:
    """SIGKILL the command's process group and every process below it, as a crash of the machine
    would: torchrun starts each worker in a session of its own, out of the launcher's group, and a
    worker left alive would go on training and saving after the 'kill'."""
    try:
        below = psutil.Process(process.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        below = []
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    for child in below:
        try:
            child.kill()
        except psutil.NoSuchProcess:
            pass
    process.wait(timeout=30)
    psutil.wait_procs(below, timeout=30)

"""pipeline.launcher.run_graph, the scheduler make demo runs its stages with, on fake children:
tiny ``python -c`` processes that append "start <name>" / "end <name>" lines to one file, so the
order of events is read from the file, not from clocks."""

import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from pipeline.launcher import Stage, StageFailed, Worker, check_graph, run_graph

REPO = Path(__file__).resolve().parents[1]


def child(events: Path, name: str, body: str = "time.sleep(0.2)") -> Worker:
    """A process that appends ``start <name>``, runs ``body``, then appends ``end <name>``."""
    code = (
        textwrap.dedent(
            f"""
        import os, pathlib, subprocess, sys, time
        def note(word):
            fd = os.open({str(events)!r}, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
            os.write(fd, f"{{word}} {name}\\n".encode())
            os.close(fd)
        note("start")
        print("output of {name}", flush=True)
        """
        )
        + textwrap.dedent(body)
        + "\nnote('end')\n"
    )
    return Worker([sys.executable, "-c", code], {}, "")


def shards(events: Path, name: str, n: int) -> list[Worker]:
    return [Worker(child(events, f"{name}-{i}").argv, {}, f"{i}/{n}") for i in range(n)]


def read_events(events: Path) -> list[tuple[str, str]]:
    return [tuple(line.split()) for line in events.read_text().splitlines()]


def group_alive(pgid: int) -> bool:
    """Whether a process of group ``pgid`` is still there (a zombie not reaped yet does not count)."""
    for status in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = status.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            return True
    return False


def wait_for(predicate, seconds: float = 30.0) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return predicate()


def test_stages_start_after_their_parents_end_and_never_more_than_jobs_at_once(tmp_path):
    events, logs = tmp_path / "events", tmp_path / "logs"
    graph = [
        Stage("a", [[child(events, "a")]]),
        Stage("b", [[child(events, "b")]], after=("a",)),
        Stage("c", [[child(events, "c")]], after=("a",)),
        # a sharded stage: two workers together, then one merging process
        Stage("s", [shards(events, "s", 2), [Worker(child(events, "s-merge").argv, {}, "merge")]], after=("a",)),
        Stage("d", [[child(events, "d")]], after=("b", "c")),
        Stage("e", [[child(events, "e")]], after=("s", "d")),
    ]
    seconds = run_graph(graph, jobs=2, log_dir=logs, label="demo", poll_seconds=0.02)
    assert set(seconds) == {"a", "b", "c", "s", "d", "e"}
    order = read_events(events)
    assert len(order) == 2 * 8  # every process started and ended once
    position = {(word, name): i for i, (word, name) in enumerate(order)}
    processes = {"a": ["a"], "b": ["b"], "c": ["c"], "d": ["d"], "e": ["e"], "s": ["s-0", "s-1", "s-merge"]}
    for stage in graph:
        first_start = min(position["start", p] for p in processes[stage.name])
        for parent in stage.after:
            assert all(position["end", p] < first_start for p in processes[parent]), (stage.name, parent)
    assert position["end", "s-0"] < position["start", "s-merge"] > position["end", "s-1"]  # phases in turn
    running = peak = 0
    for word, _ in order:
        running += 1 if word == "start" else -1
        peak = max(peak, running)
    assert peak <= 2
    # each process's output in its own log
    assert (logs / "b.log").read_text() == "output of b\n"
    assert (logs / "s-1of2.log").read_text() == "output of s-1\n"
    assert (logs / "s-merge.log").read_text() == "output of s-merge\n"


def test_one_job_runs_the_stages_one_at_a_time_in_the_given_order(tmp_path):
    events = tmp_path / "events"
    graph = [Stage(name, [[child(events, name)]]) for name in ("x", "y", "z")]
    run_graph(graph, jobs=1, poll_seconds=0.02)
    assert read_events(events) == [(w, n) for n in ("x", "y", "z") for w in ("start", "end")]


def test_a_failing_stage_stops_the_running_ones_and_is_named_with_its_log(tmp_path):
    """ "bad" fails once "sleeper" (no dependency between them) has started a grandchild: the
    sleeper's whole process group is stopped, the stage after bad never starts, and the error
    names bad and its log."""
    events, logs, pids = tmp_path / "events", tmp_path / "logs", tmp_path / "pids"
    sleeper = f"""
        grandchild = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
        pathlib.Path({str(pids)!r} + ".tmp").write_text(f"{{os.getpgid(0)}} {{grandchild.pid}}")
        os.replace({str(pids)!r} + ".tmp", {str(pids)!r})
        time.sleep(60)
        """
    bad = f"""
        deadline = time.monotonic() + 60
        while not pathlib.Path({str(pids)!r}).exists() and time.monotonic() < deadline:
            time.sleep(0.02)
        print("boom", flush=True)
        raise SystemExit(3)
        """
    graph = [
        Stage("sleeper", [[child(events, "sleeper", sleeper)]]),
        Stage("bad", [[child(events, "bad", bad)]]),
        Stage("after_bad", [[child(events, "after_bad")]], after=("bad",)),
    ]
    with pytest.raises(StageFailed) as failed:
        run_graph(graph, jobs=2, log_dir=logs, label="demo", timeout=120, poll_seconds=0.02, stop_grace=10)
    assert str(failed.value) == f"demo: stage bad exited with status 3; log: {logs / 'bad.log'}"
    assert "boom" in (logs / "bad.log").read_text()
    pgid = int(pids.read_text().split()[0])
    try:
        assert wait_for(lambda: not group_alive(pgid), 10), (
            "the sleeper's process group (its grandchild too) is still running"
        )
    finally:
        if group_alive(pgid):
            os.killpg(pgid, signal.SIGKILL)
    names = [name for _, name in read_events(events)]
    assert "after_bad" not in names and ("end", "sleeper") not in read_events(events)


def test_a_failing_shard_is_named_with_its_own_log(tmp_path):
    events, logs = tmp_path / "events", tmp_path / "logs"
    workers = shards(events, "m", 2)
    workers[1] = Worker(child(events, "m-1", "raise SystemExit(5)").argv, {}, "1/2")
    with pytest.raises(StageFailed, match=r"^demo: stage m \(shard 1/2\) exited with status 5; log: .*m-1of2\.log$"):
        run_graph([Stage("m", [workers])], jobs=2, log_dir=logs, label="demo", timeout=120, poll_seconds=0.02)


@pytest.mark.parametrize(
    "graph, jobs, message",
    [
        (
            [Stage("a", [[Worker(["x"], {}, "")]], after=("nope",))],
            1,
            "stage 'a' depends on 'nope', which is not a stage",
        ),
        (
            [Stage("a", [[Worker(["x"], {}, "")]], after=("b",)), Stage("b", [[Worker(["x"], {}, "")]], after=("a",))],
            1,
            "stage 'a' depends on itself through 'b' (a cycle)",
        ),
        ([Stage("a", [[Worker(["x"], {}, "")]], after=("a",))], 1, "stage 'a' depends on itself"),
        (
            [Stage("a", [[Worker(["x"], {}, "0/2"), Worker(["x"], {}, "1/2")]])],
            1,
            "stage 'a' runs 2 workers together, more than jobs=1",
        ),
        ([Stage("a", [[Worker(["x"], {}, "")]]), Stage("a", [[Worker(["x"], {}, "")]])], 1, "stage 'a' is given twice"),
        ([Stage("a", [[]])], 1, "stage 'a' has a phase without workers"),
    ],
)
def test_a_graph_that_cannot_run_is_refused_naming_the_stage(graph, jobs, message):
    with pytest.raises(ValueError, match="^" + re.escape(message)):
        check_graph(graph, jobs)


def test_sigterm_of_the_scheduler_stops_its_children(tmp_path):
    """SIGTERM to a process in run_graph: it stops the running children's process groups and
    exits naming the signal."""
    pids = tmp_path / "pids"
    script = textwrap.dedent(
        f"""
        import sys
        from pipeline.launcher import Stage, Worker, run_graph
        code = ("import os, pathlib, time; pathlib.Path({str(pids)!r} + '.tmp').write_text(str(os.getpgid(0))); "
                "os.replace({str(pids)!r} + '.tmp', {str(pids)!r}); time.sleep(60)")
        run_graph([Stage("sleeper", [[Worker([sys.executable, "-c", code], {{}}, "")]])], jobs=1, label="demo")
        """
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    runner = subprocess.Popen([sys.executable, "-c", script], env=env, stderr=subprocess.PIPE, text=True)
    try:
        assert wait_for(pids.exists, 120), "the child never started"
        runner.send_signal(signal.SIGTERM)
        _, stderr = runner.communicate(timeout=60)
    finally:
        if runner.poll() is None:
            runner.kill()
            runner.wait()
    assert runner.returncode != 0 and "demo: stopped by SIGTERM; the running stages were stopped" in stderr
    pgid = int(pids.read_text())
    try:
        assert wait_for(lambda: not group_alive(pgid), 10)
    finally:
        if group_alive(pgid):
            os.killpg(pgid, signal.SIGKILL)

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pipeline.io import (
    RecordError,
    ShardWriter,
    completed_problem_ids,
    parse_shard,
    read_jsonl,
    read_records,
    read_stream,
    write_records_atomic,
)
from pipeline.records import PRMExample, Problem

REPO = Path(__file__).resolve().parents[1]

# Any record types will do: the writer is generic. Four PRM examples and one problem per problem id.
WRITER = """
import sys, time
from pipeline.io import ShardWriter, completed_problem_ids
from pipeline.records import PRMExample, Problem
out, n = sys.argv[1], int(sys.argv[2])
done = completed_problem_ids(out)
with ShardWriter(out, tag="0of1", commit_every=3) as writer:
    for i in range(n):
        pid = f"p{i:04d}"
        if pid in done:
            continue
        records = [PRMExample(pid, "q", ["x" * 2000], f"step {j}", 0.5, "mcts") for j in range(4)]
        writer.add(pid, records=records, summaries=[Problem(pid, "q", "1", "tiny")])
print("finished")
"""


def example(problem_id: str) -> PRMExample:
    return PRMExample(problem_id, "q", [], "s", 1.0, "mcts")


def test_sigkill_mid_run_then_restart_leaves_every_record_once(tmp_path):
    out = tmp_path / "shards"
    script = tmp_path / "writer.py"
    script.write_text(WRITER)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    n = 3000
    proc = subprocess.Popen([sys.executable, str(script), str(out), str(n)], env=env)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and len(list(out.glob("part-*"))) < 20:
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    first = completed_problem_ids(out)
    assert 0 < len(first) < n, "the writer must be killed mid-run"
    subprocess.run([sys.executable, str(script), str(out), str(n)], env=env, check=True)
    records = list(read_stream(out, "records", PRMExample))
    keys = [(r.problem_id, r.step) for r in records]
    assert len(keys) == len(set(keys)) == 4 * n
    assert sorted(r.problem_id for r in read_stream(out, "summaries", Problem)) == [f"p{i:04d}" for i in range(n)]
    assert not list(out.glob(".tmp-*")), "a restarted writer removes stale temporary shards"


def test_uncommitted_buffer_is_not_visible(tmp_path):
    writer = ShardWriter(tmp_path, commit_every=10)
    writer.add("a", records=[example("a")])
    assert completed_problem_ids(tmp_path) == set()
    writer.commit()
    assert completed_problem_ids(tmp_path) == {"a"}
    with pytest.raises(ValueError):
        writer.add("b", records=[]) or writer.add("b", records=[])


def test_two_writers_with_distinct_tags_share_a_directory(tmp_path):
    for tag in ("0of2", "1of2"):
        with ShardWriter(tmp_path, tag=tag) as writer:
            writer.add(tag, records=[example(tag)])
    assert completed_problem_ids(tmp_path) == {"0of2", "1of2"}


def test_read_jsonl_names_file_and_line(tmp_path):
    path = tmp_path / "x.jsonl"
    path.write_text('{"a": 1}\n\n{"a": 2\n')
    with pytest.raises(RecordError, match=r"x.jsonl:3"):
        list(read_jsonl(path))
    path.write_text('{"a": 1}\n[1, 2]\n')
    with pytest.raises(RecordError, match=r"x.jsonl:2: expected a JSON object"):
        list(read_jsonl(path))


def test_records_are_written_and_read_typed_with_file_line_and_field(tmp_path):
    path = tmp_path / "prm.jsonl"
    examples = [example("a"), PRMExample("b", "q", ["s"], "t", 0.25, "augmented", "b:k:1:0")]
    assert write_records_atomic(path, examples) == 2
    assert list(read_records(path, PRMExample)) == examples
    path.write_text(path.read_text() + "\n" + json.dumps({**examples[0].to_json(), "label": 2}) + "\n")
    with pytest.raises(RecordError, match=r"prm\.jsonl:4: field 'label': expected a number in \[0, 1\], got int 2$"):
        list(read_records(path, PRMExample))
    path.write_text('{"a": 1}\n[1]\n')
    with pytest.raises(RecordError, match=r"prm\.jsonl:1: missing field 'problem_id'"):
        list(read_records(path, PRMExample))
    path.write_text("{oops\n")
    with pytest.raises(RecordError, match=r"prm\.jsonl:1: not valid JSON"):
        list(read_records(path, PRMExample))
    path.write_text("[1]\n")
    with pytest.raises(RecordError, match=r"prm\.jsonl:1: expected a JSON object"):
        list(read_records(path, PRMExample))


def test_parse_shard():
    assert parse_shard("1/4") == (1, 4)
    for bad in ("4/4", "a/b", "1"):
        with pytest.raises(ValueError):
            parse_shard(bad)


def test_fingerprint_follows_content_not_copies(tmp_path):
    import shutil

    from pipeline.io import path_fingerprint

    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text('{"a": 1}')
    (model / "model.safetensors").write_bytes(bytes(range(256)) * 20000)  # > 2 MiB: head and tail are read
    before = path_fingerprint(model)
    shutil.copytree(model, tmp_path / "copy")
    assert path_fingerprint(tmp_path / "copy") == before
    data = bytearray((model / "model.safetensors").read_bytes())
    data[-1] ^= 1  # retrained: the last bytes change
    (model / "model.safetensors").write_bytes(bytes(data))
    assert path_fingerprint(model) != before


def test_resume_guard_refuses_records_made_with_other_settings(tmp_path):
    from pipeline.io import ShardWriter, check_settings

    shards = tmp_path / "shards"
    check_settings(shards, {"policy": "a", "k": 4}, "the MCTS run")
    with ShardWriter(shards, tag="0of1") as writer:
        writer.add("p1", records=[example("p1")])
    check_settings(shards, {"policy": "a", "k": 4}, "the MCTS run")  # same settings: resume
    with pytest.raises(SystemExit, match=r"settings.json: the MCTS run .*\(k, policy differ\)"):
        check_settings(shards, {"policy": "b", "k": 8}, "the MCTS run")
    assert (shards / "settings.json").exists() and any(shards.iterdir())  # nothing deleted
    (shards / "settings.json").unlink()
    with pytest.raises(SystemExit, match="no settings.json"):
        check_settings(shards, {"policy": "a", "k": 4}, "the MCTS run")

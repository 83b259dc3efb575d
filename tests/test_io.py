import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pipeline.records import PRMExample, Problem, RecordError
from pipeline.storage.files import read_jsonl, read_records, write_records_atomic
from pipeline.storage.shards import ShardWriter, completed_problem_ids, parse_shard, read_stream

REPO = Path(__file__).resolve().parents[1]

# Any record types will do: the writer is generic. Four PRM examples and one problem per problem id.
WRITER = """
import sys, time
from pipeline.storage.shards import ShardWriter, completed_problem_ids
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

    from pipeline.storage.files import path_fingerprint

    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text('{"a": 1}')
    (model / "model.safetensors").write_bytes(bytes(range(256)) * 20000)
    before = path_fingerprint(model)
    shutil.copytree(model, tmp_path / "copy")
    assert path_fingerprint(tmp_path / "copy") == before
    data = bytearray((model / "model.safetensors").read_bytes())
    data[-1] ^= 1  # retrained: the last bytes change
    (model / "model.safetensors").write_bytes(bytes(data))
    assert path_fingerprint(model) != before


def test_resume_guard_refuses_records_made_with_other_settings(tmp_path):
    from pipeline.storage.shards import SettingsMismatch, ShardWriter, check_settings

    shards = tmp_path / "shards"
    check_settings(shards, {"policy": "a", "k": 4}, "the MCTS run")
    with ShardWriter(shards, tag="0of1") as writer:
        writer.add("p1", records=[example("p1")])
    check_settings(shards, {"policy": "a", "k": 4}, "the MCTS run")  # same settings: resume
    with pytest.raises(SettingsMismatch, match=r"settings.json: the MCTS run .*\(k, policy differ\)"):
        check_settings(shards, {"policy": "b", "k": 8}, "the MCTS run")
    assert (shards / "settings.json").exists() and any(shards.iterdir())  # nothing deleted
    (shards / "settings.json").unlink()
    with pytest.raises(SettingsMismatch, match="no settings.json"):
        check_settings(shards, {"policy": "a", "k": 4}, "the MCTS run")


# ----------------------------------------------------------------------------- hostile inputs


def test_invalid_utf8_and_deep_nesting_name_file_and_line(tmp_path):
    path = tmp_path / "x.jsonl"
    path.write_bytes(b'{"a": 1}\n{"a": "caf\xe9"}\n')
    with pytest.raises(RecordError, match=r"x\.jsonl:2: not valid UTF-8"):
        list(read_jsonl(path))
    path.write_text('{"a": 1}\n{"a": ' + "[" * 100_000 + "]" * 100_000 + "}\n")
    with pytest.raises(RecordError, match=r"x\.jsonl:2: JSON nested too deeply"):
        list(read_jsonl(path))


def write_shards(directory, problems=("p1", "p2", "p3", "p4"), per_shard=2):
    with ShardWriter(directory, tag="0of1", commit_every=per_shard) as writer:
        for pid in problems:
            writer.add(
                pid,
                records=[example(pid), PRMExample(pid, "q", [], "t", 0.0, "mcts")],
                summaries=[Problem(pid, "q", "1", "tiny")],
            )
    return sorted(directory.glob("part-*"))


def test_shards_carry_a_manifest_and_a_damaged_one_is_named(tmp_path):
    import shutil

    from pipeline.storage.shards import ShardError

    shards = write_shards(tmp_path / "s")
    manifest = json.loads((shards[0] / "shard_manifest.json").read_text())
    assert manifest["problems"] == ["p1", "p2"] and manifest["files"]["records.jsonl"]["records"] == 4
    assert len(list(read_stream(tmp_path / "s", "records", PRMExample))) == 8

    def damaged(change, match):
        target = tmp_path / f"case-{len(list(tmp_path.iterdir()))}"
        shutil.copytree(tmp_path / "s", target)
        change(sorted(target.glob("part-*")))
        with pytest.raises(ShardError, match=match):
            completed_problem_ids(target)
        with pytest.raises(ShardError, match=match):
            list(read_stream(target, "records", PRMExample))

    # the cases: a lost problem list (its problems were searched again), a deleted or
    # emptied records file (augment wrote 0 examples), a copied shard folder (duplicated records)
    damaged(lambda s: (s[0] / "problems.json").unlink(), r"part-0of1-00000: problems\.json: missing .*damaged")
    damaged(lambda s: (s[1] / "records.jsonl").unlink(), r"part-0of1-00001: records\.jsonl is missing")
    damaged(
        lambda s: (s[1] / "records.jsonl").write_text(""),
        r"part-0of1-00001: records\.jsonl holds 0 records in 0 bytes; the manifest says 4",
    )
    damaged(
        lambda s: shutil.copytree(s[0], s[0].with_name("part-0of1-00007")),
        r"part-0of1-00007 and .*part-0of1-00000 both hold problem 'p1'",
    )
    damaged(lambda s: (s[0] / "problems.json").write_text("{oops"), r"part-0of1-00000: .*not valid JSON")
    damaged(
        lambda s: (s[0] / "shard_manifest.json").write_text("[]"),
        r"part-0of1-00000: shard_manifest\.json is not a format-1",
    )
    # a shard without a manifest: its problem list is read
    (shards[0] / "shard_manifest.json").unlink()
    assert completed_problem_ids(tmp_path / "s") == {"p1", "p2", "p3", "p4"}


def test_a_shard_manifest_named_like_a_model_folders_is_read_with_the_same_checks(tmp_path):
    from pipeline.storage.shards import ShardError

    shards = write_shards(tmp_path / "s")
    assert all((s / "shard_manifest.json").is_file() and not (s / "manifest.json").exists() for s in shards)
    (shards[1] / "shard_manifest.json").rename(shards[1] / "manifest.json")  # a shard of an existing run folder
    assert completed_problem_ids(tmp_path / "s") == {"p1", "p2", "p3", "p4"}
    assert len(list(read_stream(tmp_path / "s", "records", PRMExample))) == 8
    (shards[1] / "records.jsonl").write_text("")
    emptied = r"part-0of1-00001: records\.jsonl holds 0 records in 0 bytes; the manifest says 4 "
    with pytest.raises(ShardError, match=emptied):
        completed_problem_ids(tmp_path / "s")
    (shards[1] / "manifest.json").write_text("[]")
    with pytest.raises(ShardError, match=r"part-0of1-00001: manifest\.json is not a format-1 shard manifest"):
        completed_problem_ids(tmp_path / "s")


def test_shard_and_model_folder_manifests_hash_files_with_file_digest(tmp_path, monkeypatch):
    import hashlib

    from pipeline.storage import files
    from pipeline.storage.files import file_digest, path_fingerprint
    from pipeline.storage.model_folders import commit_folder, staging_folder

    shard = write_shards(tmp_path / "s")[0]
    staging = staging_folder(tmp_path / "model")
    (staging / "weights.bin").write_bytes(bytes(range(256)) * 4096)
    model = commit_folder(staging, tmp_path / "model")
    kinds = ((shard, "shard_manifest.json", "records.jsonl"), (model, "manifest.json", "weights.bin"))
    for folder, manifest_name, name in kinds:
        listed = json.loads((folder / manifest_name).read_text())["files"][name]
        content = (folder / name).read_bytes()
        assert listed["sha256"] == file_digest(folder / name) == hashlib.sha256(content).hexdigest()
        assert listed["bytes"] == len(content)
    # above the cut-off only the first and last MiB count (the size is recorded beside the digest)
    monkeypatch.setattr(files, "FULL_HASH_BYTES", 2 << 20)
    big = tmp_path / "big.bin"
    data = bytearray(5 << 20)
    big.write_bytes(bytes(data))
    before, fingerprint = file_digest(big), path_fingerprint(big)
    data[len(data) // 2] = 1
    big.write_bytes(bytes(data))
    assert file_digest(big) == before and path_fingerprint(big) == fingerprint
    data[-1] = 1
    big.write_bytes(bytes(data))
    assert file_digest(big) != before and path_fingerprint(big) != fingerprint


def test_a_corrupt_settings_file_is_named(tmp_path):
    from pipeline.storage.shards import check_settings

    (tmp_path / "settings.json").write_text('{"policy": ')
    with pytest.raises(RecordError, match=r"settings\.json:1: not valid JSON .*settings file is damaged"):
        check_settings(tmp_path, {"policy": "a"}, "the MCTS run")


HOLDER = """
import sys, time
from pipeline.storage.locks import StageLock
StageLock(sys.argv[1], "test").acquire()
print("locked", flush=True)
time.sleep(120)
"""


def test_a_second_writer_stops_at_once_and_a_dead_holders_lock_is_taken_over(tmp_path, caplog):
    import logging

    from pipeline.storage.locks import LockError, StageLock, held_locks

    lock = tmp_path / "prm" / ".lock"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(lock)], env=env, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        with pytest.raises(LockError, match=rf"held by process {holder.pid} on host "):
            StageLock(lock, "make prm").acquire()
        assert holder.poll() is None  # refused while the holder (asleep for minutes) still holds it: not waited for
        assert [h["pid"] for h in held_locks(lock.parent, ".lock*")] == [holder.pid]
    finally:
        holder.kill()
        holder.wait(timeout=30)
    with caplog.at_level(logging.WARNING, logger="stepflow.locks"):
        taken = StageLock(lock, "make prm").acquire()  # the holder died (SIGKILL): its lock is free
    assert f"from process {holder.pid}" in caplog.text and "ended without releasing it" in caplog.text
    assert json.loads(lock.read_text())["pid"] == os.getpid()
    taken.release()
    assert lock.read_text() == "" and held_locks(lock.parent, ".lock*") == []


def test_under_a_launch_only_rank_0_locks_and_the_other_ranks_check_it_is_theirs(tmp_path, monkeypatch):
    import socket

    from pipeline.storage.locks import LockError, StageLock

    lock = tmp_path / ".lock"
    lock.write_text(json.dumps({"pid": 1, "host": socket.gethostname(), "launch": os.getppid()}))
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    assert StageLock(lock, "make prm").acquire().fd is None  # our launch (same parent) holds it: go on
    lock.write_text(json.dumps({"pid": 1, "host": socket.gethostname(), "launch": os.getppid() + 1}))
    monkeypatch.setattr(StageLock, "WAIT_FOR_RANK0_S", 0.3)
    with pytest.raises(LockError, match="not this launch"):
        StageLock(lock, "make prm").acquire()


def test_model_folders_commit_whole_and_damaged_files_are_named(tmp_path):
    import torch
    from safetensors.torch import save_file

    from pipeline.storage.model_folders import (
        FolderError,
        check_model_folder,
        commit_folder,
        is_committed_folder,
        staging_folder,
    )

    final = tmp_path / "model"
    staging = staging_folder(final)
    save_file({"w": torch.ones(64, 64)}, str(staging / "model.safetensors"))
    (staging / "config.json").write_text('{"a": 1}')
    commit_folder(staging, final, steps=3)
    assert is_committed_folder(final) and not staging.exists()
    check_model_folder(final)
    data = (final / "model.safetensors").read_bytes()
    (final / "model.safetensors").write_bytes(data[:1000])
    with pytest.raises(FolderError, match=r"model: model\.safetensors has 1000 bytes, the manifest says"):
        check_model_folder(final)
    (final / "manifest.json").unlink()  # no manifest (a hub download): the header is checked
    with pytest.raises(FolderError, match=r"model\.safetensors: its header describes .* bytes but the file has 1000"):
        check_model_folder(final)
    (final / "model.safetensors").write_bytes(data[:5])
    with pytest.raises(FolderError, match=r"model\.safetensors: not a complete safetensors file"):
        check_model_folder(final)
    (final / "model.safetensors").write_bytes(data)
    (final / "config.json").write_text("{")
    with pytest.raises(FolderError, match=r"config\.json:1: not valid JSON"):
        check_model_folder(final)

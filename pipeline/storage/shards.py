"""Resumable record shards: how a stage commits its records per finished problem and resumes.

A stage writes its records through a ShardWriter. Records are buffered per *complete problem*
and committed in shards: a shard is a folder ``<prefix>-<tag>-<seq>/`` holding one JSONL file
per stream (e.g. ``records.jsonl`` and ``summaries.jsonl``), its problems (``problems.json``) and
its manifest (``shard_manifest.json``, written last: its problems and, per file, the bytes, the
file_digest and the number of records). A commit writes the folder under a temporary name, then
renames it: a rename is atomic, so a reader sees either the whole shard or none of it. A process
killed mid-commit leaves only a ``.tmp-*`` folder, which readers ignore and the next writer
removes. Two problems of an MCTS run committed by the only process of ``shard=0/1``::

    runs/<run>/mcts/shards/
        settings.json                       what the records were made with (check_settings)
        part-0of1-00000/
            records.jsonl                   one MCTSRecord per line
            summaries.jsonl                 one MCTSSummary per line
            problems.json                   ["gsm8k-00001", "gsm8k-00002"]
            shard_manifest.json             {"format_version": 1, "problems": [...], "files": {"records.jsonl":
                                             {"bytes": 5120, "sha256": "...", "records": 7}, ...}}

Readers (``verified_shards``) check every shard against its manifest and refuse, naming the
shard, one whose file is missing, emptied or changed, one without its problems list, and two
shards listing the same problem (a copied shard folder).

Resuming: ``completed_problem_ids(directory)`` lists every problem in a committed shard; a
restarted stage skips those, so no record is ever written twice. Several processes
(``shard=i/n``) write into one directory with distinct tags. ``check_settings`` keeps a resume
from mixing records made under other settings.
"""

from __future__ import annotations

import logging
import os
import shutil
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import TypeVar

from pipeline.records import Record, RecordError
from pipeline.storage.files import (
    TMP_PREFIX,
    file_digest,
    fsync_path,
    json_objects,
    read_json,
    write_json_atomic,
    write_jsonl_atomic,
)

R = TypeVar("R", bound=Record)

SHARD_PREFIX = "part"
SHARD_PROBLEMS = "problems.json"
SHARD_MANIFEST = "shard_manifest.json"
# Shards of existing run folders may name their manifest manifest.json, as model folders do
# (pipeline.storage.model_folders): read with the same checks, so such a run resumes and stays checked.
SHARD_MANIFEST_OTHER_NAME = "manifest.json"
SHARD_FORMAT = 1
SETTINGS = "settings.json"

log = logging.getLogger("stepflow.shards")


class ShardError(ValueError):
    """A damaged or inconsistent shard folder (the message names it and what is wrong)."""


class SettingsMismatch(ValueError):
    """A folder of shards holds records made under other settings than this run's, or under
    settings it did not record: resuming would mix them (the message names the folder and the keys)."""


def committed_shards(directory: str | Path) -> list[Path]:
    """Committed shard folders of a directory, in a stable order (not checked: see verified_shards)."""
    directory = Path(directory)
    if not directory.exists():
        return []
    return sorted(p for p in directory.iterdir() if p.is_dir() and p.name.startswith(SHARD_PREFIX + "-"))


def _damaged(shard: Path, problem: str) -> ShardError:
    return ShardError(
        f"{shard}: {problem}. The shard is damaged; move it out of {shard.parent} (its problems are then "
        f"searched again) or restore it from a copy"
    )


def _records_in(path: Path) -> int:
    """Non-empty lines of a file: its records, as its manifest counts them."""
    with path.open("rb") as handle:
        return sum(1 for line in handle if line.strip())


def shard_problems(shard: Path) -> list[str]:
    """The problems of one committed shard, after checking its files against its manifest."""
    try:
        problems = read_json(shard / SHARD_PROBLEMS, "shard's problem list")
    except RecordError as error:
        raise _damaged(shard, str(error).replace(f"{shard}{os.sep}", "")) from None
    if (
        not isinstance(problems, list)
        or not all(isinstance(p, str) for p in problems)
        or len(set(problems)) != len(problems)
    ):
        raise _damaged(shard, f"{SHARD_PROBLEMS} is not a list of distinct problem ids")
    name = next((n for n in (SHARD_MANIFEST, SHARD_MANIFEST_OTHER_NAME) if (shard / n).exists()), None)
    if name is None:
        return problems  # a shard without a manifest: its problem list is all there is to check
    try:
        manifest = read_json(shard / name, "shard manifest")
    except RecordError as error:
        raise _damaged(shard, str(error).replace(f"{shard}{os.sep}", "")) from None
    if (
        not isinstance(manifest, dict)
        or manifest.get("format_version") != SHARD_FORMAT
        or not isinstance(manifest.get("files"), dict)
    ):
        raise _damaged(shard, f"{name} is not a format-{SHARD_FORMAT} shard manifest")
    if manifest.get("problems") != problems:
        raise _damaged(shard, f"{SHARD_PROBLEMS} does not list the problems of {name}")
    for file_name, expected in manifest["files"].items():
        file = shard / file_name
        if not file.is_file():
            raise _damaged(
                shard, f"{file_name} is missing (the manifest lists it with {expected.get('records')} records)"
            )
        size = file.stat().st_size
        if (size, file_digest(file)) != (expected.get("bytes"), expected.get("sha256")):
            raise _damaged(
                shard,
                f"{file_name} holds {_records_in(file)} records in {size} bytes; the manifest says "
                f"{expected.get('records')} records in {expected.get('bytes')} bytes (or another sha256)",
            )
    return problems


def verified_shards(directory: str | Path) -> list[tuple[Path, list[str]]]:
    """(shard, its problems) for every committed shard, each checked against its manifest; a
    problem listed by two shards (a copied shard folder) is an error naming both."""
    owner: dict[str, Path] = {}
    shards = []
    for shard in committed_shards(directory):
        problems = shard_problems(shard)
        for problem in problems:
            if problem in owner:
                raise ShardError(
                    f"{shard} and {owner[problem]} both hold problem {problem!r}: a shard was copied or written "
                    f"twice. Reading both would duplicate its records; move one of them out of {shard.parent}"
                )
            owner[problem] = shard
        shards.append((shard, problems))
    return shards


def read_stream(directory: str | Path, stream: str, record_type: type[R]) -> Iterator[R]:
    """Every record of one stream across the committed shards of a directory, validated as
    ``record_type`` (errors name the shard file and line); the shards are checked first
    (``verified_shards``), and every record must belong to a problem its shard lists."""
    for shard, problems in verified_shards(directory):
        path = shard / f"{stream}.jsonl"
        if not path.exists():
            continue
        listed = set(problems)
        for line_no, obj in json_objects(path):
            record = record_type.from_json(obj, f"{path}:{line_no}")
            problem_id = getattr(record, "problem_id", None)
            if problem_id is not None and problem_id not in listed:
                raise _damaged(
                    shard,
                    f"{stream}.jsonl line {line_no} belongs to problem {problem_id!r}, which {SHARD_PROBLEMS} does not list",
                )
            yield record


def completed_problem_ids(directory: str | Path) -> set[str]:
    """Problems whose records are committed (each shard lists its problems in ``problems.json``;
    every shard is checked, see verified_shards)."""
    return {problem for _, problems in verified_shards(directory) for problem in problems}


class ShardWriter:
    """Buffers the records of complete problems and commits them atomically in shards.

    ``add(problem_id, records=[...], summaries=[...])`` buffers the typed records (any
    pipeline.records type) of one finished problem, keyword names being stream names;
    ``commit()`` writes the buffer as one shard. ``tag`` distinguishes concurrent writers (e.g.
    the ``shard=i/n`` of the stage).
    """

    def __init__(self, directory: str | Path, tag: str = "0of1", commit_every: int = 16):
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.tag = tag
        self.commit_every = max(1, commit_every)
        self._buffer: dict[str, list[dict]] = {}
        self._problems: list[str] = []
        self._remove_stale_tmp()
        self._seq = self._next_seq()

    def _remove_stale_tmp(self) -> None:
        for p in self.directory.iterdir():
            if p.name.startswith(f"{TMP_PREFIX}{SHARD_PREFIX}-{self.tag}-"):
                shutil.rmtree(p, ignore_errors=True)

    def _next_seq(self) -> int:
        seqs = [
            int(p.name.rsplit("-", 1)[1])
            for p in committed_shards(self.directory)
            if p.name.startswith(f"{SHARD_PREFIX}-{self.tag}-")
        ]
        return max(seqs, default=-1) + 1

    def add(self, problem_id: str, **streams: Iterable[Record]) -> None:
        if problem_id in self._problems:
            raise ValueError(f"problem {problem_id!r} added twice to one shard")
        for name, records in streams.items():
            self._buffer.setdefault(name, []).extend(record.to_json() for record in records)
        self._problems.append(problem_id)
        if len(self._problems) >= self.commit_every:
            self.commit()

    def commit(self) -> Path | None:
        """Write the buffered problems as one shard (atomic rename). Returns its folder."""
        if not self._problems:
            return None
        name = f"{SHARD_PREFIX}-{self.tag}-{self._seq:05d}"
        tmp = self.directory / f"{TMP_PREFIX}{name}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        files = {}
        for stream, records in self._buffer.items():
            path = tmp / f"{stream}.jsonl"
            count = write_jsonl_atomic(path, records)
            files[path.name] = {"bytes": path.stat().st_size, "sha256": file_digest(path), "records": count}
        write_json_atomic(tmp / SHARD_PROBLEMS, self._problems)
        write_json_atomic(
            tmp / SHARD_MANIFEST, {"format_version": SHARD_FORMAT, "problems": self._problems, "files": files}
        )
        final = self.directory / name
        os.rename(tmp, final)
        fsync_path(self.directory)
        self._seq += 1
        self._buffer = {}
        self._problems = []
        return final

    def close(self) -> None:
        self.commit()

    def __enter__(self) -> ShardWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        # On an exception the finished problems are still committed; the unfinished one never
        # reached the buffer, so nothing partial is written.
        self.commit()


def parse_shard(spec: str) -> tuple[int, int]:
    """``"i/n"`` -> (i, n) with 0 <= i < n."""
    try:
        i_text, n_text = spec.split("/")
        i, n = int(i_text), int(n_text)
    except ValueError as exc:
        raise ValueError(f"shard must look like i/n (e.g. 0/4), got {spec!r}") from exc
    if not 0 <= i < n:
        raise ValueError(f"shard {spec!r}: need 0 <= i < n")
    return i, n


def check_settings(directory: str | Path, settings: dict, what: str, others_running: bool = False) -> None:
    """Resume guard: the first run writes ``settings`` to <directory>/settings.json; a later run
    with other settings (another policy, k, temperature...) stops with the keys that differ,
    instead of mixing its records with records made under the old ones. Nothing is deleted.
    Settings that no committed record was made with (a start that failed before its first
    commit, e.g. at model load) are replaced, unless ``others_running`` (another process of the
    run may be about to commit under them)."""
    directory = Path(directory)
    path = directory / SETTINGS
    if path.exists():
        old = read_json(path, "settings file")
        if not isinstance(old, dict):
            raise RecordError(
                f"{path}: expected a JSON object of settings, got {type(old).__name__}; the settings file is damaged"
            )
        changed = sorted(k for k in set(old) | set(settings) if old.get(k) != settings.get(k))
        if changed and not committed_shards(directory) and not others_running:
            log.info(
                "%s: no record was made with the settings it holds (%s differ): replaced", path, ", ".join(changed)
            )
            write_json_atomic(path, settings)
            return
        if changed:
            raise SettingsMismatch(
                f"{path}: {what} already holds records made with other settings ({', '.join(changed)} differ). "
                f"Resuming would mix the two. Move or delete {directory}, or use another run name."
            )
        return
    if committed_shards(directory):
        raise SettingsMismatch(
            f"{directory}: {what} holds records but no {SETTINGS} (written by an older version); "
            f"move or delete it, or use another run name"
        )
    write_json_atomic(path, settings)

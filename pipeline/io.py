"""JSONL reading and writing: typed records, atomic files and resumable shards.

``read_records(path, RecordType)`` yields the typed records (pipeline.records) of a JSONL file,
each validated where it is read; ``write_records_atomic`` writes them. ``read_jsonl`` is the raw
layer: JSON objects, for formats that are not ours (PRM800K) or not records (metrics).

A stage writes its records through a ShardWriter. Records are buffered per *complete problem*
and committed in shards: a shard is a folder ``<prefix>-<tag>-<seq>/`` holding one JSONL file
per stream (e.g. ``records.jsonl`` and ``summaries.jsonl``). A commit writes the folder under a
temporary name, fsyncs every file, then renames the folder: a rename is atomic, so a reader
sees either the whole shard or none of it. A process killed mid-commit leaves only a
``.tmp-*`` folder, which readers ignore and the next writer removes.

Resuming: ``completed_problem_ids(directory)`` lists every problem in a committed shard; a
restarted stage skips those, so no record is ever written twice. Several processes
(``shard=i/n``) write into one directory with distinct tags.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, TypeVar

from pipeline.records import Record, RecordError

R = TypeVar("R", bound=Record)

SHARD_PREFIX = "part"
TMP_PREFIX = ".tmp-"


def read_jsonl(path: str | Path, validate: Callable[[dict, str, int], None] | None = None) -> Iterator[dict]:
    """Yield the JSON objects of a JSONL file, one per non-empty line.

    A line that is not a JSON object raises RecordError naming the file and line; ``validate``
    (obj, path, line) may raise for a missing or ill-typed field. Nothing is ever evaluated.
    """
    path = Path(path)
    for line_no, obj in _json_objects(path):
        if validate is not None:
            validate(obj, str(path), line_no)
        yield obj


def read_records(path: str | Path, record_type: type[R]) -> Iterator[R]:
    """Yield the records of a JSONL file as ``record_type`` instances, one per non-empty line.

    A line that is not a JSON object, or whose fields break the record's contract, raises
    RecordError "<file>:<line>: field '<name>': expected ..., got ...".
    """
    path = Path(path)
    for line_no, obj in _json_objects(path):
        yield record_type.from_json(obj, f"{path}:{line_no}")


def _json_objects(path: Path) -> Iterator[tuple[int, dict]]:
    """(line number, JSON object) for every non-empty line; blank lines still count."""
    with path.open("r", encoding="utf-8", errors="strict") as handle:
        for line_no, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as exc:
                raise RecordError(f"{path}:{line_no}: not valid JSON ({exc.msg})") from exc
            if not isinstance(obj, dict):
                raise RecordError(f"{path}:{line_no}: expected a JSON object, got {type(obj).__name__}")
            yield line_no, obj


def _tmp_name(path: Path) -> Path:
    """A temporary name beside ``path``, distinct per process (two processes of a sharded stage
    may write the same file; readers skip names starting with TMP_PREFIX)."""
    return path.with_name(f"{TMP_PREFIX}{os.getpid()}-{path.name}")


def write_jsonl_atomic(path: str | Path, records: Iterable[dict]) -> int:
    """Write a whole JSONL file atomically (temporary file, fsync, rename). Returns the count."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = _tmp_name(path)
    count = 0
    with tmp.open("w", encoding="utf-8") as handle:
        for record in records:
            handle.write(json.dumps(record, ensure_ascii=False) + "\n")
            count += 1
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)
    fsync_path(path.parent)
    return count


def write_records_atomic(path: str | Path, records: Iterable[Record]) -> int:
    """Write typed records as a JSONL file atomically (``record.to_json()`` per line). Returns the count."""
    return write_jsonl_atomic(path, (record.to_json() for record in records))


def write_text_atomic(path: str | Path, text: str) -> None:
    """Write a text file atomically (temporary file, fsync, rename)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = _tmp_name(path)
    with tmp.open("w", encoding="utf-8") as handle:
        handle.write(text)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)


def write_json_atomic(path: str | Path, obj: Any) -> None:
    """Write one JSON document atomically."""
    write_text_atomic(path, json.dumps(obj, indent=2, ensure_ascii=False) + "\n")


def fsync_path(path: Path) -> None:
    """Flush a file's or a folder's entries to disk (a rename is durable only once its folder is
    synced); silently skipped where the platform cannot."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def committed_shards(directory: str | Path) -> list[Path]:
    """Committed shard folders of a directory, in a stable order."""
    directory = Path(directory)
    if not directory.exists():
        return []
    return sorted(p for p in directory.iterdir() if p.is_dir() and p.name.startswith(SHARD_PREFIX + "-"))


def read_stream(directory: str | Path, stream: str, record_type: type[R]) -> Iterator[R]:
    """Every record of one stream across the committed shards of a directory, validated as
    ``record_type`` (errors name the shard file and line)."""
    for shard in committed_shards(directory):
        path = shard / f"{stream}.jsonl"
        if path.exists():
            yield from read_records(path, record_type)


def completed_problem_ids(directory: str | Path) -> set[str]:
    """Problems whose records are committed (each shard lists its problems in ``problems.json``)."""
    done: set[str] = set()
    for shard in committed_shards(directory):
        manifest = shard / "problems.json"
        if manifest.exists():
            done.update(json.loads(manifest.read_text(encoding="utf-8")))
    return done


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
        for stream, records in self._buffer.items():
            with (tmp / f"{stream}.jsonl").open("w", encoding="utf-8") as handle:
                for record in records:
                    handle.write(json.dumps(record, ensure_ascii=False) + "\n")
                handle.flush()
                os.fsync(handle.fileno())
        with (tmp / "problems.json").open("w", encoding="utf-8") as handle:
            json.dump(self._problems, handle)
            handle.flush()
            os.fsync(handle.fileno())
        fsync_path(tmp)
        final = self.directory / name
        os.rename(tmp, final)
        fsync_path(self.directory)
        self._seq += 1
        self._buffer = {}
        self._problems = []
        return final

    def close(self) -> None:
        self.commit()

    def __enter__(self) -> "ShardWriter":
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


def path_fingerprint(path: str | Path) -> str:
    """A short digest that changes when a file or a folder's files change (a retrained model).

    Content-based, not time-based, so a copied run folder keeps its fingerprint: each file's
    name, size and the sha256 of its first and last MiB (a 15 GB checkpoint is read 2 MiB a file).
    """
    root = Path(path).expanduser()
    files = [root] if root.is_file() else sorted(p for p in root.rglob("*") if p.is_file())
    digest = hashlib.sha256()
    for file in files:
        size = file.stat().st_size
        digest.update(f"{file.relative_to(root) if file != root else file.name}:{size}\n".encode())
        with file.open("rb") as handle:
            digest.update(handle.read(1 << 20))
            if size > 2 << 20:
                handle.seek(-(1 << 20), 2)
                digest.update(handle.read())
    return digest.hexdigest()[:16]


def check_settings(directory: str | Path, settings: dict, what: str) -> None:
    """Resume guard: the first run writes ``settings`` to <directory>/settings.json; a later run
    with other settings (another policy, k, temperature...) stops with the keys that differ,
    instead of mixing its records with records made under the old ones. Nothing is deleted."""
    directory = Path(directory)
    path = directory / "settings.json"
    if path.exists():
        old = json.loads(path.read_text(encoding="utf-8"))
        changed = sorted(k for k in set(old) | set(settings) if old.get(k) != settings.get(k))
        if changed:
            raise SystemExit(
                f"{path}: {what} already holds records made with other settings ({', '.join(changed)} differ). "
                f"Resuming would mix the two. Move or delete {directory}, or use another run name."
            )
        return
    if committed_shards(directory):
        raise SystemExit(f"{directory}: {what} holds records but no settings.json (written by an older version); "
                         f"move or delete it, or use another run name")
    write_json_atomic(path, settings)

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

Each shard also holds ``manifest.json`` (written last): its problems and, per file, the bytes,
the sha256 and the number of records. Readers (``verified_shards``) check every shard against
it and refuse, naming the shard, one whose file is missing, emptied or changed, one without its
problems list, and two shards listing the same problem (a copied shard folder).

Resuming: ``completed_problem_ids(directory)`` lists every problem in a committed shard; a
restarted stage skips those, so no record is ever written twice. Several processes
(``shard=i/n``) write into one directory with distinct tags.

``StageLock``: one writer per run folder and stage (a lock file holding the PID and host).
"""

from __future__ import annotations

import atexit
import contextlib
import fcntl
import hashlib
import json
import logging
import os
import shutil
import socket
import time
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, TypeVar

from pipeline.records import Record, RecordError

R = TypeVar("R", bound=Record)

SHARD_PREFIX = "part"
TMP_PREFIX = ".tmp-"
SHARD_MANIFEST = "manifest.json"
SHARD_PROBLEMS = "problems.json"
SHARD_FORMAT = 1

log = logging.getLogger("stepflow.io")


class ShardError(ValueError):
    """A damaged or inconsistent shard folder (the message names it and what is wrong)."""


class LockError(RuntimeError):
    """Another process holds the lock of this run folder and stage."""


class InputNotFound(FileNotFoundError):
    """An input the user names or an earlier stage writes (a benchmark file, a model folder) is
    not there; the message names it and what makes it."""


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
    """(line number, JSON object) for every non-empty line; blank lines still count. Bytes that
    are not UTF-8, bad JSON and nesting too deep for the parser are RecordErrors naming the line."""
    with path.open("rb") as handle:
        for line_no, raw in enumerate(handle, start=1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise RecordError(f"{path}:{line_no}: not valid UTF-8 (byte {exc.start} of the line: {raw[exc.start:exc.start + 4]!r})") from None
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as exc:
                raise RecordError(f"{path}:{line_no}: not valid JSON ({exc.msg})") from exc
            except RecursionError:
                raise RecordError(f"{path}:{line_no}: JSON nested too deeply") from None
            if not isinstance(obj, dict):
                raise RecordError(f"{path}:{line_no}: expected a JSON object, got {type(obj).__name__}")
            yield line_no, obj


def read_json(path: str | Path, what: str = "JSON file") -> Any:
    """One JSON document; a missing, non-UTF-8 or malformed file raises RecordError naming it."""
    path = Path(path)
    try:
        return json.loads(path.read_bytes().decode("utf-8"))
    except FileNotFoundError:
        raise RecordError(f"{path}: missing ({what})") from None
    except UnicodeDecodeError as exc:
        raise RecordError(f"{path}: not valid UTF-8 (byte {exc.start}); the {what} is damaged") from None
    except json.JSONDecodeError as exc:
        raise RecordError(f"{path}:{exc.lineno}: not valid JSON ({exc.msg}); the {what} is damaged") from None
    except RecursionError:
        raise RecordError(f"{path}: JSON nested too deeply; the {what} is damaged") from None


def read_json_if_exists(path: str | Path, what: str = "JSON file") -> Any:
    """``read_json`` of a file a stage may not have written (None when it is absent)."""
    return read_json(path, what) if Path(path).is_file() else None


def _tmp_name(path: Path) -> Path:
    """A temporary name beside ``path``, distinct per process (two processes of a sharded stage
    may write the same file; readers skip names starting with TMP_PREFIX). Temporary files of
    ``path`` left by processes that died (killed mid-write) are removed."""
    for stale in path.parent.glob(f"{TMP_PREFIX}*-{path.name}"):
        pid = stale.name[len(TMP_PREFIX):-len(path.name) - 1]
        if pid.isdigit() and int(pid) != os.getpid() and not _alive(int(pid)):
            stale.unlink(missing_ok=True)
    return path.with_name(f"{TMP_PREFIX}{os.getpid()}-{path.name}")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


@contextlib.contextmanager
def _atomic_file(path: str | Path):
    """A text handle whose contents replace ``path`` whole when the block ends (temporary file,
    fsync, rename, fsync of the folder); an error in the block leaves ``path`` as it was."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = _tmp_name(path)
    with tmp.open("w", encoding="utf-8") as handle:
        yield handle
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)
    fsync_path(path.parent)


def write_jsonl_atomic(path: str | Path, records: Iterable[dict]) -> int:
    """Write a whole JSONL file atomically (temporary file, fsync, rename). Returns the count."""
    count = 0
    with _atomic_file(path) as handle:
        for record in records:
            handle.write(json.dumps(record, ensure_ascii=False) + "\n")
            count += 1
    return count


def write_records_atomic(path: str | Path, records: Iterable[Record]) -> int:
    """Write typed records as a JSONL file atomically (``record.to_json()`` per line). Returns the count."""
    return write_jsonl_atomic(path, (record.to_json() for record in records))


def write_text_atomic(path: str | Path, text: str) -> None:
    """Write a text file atomically (temporary file, fsync, rename)."""
    with _atomic_file(path) as handle:
        handle.write(text)


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


# ----------------------------------------------------------------------------- folders with a manifest

MANIFEST = "manifest.json"
MANIFEST_FORMAT = 1
_FULL_HASH_BYTES = 64 << 20  # larger files: size + sha256 of the first and last MiB
STAGING_PREFIX = ".staging-"


class FolderError(ValueError):
    """A model or checkpoint folder whose files are missing, damaged or unreadable (names the file)."""


def file_digest(path: Path) -> str:
    """sha256 of a file; of a file over 64 MiB, of its first and last MiB (with its size, checked
    apart, that catches truncation and a different file without reading gigabytes)."""
    digest = hashlib.sha256()
    size = path.stat().st_size
    with path.open("rb") as handle:
        if size <= _FULL_HASH_BYTES:
            for block in iter(lambda: handle.read(1 << 20), b""):
                digest.update(block)
        else:
            digest.update(handle.read(1 << 20))
            handle.seek(-(1 << 20), 2)
            digest.update(handle.read())
    return digest.hexdigest()


def write_manifest(directory: Path, **extra: Any) -> dict:
    """fsync every file under ``directory`` and write ``manifest.json`` (each file's relative path,
    bytes and sha256, plus ``extra``) last, fsynced."""
    directory = Path(directory)
    files = {}
    for path in sorted(p for p in directory.rglob("*") if p.is_file() and p.name != MANIFEST):
        fsync_path(path)
        files[path.relative_to(directory).as_posix()] = {"bytes": path.stat().st_size, "sha256": file_digest(path)}
    manifest = {"format_version": MANIFEST_FORMAT, **extra, "files": files}
    with (directory / MANIFEST).open("w", encoding="utf-8") as handle:
        json.dump(manifest, handle, indent=1)
        handle.flush()
        os.fsync(handle.fileno())
    for folder in {directory, *(p.parent for p in directory.rglob("*"))}:
        fsync_path(folder)
    return manifest


def verify_manifest(directory: Path) -> dict:
    """The manifest of a folder after checking every file it lists (size and sha256); raises
    FolderError naming the folder and the first file that does not match."""
    directory = Path(directory)
    try:
        manifest = read_json(directory / MANIFEST, "manifest")
    except RecordError as error:
        raise FolderError(f"{directory}: no readable {MANIFEST} ({str(error).split(': ', 1)[1]})") from None
    if not isinstance(manifest, dict) or manifest.get("format_version") != MANIFEST_FORMAT or not isinstance(manifest.get("files"), dict):
        version = manifest.get("format_version") if isinstance(manifest, dict) else None
        raise FolderError(f"{directory}: {MANIFEST} has format {version!r}, expected {MANIFEST_FORMAT}")
    for name, expected in manifest["files"].items():
        file = directory / name
        if not file.is_file():
            raise FolderError(f"{directory}: {name} is missing")
        if file.stat().st_size != expected["bytes"]:
            raise FolderError(f"{directory}: {name} has {file.stat().st_size} bytes, the manifest says {expected['bytes']}")
        if file_digest(file) != expected["sha256"]:
            raise FolderError(f"{directory}: {name} does not match its sha256 in the manifest")
    return manifest


def staging_folder(final: Path) -> Path:
    """A fresh, empty staging folder beside ``final`` (what commit_folder renames into place)."""
    final = Path(final)
    staging = final.parent / f"{STAGING_PREFIX}{final.name}"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    return staging


def commit_folder(staging: Path, final: Path, **extra: Any) -> Path:
    """Write the manifest of ``staging`` and rename it to ``final`` (one atomic rename). A folder
    already at ``final`` (a retrained model) is renamed aside first and removed after, so ``final``
    is at every moment either absent or whole."""
    staging, final = Path(staging), Path(final)
    write_manifest(staging, **extra)
    aside = final.parent / f"{STAGING_PREFIX}replaced-{final.name}"
    shutil.rmtree(aside, ignore_errors=True)
    if final.exists():
        os.rename(final, aside)
    os.rename(staging, final)
    fsync_path(final.parent)
    shutil.rmtree(aside, ignore_errors=True)
    return final


def is_committed_folder(path: str | Path) -> bool:
    """Whether ``path`` is a folder committed by commit_folder whose files all match its manifest."""
    try:
        verify_manifest(Path(path))
        return True
    except FolderError:
        return False


def check_safetensors(path: Path) -> None:
    """A safetensors file's header is readable and its tensors fit in the file (a truncated or
    damaged file raises FolderError naming it, instead of safetensors' bare "invalid header length")."""
    size = path.stat().st_size
    with path.open("rb") as handle:
        head = handle.read(8)
        length = int.from_bytes(head, "little") if len(head) == 8 else -1
        if length < 2 or 8 + length > size:
            raise FolderError(f"{path}: not a complete safetensors file ({size} bytes; header length {length}): truncated or damaged")
        try:
            header = json.loads(handle.read(length).decode("utf-8"))
        except (UnicodeDecodeError, ValueError, RecursionError):
            raise FolderError(f"{path}: its safetensors header is not valid JSON: damaged") from None
    ends = [entry["data_offsets"][1] for key, entry in header.items()
            if key != "__metadata__" and isinstance(entry, dict) and isinstance(entry.get("data_offsets"), list) and len(entry["data_offsets"]) == 2]
    if 8 + length + max(ends, default=0) != size:
        raise FolderError(f"{path}: its header describes {8 + length + max(ends, default=0)} bytes but the file has {size}: "
                          "truncated or damaged")


def check_model_folder(path: str | Path) -> None:
    """Before a model folder is loaded: with a manifest, every file matches it; without one (a
    hub download, an older run), every safetensors file is whole and every JSON file parses.
    Raises FolderError naming the file. A hub id (no such folder) is left to the loader."""
    directory = Path(path)
    if not directory.is_dir():
        return
    if (directory / MANIFEST).exists():
        verify_manifest(directory)
        return
    for file in sorted(directory.rglob("*.safetensors")):
        check_safetensors(file)
    for file in sorted(directory.rglob("*.json")):
        try:
            read_json(file, "model file")
        except RecordError as error:
            raise FolderError(str(error)) from None


def committed_shards(directory: str | Path) -> list[Path]:
    """Committed shard folders of a directory, in a stable order (not checked: see verified_shards)."""
    directory = Path(directory)
    if not directory.exists():
        return []
    return sorted(p for p in directory.iterdir() if p.is_dir() and p.name.startswith(SHARD_PREFIX + "-"))


def _shard_file_digest(path: Path) -> tuple[int, str, int]:
    """(bytes, sha256, non-empty lines) of a file."""
    digest, size, lines = hashlib.sha256(), 0, 0
    with path.open("rb") as handle:
        for line in handle:
            digest.update(line)
            size += len(line)
            lines += bool(line.strip())
    return size, digest.hexdigest(), lines


def _damaged(shard: Path, problem: str) -> ShardError:
    return ShardError(f"{shard}: {problem}. The shard is damaged; move it out of {shard.parent} (its problems are then "
                      f"searched again) or restore it from a copy")


def shard_problems(shard: Path) -> list[str]:
    """The problems of one committed shard, after checking its files against its manifest."""
    try:
        problems = read_json(shard / SHARD_PROBLEMS, "shard's problem list")
    except RecordError as error:
        raise _damaged(shard, str(error).replace(f"{shard}{os.sep}", "")) from None
    if not isinstance(problems, list) or not all(isinstance(p, str) for p in problems) or len(set(problems)) != len(problems):
        raise _damaged(shard, f"{SHARD_PROBLEMS} is not a list of distinct problem ids")
    if not (shard / SHARD_MANIFEST).exists():
        return problems  # written before manifests existed: nothing more to check
    try:
        manifest = read_json(shard / SHARD_MANIFEST, "shard manifest")
    except RecordError as error:
        raise _damaged(shard, str(error).replace(f"{shard}{os.sep}", "")) from None
    if not isinstance(manifest, dict) or manifest.get("format_version") != SHARD_FORMAT or not isinstance(manifest.get("files"), dict):
        raise _damaged(shard, f"{SHARD_MANIFEST} is not a format-{SHARD_FORMAT} shard manifest")
    if manifest.get("problems") != problems:
        raise _damaged(shard, f"{SHARD_PROBLEMS} does not list the problems of {SHARD_MANIFEST}")
    for name, expected in manifest["files"].items():
        file = shard / name
        if not file.is_file():
            raise _damaged(shard, f"{name} is missing (the manifest lists it with {expected.get('records')} records)")
        size, sha256, records = _shard_file_digest(file)
        if (size, sha256) != (expected.get("bytes"), expected.get("sha256")):
            raise _damaged(shard, f"{name} holds {records} records in {size} bytes; the manifest says "
                                  f"{expected.get('records')} records in {expected.get('bytes')} bytes (or another sha256)")
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
                raise ShardError(f"{shard} and {owner[problem]} both hold problem {problem!r}: a shard was copied or written "
                                 f"twice. Reading both would duplicate its records; move one of them out of {shard.parent}")
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
        for line_no, obj in _json_objects(path):
            record = record_type.from_json(obj, f"{path}:{line_no}")
            problem_id = getattr(record, "problem_id", None)
            if problem_id is not None and problem_id not in listed:
                raise _damaged(shard, f"{stream}.jsonl line {line_no} belongs to problem {problem_id!r}, which {SHARD_PROBLEMS} does not list")
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
        for stream, records in self._buffer.items():
            with (tmp / f"{stream}.jsonl").open("w", encoding="utf-8") as handle:
                for record in records:
                    handle.write(json.dumps(record, ensure_ascii=False) + "\n")
                handle.flush()
                os.fsync(handle.fileno())
        with (tmp / SHARD_PROBLEMS).open("w", encoding="utf-8") as handle:
            json.dump(self._problems, handle)
            handle.flush()
            os.fsync(handle.fileno())
        files = {}
        for stream in self._buffer:
            size, sha256, records = _shard_file_digest(tmp / f"{stream}.jsonl")
            files[f"{stream}.jsonl"] = {"bytes": size, "sha256": sha256, "records": records}
        with (tmp / SHARD_MANIFEST).open("w", encoding="utf-8") as handle:
            json.dump({"format_version": SHARD_FORMAT, "problems": self._problems, "files": files}, handle, indent=1)
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


def check_settings(directory: str | Path, settings: dict, what: str, others_running: bool = False) -> None:
    """Resume guard: the first run writes ``settings`` to <directory>/settings.json; a later run
    with other settings (another policy, k, temperature...) stops with the keys that differ,
    instead of mixing its records with records made under the old ones. Nothing is deleted.
    Settings that no committed record was made with (a start that failed before its first
    commit, e.g. at model load) are replaced, unless ``others_running`` (another process of the
    run may be about to commit under them)."""
    directory = Path(directory)
    path = directory / "settings.json"
    if path.exists():
        old = read_json(path, "settings file")
        if not isinstance(old, dict):
            raise RecordError(f"{path}: expected a JSON object of settings, got {type(old).__name__}; the settings file is damaged")
        changed = sorted(k for k in set(old) | set(settings) if old.get(k) != settings.get(k))
        if changed and not committed_shards(directory) and not others_running:
            log.info("%s: no record was made with the settings it holds (%s differ): replaced", path, ", ".join(changed))
            write_json_atomic(path, settings)
            return
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


# ----------------------------------------------------------------------------- one writer per stage


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

    def acquire(self) -> "StageLock":
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
            raise LockError(f"{self.what}: another process is writing this stage of this run: {self.path} is held by process "
                            f"{holder.get('pid', '?')} on host {holder.get('host', '?')} (since {holder.get('started', '?')}). "
                            f"Wait for it to finish or stop it; a lock whose process has died is taken over automatically") from None
        previous = self._holder()
        if previous.get("pid") not in (None, os.getpid()):
            log.warning("%s: took over %s from process %s on host %s, which ended without releasing it (killed, or crashed)",
                        self.what, self.path, previous.get("pid"), previous.get("host"))
        os.ftruncate(fd, 0)
        holder = {"pid": os.getpid(), "host": socket.gethostname(), "launch": launch,
                  "started": time.strftime("%Y-%m-%d %H:%M:%S")}
        os.pwrite(fd, (json.dumps(holder) + "\n").encode(), 0)
        os.fsync(fd)
        self.fd = fd
        return self

    def _wait_for_launch(self, launch: int) -> "StageLock":
        host = socket.gethostname()
        start = time.monotonic()
        while True:
            holder = self._holder()
            if holder.get("launch") == launch and holder.get("host") == host:
                return self
            waited = time.monotonic() - start
            if holder.get("host") not in (None, host) and waited > 10:
                log.warning("%s: %s is held on host %s: a multi-node launch, not checked from this node", self.what, self.path,
                            holder.get("host"))
                return self
            if waited > self.WAIT_FOR_RANK0_S:
                raise LockError(f"{self.what}: {self.path} names process {holder.get('pid', '?')} of launch "
                                f"{holder.get('launch', '?')} on {holder.get('host', '?')}, not this launch ({launch}): another run "
                                "of this stage holds the run folder")
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
            _AT_EXIT.append(atexit.register(release_stage_locks))  # a clean exit (errors included) leaves nothing to take over
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

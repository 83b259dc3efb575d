"""One file at a time: JSON and JSONL reading, atomic writes and the one file hash.

``read_records(path, RecordType)`` yields the typed records (pipeline.records) of a JSONL file,
each validated where it is read; ``write_records_atomic`` writes them. ``read_jsonl`` is the raw
layer: JSON objects, for formats that are not ours (PRM800K) or not records (metrics). Every
``write_*_atomic`` replaces its file whole (temporary file, fsync, rename, fsync of the folder),
so a reader sees the old file or the new one, never a part.

``file_digest`` is the one content hash of the project (model-folder and shard manifests, the
benchmark files' sha256 in SOURCES.md, ``path_fingerprint``): the sha256 of the whole file up to
64 MiB; above that, of its first and last MiB (read with the size, that catches a truncated or a
different file without reading gigabytes).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any, TypeVar

from pipeline.records import Record, RecordError

R = TypeVar("R", bound=Record)

TMP_PREFIX = ".tmp-"  # temporary files and folders; every reader skips names starting with it
FULL_HASH_BYTES = 64 << 20  # file_digest reads a file up to this size whole, a larger one by its first and last MiB
_EDGE_BYTES = 1 << 20


class InputNotFound(FileNotFoundError):
    """An input the user names or an earlier stage writes (a benchmark file, a model folder) is
    not there; the message names it and what makes it."""


def read_jsonl(path: str | Path, validate: Callable[[dict, str, int], None] | None = None) -> Iterator[dict]:
    """Yield the JSON objects of a JSONL file, one per non-empty line.

    A line that is not a JSON object raises RecordError naming the file and line; ``validate``
    (obj, path, line) may raise for a missing or ill-typed field. Nothing is ever evaluated.
    """
    path = Path(path)
    for line_no, obj in json_objects(path):
        if validate is not None:
            validate(obj, str(path), line_no)
        yield obj


def read_records(path: str | Path, record_type: type[R]) -> Iterator[R]:
    """Yield the records of a JSONL file as ``record_type`` instances, one per non-empty line.

    A line that is not a JSON object, or whose fields break the record's contract, raises
    RecordError "<file>:<line>: field '<name>': expected ..., got ...".
    """
    path = Path(path)
    for line_no, obj in json_objects(path):
        yield record_type.from_json(obj, f"{path}:{line_no}")


def json_objects(path: str | Path) -> Iterator[tuple[int, dict]]:
    """(line number, JSON object) for every non-empty line; blank lines still count. Bytes that
    are not UTF-8, bad JSON and nesting too deep for the parser are RecordErrors naming the line."""
    path = Path(path)
    with path.open("rb") as handle:
        for line_no, raw in enumerate(handle, start=1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise RecordError(
                    f"{path}:{line_no}: not valid UTF-8 (byte {exc.start} of the line: {raw[exc.start : exc.start + 4]!r})"
                ) from None
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
        pid = stale.name[len(TMP_PREFIX) : -len(path.name) - 1]
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
def atomic_file(path: str | Path):
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
    with atomic_file(path) as handle:
        for record in records:
            handle.write(json.dumps(record, ensure_ascii=False) + "\n")
            count += 1
    return count


def write_records_atomic(path: str | Path, records: Iterable[Record]) -> int:
    """Write typed records as a JSONL file atomically (``record.to_json()`` per line). Returns the count."""
    return write_jsonl_atomic(path, (record.to_json() for record in records))


def write_text_atomic(path: str | Path, text: str) -> None:
    """Write a text file atomically (temporary file, fsync, rename)."""
    with atomic_file(path) as handle:
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


def file_digest(path: str | Path) -> str:
    """sha256 (hex) of a file's bytes; of a file over FULL_HASH_BYTES (64 MiB), of its first and
    last MiB only: compare its size too (every manifest records both). A file holding the three
    bytes ``abc`` gives "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad", as
    ``sha256sum`` does."""
    path = Path(path)
    digest = hashlib.sha256()
    size = path.stat().st_size
    with path.open("rb") as handle:
        if size <= FULL_HASH_BYTES:
            for block in iter(lambda: handle.read(_EDGE_BYTES), b""):
                digest.update(block)
        else:
            digest.update(handle.read(_EDGE_BYTES))
            handle.seek(-_EDGE_BYTES, 2)
            digest.update(handle.read())
    return digest.hexdigest()


def path_fingerprint(path: str | Path) -> str:
    """A short digest (16 hex digits) that changes when a file or a folder's files change (a
    retrained model).

    Content-based, not time-based, so a copied run folder keeps its fingerprint: each file's
    relative name, size and file_digest (a 15 GB checkpoint is read 2 MiB a file).
    """
    root = Path(path).expanduser()
    files = [root] if root.is_file() else sorted(p for p in root.rglob("*") if p.is_file())
    digest = hashlib.sha256()
    for file in files:
        name = file.name if file == root else file.relative_to(root).as_posix()
        digest.update(f"{name}:{file.stat().st_size}:{file_digest(file)}\n".encode())
    return digest.hexdigest()[:16]

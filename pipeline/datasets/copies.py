"""Which copy of a benchmark a loader reads: a local file when given a path; without one, the
repository's copy in data/benchmarks/ (or the folder named by ``$STEPFLOW_BENCHMARKS``), checked
against the size and sha256 that data/benchmarks/SOURCES.md records; for a benchmark the
repository does not carry (OpenMathInstruct-2), or with the path ``"hub"``, the Hugging Face hub
copy through ``datasets`` (imported only then). Inside ``hub_forbidden()`` a hub read raises
``NeedsHub`` instead (`make plan`)."""

from __future__ import annotations

import contextvars
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import lru_cache
from pathlib import Path

from pipeline.datasets.problems import Row, read_local_rows
from pipeline.storage.files import InputNotFound, file_digest
from pipeline.storage.model_folders import FolderError

HUB = "hub"  # a loader's path that asks for the hub copy even where the repository carries one

# The benchmark files the repository carries, and where: $STEPFLOW_BENCHMARKS names another folder
# holding the same files (they are checked against the same SOURCES.md either way).
SHIPPED_DIR = Path(__file__).resolve().parents[2] / "data" / "benchmarks"
SOURCES = SHIPPED_DIR / "SOURCES.md"
BENCHMARKS_ENV = "STEPFLOW_BENCHMARKS"
SHIPPED = {  # (loader family, split) -> file
    ("gsm8k", "test"): "gsm8k_test.jsonl",
    ("gsm8k", "train"): "gsm8k_train.jsonl",
    ("math", "test"): "math_test.jsonl",
    ("math500", "test"): "math500_test.jsonl",
    ("sat_math_32", "test"): "sat_math_32.jsonl",
    ("agieval_sat_math", "test"): "agieval_sat_math.jsonl",
}


def benchmarks_dir() -> Path:
    """Where the benchmark files are read from: ``$STEPFLOW_BENCHMARKS`` when set, else data/benchmarks/."""
    env = os.environ.get(BENCHMARKS_ENV)
    return Path(env) if env else SHIPPED_DIR


@lru_cache(maxsize=1)
def recorded_files() -> dict[str, tuple[int, str]]:
    """file name -> (bytes, sha256), from the table of data/benchmarks/SOURCES.md."""
    files, columns = {}, None
    for line in SOURCES.read_text(encoding="utf-8").splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if not line.startswith("|") or set(cells[0]) <= {"-"}:
            continue
        if columns is None:
            columns = cells
            continue
        row = dict(zip(columns, cells))
        files[row["file"]] = (int(row["bytes"]), row["sha256"])
    return files


@lru_cache(maxsize=16)
def _checked_digest(path: Path, size: int, mtime_ns: int) -> str:
    return file_digest(path)  # keyed on size and mtime: a file is hashed once per process, again when it changes


def shipped_file(name: str) -> Path:
    """A benchmark file of data/benchmarks/SOURCES.md, in ``benchmarks_dir()``, after checking its
    size and sha256 against what SOURCES.md records: a missing or changed file raises FolderError
    naming the file and the folder it looked in."""
    expected_size, expected_sha = recorded_files()[name]
    folder = benchmarks_dir()
    path = folder / name
    where = f"benchmark file {name}, looked for in {folder}" + (
        f" (${BENCHMARKS_ENV})" if os.environ.get(BENCHMARKS_ENV) else ""
    )
    if not path.is_file():
        raise FolderError(
            f"{where}: missing. The repository carries it in {SHIPPED_DIR}; unset ${BENCHMARKS_ENV} or copy it there"
        )
    stat = path.stat()
    if stat.st_size != expected_size:
        raise FolderError(
            f"{where}: {stat.st_size} bytes, {SOURCES.name} records {expected_size}: the file was changed or truncated"
        )
    if _checked_digest(path, stat.st_size, stat.st_mtime_ns) != expected_sha:
        raise FolderError(f"{where}: its sha256 differs from the one {SOURCES.name} records: the file was changed")
    return path


def benchmark_rows(
    family: str, split: str, path: str | Path | None, hub: Callable[[], Iterator[Row]] | None
) -> Iterator[Row]:
    """The rows a loader reads: ``path``; the repository's copy when no path is given; the hub copy
    (``hub``) with the path "hub", or without a path when the repository has no copy."""
    if path is not None and str(path) != HUB:
        return read_local_rows(path)
    name = SHIPPED.get((family, split))
    if path is None and name is not None:
        return read_local_rows(shipped_file(name))
    if hub is None:
        raise ValueError(
            f"{family} has no hub copy: give the path of a local file (the repository's copy is "
            f"{SHIPPED.get((family, 'test'), 'not carried')})"
        )
    return hub()


class NeedsHub(Exception):
    """Raised by a hub read inside ``hub_forbidden()``: the benchmark has no local copy."""

    def __init__(self, hub_id: str, config: str | None, split: str):
        super().__init__(f"hf://{hub_id}" + (f"[{config}]" if config else "") + f"/{split}")
        self.hub_id = hub_id


class HubUnreachable(InputNotFound):
    """A hub dataset that cannot be read (offline mode, no network, no such dataset): one line naming
    it, why (the hub library's own first line) and what to do; ``named`` adds the config key."""

    def __init__(self, label: str, reason: str, key: str | None = None, local_key: str | None = None):
        self.label, self.reason, self.key, self.local_key = label, reason, key, local_key
        where = f"{key}: " if key else ""
        local = f"set {local_key} to a local file" if local_key else "give it a local file"
        super().__init__(
            f"{where}hub dataset {label} cannot be read ({reason}). Run where the hub is reachable (with "
            f"HF_HUB_OFFLINE=1 or HF_DATASETS_OFFLINE=1 only a dataset already in the cache loads), or {local}"
        )

    def named(self, key: str, local_key: str) -> HubUnreachable:
        return HubUnreachable(self.label, self.reason, key, local_key)


def _first_line(error: BaseException, limit: int = 200) -> str:
    text = next((line.strip() for line in str(error).splitlines() if line.strip()), type(error).__name__)
    return text if len(text) <= limit else text[: limit - 3] + "..."


_HUB_FORBIDDEN: contextvars.ContextVar[bool] = contextvars.ContextVar("hub_forbidden", default=False)


@contextmanager
def hub_forbidden():
    """Inside: a loader that would read from the hub raises NeedsHub instead (`make plan` finds
    which benchmarks need the hub without downloading them)."""
    token = _HUB_FORBIDDEN.set(True)
    try:
        yield
    finally:
        _HUB_FORBIDDEN.reset(token)


def read_hub_rows(hub_id: str, config: str | None, split: str, *, streaming: bool = False) -> Iterator[Row]:
    """The rows of one hub dataset split (``datasets`` is imported only here)."""
    if _HUB_FORBIDDEN.get():
        raise NeedsHub(hub_id, config, split)
    import datasets  # heavy (pyarrow): only a hub read needs it

    label = f"hf://{hub_id}" + (f"[{config}]" if config else "") + f"/{split}"
    try:
        rows = datasets.load_dataset(hub_id, config, split=split, streaming=streaming)
    except (OSError, ValueError) as error:  # datasets' and huggingface_hub's: offline, not found, no connection
        raise HubUnreachable(label, f"{type(error).__name__}: {_first_line(error)}") from None
    for i, row in enumerate(rows):
        yield f"{label}: row {i}", dict(row), None

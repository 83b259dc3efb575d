"""Problems from rows: the records of a local file (JSONL, or a JSON array) as rows
(``read_local_rows``), every loader's rows converted and checked into ``pipeline.records.Problem``
(``collect_problems``), and the problems contract's own JSONL (``write_problems_jsonl``,
``load_problems_jsonl``, ``question_places``). The benchmark loaders built on them are
``pipeline.datasets.loaders``.

A malformed record (bytes that are not UTF-8, bad or too deeply nested JSON, a missing or
ill-typed field, an answer that cannot be extracted or is not what the benchmark holds, e.g. a
GSM8K answer that is not a number or a MATH level outside 1-5, an id that is neither a string nor
an integer, a problem id seen before) raises ``RecordError`` (a ValueError) naming the file, the
line and the field. With ``lenient=True`` (``data.lenient`` in the config) such records are
skipped instead, and one warning on the ``pipeline.datasets.problems`` logger gives their count and the
first error once loading ends. An empty input, or one where no problem is left, is an error
either way.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

from pipeline.records import Problem, RecordError
from pipeline.storage.files import InputNotFound, read_json, write_records_atomic

log = logging.getLogger(__name__)


def write_problems_jsonl(problems: Iterable[Problem], path: str | Path) -> int:
    """Write problems as problems-contract JSONL, atomically. Returns the count."""
    return write_records_atomic(path, problems)


# (where, record or None, error or None): one entry per non-empty line / array item / hub row.
Row = tuple[str, Any, "RecordError | None"]


def read_local_rows(path: str | Path) -> Iterator[Row]:
    """The records of a local JSONL file, or of a JSON file holding one array of records. An empty
    file (nothing but whitespace) is an error."""
    path = Path(path)
    if not path.is_file():
        raise InputNotFound(f"benchmark file not found: {path}")
    with path.open("rb") as handle:
        head = handle.read(4096).lstrip()
        handle.seek(0)
        if head.startswith(b"["):
            records = read_json(path, "benchmark file")
            if not records:
                raise RecordError(f"{path}: no records (an empty JSON array)")
            for i, record in enumerate(records):
                yield f"{path}: item {i}", record, None
            return
        found = False
        for line_no, raw in enumerate(handle, start=1):
            if not raw.strip():
                continue
            found = True
            where = f"{path}:{line_no}"
            try:
                record = json.loads(raw.decode("utf-8"))
            except UnicodeDecodeError as exc:
                yield where, None, RecordError(f"{where}: not valid UTF-8 (byte {exc.start} of the line)")
                continue
            except json.JSONDecodeError as exc:
                yield where, None, RecordError(f"{where}: not valid JSON ({exc.msg})")
                continue
            except RecursionError:
                yield where, None, RecordError(f"{where}: JSON nested too deeply")
                continue
            yield where, record, None
        if not found:
            raise RecordError(f"{path}: no records (an empty file)")


def collect_problems(
    rows: Iterable[Row],
    to_problem: Callable[[Any, str, int], Problem],
    *,
    loader: str,
    lenient: bool,
    keep: Callable[[Problem], bool] | None = None,
    limit: int | None = None,
) -> list[Problem]:
    """Convert rows to problems (``to_problem(record, where, index)``), filter, stop at ``limit``.

    ``index`` counts every row, malformed ones included, so ids do not shift when a record is
    skipped or a filter is applied. A problem id met twice is a malformed record. No problem at
    all (an empty input, every record malformed, none passing the filter) is an error.
    """
    if limit is not None and limit < 0:
        raise ValueError(f"{loader}: limit must be >= 0, got {limit}")
    problems: list[Problem] = []
    skipped, first_error, rows_seen, source = 0, None, 0, None
    first_seen: dict[str, str] = {}
    if limit == 0:
        return problems
    for index, (where, record, error) in enumerate(rows):
        rows_seen += 1
        source = source or where.rsplit(":", 1)[0]
        try:
            if error is not None:
                raise error
            if not isinstance(record, dict):
                raise RecordError(f"{where}: expected a JSON object, got {type(record).__name__}")
            problem = to_problem(record, where, index)
            if keep is not None and not keep(problem):
                continue
            if problem.problem_id in first_seen:
                raise RecordError(
                    f"{where}: field 'problem_id': {problem.problem_id!r} appears twice (first at "
                    f"{first_seen[problem.problem_id]}); problem ids must be unique"
                )
        except RecordError as exc:
            if not lenient:
                raise
            skipped += 1
            first_error = first_error or exc
            continue
        first_seen[problem.problem_id] = where
        problems.append(problem)
        if limit is not None and len(problems) >= limit:
            break
    if skipped:
        log.warning(
            "%s: skipped %d malformed record(s) of %d (lenient=True); first: %s",
            loader,
            skipped,
            rows_seen,
            first_error,
        )
    if not problems:
        why = (
            "no records"
            if rows_seen == 0
            else f"all {rows_seen} records were malformed"
            if skipped == rows_seen
            else f"none of the {rows_seen} records passed the filter"
        )
        raise RecordError(f"{loader}: {source or 'the input'}: no problems ({why})")
    return problems


def require_field(record: dict, name: str, where: str, types: type | tuple[type, ...], expected: str) -> Any:
    if name not in record:
        raise RecordError(f"{where}: field '{name}': missing (expected {expected})")
    value = record[name]
    if not isinstance(value, types) or isinstance(value, bool):
        raise RecordError(f"{where}: field '{name}': expected {expected}, got {type(value).__name__}")
    return value


def text_field(record: dict, name: str, where: str) -> str:
    value = require_field(record, name, where, str, "a string")
    if not value.strip():
        raise RecordError(f"{where}: field '{name}': expected a non-empty string")
    return value


def load_problems_jsonl(path: str | Path, *, limit: int | None = None, lenient: bool = False) -> list[Problem]:
    """Problems-contract records {problem_id, question, answer, source, meta} (JSONL or JSON array),
    each validated by ``Problem.from_json``; problem ids must be unique."""
    return collect_problems(
        read_local_rows(path),
        lambda record, where, index: Problem.from_json(record, where),
        loader="load_problems_jsonl",
        lenient=lenient,
        limit=limit,
    )


def question_places(path: str | Path, *, lenient: bool = False, validate: bool = True) -> dict[str, tuple[str, str]]:
    """Question text -> (where, problem id) of the first record holding it ("file:line", or "file:
    item i" in a JSON array), for a local file of problems-contract records. ``validate``: each
    record checked by ``Problem.from_json`` (RecordError naming the file, line and field; skipped
    with ``lenient``); without it, records lacking a string "question" are passed over (a file of
    another benchmark's layout: its lines are then not known)."""
    places: dict[str, tuple[str, str]] = {}
    for where, record, error in read_local_rows(path):
        try:
            if error is not None:
                raise error
            if validate:
                problem = Problem.from_json(record, where)
                question, problem_id = problem.question, problem.problem_id
            elif isinstance(record, dict) and isinstance(record.get("question"), str):
                question, problem_id = record["question"], str(record.get("problem_id", "?"))
            else:
                continue
        except RecordError:
            if validate and not lenient:
                raise
            continue
        places.setdefault(question, (where, problem_id))
    return places

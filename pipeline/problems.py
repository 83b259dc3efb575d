"""The benchmark loaders: every benchmark as a list of ``pipeline.records.Problem``.

Every benchmark becomes a list of ``Problem(problem_id, question, answer, source, meta)``, the
JSONL problems contract of DESIGN.md. A loader reads a local file (JSONL, or a JSON array) when
given a path; without one, the repository's copy in data/benchmarks/ (or the folder named by
``$STEPFLOW_BENCHMARKS``), checked against the size and sha256 that data/benchmarks/SOURCES.md
records; for a benchmark the repository does not carry (OpenMathInstruct-2), or with the path
``"hub"``, the Hugging Face hub copy through ``datasets`` (imported only then). Field layouts, hub
ids and every mapping decision are in docs/data.md, "Benchmarks".

A malformed record (bytes that are not UTF-8, bad or too deeply nested JSON, a missing or
ill-typed field, an answer that cannot be extracted or is not what the benchmark holds, e.g. a
GSM8K answer that is not a number or a MATH level outside 1-5, an id that is neither a string nor
an integer, a problem id seen before) raises ``RecordError`` (a ValueError) naming the file, the
line and the field. With ``lenient=True`` (``data.lenient`` in the config) such records are
skipped instead, and one warning on the ``pipeline.problems`` logger gives their count and the
first error once loading ends. An empty input, or one where no problem is left, is an error
either way.
"""

from __future__ import annotations

import contextvars
import hashlib
import heapq
import json
import logging
import os
import re
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from functools import lru_cache
from pathlib import Path
from typing import Any

from pipeline.files import InputNotFound, file_digest, read_json, write_records_atomic
from pipeline.grading import extract_answer
from pipeline.model_folders import FolderError
from pipeline.records import Problem, RecordError

log = logging.getLogger(__name__)

# Hub copies used when a loader is given no path (docs/data.md says why these ids).
HUB_GSM8K = ("openai/gsm8k", "main")
HUB_MATH = "EleutherAI/hendrycks_math"
HUB_MATH_CONFIGS = (  # alphabetical: the subject order of the MATH test file we ship tests against
    "algebra",
    "counting_and_probability",
    "geometry",
    "intermediate_algebra",
    "number_theory",
    "prealgebra",
    "precalculus",
)
HUB_MATH500 = "HuggingFaceH4/MATH-500"
HUB_AGIEVAL_SAT_MATH = "hails/agieval-sat-math"
HUB_OPENMATHINSTRUCT2 = "nvidia/OpenMathInstruct-2"
HUB = "hub"  # a loader's path that asks for the hub copy even where the repository carries one

# The benchmark files the repository carries, and where: $STEPFLOW_BENCHMARKS names another folder
# holding the same files (they are checked against the same SOURCES.md either way).
SHIPPED_DIR = Path(__file__).resolve().parents[1] / "data" / "benchmarks"
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


def write_problems_jsonl(problems: Iterable[Problem], path: str | Path) -> int:
    """Write problems as problems-contract JSONL, atomically. Returns the count."""
    return write_records_atomic(path, problems)


# ----------------------------------------------------------------------------- the repository's copies


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


def _rows(family: str, split: str, path: str | Path | None, hub: Callable[[], Iterator[Row]] | None) -> Iterator[Row]:
    """The rows a loader reads: ``path``; the repository's copy when no path is given; the hub copy
    (``hub``) with the path "hub", or without a path when the repository has no copy."""
    if path is not None and str(path) != HUB:
        return _read_local(path)
    name = SHIPPED.get((family, split))
    if path is None and name is not None:
        return _read_local(shipped_file(name))
    if hub is None:
        raise ValueError(
            f"{family} has no hub copy: give the path of a local file (the repository's copy is "
            f"{SHIPPED.get((family, 'test'), 'not carried')})"
        )
    return hub()


# ----------------------------------------------------------------------------- answer extraction


def math_final_answer(solution: str) -> str | None:
    """The final answer of a MATH reference solution: the content of its last \\boxed{...} (or
    \\fbox{...}), nested braces matched, e.g. ``\\boxed{\\frac{1}{2}}`` -> ``\\frac{1}{2}`` (the grader
    also drops ``$...$`` around it and a trailing period).

    The one grader extracts it (``pipeline.grading.extract_answer``), so a reference answer is
    read exactly as a model's answer is; a solution without a box has no answer (None) rather
    than the grader's "The answer is ..." fallback.
    """
    if "\\boxed" not in solution and "\\fbox" not in solution:
        return None
    return extract_answer(solution, "math")


def gsm8k_final_answer(solution: str) -> str | None:
    """The number after GSM8K's '####' marker, thousands commas removed ('2,125' -> '2125')."""
    if "####" not in solution:
        return None
    answer = solution.rsplit("####", 1)[1].strip().replace(",", "")
    return answer or None


# ----------------------------------------------------------------------------- SAT options

_ITEM_OPTION = re.compile(r"^\s*\(?([A-Z])\s*[).:]\s*(.*)$", re.DOTALL)
_FIRST_MARKER = re.compile(r"^\s*(\()?A([).])")


def parse_options_list(items: Sequence[Any], where: str = "record", field_name: str = "options") -> dict[str, str]:
    """AGIEval's option list ["(A)2", "(B)4", ...] as {"A": "2", "B": "4", ...}."""
    if not isinstance(items, (list, tuple)) or not items:
        raise RecordError(f"{where}: field '{field_name}': expected a non-empty list of '(A)...' strings")
    options: dict[str, str] = {}
    for i, item in enumerate(items):
        expected = chr(ord("A") + i)
        match = _ITEM_OPTION.match(item) if isinstance(item, str) else None
        if match is None or match.group(1) != expected:
            raise RecordError(
                f"{where}: field '{field_name}': item {i} {item!r}: expected it to start with '({expected})'"
            )
        options[expected] = match.group(2).strip()
    return options


def parse_options_string(text: Any, where: str = "record", field_name: str = "options") -> dict[str, str]:
    """One-string options "A) x B) y C) z D) w" (or "A. x B. y ...") as {"A": "x", ...}.

    The marker style is taken from the leading "A)" / "A." / "(A)"; each next letter's marker must
    follow whitespace, and the first such marker after the previous option is the split point,
    so option text such as "data set $B$" (no marker punctuation) stays whole.
    """
    if not isinstance(text, str):
        raise RecordError(f"{where}: field '{field_name}': expected a string, got {type(text).__name__}")
    first = _FIRST_MARKER.match(text)
    if first is None:
        raise RecordError(f"{where}: field '{field_name}': expected it to start with 'A)' or 'A.', got {text[:30]!r}")
    open_paren = r"\(" if first.group(1) else ""
    close = re.escape(first.group(2))
    # "A." style needs whitespace after the marker too ("U.S." or "B.C." must not split).
    after = r"\s+" if first.group(2) == "." else r"\s*"
    letters: list[str] = ["A"]
    starts: list[int] = [first.end()]
    ends: list[int] = []
    position = first.end()
    while True:
        letter = chr(ord(letters[-1]) + 1)
        marker = re.compile(rf"\s{open_paren}{letter}{close}{after}")
        match = marker.search(text, position)
        if match is None:
            break
        ends.append(match.start())
        letters.append(letter)
        starts.append(match.end())
        position = match.end()
    ends.append(len(text))
    if len(letters) < 2:
        raise RecordError(f"{where}: field '{field_name}': expected at least options A and B, found only A")
    return {letter: text[s:e].strip() for letter, s, e in zip(letters, starts, ends)}


# ----------------------------------------------------------------------------- reading records

# (where, record or None, error or None): one entry per non-empty line / array item / hub row.
Row = tuple[str, Any, "RecordError | None"]


def _read_local(path: str | Path) -> Iterator[Row]:
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


def _read_hub(hub_id: str, config: str | None, split: str, *, streaming: bool = False) -> Iterator[Row]:
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


def _collect(
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


def _require(record: dict, name: str, where: str, types: type | tuple[type, ...], expected: str) -> Any:
    if name not in record:
        raise RecordError(f"{where}: field '{name}': missing (expected {expected})")
    value = record[name]
    if not isinstance(value, types) or isinstance(value, bool):
        raise RecordError(f"{where}: field '{name}': expected {expected}, got {type(value).__name__}")
    return value


def _text(record: dict, name: str, where: str) -> str:
    value = _require(record, name, where, str, "a string")
    if not value.strip():
        raise RecordError(f"{where}: field '{name}': expected a non-empty string")
    return value


# ----------------------------------------------------------------------------- GSM8K

_NUMBER = re.compile(r"[-+]?(\d+(\.\d*)?|\.\d+)")


def _gsm8k_problem(split: str) -> Callable[[dict, str, int], Problem]:
    def convert(record: dict, where: str, index: int) -> Problem:
        question = _text(record, "question", where)
        solution = _text(record, "answer", where)
        answer = gsm8k_final_answer(solution)
        if answer is None or not _NUMBER.fullmatch(answer):
            raise RecordError(
                f"{where}: field 'answer': expected a solution ending in '#### <number>'"
                + (f", got '#### {answer[:40]}'" if answer is not None else "")
            )
        return Problem(f"gsm8k-{split}-{index}", question, answer, "gsm8k", {"solution": solution})

    return convert


def load_gsm8k(
    path: str | Path | None = None, *, split: str = "test", limit: int | None = None, lenient: bool = False
) -> list[Problem]:
    """GSM8K: answer = the number after '####' without thousands commas; id "gsm8k-<split>-<index>".

    ``split`` names the split in the ids and picks the repository's file or the hub split: pass
    split="train" with a local train file.
    """
    rows = _rows("gsm8k", split, path, lambda: _read_hub(HUB_GSM8K[0], HUB_GSM8K[1], split))
    return _collect(rows, _gsm8k_problem(split), loader="load_gsm8k", lenient=lenient, limit=limit)


# ----------------------------------------------------------------------------- MATH and MATH-500

_LEVEL = re.compile(r"^\s*(?:Level\s*)?([1-5])\s*$")


def _math_level(record: dict, where: str) -> int | None:
    """'Level 5' or 5 -> 5; MATH has a few 'Level ?' (train split): None, kept unless filtered."""
    value = _require(record, "level", where, (str, int), "'Level N' or an integer")
    if isinstance(value, int):
        if not 1 <= value <= 5:
            raise RecordError(f"{where}: field 'level': expected a level from 1 to 5, got {value}")
        return value
    match = _LEVEL.match(value)
    if match:
        return int(match.group(1))
    if value.strip() == "Level ?":
        return None
    raise RecordError(f"{where}: field 'level': expected 'Level 1'..'Level 5', got {value!r}")


def _math_problem(split: str) -> Callable[[dict, str, int], Problem]:
    def convert(record: dict, where: str, index: int) -> Problem:
        question = _text(record, "problem", where)
        solution = _text(record, "solution", where)
        answer = math_final_answer(solution)
        if not answer:
            raise RecordError(f"{where}: field 'solution': expected a final \\boxed{{...}} answer")
        subject = _text(record, "type", where)
        meta: dict[str, Any] = {"level": _math_level(record, where), "subject": subject, "solution": solution}
        ordinal = index
        if "idx" in record:
            ordinal = _require(record, "idx", where, int, "an integer")
            meta["idx"] = ordinal
        return Problem(f"math-{split}-{ordinal}", question, answer, "math", meta)

    return convert


def _math_hub_rows(split: str) -> Iterator[Row]:
    for config in HUB_MATH_CONFIGS:
        yield from _read_hub(HUB_MATH, config, split)


def load_math(
    path: str | Path | None = None,
    *,
    split: str = "test",
    limit: int | None = None,
    lenient: bool = False,
    levels: Iterable[int] | None = None,
) -> list[Problem]:
    """MATH: answer = the last \\boxed{} of the solution; id "math-<split>-<idx>".

    ``levels`` keeps only those difficulty levels (e.g. [5]). meta: level (int), subject (the
    record's ``type``), solution, idx (when the file has it).
    """
    wanted = None if levels is None else {int(level) for level in levels}

    def keep(problem: Problem) -> bool:
        return wanted is None or problem.meta.get("level") in wanted

    rows = _rows("math", split, path, lambda: _math_hub_rows(split))
    return _collect(rows, _math_problem(split), loader="load_math", lenient=lenient, keep=keep, limit=limit)


def load_math_level5(
    path: str | Path | None = None, *, split: str = "test", limit: int | None = None, lenient: bool = False
) -> list[Problem]:
    """MATH Level 5 ("MATH Hard"): the 1324 Level 5 problems of the MATH test set."""
    return load_math(path, split=split, limit=limit, lenient=lenient, levels=[5])


def _math500_problem(record: dict, where: str, index: int) -> Problem:
    question = _text(record, "problem", where)
    answer = _text(record, "answer", where)
    meta: dict[str, Any] = {
        "level": _require(record, "level", where, int, "an integer"),
        "subject": _text(record, "subject", where),
        "unique_id": _text(record, "unique_id", where),
    }
    if not 1 <= meta["level"] <= 5:
        raise RecordError(f"{where}: field 'level': expected a level from 1 to 5, got {meta['level']}")
    if isinstance(record.get("solution"), str):
        meta["solution"] = record["solution"]
    return Problem(f"math500-{index}", question, answer, "math500", meta)


def load_math500(
    path: str | Path | None = None, *, split: str = "test", limit: int | None = None, lenient: bool = False
) -> list[Problem]:
    """MATH-500: answer = the file's ``answer`` field; id "math500-<index>", meta unique_id."""
    rows = _rows("math500", split, path, lambda: _read_hub(HUB_MATH500, None, split))
    return _collect(rows, _math500_problem, loader="load_math500", lenient=lenient, limit=limit)


# ----------------------------------------------------------------------------- SAT math


def _choice_answer(letter: Any, options: dict[str, str], where: str, field_name: str) -> str:
    if not isinstance(letter, str):
        raise RecordError(f"{where}: field '{field_name}': expected an option letter, got {type(letter).__name__}")
    answer = letter.strip().strip("()").upper()
    if answer not in options:
        raise RecordError(f"{where}: field '{field_name}': expected one of {sorted(options)}, got {letter!r}")
    return answer


def _sat32_problem(record: dict, where: str, index: int) -> Problem:
    question = _text(record, "question", where)
    options = parse_options_string(_require(record, "options", where, str, "a string"), where)
    answer = _choice_answer(_require(record, "Answer", where, str, "an option letter"), options, where, "Answer")
    record_id = record.get("id", index)
    if isinstance(record_id, bool) or not (
        isinstance(record_id, int) or (isinstance(record_id, str) and record_id.strip())
    ):
        raise RecordError(
            f"{where}: field 'id': expected a non-empty string or an integer, got {type(record_id).__name__}"
        )
    return Problem(f"sat_math-{record_id}", question, answer, "sat_math", {"options": options, "id": record_id})


_AGIEVAL_QUERY = re.compile(r"^(?P<passage>.*?)Q:\s*(?P<question>.*?)\s*Answer Choices:", re.DOTALL)


def _agieval_problem(record: dict, where: str, index: int) -> Problem:
    if "query" in record:  # the lm-eval-harness export on the hub: query, choices, gold
        return _agieval_hub_problem(record, where, index)
    question = _text(record, "question", where)
    passage = record.get("passage") or ""
    if not isinstance(passage, str):
        raise RecordError(f"{where}: field 'passage': expected a string or null, got {type(passage).__name__}")
    if passage.strip():
        question = f"{passage.strip()}\n{question}"
    options = parse_options_list(_require(record, "options", where, list, "a list"), where)
    answer = _choice_answer(_require(record, "label", where, str, "an option letter"), options, where, "label")
    meta: dict[str, Any] = {"options": options}
    other = record.get("other")
    if isinstance(other, dict) and isinstance(other.get("solution"), str):
        meta["solution"] = other["solution"]
    return Problem(f"agieval_sat_math-{index}", question, answer, "agieval_sat_math", meta)


def _agieval_hub_problem(record: dict, where: str, index: int) -> Problem:
    query = _text(record, "query", where)
    match = _AGIEVAL_QUERY.match(query)
    if match is None:
        raise RecordError(f"{where}: field 'query': expected '[passage] Q: <question> Answer Choices: ...'")
    question = match.group("question").strip()
    if match.group("passage").strip():
        question = f"{match.group('passage').strip()}\n{question}"
    options = parse_options_list(_require(record, "choices", where, list, "a list"), where, "choices")
    gold = _require(record, "gold", where, (list, int), "a list holding one option index")
    gold_index = gold[0] if isinstance(gold, list) and len(gold) == 1 else gold
    if not isinstance(gold_index, int) or isinstance(gold_index, bool) or not 0 <= gold_index < len(options):
        raise RecordError(f"{where}: field 'gold': expected one index into the {len(options)} choices, got {gold!r}")
    answer = chr(ord("A") + gold_index)
    return Problem(f"agieval_sat_math-{index}", question, answer, "agieval_sat_math", {"options": options})


def load_sat_math(
    path: str | Path | None = None,
    *,
    variant: str = "32",
    split: str = "test",
    limit: int | None = None,
    lenient: bool = False,
) -> list[Problem]:
    """SAT math, multiple choice: answer = the letter, meta["options"] = {"A": ..., "B": ..., ...}.

    variant "32": the 32-question set of the paper's SAT MATH figures (id, question, options as
    one string, Answer; data/sat_math/test.jsonl of ZubinGou/math-evaluation-harness); it has no
    hub copy. variant "agieval": AGIEval's 220 (passage prepended to the question, options list,
    label); hub: hails/agieval-sat-math.
    """
    if variant == "32":
        rows = _rows("sat_math_32", split, path, None)
        return _collect(rows, _sat32_problem, loader="load_sat_math", lenient=lenient, limit=limit)
    if variant == "agieval":
        rows = _rows("agieval_sat_math", split, path, lambda: _read_hub(HUB_AGIEVAL_SAT_MATH, None, split))
        return _collect(rows, _agieval_problem, loader="load_sat_math", lenient=lenient, limit=limit)
    raise ValueError(f"load_sat_math: variant must be '32' or 'agieval', got {variant!r}")


# ----------------------------------------------------------------------------- OpenMathInstruct-2


def _question_key(question: str, seed: int | None = None) -> bytes:
    salt = b"" if seed is None else f"{seed}\x00".encode()
    return hashlib.sha256(salt + question.encode("utf-8")).digest()


def _omi2_problem(record: dict, where: str, index: int) -> Problem:
    question = _text(record, "problem", where)
    answer = _text(record, "expected_answer", where)
    meta: dict[str, Any] = {"problem_source": _text(record, "problem_source", where)}
    if isinstance(record.get("generated_solution"), str):
        meta["solution"] = record["generated_solution"]
    problem_id = f"openmathinstruct2-{_question_key(question).hex()[:16]}"
    return Problem(problem_id, question, answer, "openmathinstruct2", meta)


def load_openmathinstruct2(
    path: str | Path | None = None,
    *,
    split: str = "train_1M",
    limit: int | None = None,
    lenient: bool = False,
    problem_sources: Iterable[str] | None = None,
    subset_size: int | None = None,
    seed: int = 0,
) -> list[Problem]:
    """OpenMathInstruct-2 problems: answer = expected_answer; one Problem per distinct question.

    The dataset repeats each question once per generated solution: the first row of a question
    is kept. ``problem_sources`` keeps those origins (e.g. ["augmented_math"]). ``subset_size``
    draws a deterministic random subset: the questions with the smallest sha256(seed, question),
    so a subset does not depend on row order and a smaller one is contained in a larger one
    (it reads the whole split). The id is a hash of the question ("openmathinstruct2-<16 hex>"),
    stable across splits. Hub: streamed, so the 14M-row dataset is never downloaded whole.
    """
    if subset_size is not None and subset_size < 0:
        raise ValueError(f"load_openmathinstruct2: subset_size must be >= 0, got {subset_size}")
    wanted = set(problem_sources) if problem_sources else None
    seen: set[bytes] = set()

    def keep(problem: Problem) -> bool:
        if wanted is not None and problem.meta["problem_source"] not in wanted:
            return False
        key = _question_key(problem.question)[:16]
        if key in seen:
            return False
        seen.add(key)
        return True

    rows = _rows(
        "openmathinstruct2", split, path, lambda: _read_hub(HUB_OPENMATHINSTRUCT2, None, split, streaming=True)
    )
    if subset_size is None:
        return _collect(rows, _omi2_problem, loader="load_openmathinstruct2", lenient=lenient, keep=keep, limit=limit)
    problems = _collect(rows, _omi2_problem, loader="load_openmathinstruct2", lenient=lenient, keep=keep)
    chosen = heapq.nsmallest(subset_size, range(len(problems)), key=lambda i: _question_key(problems[i].question, seed))
    subset = [problems[i] for i in sorted(chosen)]  # back in file order
    return subset if limit is None else subset[:limit]


# ----------------------------------------------------------------------------- our own JSONL


def load_problems_jsonl(path: str | Path, *, limit: int | None = None, lenient: bool = False) -> list[Problem]:
    """Problems-contract records {problem_id, question, answer, source, meta} (JSONL or JSON array),
    each validated by ``Problem.from_json``; problem ids must be unique."""
    return _collect(
        _read_local(path),
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
    for where, record, error in _read_local(path):
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


# ----------------------------------------------------------------------------- dispatch


def _load_sat_math_32(path=None, **kw) -> list[Problem]:
    return load_sat_math(path, variant="32", **kw)


def _load_agieval_sat_math(path=None, **kw) -> list[Problem]:
    return load_sat_math(path, variant="agieval", **kw)


def _load_problems(path=None, **kw) -> list[Problem]:
    if path is None:
        raise ValueError("load_benchmark('problems') needs a path to a problems JSONL file")
    return load_problems_jsonl(path, **kw)


BENCHMARK_LOADERS: dict[str, Callable[..., list[Problem]]] = {
    "gsm8k": load_gsm8k,
    "math": load_math,
    "math_level5": load_math_level5,
    "math500": load_math500,
    "sat_math_32": _load_sat_math_32,
    "agieval_sat_math": _load_agieval_sat_math,
    "openmathinstruct2": load_openmathinstruct2,
    "problems": _load_problems,
}


def load_benchmark(name: str, path: str | Path | None = None, **kw: Any) -> list[Problem]:
    """Load a benchmark by name (see BENCHMARK_LOADERS); ``kw`` goes to its loader."""
    try:
        loader = BENCHMARK_LOADERS[name]
    except KeyError:
        raise ValueError(f"unknown benchmark {name!r}; expected one of {sorted(BENCHMARK_LOADERS)}") from None
    return loader(path, **kw)

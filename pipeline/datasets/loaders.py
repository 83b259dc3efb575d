"""The benchmark loaders: every benchmark as a list of ``pipeline.records.Problem``.

Every benchmark becomes a list of ``Problem(problem_id, question, answer, source, meta)``, the
JSONL problems contract of DESIGN.md, read from a local file when given a path, else from the
repository's checked copy or the hub's (``pipeline.datasets.copies`` says which). Field layouts,
hub ids and every mapping decision are in docs/data.md, "Benchmarks". The fields holding answers
and options are read by ``pipeline.datasets.fields``; malformed records and ``lenient``:
``pipeline.datasets.problems``.
"""

from __future__ import annotations

import hashlib
import heapq
import re
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

from pipeline.datasets.copies import benchmark_rows, read_hub_rows
from pipeline.datasets.fields import gsm8k_final_answer, math_final_answer, parse_options_list, parse_options_string
from pipeline.datasets.problems import Row, collect_problems, load_problems_jsonl, require_field, text_field
from pipeline.records import Problem, RecordError

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


# ----------------------------------------------------------------------------- GSM8K

_NUMBER = re.compile(r"[-+]?(\d+(\.\d*)?|\.\d+)")


def _gsm8k_problem(split: str) -> Callable[[dict, str, int], Problem]:
    def convert(record: dict, where: str, index: int) -> Problem:
        question = text_field(record, "question", where)
        solution = text_field(record, "answer", where)
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
    rows = benchmark_rows("gsm8k", split, path, lambda: read_hub_rows(HUB_GSM8K[0], HUB_GSM8K[1], split))
    return collect_problems(rows, _gsm8k_problem(split), loader="load_gsm8k", lenient=lenient, limit=limit)


# ----------------------------------------------------------------------------- MATH and MATH-500

_LEVEL = re.compile(r"^\s*(?:Level\s*)?([1-5])\s*$")


def _math_level(record: dict, where: str) -> int | None:
    """'Level 5' or 5 -> 5; MATH has a few 'Level ?' (train split): None, kept unless filtered."""
    value = require_field(record, "level", where, (str, int), "'Level N' or an integer")
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
        question = text_field(record, "problem", where)
        solution = text_field(record, "solution", where)
        answer = math_final_answer(solution)
        if not answer:
            raise RecordError(f"{where}: field 'solution': expected a final \\boxed{{...}} answer")
        subject = text_field(record, "type", where)
        meta: dict[str, Any] = {"level": _math_level(record, where), "subject": subject, "solution": solution}
        ordinal = index
        if "idx" in record:
            ordinal = require_field(record, "idx", where, int, "an integer")
            meta["idx"] = ordinal
        return Problem(f"math-{split}-{ordinal}", question, answer, "math", meta)

    return convert


def _math_hub_rows(split: str) -> Iterator[Row]:
    for config in HUB_MATH_CONFIGS:
        yield from read_hub_rows(HUB_MATH, config, split)


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

    rows = benchmark_rows("math", split, path, lambda: _math_hub_rows(split))
    return collect_problems(rows, _math_problem(split), loader="load_math", lenient=lenient, keep=keep, limit=limit)


def load_math_level5(
    path: str | Path | None = None, *, split: str = "test", limit: int | None = None, lenient: bool = False
) -> list[Problem]:
    """MATH Level 5 ("MATH Hard"): the 1324 Level 5 problems of the MATH test set."""
    return load_math(path, split=split, limit=limit, lenient=lenient, levels=[5])


def _math500_problem(record: dict, where: str, index: int) -> Problem:
    question = text_field(record, "problem", where)
    answer = text_field(record, "answer", where)
    meta: dict[str, Any] = {
        "level": require_field(record, "level", where, int, "an integer"),
        "subject": text_field(record, "subject", where),
        "unique_id": text_field(record, "unique_id", where),
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
    rows = benchmark_rows("math500", split, path, lambda: read_hub_rows(HUB_MATH500, None, split))
    return collect_problems(rows, _math500_problem, loader="load_math500", lenient=lenient, limit=limit)


# ----------------------------------------------------------------------------- SAT math


def _choice_answer(letter: Any, options: dict[str, str], where: str, field_name: str) -> str:
    if not isinstance(letter, str):
        raise RecordError(f"{where}: field '{field_name}': expected an option letter, got {type(letter).__name__}")
    answer = letter.strip().strip("()").upper()
    if answer not in options:
        raise RecordError(f"{where}: field '{field_name}': expected one of {sorted(options)}, got {letter!r}")
    return answer


def _sat32_problem(record: dict, where: str, index: int) -> Problem:
    question = text_field(record, "question", where)
    options = parse_options_string(require_field(record, "options", where, str, "a string"), where)
    answer = _choice_answer(require_field(record, "Answer", where, str, "an option letter"), options, where, "Answer")
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
    question = text_field(record, "question", where)
    passage = record.get("passage") or ""
    if not isinstance(passage, str):
        raise RecordError(f"{where}: field 'passage': expected a string or null, got {type(passage).__name__}")
    if passage.strip():
        question = f"{passage.strip()}\n{question}"
    options = parse_options_list(require_field(record, "options", where, list, "a list"), where)
    answer = _choice_answer(require_field(record, "label", where, str, "an option letter"), options, where, "label")
    meta: dict[str, Any] = {"options": options}
    other = record.get("other")
    if isinstance(other, dict) and isinstance(other.get("solution"), str):
        meta["solution"] = other["solution"]
    return Problem(f"agieval_sat_math-{index}", question, answer, "agieval_sat_math", meta)


def _agieval_hub_problem(record: dict, where: str, index: int) -> Problem:
    query = text_field(record, "query", where)
    match = _AGIEVAL_QUERY.match(query)
    if match is None:
        raise RecordError(f"{where}: field 'query': expected '[passage] Q: <question> Answer Choices: ...'")
    question = match.group("question").strip()
    if match.group("passage").strip():
        question = f"{match.group('passage').strip()}\n{question}"
    options = parse_options_list(require_field(record, "choices", where, list, "a list"), where, "choices")
    gold = require_field(record, "gold", where, (list, int), "a list holding one option index")
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
        rows = benchmark_rows("sat_math_32", split, path, None)
        return collect_problems(rows, _sat32_problem, loader="load_sat_math", lenient=lenient, limit=limit)
    if variant == "agieval":
        rows = benchmark_rows("agieval_sat_math", split, path, lambda: read_hub_rows(HUB_AGIEVAL_SAT_MATH, None, split))
        return collect_problems(rows, _agieval_problem, loader="load_sat_math", lenient=lenient, limit=limit)
    raise ValueError(f"load_sat_math: variant must be '32' or 'agieval', got {variant!r}")


# ----------------------------------------------------------------------------- OpenMathInstruct-2


def _question_key(question: str, seed: int | None = None) -> bytes:
    salt = b"" if seed is None else f"{seed}\x00".encode()
    return hashlib.sha256(salt + question.encode("utf-8")).digest()


def _omi2_problem(record: dict, where: str, index: int) -> Problem:
    question = text_field(record, "problem", where)
    answer = text_field(record, "expected_answer", where)
    meta: dict[str, Any] = {"problem_source": text_field(record, "problem_source", where)}
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

    rows = benchmark_rows(
        "openmathinstruct2", split, path, lambda: read_hub_rows(HUB_OPENMATHINSTRUCT2, None, split, streaming=True)
    )
    if subset_size is None:
        return collect_problems(
            rows, _omi2_problem, loader="load_openmathinstruct2", lenient=lenient, keep=keep, limit=limit
        )
    problems = collect_problems(rows, _omi2_problem, loader="load_openmathinstruct2", lenient=lenient, keep=keep)
    chosen = heapq.nsmallest(subset_size, range(len(problems)), key=lambda i: _question_key(problems[i].question, seed))
    subset = [problems[i] for i in sorted(chosen)]  # back in file order
    return subset if limit is None else subset[:limit]


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

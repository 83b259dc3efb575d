"""The Problem record and the benchmark loaders, on the real benchmark files (never the hub)."""

from __future__ import annotations

import json
import logging
import random
import sys
import types
from pathlib import Path

import pytest

from pipeline.datasets.copies import SHIPPED_DIR, recorded_files, shipped_file
from pipeline.datasets.fields import math_final_answer, parse_options_list, parse_options_string
from pipeline.datasets.loaders import (
    load_benchmark,
    load_gsm8k,
    load_math,
    load_math500,
    load_math_level5,
    load_openmathinstruct2,
    load_sat_math,
)
from pipeline.datasets.problems import load_problems_jsonl, write_problems_jsonl
from pipeline.records import Problem, RecordError, answer_kind
from pipeline.storage.model_folders import FolderError

FILES = {
    "gsm8k": "gsm8k_test.jsonl",
    "math": "math_test.jsonl",
    "math_level5": "math_test.jsonl",
    "math500": "math500_test.jsonl",
    "sat_math_32": "sat_math_32.jsonl",
    "agieval_sat_math": "agieval_sat_math.jsonl",
}


def _records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def _write_lines(path: Path, lines: list[str]) -> Path:
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def math_test(benchmarks_dir) -> list[Problem]:
    return load_math(benchmarks_dir / "math_test.jsonl")


# ----------------------------------------------------------------------------- counts and dispatch


@pytest.mark.parametrize(
    "name, count, source",
    [
        ("gsm8k", 1319, "gsm8k"),
        ("math", 5000, "math"),
        ("math_level5", 1324, "math"),
        ("math500", 500, "math500"),
        ("sat_math_32", 32, "sat_math"),
        ("agieval_sat_math", 220, "agieval_sat_math"),
    ],
)
def test_load_benchmark_counts_on_the_real_files(benchmarks_dir, name, count, source):
    problems = load_benchmark(name, benchmarks_dir / FILES[name])
    assert len(problems) == count
    assert {p.source for p in problems} == {source}
    assert len({p.problem_id for p in problems}) == count
    assert all(p.question.strip() and p.answer.strip() for p in problems)


def test_load_benchmark_limit_and_unknown_names(benchmarks_dir, tmp_path):
    assert [p.problem_id for p in load_benchmark("gsm8k", benchmarks_dir / FILES["gsm8k"], limit=3)] == [
        "gsm8k-test-0",
        "gsm8k-test-1",
        "gsm8k-test-2",
    ]
    with pytest.raises(ValueError, match="unknown benchmark 'gsm9k'"):
        load_benchmark("gsm9k")
    with pytest.raises(ValueError, match="needs a path"):
        load_benchmark("problems")
    with pytest.raises(ValueError, match="no hub copy"):
        load_benchmark("sat_math_32", "hub")
    path = tmp_path / "problems.jsonl"
    write_problems_jsonl([Problem("p-0", "1+1?", "2", "tiny", {})], path)
    assert load_benchmark("problems", path)[0].answer == "2"


def test_without_a_path_every_loader_reads_the_repository_copy(monkeypatch):
    monkeypatch.delenv("STEPFLOW_BENCHMARKS", raising=False)
    monkeypatch.setitem(sys.modules, "datasets", None)  # a reach for the hub would fail to import it
    for name, file in FILES.items():
        assert load_benchmark(name, limit=2) == load_benchmark(name, SHIPPED_DIR / file, limit=2)
    assert [p.problem_id for p in load_gsm8k(split="train", limit=1)] == ["gsm8k-train-0"]


def test_every_carried_benchmark_file_matches_its_sources_row(monkeypatch):
    monkeypatch.delenv("STEPFLOW_BENCHMARKS", raising=False)
    assert sorted(recorded_files()) == sorted(p.name for p in SHIPPED_DIR.glob("*.jsonl"))
    for name, (size, _) in recorded_files().items():
        assert shipped_file(name).stat().st_size == size


def test_a_missing_or_altered_benchmark_file_is_an_error_naming_it_and_the_folder(tmp_path, monkeypatch):
    monkeypatch.setenv("STEPFLOW_BENCHMARKS", str(tmp_path))
    where = f"sat_math_32.jsonl, looked for in {tmp_path}"
    with pytest.raises(FolderError, match=f"{where}.*: missing"):
        load_benchmark("sat_math_32")
    original = (SHIPPED_DIR / "sat_math_32.jsonl").read_bytes()
    (tmp_path / "sat_math_32.jsonl").write_bytes(original[:-1])
    with pytest.raises(FolderError, match=f"{where}.*: {len(original) - 1} bytes, SOURCES.md records {len(original)}"):
        load_benchmark("sat_math_32")
    position = original.index(b"the")
    (tmp_path / "sat_math_32.jsonl").write_bytes(original[:position] + b"thE" + original[position + 3 :])
    with pytest.raises(FolderError, match=f"{where}.*: its sha256 differs"):
        load_benchmark("sat_math_32")
    (tmp_path / "sat_math_32.jsonl").write_bytes(original)
    assert len(load_benchmark("sat_math_32")) == 32


# ----------------------------------------------------------------------------- GSM8K


def test_gsm8k_answers(benchmarks_dir):
    problems = load_gsm8k(benchmarks_dir / "gsm8k_test.jsonl")
    assert problems[0].answer == "18"
    assert problems[0].question.startswith("Janet\u2019s ducks lay 16 eggs")
    assert problems[0].meta["solution"].endswith("#### 18")
    assert problems[146].answer == "2125"  # "#### 2,125" in the file
    assert not any("," in p.answer for p in problems)
    assert problems[146].problem_id == "gsm8k-test-146"
    train = load_gsm8k(benchmarks_dir / "gsm8k_train.jsonl", split="train", limit=2)
    assert [p.problem_id for p in train] == ["gsm8k-train-0", "gsm8k-train-1"]


# ----------------------------------------------------------------------------- MATH


def test_math_takes_the_last_box_with_nested_braces(math_test):
    by_idx = {p.meta["idx"]: p for p in math_test}
    assert by_idx[91].meta["solution"].count("\\boxed") == 2
    assert by_idx[91].answer == "161"  # the first box holds \frac{2\sqrt{53}+53}{53}
    assert by_idx[2].answer == "\\dfrac{9}{7}"
    assert by_idx[0].answer == "2" and by_idx[0].meta["level"] == 3 and by_idx[0].meta["subject"] == "Algebra"
    assert by_idx[0].problem_id == "math-test-0"


def test_math_level5_filter(benchmarks_dir, math_test):
    hard = load_math_level5(benchmarks_dir / "math_test.jsonl")
    assert len(hard) == 1324 and {p.meta["level"] for p in hard} == {5}
    assert [p.problem_id for p in hard] == [p.problem_id for p in math_test if p.meta["level"] == 5]
    two_levels = load_math(benchmarks_dir / "math_test.jsonl", levels=[1, 2])
    assert len(two_levels) == 437 + 894


def test_math500_answer_field_and_meta(benchmarks_dir):
    problems = load_math500(benchmarks_dir / "math500_test.jsonl")
    assert problems[0].answer == "\\left( 3, \\frac{\\pi}{2} \\right)"
    assert problems[0].meta["unique_id"] == "test/precalculus/807.json"
    assert problems[0].meta["level"] == 2 and problems[0].problem_id == "math500-0"
    # The given answers are the last box of each solution: 500 real cases for the extraction.
    assert all(math_final_answer(p.meta["solution"]) == p.answer for p in problems)


@pytest.mark.parametrize(
    "text, expected",
    [
        ("so $x=\\boxed{\\frac{1}{2}}$.", "\\frac{1}{2}"),
        ("\\boxed{1} then \\boxed{2}", "2"),
        ("\\fbox{7}", "7"),
        ("\\boxed{\\{1, 2\\}}", "\\{1, 2\\}"),
        ("no box here. The answer is 5", None),  # a reference solution needs its box
    ],
)
def test_math_final_answer(text, expected):
    assert math_final_answer(text) == expected


def test_math_loader_on_nested_and_repeated_boxes(tmp_path):
    records = [
        {"problem": "p0", "level": "Level 2", "type": "Algebra", "solution": "So $\\boxed{\\frac{1}{2}}$."},
        {
            "problem": "p1",
            "level": "Level 5",
            "type": "Geometry",
            "solution": "$\\boxed{3}$, so $\\boxed{\\sqrt{x^{2}}}$",
        },
    ]
    path = _write_lines(tmp_path / "math.jsonl", [json.dumps(r) for r in records])
    problems = load_math(path)
    assert [p.answer for p in problems] == ["\\frac{1}{2}", "\\sqrt{x^{2}}"]
    assert [p.problem_id for p in problems] == ["math-test-0", "math-test-1"]
    assert [p.problem_id for p in load_math(path, levels=[5])] == ["math-test-1"]


# ----------------------------------------------------------------------------- SAT math


def test_sat_options_parse_to_letters_for_every_record(benchmarks_dir):
    for problems in (
        load_sat_math(benchmarks_dir / "sat_math_32.jsonl", variant="32"),
        load_sat_math(benchmarks_dir / "agieval_sat_math.jsonl", variant="agieval"),
    ):
        for p in problems:
            assert list(p.meta["options"]) == ["A", "B", "C", "D"], p.problem_id
            assert all(text.strip() for text in p.meta["options"].values()), p.problem_id
            assert p.answer in "ABCD" and len(p.answer) == 1
            assert answer_kind(p.source) == "sat"


def test_sat32_known_records(benchmarks_dir):
    problems = load_sat_math(benchmarks_dir / "sat_math_32.jsonl")
    assert problems[0].problem_id == "sat_math-0" and problems[0].answer == "A"
    assert problems[0].meta["options"]["A"] == "$f(-6)=0$"
    # "data set $B$ B) ..." splits at the marker, not at the letter inside the text.
    assert problems[15].meta["options"]["A"] == "The median of data set A is greater than the median of data set $B$"
    # "A. ... B. ..." style with thousands commas inside the options.
    assert problems[26].meta["options"] == {"A": "1,190", "B": "1,900", "C": "2,900", "D": "19,000"}


def test_agieval_passage_is_prepended(benchmarks_dir):
    raw = _records(benchmarks_dir / "agieval_sat_math.jsonl")
    problems = load_sat_math(benchmarks_dir / "agieval_sat_math.jsonl", variant="agieval")
    with_passage = [i for i, r in enumerate(raw) if r["passage"].strip()]
    assert with_passage
    for i in with_passage:
        assert problems[i].question == f"{raw[i]['passage'].strip()}\n{raw[i]['question']}"
    assert problems[0].question == raw[0]["question"] and problems[0].answer == "D"
    assert problems[0].meta["options"] == {"A": "2", "B": "4", "C": "9", "D": "10"}


def test_parse_options_forms_and_errors():
    assert parse_options_string("A) 1 B) 2 C) 3 D) 4") == {"A": "1", "B": "2", "C": "3", "D": "4"}
    assert parse_options_string("A. U.S. B. C.I.A.") == {"A": "U.S.", "B": "C.I.A."}
    assert parse_options_string("(A) x (B) y (C) z") == {"A": "x", "B": "y", "C": "z"}
    assert parse_options_string("A) 1\nB) 2\nC) 3\nD) 4\nE) 5")["E"] == "5"
    assert parse_options_list(["(A)2", "(B) 4"]) == {"A": "2", "B": "4"}
    with pytest.raises(RecordError, match="field 'options'"):
        parse_options_string("1, 2, 3")
    with pytest.raises(RecordError, match="item 1"):
        parse_options_list(["(A)2", "(C)4"])


# ----------------------------------------------------------------------------- malformed input


def test_malformed_lines_name_file_line_and_field(tmp_path):
    good = json.dumps({"question": "q?", "answer": "so #### 5"})
    cases = [
        ("{not json", "not valid JSON"),
        (json.dumps({"question": "q?"}), "field 'answer': missing"),
        (json.dumps({"question": "q?", "answer": 5}), "field 'answer': expected a string, got int"),
        (json.dumps({"question": "q?", "answer": "no marker"}), "field 'answer': expected a solution ending"),
        (json.dumps(["a", "list"]), "expected a JSON object"),
    ]
    for n, (bad, message) in enumerate(cases):
        path = _write_lines(tmp_path / f"bad{n}.jsonl", [good, "", bad, good])
        with pytest.raises(ValueError, match=rf"bad{n}\.jsonl:3: .*{message}"):
            load_gsm8k(path)
    math_path = _write_lines(
        tmp_path / "math.jsonl",
        [json.dumps({"problem": "p", "solution": "none", "level": "Level 2", "type": "Algebra"})],
    )
    with pytest.raises(ValueError, match=r"math\.jsonl:1: field 'solution'"):
        load_math(math_path)
    sat_path = _write_lines(
        tmp_path / "sat.jsonl", [json.dumps({"question": "q", "options": "A) 1 B) 2", "Answer": "C"})]
    )
    with pytest.raises(ValueError, match=r"sat\.jsonl:1: field 'Answer': expected one of \['A', 'B'\]"):
        load_sat_math(sat_path)


def test_lenient_skips_and_counts(tmp_path, caplog):
    path = _write_lines(
        tmp_path / "mixed.jsonl",
        [
            json.dumps({"question": "a?", "answer": "#### 1"}),
            "{oops",
            json.dumps({"question": "b?", "answer": 2}),
            json.dumps({"question": "c?", "answer": "#### 1,000"}),
        ],
    )
    with caplog.at_level(logging.WARNING, logger="pipeline.datasets.problems"):
        problems = load_gsm8k(path, lenient=True)
    # Ids keep the record's position, so a skipped line never renames the ones after it.
    assert [(p.problem_id, p.answer) for p in problems] == [("gsm8k-test-0", "1"), ("gsm8k-test-3", "1000")]
    assert "skipped 2 malformed record(s)" in caplog.text
    assert "mixed.jsonl:2" in caplog.text


# ----------------------------------------------------------------------------- the record and our JSONL


def test_problem_round_trip_and_answer_kind(tmp_path):
    problem = Problem("math-test-7", "What is $1/2$?", "\\frac{1}{2}", "math", {"level": 1})
    assert Problem.from_json(problem.to_json()) == problem
    assert hash(problem) == hash(Problem.from_json(problem.to_json()))
    assert problem.kind == "math"
    path = tmp_path / "out" / "problems.jsonl"
    assert write_problems_jsonl([problem, Problem("t-1", "2+2?", "4", "tiny", {})], path) == 2
    assert set(json.loads(path.read_text().splitlines()[0])) == {"problem_id", "question", "answer", "source", "meta"}
    assert load_problems_jsonl(path) == [problem, Problem("t-1", "2+2?", "4", "tiny", {})]
    kinds = {
        s: answer_kind(s)
        for s in ["gsm8k", "math", "math500", "sat_math", "agieval_sat_math", "openmathinstruct2", "tiny"]
    }
    assert kinds == {
        "gsm8k": "gsm8k",
        "math": "math",
        "math500": "math",
        "sat_math": "sat",
        "agieval_sat_math": "sat",
        "openmathinstruct2": "math",
        "tiny": "tiny",
    }
    with pytest.raises(ValueError, match="unknown problem source 'aime'"):
        answer_kind("aime")


def test_problem_from_json_errors(tmp_path):
    record = {"problem_id": "p", "question": "q", "answer": "1", "source": "tiny", "meta": {}}
    with pytest.raises(RecordError, match=r"^f\.jsonl:4: field 'meta': expected an object"):
        Problem.from_json({**record, "meta": []}, "f.jsonl:4")
    with pytest.raises(RecordError, match=r"^f\.jsonl:2: missing field 'question'"):
        Problem.from_json({k: v for k, v in record.items() if k != "question"}, "f.jsonl:2")
    assert Problem.from_json({k: v for k, v in record.items() if k != "meta"}).meta == {}
    path = _write_lines(
        tmp_path / "ours.jsonl",
        [json.dumps(record), json.dumps({**record, "source": "nope"}), json.dumps(record)],
    )
    with pytest.raises(RecordError, match=r"ours\.jsonl:2: field 'source'"):
        load_problems_jsonl(path)
    duplicated = _write_lines(tmp_path / "dup.jsonl", [json.dumps(record), json.dumps(record)])
    with pytest.raises(RecordError, match=r"dup\.jsonl:2: field 'problem_id': 'p' appears twice"):
        load_problems_jsonl(duplicated)


def test_json_array_files_load_too(tmp_path, benchmarks_dir):
    records = _records(benchmarks_dir / "math500_test.jsonl")[:3]
    path = tmp_path / "math500.json"
    path.write_text(json.dumps(records, indent=1), encoding="utf-8")
    assert [p.answer for p in load_math500(path)] == [r["answer"] for r in records]


# ----------------------------------------------------------------------------- OpenMathInstruct-2


def _omi2_rows() -> list[dict]:
    rows = []
    for i in range(40):
        source = ["augmented_math", "math", "augmented_gsm8k", "gsm8k"][i % 4]
        for copy in range(2 if i % 3 == 0 else 1):  # the dataset repeats a question per solution
            rows.append(
                {
                    "problem": f"Compute {i} + {i}.",
                    "generated_solution": f"sol {copy}",
                    "expected_answer": str(2 * i),
                    "problem_source": source,
                }
            )
    return rows


def test_openmathinstruct2_dedupe_filter_and_subset(tmp_path):
    rows = _omi2_rows()
    path = _write_lines(tmp_path / "omi2.jsonl", [json.dumps(r) for r in rows])
    problems = load_openmathinstruct2(path)
    assert len(problems) == 40 and len({p.problem_id for p in problems}) == 40
    assert problems[3].answer == "6" and problems[0].meta["solution"] == "sol 0"
    augmented = load_openmathinstruct2(path, problem_sources=["augmented_math"])
    assert len(augmented) == 10 and {p.meta["problem_source"] for p in augmented} == {"augmented_math"}

    subset = load_openmathinstruct2(path, subset_size=10, seed=1)
    assert len(subset) == 10
    assert subset == load_openmathinstruct2(path, subset_size=10, seed=1)
    assert {p.problem_id for p in subset} != {
        p.problem_id for p in load_openmathinstruct2(path, subset_size=10, seed=2)
    }
    assert {p.problem_id for p in load_openmathinstruct2(path, subset_size=5, seed=1)} <= {p.problem_id for p in subset}
    # The subset depends on the seed and the questions, not on the row order.
    shuffled = rows[:]
    random.Random(0).shuffle(shuffled)
    other = _write_lines(tmp_path / "shuffled.jsonl", [json.dumps(r) for r in shuffled])
    assert {p.problem_id for p in load_openmathinstruct2(other, subset_size=10, seed=1)} == {
        p.problem_id for p in subset
    }
    assert [p.problem_id for p in subset] == [p.problem_id for p in problems if p in subset]  # file order


# ----------------------------------------------------------------------------- the hub branch (faked)


class FakeHub:
    """Stands in for the `datasets` module: answers load_dataset from in-memory rows."""

    def __init__(self, tables: dict[tuple, list[dict]]):
        self.tables = tables
        self.calls: list[tuple] = []

    def load_dataset(self, hub_id, config=None, *, split, streaming=False):
        self.calls.append((hub_id, config, split, streaming))
        rows = self.tables[(hub_id, config, split)]
        return iter(rows) if streaming else list(rows)


@pytest.fixture
def fake_hub(monkeypatch):
    def install(tables):
        hub = FakeHub(tables)
        monkeypatch.setitem(sys.modules, "datasets", types.SimpleNamespace(load_dataset=hub.load_dataset))
        return hub

    return install


def test_hub_branch_maps_fields_like_the_files(benchmarks_dir, fake_hub):
    gsm8k = _records(benchmarks_dir / "gsm8k_test.jsonl")[:20]
    math = _records(benchmarks_dir / "math_test.jsonl")
    math500 = _records(benchmarks_dir / "math500_test.jsonl")[:20]
    subjects = {
        "algebra": "Algebra",
        "counting_and_probability": "Counting & Probability",
        "geometry": "Geometry",
        "intermediate_algebra": "Intermediate Algebra",
        "number_theory": "Number Theory",
        "prealgebra": "Prealgebra",
        "precalculus": "Precalculus",
    }
    # The hub's MATH has no idx: per-subject configs, read in alphabetical order.
    tables = {("openai/gsm8k", "main", "test"): gsm8k, ("HuggingFaceH4/MATH-500", None, "test"): math500}
    for config, subject in subjects.items():
        tables[("EleutherAI/hendrycks_math", config, "test")] = [
            {k: v for k, v in r.items() if k != "idx"} for r in math if r["type"] == subject
        ]
    hub = fake_hub(tables)

    local_gsm8k = load_gsm8k(benchmarks_dir / "gsm8k_test.jsonl", limit=20)
    assert load_gsm8k("hub") == local_gsm8k
    local_math = load_math(benchmarks_dir / "math_test.jsonl")
    from_hub = load_math("hub")
    assert len(from_hub) == 5000
    assert [(p.problem_id, p.question, p.answer, p.meta["level"]) for p in from_hub] == [
        (p.problem_id, p.question, p.answer, p.meta["level"]) for p in local_math
    ]
    assert len(load_math_level5("hub")) == 1324
    assert load_math500("hub") == load_math500(benchmarks_dir / "math500_test.jsonl", limit=20)
    assert ("openai/gsm8k", "main", "test", False) in hub.calls


def test_hub_agieval_export_maps_like_the_file(benchmarks_dir, fake_hub):
    raw = _records(benchmarks_dir / "agieval_sat_math.jsonl")
    # lm-eval-harness's export: query = [passage] "Q: " question " Answer Choices: " options.
    exported = [
        {
            "query": f"{r['passage']}Q: {r['question']} Answer Choices: {' '.join(r['options'])}\nA: Among A through D, the answer is",
            "choices": r["options"],
            "gold": ["ABCD".index(r["label"])],
        }
        for r in raw
    ]
    fake_hub({("hails/agieval-sat-math", None, "test"): exported})
    local = load_sat_math(benchmarks_dir / "agieval_sat_math.jsonl", variant="agieval")
    from_hub = load_sat_math("hub", variant="agieval")
    assert [(p.problem_id, p.question.strip(), p.answer, p.meta["options"]) for p in from_hub] == [
        (p.problem_id, p.question.strip(), p.answer, p.meta["options"]) for p in local
    ]


def test_hub_openmathinstruct2_streams(fake_hub):
    hub = fake_hub({("nvidia/OpenMathInstruct-2", None, "train_1M"): _omi2_rows()})
    problems = load_openmathinstruct2(problem_sources=["gsm8k"], limit=3)
    assert len(problems) == 3 and {p.meta["problem_source"] for p in problems} == {"gsm8k"}
    assert hub.calls == [("nvidia/OpenMathInstruct-2", None, "train_1M", True)]


# ----------------------------------------------------------------------------- hostile inputs

MATH_RECORD = {"problem": "p", "solution": "so \\boxed{3}", "level": "Level 2", "type": "Algebra"}


@pytest.mark.parametrize(
    "name,loader",
    [
        ("gsm8k", load_gsm8k),
        ("math", load_math),
        ("math500", load_math500),
        ("sat32", load_sat_math),
        ("problems", load_problems_jsonl),
        ("omi2", load_openmathinstruct2),
    ],
)
@pytest.mark.parametrize("content", ["", "\n\n  \n", "[]"])
def test_an_empty_input_is_an_error(tmp_path, name, loader, content):
    path = tmp_path / f"{name}.jsonl"
    path.write_text(content)
    with pytest.raises(RecordError, match=rf"{name}\.jsonl: no records"):
        loader(path)


def test_invalid_utf8_and_deep_nesting_name_the_line_and_lenient_skips_them(tmp_path, caplog):
    good = json.dumps({"question": "q?", "answer": "so #### 5"}).encode()
    path = tmp_path / "g.jsonl"
    path.write_bytes(
        good
        + b"\n"
        + b'{"question": "caf\xe9", "answer": "#### 1"}\n'
        + b'{"a": '
        + b"[" * 100_000
        + b"]" * 100_000
        + b"}\n"
        + good
        + b"\n"
    )
    with pytest.raises(RecordError, match=r"g\.jsonl:2: not valid UTF-8"):
        load_gsm8k(path)
    path.write_bytes(good + b"\n" + b'{"a": ' + b"[" * 100_000 + b"]" * 100_000 + b"}\n")
    with pytest.raises(RecordError, match=r"g\.jsonl:2: JSON nested too deeply"):
        load_gsm8k(path)
    path.write_bytes(
        good
        + b"\n"
        + b'{"question": "caf\xe9", "answer": "#### 1"}\n'
        + b'{"a": '
        + b"[" * 100_000
        + b"]" * 100_000
        + b"}\n"
        + good
        + b"\n"
    )
    with caplog.at_level(logging.WARNING, logger="pipeline.datasets.problems"):
        problems = load_gsm8k(path, lenient=True)
    assert [p.problem_id for p in problems] == ["gsm8k-test-0", "gsm8k-test-3"]
    assert "skipped 2 malformed record(s) of 4" in caplog.text and "g.jsonl:2: not valid UTF-8" in caplog.text
    (tmp_path / "bad.jsonl").write_bytes(b"\xff\xfe\n")
    with pytest.raises(RecordError, match=r"no problems \(all 1 records were malformed\)"):
        load_gsm8k(tmp_path / "bad.jsonl", lenient=True)


def test_duplicate_ids_are_errors(tmp_path):
    math = _write_lines(
        tmp_path / "math.jsonl", [json.dumps({**MATH_RECORD, "idx": 7}), json.dumps({**MATH_RECORD, "idx": 7})]
    )
    with pytest.raises(
        RecordError,
        match=r"math\.jsonl:2: field 'problem_id': 'math-test-7' appears twice \(first at .*math\.jsonl:1\)",
    ):
        load_math(math)
    sat = {"question": "q", "options": "A) 1 B) 2", "Answer": "A", "id": "x1"}
    path = _write_lines(tmp_path / "sat.jsonl", [json.dumps(sat), json.dumps(sat)])
    with pytest.raises(RecordError, match=r"sat\.jsonl:2: field 'problem_id': 'sat_math-x1' appears twice"):
        load_sat_math(path)
    assert len(load_sat_math(path, lenient=True)) == 1  # lenient: the repeat is a counted skip


@pytest.mark.parametrize(
    "record,message",
    [
        (
            {"question": "q", "options": "A) 1 B) 2", "Answer": "A", "id": {"x": [1, 2]}},
            r"field 'id': expected a non-empty string or an integer, got dict",
        ),
        ({"question": "q", "options": "A) 1 B) 2", "Answer": "A", "id": True}, r"field 'id'"),
        ({"question": "q", "options": "A) 1 B) 2", "Answer": "A", "id": " "}, r"field 'id'"),
    ],
)
def test_sat_ids_must_be_strings_or_integers(tmp_path, record, message):
    with pytest.raises(RecordError, match=rf"sat\.jsonl:1: {message}"):
        load_sat_math(_write_lines(tmp_path / "sat.jsonl", [json.dumps(record)]))


@pytest.mark.parametrize("answer", ["banana", "12 apples", "", "1/2", "$5"])
def test_gsm8k_answers_must_be_numbers(tmp_path, answer):
    path = _write_lines(tmp_path / "g.jsonl", [json.dumps({"question": "q?", "answer": f"so #### {answer}"})])
    with pytest.raises(RecordError, match=r"g\.jsonl:1: field 'answer': expected a solution ending in '#### <number>'"):
        load_gsm8k(path)


@pytest.mark.parametrize("number", ["-3", "1,000", "2.5", "+7"])
def test_gsm8k_numeric_answers_load(tmp_path, number):
    path = _write_lines(tmp_path / "g.jsonl", [json.dumps({"question": "q?", "answer": f"so #### {number}"})])
    assert load_gsm8k(path)[0].answer == number.replace(",", "")


@pytest.mark.parametrize("level", [-3, 0, 6, 99, "Level 9"])
def test_math_levels_outside_1_to_5_are_errors(tmp_path, level):
    path = _write_lines(tmp_path / "m.jsonl", [json.dumps({**MATH_RECORD, "level": level})])
    with pytest.raises(RecordError, match=r"m\.jsonl:1: field 'level'"):
        load_math(path)
    if isinstance(level, int):
        m500 = _write_lines(
            tmp_path / "m500.jsonl",
            [json.dumps({"problem": "p", "answer": "3", "level": level, "subject": "s", "unique_id": "u"})],
        )
        with pytest.raises(RecordError, match=r"m500\.jsonl:1: field 'level': expected a level from 1 to 5"):
            load_math500(m500)


def test_a_filter_that_leaves_nothing_is_an_error(tmp_path):
    path = _write_lines(tmp_path / "m.jsonl", [json.dumps(MATH_RECORD)])
    with pytest.raises(RecordError, match=r"m\.jsonl: no problems \(none of the 1 records passed the filter\)"):
        load_math_level5(path)


def test_data_lenient_reaches_the_stages_loader(tmp_path):
    from pipeline.config.loader import load_config
    from stages.inputs import training_problems

    good = {"problem_id": "p1", "question": "q", "answer": "1", "source": "tiny"}
    path = _write_lines(tmp_path / "train.jsonl", [json.dumps(good), "{oops", json.dumps({**good, "problem_id": "p2"})])
    with pytest.raises(RecordError, match=r"train\.jsonl:2: not valid JSON"):
        training_problems(load_config(None, [f"data.train_path={path}"]))
    assert [
        p.problem_id for p in training_problems(load_config(None, [f"data.train_path={path}", "data.lenient=true"]))
    ] == ["p1", "p2"]


def test_training_problems_that_share_a_question_with_a_disjoint_from_file_are_refused(tmp_path):
    from pipeline.config.loader import load_config
    from pipeline.storage.files import InputNotFound
    from stages.inputs import training_problems

    def record(problem_id, question):
        return json.dumps({"problem_id": problem_id, "question": question, "answer": "1", "source": "tiny"})

    base = _write_lines(
        tmp_path / "base_train.jsonl", [record("b0", "q zero"), record("b1", "q one"), record("b2", "q two")]
    )
    rl = _write_lines(tmp_path / "rl.jsonl", [record("r0", "q new"), "", record("r1", "q two"), record("r2", "q one")])
    clean = _write_lines(tmp_path / "clean.jsonl", [record("r0", "q new"), record("r1", "q newer")])
    # the first shared problem in the training file's order, with its id and line in both files (line 3: a blank line counts)
    with pytest.raises(
        RecordError,
        match=r"rl\.jsonl \(data\.train_path\) and .*base_train\.jsonl share 2 of 3 questions; "
        r"first: 'r1' at .*rl\.jsonl:3 is 'b2' at .*base_train\.jsonl:3",
    ):
        training_problems(load_config(None, [f"data.train_path={rl}", f"data.disjoint_from=[{base}]"]))
    assert [
        p.problem_id
        for p in training_problems(load_config(None, [f"data.train_path={clean}", f"data.disjoint_from=[{base}]"]))
    ] == ["r0", "r1"]
    assert (
        len(training_problems(load_config(None, [f"data.train_path={rl}"]))) == 3
    )  # nothing to be disjoint from: no check
    with pytest.raises(InputNotFound, match=r"data\.disjoint_from: .*nope\.jsonl not found"):
        training_problems(
            load_config(None, [f"data.train_path={clean}", f"data.disjoint_from=[{tmp_path / 'nope.jsonl'}]"])
        )
    broken = _write_lines(tmp_path / "broken.jsonl", [record("b0", "q zero"), "{oops"])
    with pytest.raises(RecordError, match=r"broken\.jsonl:2: not valid JSON"):
        training_problems(load_config(None, [f"data.train_path={clean}", f"data.disjoint_from=[{broken}]"]))


def test_the_tiny_config_trains_the_later_stages_on_the_rl_split_disjoint_from_the_bootstraps(tmp_path):
    from pipeline.config.loader import load_config
    from pipeline.config.schema import TinyWorldConfig
    from pipeline.datasets.problems import write_problems_jsonl
    from pipeline.tinyworld import generate_splits
    from stages.inputs import training_problems

    config = load_config(
        Path(__file__).resolve().parents[1] / "configs" / "tiny.yaml", [f"runs_root={tmp_path}", "run=d"]
    )
    assert config.data.train_path.endswith("/bootstrap/problems_rl.jsonl")
    splits = generate_splits(TinyWorldConfig(n_train=30, n_val=2, n_test=2, n_rl=20))
    out = tmp_path / "d" / "bootstrap"
    out.mkdir(parents=True)
    for name, problems in splits.items():
        write_problems_jsonl(problems, out / f"problems_{name}.jsonl")
    assert [p.problem_id for p in training_problems(config)] == [f"tiny-rl-{i:05d}" for i in range(20)]
    write_problems_jsonl(
        splits["rl"] + splits["train"][5:6], out / "problems_rl.jsonl"
    )  # one of the bootstrap's problems slipped in
    with pytest.raises(
        RecordError,
        match=r"problems_rl\.jsonl \(data\.train_path\) and .*problems_train\.jsonl share 1 of 21 "
        r"questions; first: 'tiny-train-00005' at .*problems_rl\.jsonl:21 is 'tiny-train-00005' at "
        r".*problems_train\.jsonl:6",
    ):
        training_problems(config)

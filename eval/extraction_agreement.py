"""Our answer extraction measured against Math-Verify's: on each text, does
pipeline.grading.extract_answer find the answer math_verify.parse finds?

Per text: ours = extract_answer(text, kind); theirs = math_verify.parse(text) (its default
extraction: LaTeX and plain expressions, the last boxed answer first). They agree when both find
nothing, or both find something and Math-Verify's verify calls ours (parsed as ``\\boxed{ours}``)
equal to theirs. Where they disagree and a gold answer is known, each side is graded against it
(ours with our grader, theirs with Math-Verify's verify), so the disagreement says which is right.

    python -m eval.extraction_agreement [--out FILE]   # MATH-500 (+ MATH test) gold solutions, tests/data samples

Trusted inputs only (benchmark files, the tests' data): Math-Verify runs in this process, with
its own timeouts, not in the grader's sandboxed child.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from pathlib import Path

from math_verify import parse, verify

from pipeline.datasets.copies import benchmarks_dir
from pipeline.grading import answers_equal, extract_answer
from pipeline.records import Problem, Sample
from pipeline.storage.files import read_records

REPO = Path(__file__).resolve().parents[1]
NUMERIC_KINDS = ("math", "gsm8k", "tiny")  # Math-Verify reads math; a multiple-choice letter (sat) is not its business


def math_verify_answer(text: str) -> list:
    """math_verify.parse of a whole text ([] when it finds no answer)."""
    return parse(text)


def same_answer(ours: str | None, theirs: list) -> bool:
    """Whether our extracted answer and Math-Verify's parse are the same answer (module docstring)."""
    if ours is None or not ours.strip():
        return not theirs
    if not theirs:
        return False
    return bool(verify(theirs, parse("\\boxed{" + ours + "}")))


def compare(
    texts: Sequence[str], kind: str, golds: Sequence[str | None] | None = None, ids: Sequence[str] | None = None
) -> dict:
    """{n, agree, share, disagreements: [{id, ours, theirs, gold, ours_right, theirs_right}]}."""
    golds = golds if golds is not None else [None] * len(texts)
    ids = ids if ids is not None else [str(i) for i in range(len(texts))]
    agree, disagreements = 0, []
    for text, gold, item in zip(texts, golds, ids, strict=True):
        ours = extract_answer(text, kind)
        theirs = math_verify_answer(text)
        if same_answer(ours, theirs):
            agree += 1
            continue
        row = {"id": item, "ours": ours, "theirs": str(theirs[-1]) if theirs else None, "gold": gold}
        if gold is not None:
            row["ours_right"] = ours is not None and answers_equal(ours, gold, kind)
            row["theirs_right"] = bool(theirs) and bool(verify(parse("\\boxed{" + gold + "}"), theirs))
        disagreements.append(row)
    return {
        "n": len(texts),
        "agree": agree,
        "share": agree / len(texts) if texts else None,
        "disagreements": disagreements,
    }


def math_texts(path: str | Path) -> tuple[list[str], list[str | None], list[str]]:
    """(gold solutions, their answers (None where the file has none: MATH's test split), ids)."""
    rows = [json.loads(line) for line in Path(path).read_text(encoding="utf-8").splitlines() if line.strip()]
    return (
        [r["solution"] for r in rows],
        [r.get("answer") for r in rows],
        [str(r.get("unique_id", r.get("idx", i))) for i, r in enumerate(rows)],
    )


def sample_texts(samples: str | Path, problems: str | Path) -> dict[str, tuple[list[str], list[str | None], list[str]]]:
    """The tests' policy samples of NUMERIC_KINDS by grading kind: {kind: (texts, golds, ids)}; a
    sample's text is its steps joined by newlines."""
    by_id = {p.problem_id: p for p in read_records(problems, Problem)}
    out: dict[str, tuple[list, list, list]] = {}
    for sample in read_records(samples, Sample):
        problem = by_id.get(sample.problem_id)
        if problem is None or not sample.steps or problem.kind not in NUMERIC_KINDS:
            continue
        texts, golds, ids = out.setdefault(problem.kind, ([], [], []))
        texts.append("\n".join(sample.steps))
        golds.append(problem.answer or None)
        ids.append(f"{sample.problem_id}#{sample.sample_idx}")
    return out


def measure(benchmarks: str | Path) -> dict:
    """Agreement on the gold solutions of MATH-500 (and of MATH's whole test split where the file
    is there) and on tests/data's policy samples."""
    results = {}
    for name, file in (
        ("math500_gold_solutions", "math500_test.jsonl"),
        ("math_test_gold_solutions", "math_test.jsonl"),
    ):
        if (Path(benchmarks) / file).is_file():
            texts, golds, ids = math_texts(Path(benchmarks) / file)
            results[name] = compare(texts, "math", golds, ids)
    data = REPO / "tests" / "data" / "records"
    for kind, (texts, golds, ids) in sample_texts(data / "samples.jsonl", data / "problems.jsonl").items():
        results[f"test_samples_{kind}"] = compare(texts, kind, golds, ids)
    return results


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(prog="python -m eval.extraction_agreement", description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--benchmarks",
        default=str(benchmarks_dir()),
        help="the benchmark folder (default: $STEPFLOW_BENCHMARKS or data/benchmarks)",
    )
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    args = parser.parse_args(argv)
    results = measure(args.benchmarks)
    for name, result in results.items():
        print(f"{name}: {result['agree']}/{result['n']} agree ({result['share']:.4f})")
        for row in result["disagreements"]:
            print(f"  {row}")
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1), encoding="utf-8")
    return results


if __name__ == "__main__":
    main()

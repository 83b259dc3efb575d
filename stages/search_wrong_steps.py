"""The wrong steps of a finished search, read again from its solutions without searching again.

    python -m stages.search_wrong_steps --config runs/<run>/search/config.yaml

Reads:  runs/<run>/search/solutions.jsonl (make search) and the benchmark's problems, found as
        make search finds them (stages.search.search_problems: for tiny_test the bootstrap
        stage's problems_test.jsonl)
Prints: per strategy and k, the wrongly answered solutions by the category of their first wrong
        step (prm.search.wrong_steps: counts and shares), as a markdown table. Writes nothing:
        a search made before make search classified its wrong steps is measured where it lies.
"""

from __future__ import annotations

from collections.abc import Sequence

from pipeline.records import SearchRecord
from pipeline.storage.files import read_records
from prm.search.summary import grade_results
from prm.search.wrong_steps import WRONG_STEP_CATEGORIES, wrong_step_classifier
from stages.cli import cli, parse_args
from stages.inputs import require_records
from stages.search import search_problems, wrong_steps_of


def wrong_step_rows(solutions: Sequence[SearchRecord], problems, source: str = "solutions") -> list[dict]:
    """One row per (strategy, k) of ``solutions`` (in the order first seen): {strategy, k, n_problems,
    accuracy (share graded right), wrong_steps (prm.search.wrong_steps.summarize_wrong_steps)}.
    Every (strategy, k) must hold one solution per problem, in the problems' order (as make search
    writes them); ``source`` names the file in the error otherwise."""
    kinds = {p.kind for p in problems}
    if len(kinds) != 1:
        raise SystemExit(f"search_wrong_steps: problems mix answer kinds {sorted(kinds)}")
    kind = kinds.pop()
    classifier, not_classified = wrong_step_classifier(problems, kind)
    groups: dict[tuple[str, int], list[SearchRecord]] = {}
    for record in solutions:
        groups.setdefault((record.strategy, record.k), []).append(record)
    ids = [p.problem_id for p in problems]
    rows = []
    for (strategy, k), records in groups.items():
        if [r.problem_id for r in records] != ids:
            raise SystemExit(
                f"{source}: strategy {strategy!r} k={k} has solutions of {len(records)} problems that are not the "
                f"benchmark's {len(ids)} in order (first: {records[0].problem_id!r}, expected {ids[0]!r})"
            )
        correct = grade_results(records, [p.answer for p in problems], kind)
        rows.append(
            {
                "strategy": strategy,
                "k": k,
                "n_problems": len(records),
                "accuracy": sum(correct) / len(correct),
                "wrong_steps": wrong_steps_of(records, problems, correct, classifier, not_classified),
            }
        )
    return rows


def wrong_steps_table(rows: Sequence[dict]) -> str:
    """The rows as a markdown table: per category "count (share)"; "-" where not measured."""
    lines = [
        "| strategy | k | accuracy | wrong | " + " | ".join(WRONG_STEP_CATEGORIES) + " |",
        "|---|---:|---:|---:|" + "---:|" * len(WRONG_STEP_CATEGORIES),
    ]
    for row in rows:
        wrong = row["wrong_steps"]
        if wrong["n_wrong"] is None:
            cells = ["-"] * (1 + len(WRONG_STEP_CATEGORIES))
        else:
            cells = [str(wrong["n_wrong"])] + [
                f"{wrong['counts'][c]}" + ("" if wrong["shares"][c] is None else f" ({wrong['shares'][c]:.2f})")
                for c in WRONG_STEP_CATEGORIES
            ]
        lines.append(f"| {row['strategy']} | {row['k']} | {row['accuracy']:.3f} | " + " | ".join(cells) + " |")
    notes = sorted({row["wrong_steps"]["note"] for row in rows if "note" in row["wrong_steps"]})
    return "\n".join(lines + [f"\n{note}" for note in notes]) + "\n"


def main(argv: list[str] | None = None) -> list[dict]:
    config = parse_args("search_wrong_steps", argv)
    problems = search_problems(config)
    path = config.stage_dir("search") / "solutions.jsonl"
    solutions = require_records(path, lambda p: list(read_records(p, SearchRecord)), "search")
    rows = wrong_step_rows(solutions, problems, source=str(path))
    print(wrong_steps_table(rows), end="")
    return rows


if __name__ == "__main__":
    cli(main)

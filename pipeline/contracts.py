"""The DESIGN.md data contracts as checks of a finished run, used by `make demo` and the
end-to-end test.

Every line of a stage's output is validated by its record type (pipeline.records). A check
returns a list of problems ("file:line: field ...") instead of raising, so a run's report can
list every violation at once.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

from pipeline.records import MCTSRecord, MCTSSummary, PRMExample, Problem, Record, RecordError, Sample


def check_files(paths: Iterable[Path], record_type: type[Record] | None, min_records: int = 1) -> list[str]:
    """Every line of the files as a ``record_type`` (None: any JSON object, for metrics); the
    problems found, and one more when there are fewer than ``min_records`` lines in all."""
    paths = list(paths)
    what = record_type.__name__ if record_type is not None else "JSON object"
    if not paths:
        return [f"no {what} files found"]
    problems, count = [], 0
    for path in paths:
        for line_no, line in enumerate(Path(path).read_text(encoding="utf-8").splitlines(), start=1):
            if not line.strip():
                continue
            count += 1
            where = f"{path}:{line_no}"
            try:
                obj = json.loads(line)
            except json.JSONDecodeError:
                problems.append(f"{where}: not valid JSON")
                continue
            if record_type is None:
                if not isinstance(obj, dict):
                    problems.append(f"{where}: not a JSON object")
                continue
            try:
                record_type.from_json(obj, where)
            except RecordError as error:
                problems.append(str(error))
    if count < min_records:
        problems.append(f"{what}: {count} records in {', '.join(map(str, paths))}, expected at least {min_records}")
    return problems


def check_run(run_dir: Path, reports_dir: Path) -> list[str]:
    """Every stage output of a finished run against its contract."""
    run_dir, reports_dir = Path(run_dir), Path(reports_dir)
    shards = run_dir / "mcts" / "shards"
    problems = []
    problems += check_files(sorted((run_dir / "bootstrap").glob("problems_*.jsonl")), Problem)
    problems += check_files(sorted(shards.glob("part-*/records.jsonl")), MCTSRecord)
    problems += check_files(sorted(shards.glob("part-*/summaries.jsonl")), MCTSSummary)
    problems += check_files(
        [p for p in (run_dir / "augment" / "prm_train.jsonl", run_dir / "augment" / "prm_val.jsonl") if p.exists()],
        PRMExample,
    )
    for stage in ("gfn", "ppo"):
        problems += check_files([p for p in [run_dir / stage / "metrics.jsonl"] if p.exists()], None)
        for name in ("loss", "avg_reward"):
            path = run_dir / stage / "metrics.jsonl"
            if path.exists() and not all(
                name in json.loads(line) for line in path.read_text().splitlines() if line.strip()
            ):
                problems.append(f"{path}: some records lack '{name}'")
        if not (run_dir / stage / "model" / "config.json").exists():
            problems.append(f"{run_dir / stage / 'model'}: no saved model")
    problems += check_files(sorted((reports_dir / "samples").glob("*.jsonl")), Sample)
    if not (run_dir / "prm" / "model").exists():
        problems.append(f"{run_dir / 'prm' / 'model'}: no saved PRM")
    if (
        not (run_dir / "gfn" / "metrics.jsonl").exists()
        or "proportionality_gap" not in (run_dir / "gfn" / "metrics.jsonl").read_text()
    ):
        problems.append(f"{run_dir / 'gfn' / 'metrics.jsonl'}: no proportionality_gap metric")
    return problems

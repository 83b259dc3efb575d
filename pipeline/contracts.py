"""The DESIGN.md data contracts as checks, used by `make demo` and the end-to-end test.

Each check returns a list of problems ("file:line: field ...") instead of raising, so a run's
report can list every violation at once.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterable

CONTRACTS: dict[str, dict[str, type | tuple[type, ...]]] = {
    "problems": {"problem_id": str, "question": str, "answer": str, "source": str, "meta": dict},
    "mcts": {"problem_id": str, "question": str, "prefix_steps": list, "step": str, "mc": (int, float),
             "n_correct": int, "n_rollouts": int, "rollouts": list, "depth": int},
    "prm": {"problem_id": str, "question": str, "prefix_steps": list, "step": str, "label": (int, float), "origin": str},
    "samples": {"problem_id": str, "model": str, "sample_idx": int, "steps": list, "final_answer": (str, type(None)), "correct": bool},
    "metrics": {},
}


def check_record(obj: dict, contract: str, where: str) -> list[str]:
    problems = []
    for field, types in CONTRACTS[contract].items():
        if field not in obj:
            problems.append(f"{where}: missing field '{field}'")
        elif not isinstance(obj[field], types) or (types is int and isinstance(obj[field], bool)):
            problems.append(f"{where}: field '{field}' has type {type(obj[field]).__name__}")
    if contract == "mcts" and isinstance(obj.get("mc"), (int, float)) and not 0 <= obj["mc"] <= 1:
        problems.append(f"{where}: field 'mc' = {obj['mc']} outside [0, 1]")
    if contract == "prm":
        if isinstance(obj.get("label"), (int, float)) and not 0 <= obj["label"] <= 1:
            problems.append(f"{where}: field 'label' = {obj['label']} outside [0, 1]")
        if obj.get("origin") not in ("mcts", "augmented"):
            problems.append(f"{where}: field 'origin' = {obj.get('origin')!r}, expected mcts | augmented")
    if contract == "mcts":
        for i, r in enumerate(obj.get("rollouts") or []):
            if not (isinstance(r, dict) and isinstance(r.get("steps"), list) and isinstance(r.get("correct"), bool) and "answer" in r):
                problems.append(f"{where}: field 'rollouts[{i}]' is not {{steps, answer, correct}}")
                break
    return problems


def check_files(paths: Iterable[Path], contract: str, min_records: int = 1) -> list[str]:
    problems, count = [], 0
    paths = list(paths)
    if not paths:
        return [f"no {contract} files found"]
    for path in paths:
        for line_no, line in enumerate(Path(path).read_text(encoding="utf-8").splitlines(), start=1):
            if not line.strip():
                continue
            count += 1
            try:
                obj = json.loads(line)
            except json.JSONDecodeError:
                problems.append(f"{path}:{line_no}: not valid JSON")
                continue
            if not isinstance(obj, dict):
                problems.append(f"{path}:{line_no}: not a JSON object")
                continue
            problems += check_record(obj, contract, f"{path}:{line_no}")
    if count < min_records:
        problems.append(f"{contract}: {count} records in {', '.join(map(str, paths))}, expected at least {min_records}")
    return problems


def check_run(run_dir: Path, reports_dir: Path) -> list[str]:
    """Every stage output of a finished run against its contract."""
    run_dir, reports_dir = Path(run_dir), Path(reports_dir)
    problems = []
    problems += check_files(sorted((run_dir / "bootstrap").glob("problems_*.jsonl")), "problems")
    problems += check_files(sorted((run_dir / "mcts" / "shards").glob("part-*/records.jsonl")), "mcts")
    problems += check_files([p for p in (run_dir / "augment" / "prm_train.jsonl", run_dir / "augment" / "prm_val.jsonl") if p.exists()], "prm")
    for stage in ("gfn", "ppo"):
        problems += check_files([p for p in [run_dir / stage / "metrics.jsonl"] if p.exists()], "metrics")
        for name in ("loss", "avg_reward"):
            path = run_dir / stage / "metrics.jsonl"
            if path.exists() and not all(name in json.loads(l) for l in path.read_text().splitlines() if l.strip()):
                problems.append(f"{path}: some records lack '{name}'")
        if not (run_dir / stage / "model" / "config.json").exists():
            problems.append(f"{run_dir / stage / 'model'}: no saved model")
    problems += check_files(sorted((reports_dir / "samples").glob("*.jsonl")), "samples")
    if not (run_dir / "prm" / "model").exists():
        problems.append(f"{run_dir / 'prm' / 'model'}: no saved PRM")
    if not (run_dir / "gfn" / "metrics.jsonl").exists() or "proportionality_gap" not in (run_dir / "gfn" / "metrics.jsonl").read_text():
        problems.append(f"{run_dir / 'gfn' / 'metrics.jsonl'}: no proportionality_gap metric")
    return problems

"""A clean-label control for PRM training on the tiny world: exact step labels, no Monte Carlo noise.

Every step of each problem's gold solution is a record with label 1, and the same step with its
result altered (prm.validation.corrupt_step, +1..9) is a sibling record with label 0. If the PRM
trainer cannot separate these, MC labels (where a slip after a clean prefix averages a label of
about 0.03 and a clean step about 0.4: docs/gflownet.md) cannot teach it either; if it can, the
gap is in the labels or their amount.

    python -m prm.control runs/<run> [--problems N] [--corruption pm1to9]

reads runs/<run>/bootstrap/problems_{train,val}.jsonl (make bootstrap) and writes
runs/<run>/augment/prm_{train,val}.jsonl in the PRM data contract, so ``make prm RUN=<run>``
trains and validates on them (validation.json: AUC, corrupted-step drop). It refuses to
overwrite existing files: point it at a fresh run folder whose bootstrap/ is a copy or link.

Measured limit of the default: the altered results are only ever raised (corrupt_step's +1..9), so
the PRM can learn the direction of the change instead of the arithmetic; on the policy's own
slips, which often lower a result, that control's PRM is inverted (docs/results/prm.md, "Sibling
AUC at the search temperature"). ``--corruption pm1to9`` moves results both ways.
"""

from __future__ import annotations

import argparse
import random
from collections.abc import Sequence
from pathlib import Path

from pipeline.datasets.problems import load_problems_jsonl
from pipeline.records import ORIGIN_MCTS, PRMExample, Problem
from pipeline.storage.files import write_records_atomic
from prm.validation import CORRUPTIONS, corrupt_step


def control_records(problems: Sequence[Problem], seed: int = 0, corruption: str = "1to9") -> list[PRMExample]:
    """Gold steps labelled 1 and their result-corrupted siblings labelled 0, each after its gold prefix.

    ``corruption``: how the result is altered (prm.validation.CORRUPTIONS; "pm1to9" moves it both ways).

    A step with no ``= <number>`` result to alter (``The answer is N``) gets only its label-1 record.
    """
    rng = random.Random(seed)
    records = []
    for problem in problems:
        steps = problem.meta["solutions"][0]
        for index, step in enumerate(steps):
            prefix = list(steps[:index])
            records.append(PRMExample(problem.problem_id, problem.question, prefix, step, 1.0, ORIGIN_MCTS))
            corrupted = corrupt_step(step, rng.randrange(1 << 30), corruption)
            if corrupted is not None:
                records.append(
                    PRMExample(f"{problem.problem_id}-corrupted", problem.question, prefix, corrupted, 0.0, ORIGIN_MCTS)
                )
    return records


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m prm.control", description=__doc__.split("\n\n")[0])
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("--problems", type=int, default=2000, help="training problems to use (default 2000)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--corruption",
        choices=sorted(CORRUPTIONS),
        default="1to9",
        help="how a gold result is altered: 1to9 raises it (default), pm1to9 moves it up or down",
    )
    args = parser.parse_args(argv)
    outputs = {split: args.run_dir / "augment" / f"prm_{split}.jsonl" for split in ("train", "val")}
    existing = [str(path) for path in outputs.values() if path.exists()]
    if existing:
        raise SystemExit(f"prm.control: {', '.join(existing)} already exist; use a fresh run folder")
    for split, limit in (("train", args.problems), ("val", None)):
        problems = load_problems_jsonl(args.run_dir / "bootstrap" / f"problems_{split}.jsonl", limit=limit)
        records = control_records(problems, args.seed + (split == "val"), args.corruption)
        write_records_atomic(outputs[split], records)
        print(f"prm.control: {len(problems)} {split} problems -> {len(records)} records in {outputs[split]}")


if __name__ == "__main__":
    main()

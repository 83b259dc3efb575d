"""Human step labels (PRM800K's format) as PRM training records, so our PRM can train on them.

A PRM800K line is one labelled solution: at each step the labeler rated one or more completions
(1 good, 0 neutral, -1 wrong) and either chose one, wrote their own (``human_completion``) or
stopped. Every rated completion of every step on the solution's path becomes a record: its
prefix is the path so far (the chosen, else the human completion of each earlier step, as
``prm.validation.load_prm800k`` walks it), its step the completion, its label the rating mapped:

    1 -> 1.0,  -1 -> 0.0,  0 -> neutral_label (default 1.0: a neutral step is not an error, as in
    PRM800K's own first-error reading and Qwen's PRM800K baseline; TRL's conversion uses 0.0)

A human completion (unrated: the labeler wrote it as a correct step) is labelled 1.0. The path
ends where the labeler stopped. problem_id is a hash of the problem text, so splits are by
problem; origin "human".
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from pipeline.records import ORIGIN_HUMAN, PRMExample
from pipeline.storage.files import read_jsonl, read_records
from prm.validation import prm800k_step, validate_prm800k_record


def rating_label(rating: int, neutral_label: float = 1.0) -> float:
    """A PRM800K rating (1, 0, -1) as a label in [0, 1]."""
    return {1: 1.0, 0: float(neutral_label), -1: 0.0}[rating]


def problem_id(problem: str) -> str:
    return "prm800k-" + hashlib.sha256(problem.encode("utf-8")).hexdigest()[:12]


def prm800k_examples(path: str | Path, neutral_label: float = 1.0) -> list[PRMExample]:
    """The PRM training records of a PRM800K-format file (module docstring)."""
    if not 0.0 <= neutral_label <= 1.0:
        raise ValueError(f"neutral_label must be in [0, 1], got {neutral_label}")
    records: list[PRMExample] = []
    lines = [0]

    def validate(obj, where: str, line_no: int) -> None:
        validate_prm800k_record(obj, where, line_no)
        lines[0] = line_no

    for obj in read_jsonl(path, validate=validate):
        question = obj["question"]["problem"]
        pid = problem_id(question)
        path_steps: list[str] = []
        for index, step in enumerate(obj["label"]["steps"]):
            text, _, last = prm800k_step(step, str(path), lines[0], index)  # checks the step's fields
            for completion in step["completions"]:
                if completion["rating"] is not None and completion["text"].strip():
                    records.append(
                        PRMExample(
                            pid,
                            question,
                            list(path_steps),
                            completion["text"],
                            rating_label(completion["rating"], neutral_label),
                            ORIGIN_HUMAN,
                        )
                    )
            human = step.get("human_completion")
            if step.get("chosen_completion") is None and human is not None and text.strip():
                records.append(PRMExample(pid, question, list(path_steps), text, 1.0, ORIGIN_HUMAN))
            if last or not text.strip():
                break
            path_steps.append(text)
    return records


def is_prm800k_file(path: str | Path) -> bool:
    """Whether a JSONL file holds PRM800K-format lines (a ``label`` object with ``steps``) rather
    than our PRM records (a numeric ``label``): decided by its first non-empty line."""
    with Path(path).open(encoding="utf-8") as handle:
        for line in handle:
            if line.strip():
                try:
                    first = json.loads(line)
                except json.JSONDecodeError:
                    return False  # read_records then names the file and line
                return isinstance(first, dict) and isinstance(first.get("label"), dict)
    return False


def read_training_records(path: str | Path, neutral_label: float = 1.0) -> list[PRMExample]:
    """PRM records from our format (make augment) or from PRM800K's, whichever the file holds."""
    if is_prm800k_file(path):
        return prm800k_examples(path, neutral_label)
    return list(read_records(path, PRMExample))

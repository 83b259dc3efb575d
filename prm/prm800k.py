"""Human step labels in PRM800K's format: the labelled solution paths (``load_prm800k``, which the
first-error checks read) and the PRM training records they give, so our PRM can train on them.

A PRM800K line is one labelled solution: at each step the labeler rated one or more completions
(1 good, 0 neutral, -1 wrong) and either chose one, wrote their own (``human_completion``) or
stopped. Every rated completion of every step on the solution's path becomes a record: its
prefix is the path so far (the chosen, else the human completion of each earlier step, as
``load_prm800k`` walks it), its step the completion, its label the rating mapped:

    1 -> 1.0,  -1 -> 0.0,  0 -> neutral_label (default 1.0: a neutral step is not an error, as in
    PRM800K's own first-error reading and Qwen's PRM800K baseline; TRL's conversion uses 0.0)

A human completion (unrated: the labeler wrote it as a correct step) is labelled 1.0. The path
ends where the labeler stopped. problem_id is a hash of the problem text, so splits are by
problem; origin "human".
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipeline.records import ORIGIN_HUMAN, PRMExample, RecordError
from pipeline.storage.files import read_jsonl, read_records


@dataclass
class LabelledSolution:
    """A solution with human step ratings (1 good, 0 neutral, -1 wrong; None unrated).

    first_error: index of the first step rated -1, None when no step is
    """

    question: str
    steps: list[str]
    ratings: list[int | None]
    source_line: int = 0

    @property
    def first_error(self) -> int | None:
        return next((k for k, rating in enumerate(self.ratings) if rating == -1), None)


RATINGS = (-1, 0, 1)  # PRM800K's step ratings: wrong, neutral, good (null: unrated)


def check_rating(rating: Any, where: str) -> None:
    """A PRM800K rating is -1, 0, 1 or null; RecordError "<where>': expected ..." otherwise (true, which
    Python counts as 1, is no rating; nor are 0.5, NaN or 5)."""
    if rating is not None and (isinstance(rating, bool) or rating not in RATINGS):
        raise RecordError(f"{where}': expected -1, 0, 1 or null, got {rating!r}")


def prm800k_step(step: Any, path: str, line_no: int, index: int) -> tuple[str, int | None, bool]:
    """(text, rating, last): the step the solution path takes at this position."""
    where = f"{path}:{line_no}: field 'label.steps[{index}]"
    if not isinstance(step, dict) or not isinstance(step.get("completions"), list):
        raise RecordError(f"{where}.completions': expected a list of {{text, rating}}")
    completions = step["completions"]
    for j, completion in enumerate(completions):
        if not isinstance(completion, dict) or not isinstance(completion.get("text"), str):
            raise RecordError(f"{where}.completions[{j}].text': expected a string")
        check_rating(completion.get("rating"), f"{where}.completions[{j}].rating")
    chosen = step.get("chosen_completion")
    human = step.get("human_completion")
    if isinstance(chosen, int) and not isinstance(chosen, bool):
        if not 0 <= chosen < len(completions):
            raise RecordError(f"{where}.chosen_completion': index {chosen} outside the {len(completions)} completions")
        return completions[chosen]["text"], completions[chosen]["rating"], False
    if human is not None:
        text = human.get("text") if isinstance(human, dict) else human
        if not isinstance(text, str):
            raise RecordError(f"{where}.human_completion': expected a string or {{text}}")
        rating = human.get("rating") if isinstance(human, dict) else None
        check_rating(rating, f"{where}.human_completion.rating")
        return text, (1 if rating is None else rating), False  # the labeler wrote it as a correct step
    if not completions:
        raise RecordError(f"{where}.completions': empty, and no chosen or human completion")
    # No completion chosen: the labeler stopped here. The path ends on the step that stopped
    # them (the first one rated -1), else on the first completion (the pre-generated step).
    wrong = next((c for c in completions if c["rating"] == -1), completions[0])
    return wrong["text"], wrong["rating"], True


def validate_prm800k_record(obj: Any, path: str, line_no: int) -> None:
    if not isinstance(obj.get("question"), dict) or not isinstance(obj["question"].get("problem"), str):
        raise RecordError(f"{path}:{line_no}: field 'question.problem': expected a string")
    if not isinstance(obj.get("label"), dict) or not isinstance(obj["label"].get("steps"), list):
        raise RecordError(f"{path}:{line_no}: field 'label.steps': expected a list")


def load_prm800k(path: str | Path) -> list[LabelledSolution]:
    """PRM800K-format solutions: the path through the chosen (or human) completion of each step,
    ending where the labeler stopped; step ratings from the completions taken."""
    solutions = []
    line = [0]

    def validate(obj: Any, where: str, line_no: int) -> None:
        validate_prm800k_record(obj, where, line_no)
        line[0] = line_no

    for obj in read_jsonl(path, validate=validate):
        line_no = line[0]
        steps, ratings = [], []
        for index, step in enumerate(obj["label"]["steps"]):
            text, rating, last = prm800k_step(step, str(path), line_no, index)
            steps.append(text)
            ratings.append(rating)
            if last:
                break
        solutions.append(LabelledSolution(obj["question"]["problem"], steps, ratings, line_no))
    return solutions


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

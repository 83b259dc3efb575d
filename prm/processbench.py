"""The ProcessBench protocol (Zheng et al., 2024) for any PRM that prm.formats.load_scorer loads.

A case is a solution split into steps with the index of its earliest wrong step (``label``; -1
when every step is right). A PRM predicts the first step whose score U falls below a threshold
(-1 when none does). With acc_err the share of erroneous cases (label >= 0) whose prediction is
their label and acc_ok the share of correct cases (label -1) predicted -1,

    F1 = 2 acc_err acc_ok / (acc_err + acc_ok)

The threshold is the one of THRESHOLDS with the best F1 on a held-out part of the cases (chosen by
a hash of each id) and F1 is reported on the rest, with a percentile-bootstrap interval that
resamples cases. Cases come from ProcessBench-format files or hub splits, PRM800K's phase-2
ratings (the first step rated -1) or a problem kind's exact labeller on the policy's own samples
(prm.exact_check.FIRST_ERROR_LABELLERS; docs/prm.md, "ProcessBench").
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from pipeline.datasets.copies import read_hub_rows
from pipeline.records import Problem, RecordError
from pipeline.stats import bootstrap_statistic
from pipeline.storage.files import read_jsonl
from prm.prm800k import load_prm800k

THRESHOLDS = tuple(round(0.01 * k, 2) for k in range(1, 100))  # the candidates the held-out part chooses from


@dataclass
class FirstErrorCase:
    """One ProcessBench case. label: index of the earliest wrong step, -1 when none is;
    final_answer_correct: None where the source does not say; source: "file:line"."""

    id: str
    problem: str
    steps: list[str]
    label: int
    final_answer_correct: bool | None = None
    source: str = ""


# ----------------------------------------------------------------------------- reading cases


def processbench_case(obj: Any, where: str) -> FirstErrorCase:
    """A ProcessBench record ({id, problem, steps, label, final_answer_correct}), checked."""
    if not isinstance(obj, dict):
        raise RecordError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    steps = obj.get("steps")
    if not isinstance(steps, list) or not all(isinstance(step, str) for step in steps):
        raise RecordError(f"{where}: field 'steps': expected a list of strings, got {steps!r:.80}")
    label = obj.get("label")
    if not isinstance(label, int) or isinstance(label, bool) or not -1 <= label <= len(steps) - 1:
        raise RecordError(
            f"{where}: field 'label': expected an integer in [-1, {len(steps) - 1}] (the earliest wrong step of "
            f"{len(steps)} steps, -1 for none), got {label!r}"
        )
    if not isinstance(obj.get("problem"), str):
        raise RecordError(f"{where}: field 'problem': expected a string, got {obj.get('problem')!r:.80}")
    if not isinstance(obj.get("id"), (str, int)) or isinstance(obj.get("id"), bool):
        raise RecordError(f"{where}: field 'id': expected a string, got {obj.get('id')!r:.80}")
    final = obj.get("final_answer_correct")
    if final is not None and not isinstance(final, bool):
        raise RecordError(f"{where}: field 'final_answer_correct': expected true, false or null, got {final!r:.80}")
    return FirstErrorCase(str(obj["id"]), obj["problem"], list(steps), label, final, where)


def _json_array_items(path: Path) -> list[tuple[int, Any]]:
    """(line where it starts, item) of each item of a file holding one JSON array."""
    text = path.read_text(encoding="utf-8")
    decoder = json.JSONDecoder()
    position = len(text) - len(text.lstrip())
    if not text.startswith("[", position):
        raise RecordError(f"{path}:1: expected a JSON array of ProcessBench records (or a .jsonl file, one per line)")
    items, position = [], position + 1
    while True:
        while position < len(text) and text[position] in " \t\r\n,":
            position += 1
        if position >= len(text) or text[position] == "]":
            return items
        line = text.count("\n", 0, position) + 1
        try:
            item, position = decoder.raw_decode(text, position)
        except json.JSONDecodeError as exc:
            raise RecordError(f"{path}:{exc.lineno}: not valid JSON ({exc.msg})") from None
        items.append((line, item))


def read_processbench(path: str | Path) -> list[FirstErrorCase]:
    """The cases of a ProcessBench-format file: a JSON array (as the hub's files are) or JSONL."""
    path = Path(path)
    if path.suffix == ".json":
        return [processbench_case(item, f"{path}:{line}") for line, item in _json_array_items(path)]
    cases: list[FirstErrorCase] = []
    for _ in read_jsonl(
        path, validate=lambda obj, where, line: cases.append(processbench_case(obj, f"{where}:{line}"))
    ):
        pass
    return cases


_HUB_SPLIT = re.compile(r"hf://(?P<hub_id>[A-Za-z0-9][\w.-]*/[\w.-]+)(?:\[(?P<config>[\w.-]+)\])?/(?P<split>[\w.-]+)")


def processbench_source(spec: str) -> tuple[str, str | None, str] | None:
    """(hub id, config or None, split) of a hub split, spelled ``hf://owner/name/split`` or
    ``hf://owner/name[config]/split``; None for anything not starting with hf:// (a local path)."""
    if not spec.startswith("hf://"):
        return None
    match = _HUB_SPLIT.fullmatch(spec)
    if match is None:
        raise ValueError(
            f"prm_bench.processbench_paths: {spec!r}: a hub split is hf://owner/name/split or "
            "hf://owner/name[config]/split, e.g. hf://Qwen/ProcessBench/gsm8k"
        )
    return match["hub_id"], match["config"], match["split"]


def read_processbench_hub(hub_id: str, config: str | None, split: str) -> list[FirstErrorCase]:
    """The cases of a ProcessBench-format split on the hub (Qwen/ProcessBench: gsm8k, math,
    olympiadbench, omnimath), each checked as a file's record is; a bad one names its row."""
    return [processbench_case(row, where) for where, row, _ in read_hub_rows(hub_id, config, split)]


def prm800k_cases(path: str | Path) -> list[FirstErrorCase]:
    """PRM800K phase-2 solutions as cases: the path prm.prm800k.load_prm800k walks, labelled with
    its first step rated -1 (-1 when none is: a neutral step is no error, as in PRM800K's reading)."""
    cases = []
    for solution in load_prm800k(path):
        if solution.steps:
            first = solution.first_error
            cases.append(
                FirstErrorCase(
                    f"{Path(path).name}:{solution.source_line}",
                    solution.question,
                    list(solution.steps),
                    -1 if first is None else first,
                    None,
                    f"{path}:{solution.source_line}",
                )
            )
    return cases


def labelled_cases(
    problems: Sequence[Problem],
    solutions: Sequence[Sequence[str]],
    labeller: Callable[[Problem, Sequence[str]], int],
    question: Callable[[Problem], str] = lambda p: p.question,
) -> list[FirstErrorCase]:
    """Cases of solutions (steps) to problems (aligned), labelled by an exact labeller."""
    cases = []
    for index, (problem, steps) in enumerate(zip(problems, solutions, strict=True)):
        if steps:
            label = labeller(problem, steps)
            cases.append(
                FirstErrorCase(
                    f"{problem.problem_id}#{index}", question(problem), list(steps), label, None, problem.problem_id
                )
            )
    return cases


# ----------------------------------------------------------------------------- the protocol


def predicted_first_error(scores: Sequence[float], threshold: float) -> int:
    """Index of the first step with U < threshold, -1 when none."""
    return next((k for k, u in enumerate(scores) if u < threshold), -1)


def first_error_f1(predicted: Sequence[int], labels: Sequence[int]) -> dict:
    """ProcessBench's score of predictions against labels (aligned; -1 = no wrong step).
    Returns {f1, accuracy_erroneous, accuracy_correct, n_erroneous, n_correct}; an accuracy is
    None without cases of its kind, and f1 None when either is (0 when both are 0)."""
    predicted, labels = np.asarray(predicted, dtype=np.int64), np.asarray(labels, dtype=np.int64)
    erroneous = labels >= 0
    n_err, n_ok = int(erroneous.sum()), int((~erroneous).sum())
    acc_err = float((predicted[erroneous] == labels[erroneous]).mean()) if n_err else None
    acc_ok = float((predicted[~erroneous] == -1).mean()) if n_ok else None
    f1 = None
    if acc_err is not None and acc_ok is not None:
        f1 = 2 * acc_err * acc_ok / (acc_err + acc_ok) if acc_err + acc_ok > 0 else 0.0
    return {
        "f1": f1,
        "accuracy_erroneous": acc_err,
        "accuracy_correct": acc_ok,
        "n_erroneous": n_err,
        "n_correct": n_ok,
    }


def choose_threshold(
    scores: Sequence[Sequence[float]], labels: Sequence[int], thresholds: Sequence[float] = THRESHOLDS
) -> float:
    """The threshold of the best F1 on these cases (the first of equals); where the cases are of
    one kind only (no F1), of the best accuracy on that kind."""
    best, best_value = thresholds[0], -1.0
    for threshold in thresholds:
        result = first_error_f1([predicted_first_error(row, threshold) for row in scores], labels)
        value = (
            result["f1"]
            if result["f1"] is not None
            else (result["accuracy_erroneous"] or result["accuracy_correct"] or 0.0)
        )
        if value > best_value:
            best, best_value = threshold, value
    return best


def held_out(case_id: str, fraction: float, seed: int) -> bool:
    """Whether a case is in the part the threshold is chosen on (a hash of seed and id)."""
    draw = int.from_bytes(hashlib.sha256(f"{seed}:{case_id}".encode()).digest()[:8], "big") / 2.0**64
    return draw < fraction


def processbench(
    scorer,
    cases: Sequence[FirstErrorCase],
    *,
    held_out_fraction: float = 0.5,
    threshold: float | None = None,
    n_resamples: int = 1000,
    seed: int = 0,
) -> dict:
    """The protocol on one set of cases (module docstring). ``threshold``: use it instead of
    choosing one (then every case is scored). Returns {threshold, threshold_from, f1, interval,
    accuracy_erroneous, accuracy_correct, n_erroneous, n_correct, n_held_out, held_out_f1,
    cases: [{id, label, predicted}]}."""
    scores = scorer.score_many([(case.problem, case.steps) for case in cases]) if cases else []
    labels = [case.label for case in cases]
    if threshold is None:
        tune = [i for i, case in enumerate(cases) if held_out(case.id, held_out_fraction, seed)]
        chosen = choose_threshold([scores[i] for i in tune], [labels[i] for i in tune]) if tune else 0.5
        held_f1 = first_error_f1([predicted_first_error(scores[i], chosen) for i in tune], [labels[i] for i in tune])[
            "f1"
        ]
        threshold_from = (
            f"the best F1 (accuracy where one kind only) on {len(tune)} held-out cases"
            if tune
            else "0.5 (no held-out case)"
        )
    else:
        tune, chosen, held_f1, threshold_from = [], float(threshold), None, "given"
    tuned = set(tune)
    test = [i for i in range(len(cases)) if i not in tuned]
    predicted = np.array([predicted_first_error(row, chosen) for row in scores], dtype=np.int64)
    test_predicted, test_labels = predicted[test], np.asarray(labels, dtype=np.int64)[test]
    result = {"threshold": chosen, "threshold_from": threshold_from, **first_error_f1(test_predicted, test_labels)}
    lo, hi = (None, None)
    if len(test):
        lo, hi = bootstrap_statistic(
            lambda rows: first_error_f1(test_predicted[rows], test_labels[rows])["f1"],
            len(test),
            n_resamples=n_resamples,
            seed=seed,
        )
    result.update(
        {
            "interval": [lo, hi],
            "n_held_out": len(tune),
            "held_out_f1": held_f1,
            "cases": [
                {"id": cases[i].id, "label": labels[i], "predicted": int(predicted[i]), "held_out": i in tuned}
                for i in range(len(cases))
            ],
        }
    )
    return result

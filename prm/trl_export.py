"""Our PRM data as TRL's stepwise-supervision dataset: {prompt, completions, labels}, what TRL's
PRMTrainer trains on (it tokenizes [BOS] + prompt, then each completion followed by the step
separator, and puts each label on the completion's last token).

Records are packed into solution paths as for our own training (prm.data.group_records: a record
whose path is a prefix of another's shares its row), and each path becomes rows whose labels sit
exactly where ours do, with the same text before them:

- a row's completions are a run of consecutive labelled steps; a step without a label of its own
  (an MCTS prefix step no probe scored) ends the run, and the next run's row carries every step
  before it in its prompt: prompt = question + each earlier step followed by the separator, the
  text TRL would have built from those steps as completions (TRL puts no separator between the
  prompt and the first completion, so neither do we);
- labels are booleans (TRL casts them with int()): True when our label (the mean of the records
  at that step) is above 0.5, the positives of our MC-label AUC; ``soft_labels`` keeps the
  values (TRL drops extra columns), with ``problem_id``.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path

from pipeline.records import PRMExample
from pipeline.steps import join_steps
from pipeline.storage.files import write_jsonl_atomic
from prm.data import group_records

POSITIVE_ABOVE = 0.5


def stepwise_rows(records: Sequence[PRMExample], separator: str = "\n") -> Iterator[dict]:
    """TRL stepwise-supervision rows of PRM records (module docstring)."""
    sequences, _ = group_records(records, merge_prefixes=True)
    for sequence in sequences:
        labelled = sequence.labels  # {step index: (mean label, weight)}
        index, last = 0, max(labelled)
        while index <= last:
            if index not in labelled:
                index += 1
                continue
            end = index
            while end + 1 in labelled:
                end += 1
            soft = [labelled[k][0] for k in range(index, end + 1)]
            yield {
                "prompt": sequence.question + join_steps(sequence.steps[:index], separator),
                "completions": list(sequence.steps[index : end + 1]),
                "labels": [value > POSITIVE_ABOVE for value in soft],
                "soft_labels": soft,
                "problem_id": sequence.problem_id,
            }
            index = end + 1


def write_stepwise_dataset(records: Sequence[PRMExample], path: str | Path, separator: str = "\n") -> dict:
    """Write the rows as JSONL (``datasets.load_dataset("json", data_files=...)`` reads it);
    returns {rows, records, steps, positive}."""
    rows = list(stepwise_rows(records, separator))
    write_jsonl_atomic(path, rows)
    labels = [label for row in rows for label in row["labels"]]
    return {"rows": len(rows), "records": len(records), "steps": len(labels), "positive": sum(labels)}

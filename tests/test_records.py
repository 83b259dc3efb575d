"""Typed records (pipeline.records): round trips, the validator derived from the fields, the
JSON written to disk, and a golden test that the on-disk formats did not change."""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from eval.sampling import generate_samples, problem_kind
from pipeline.config.codec import FieldError, rules
from pipeline.config.loader import load_config
from pipeline.config.schema import MCTSConfig
from pipeline.datasets.problems import write_problems_jsonl
from pipeline.generation.base import Completion
from pipeline.records import (
    MCTSRecord,
    MCTSRollout,
    MCTSSummary,
    PRMExample,
    Problem,
    Record,
    RecordError,
    Sample,
    Trajectory,
)
from pipeline.rollouts.augmentation import augment_records
from pipeline.rollouts.mcts import Rollout, run_mcts
from pipeline.storage.files import read_records, write_records_atomic
from pipeline.storage.shards import ShardWriter

GOLDEN = Path(__file__).resolve().parent / "data" / "records"

ROLLOUTS = [MCTSRollout(["3 * 4 = 12", "The answer is 12"], "12", True), MCTSRollout(["3 + 4 = 7"], None, False)]
RECORDS = [
    Problem("tiny-0", "Ann has 3 boxes of 4 pens. How many pens?", "12", "tiny", {"solutions": [["3 * 4 = 12"]]}),
    Problem("gsm8k-1", "What is 2 + 2?", "", "gsm8k"),
    MCTSRollout(["a", "b"], "7", True),
    MCTSRecord("p", "q", ["s1"], "s2", 0.5, 1, 2, ROLLOUTS, 2),
    MCTSRecord("p", "q", [], "s1", 0.0, 0, 0, [], 1),
    MCTSSummary("p", 0.5, 1, ROLLOUTS, True, 3, 7, 40, 2),
    PRMExample("p", "q", ["s1"], "s2", 0.25, "mcts"),
    PRMExample("p", "q", ["s1", "s2"], "s3", 1.0, "augmented", "p:0123456789ab:1:0"),
    Sample("p", "base", -1, ["x = 1", "The answer is 1"], "1", True),
    Sample("p", "base", 0, [], None, False, finished=False, step_scores=[]),
    Sample("p", "gfn", 1, ["a", "b"], "2", False, finished=True, step_scores=[0.9, 0.1]),
    Trajectory("p", "q", "Q: q\nA:\n", ["a", "b"], [-0.1, -2.3], [0, 1], True, -2.4, None, None),
    Trajectory("p", "q", "Q: q\nA:\n", ["a"], [-0.5], [-1], False, -0.5, [-1.5], -0.25, policy_version=7),
]


# ----------------------------------------------------------------------------- round trips and JSON


@pytest.mark.parametrize("record", RECORDS, ids=lambda r: type(r).__name__)
def test_every_record_type_round_trips(record):
    obj = record.to_json()
    assert type(record).from_json(obj, "f.jsonl:1") == record
    assert type(record).from_json(json.loads(json.dumps(obj))) == record  # and through JSON text


def test_to_json_writes_the_fields_in_order_with_nested_records_as_dicts():
    record = RECORDS[3]
    assert list(record.to_json()) == [
        "problem_id",
        "question",
        "prefix_steps",
        "step",
        "mc",
        "n_correct",
        "n_rollouts",
        "rollouts",
        "depth",
    ]
    assert record.to_json()["rollouts"] == [
        {"steps": ["3 * 4 = 12", "The answer is 12"], "answer": "12", "correct": True},
        {"steps": ["3 + 4 = 7"], "answer": None, "correct": False},
    ]
    obj = record.to_json()
    obj["prefix_steps"].append("changed")  # to_json returns copies: the record stays as it was
    assert record.prefix_steps == ["s1"]


def test_optional_keys_are_omitted_or_written_as_declared():
    mcts, augmented = RECORDS[6].to_json(), RECORDS[7].to_json()
    assert "group_id" not in mcts and augmented["group_id"] == "p:0123456789ab:1:0"
    unscored = RECORDS[8].to_json()
    assert list(unscored) == ["problem_id", "model", "sample_idx", "steps", "final_answer", "correct"]
    assert unscored["final_answer"] == "1"
    assert RECORDS[9].to_json()["final_answer"] is None  # null stays written
    assert RECORDS[9].to_json()["finished"] is False and RECORDS[9].to_json()["step_scores"] == []
    assert RECORDS[3].to_json()["rollouts"][1]["answer"] is None  # a rollout's answer: null stays written
    trajectory = RECORDS[11].to_json()
    assert trajectory["reference_step_logprobs"] is None and trajectory["reference_stop_logprob"] is None
    assert trajectory["policy_version"] == 0
    for key in ("group_id", "finished", "step_scores"):  # absent on input: None
        assert getattr(PRMExample.from_json(mcts) if key == "group_id" else Sample.from_json(unscored), key) is None


def test_unknown_keys_are_ignored_and_defaults_fill_absent_optional_keys():
    obj = {**RECORDS[6].to_json(), "written_by": "a later version", "score": [1, 2]}
    assert PRMExample.from_json(obj) == RECORDS[6]
    assert Problem.from_json({"problem_id": "t", "question": "q", "answer": "1", "source": "tiny"}).meta == {}
    obj = RECORDS[11].to_json()
    del obj["policy_version"]
    assert Trajectory.from_json(obj).policy_version == 0


def test_ints_are_widened_to_floats_and_numeric_answers_read_as_text():
    record = MCTSRecord.from_json(
        {
            **RECORDS[3].to_json(),
            "mc": 1,
            "n_correct": 2,
            "rollouts": [{"steps": [], "answer": 7, "correct": True}, {"steps": [], "answer": 2.5, "correct": True}],
        }
    )
    assert record.mc == 1.0 and isinstance(record.mc, float)
    assert [r.answer for r in record.rollouts] == ["7", "2.5"]
    assert record.to_json()["mc"] == 1.0 and json.dumps(record.to_json()["mc"]) == "1.0"
    assert PRMExample.from_json({**RECORDS[6].to_json(), "label": 0}).label == 0.0


# ----------------------------------------------------------------------------- errors name file, line, field


def _error(record_type, obj) -> str:
    with pytest.raises(RecordError) as info:
        record_type.from_json(obj, "runs/x/part-0/records.jsonl:12")
    assert isinstance(info.value, ValueError)
    return str(info.value)


def set_field(obj: dict, path: tuple, value) -> dict:
    """A copy of obj with the field at path (keys and list indices) set, or deleted for value=KeyError."""
    obj = json.loads(json.dumps(obj))
    target = obj
    for key in path[:-1]:
        target = target[key]
    if value is KeyError:
        del target[path[-1]]
    else:
        target[path[-1]] = value
    return obj


MCTS_JSON = RECORDS[3].to_json()
PRM_JSON = RECORDS[6].to_json()
SAMPLE_JSON = RECORDS[10].to_json()
TRAJECTORY_JSON = RECORDS[12].to_json()
SUMMARY_JSON = RECORDS[5].to_json()


@pytest.mark.parametrize(
    "record_type, obj, message",
    [
        # wrong type
        (
            PRMExample,
            set_field(PRM_JSON, ("label",), "0.5"),
            "field 'label': expected a number in [0, 1], got str \"0.5\"",
        ),
        (
            MCTSRecord,
            set_field(MCTS_JSON, ("prefix_steps",), "s1"),
            "field 'prefix_steps': expected a list of strings, got str \"s1\"",
        ),
        (Problem, {**RECORDS[0].to_json(), "meta": []}, "field 'meta': expected an object, got list []"),
        (
            Sample,
            set_field(SAMPLE_JSON, ("final_answer",), 2),
            "field 'final_answer': expected a string or null, got int 2",
        ),
        (
            Sample,
            set_field(SAMPLE_JSON, ("finished",), "yes"),
            "field 'finished': expected true, false or null, got str \"yes\"",
        ),
        (PRMExample, set_field(PRM_JSON, ("step",), None), "field 'step': expected a non-empty string, got null"),
        # a bool is not an int (nor a number)
        (MCTSRecord, set_field(MCTS_JSON, ("depth",), True), "field 'depth': expected an integer >= 0, got bool true"),
        (
            Sample,
            set_field(SAMPLE_JSON, ("sample_idx",), False),
            "field 'sample_idx': expected an integer >= -1, got bool false",
        ),
        (
            PRMExample,
            set_field(PRM_JSON, ("label",), True),
            "field 'label': expected a number in [0, 1], got bool true",
        ),
        # an int field refuses a float
        (
            MCTSRecord,
            set_field(MCTS_JSON, ("n_rollouts",), 2.0),
            "field 'n_rollouts': expected an integer >= 0, got float 2.0",
        ),
        # out of range / not allowed
        (PRMExample, set_field(PRM_JSON, ("label",), 1.5), "field 'label': expected a number in [0, 1], got float 1.5"),
        (MCTSRecord, set_field(MCTS_JSON, ("mc",), -0.5), "field 'mc': expected a number in [0, 1], got float -0.5"),
        (
            MCTSRecord,
            set_field(MCTS_JSON, ("n_correct",), -1),
            "field 'n_correct': expected an integer >= 0, got int -1",
        ),
        (
            PRMExample,
            set_field(PRM_JSON, ("origin",), "judge"),
            "field 'origin': expected one of 'mcts', 'augmented', 'human', got str \"judge\"",
        ),
        (PRMExample, set_field(PRM_JSON, ("step",), "  "), "field 'step': expected a non-empty string, got str \"  \""),
        (
            Problem,
            {**RECORDS[0].to_json(), "source": "aime"},
            "field 'source': expected one of 'agieval_sat_math', 'gsm8k'",
        ),
        (
            Sample,
            set_field(SAMPLE_JSON, ("step_scores", 1), 2),
            "field 'step_scores[1]': expected a number in [0, 1], got int 2",
        ),
        (
            Trajectory,
            set_field(TRAJECTORY_JSON, ("answer_flags", 0), 2),
            "field 'answer_flags[0]': expected one of -1, 0, 1, got int 2",
        ),
        (
            Trajectory,
            set_field(TRAJECTORY_JSON, ("steps",), []),
            "field 'steps': expected a non-empty list of strings, got list []",
        ),
        (
            Trajectory,
            set_field(TRAJECTORY_JSON, ("policy_version",), -1),
            "field 'policy_version': expected an integer >= 0",
        ),
        # missing
        (PRMExample, set_field(PRM_JSON, ("step",), KeyError), "missing field 'step' (expected a non-empty string)"),
        (Sample, set_field(SAMPLE_JSON, ("correct",), KeyError), "missing field 'correct' (expected true or false)"),
        (
            Trajectory,
            set_field(TRAJECTORY_JSON, ("finished",), KeyError),
            "missing field 'finished' (expected true or false)",
        ),
        # a bad nested rollout
        (
            MCTSRecord,
            set_field(MCTS_JSON, ("rollouts", 1, "correct"), "no"),
            "field 'rollouts[1].correct': expected true or false, got str \"no\"",
        ),
        (
            MCTSRecord,
            set_field(MCTS_JSON, ("rollouts", 0, "steps", 1), 5),
            "field 'rollouts[0].steps[1]': expected a string, got int 5",
        ),
        (
            MCTSRecord,
            set_field(MCTS_JSON, ("rollouts", 1, "answer"), ["7"]),
            "field 'rollouts[1].answer': expected a string, a number or null, got list [\"7\"]",
        ),
        (
            MCTSRecord,
            set_field(MCTS_JSON, ("rollouts", 0, "answer"), KeyError),
            "missing field 'rollouts[0].answer' (expected a string, a number or null)",
        ),
        (
            MCTSRecord,
            set_field(MCTS_JSON, ("rollouts", 1), "3 + 4 = 7"),
            "field 'rollouts[1]': expected an object {steps, answer, correct}, got str \"3 + 4 = 7\"",
        ),
        (
            MCTSSummary,
            set_field(SUMMARY_JSON, ("root_rollouts", 0, "correct"), 1),
            "field 'root_rollouts[0].correct': expected true or false, got int 1",
        ),
        # rules across fields
        (
            MCTSRecord,
            set_field(MCTS_JSON, ("n_correct",), 3),
            "field 'n_correct': expected at most n_rollouts (2), got int 3",
        ),
        (
            MCTSSummary,
            set_field(SUMMARY_JSON, ("root_n_correct",), 5),
            "field 'root_n_correct': expected at most the number of root_rollouts (2)",
        ),
        (
            Sample,
            set_field(SAMPLE_JSON, ("step_scores",), [0.5]),
            "field 'step_scores': expected one score per step (2), got list [0.5]",
        ),
        (
            Trajectory,
            set_field(TRAJECTORY_JSON, ("step_log_scores",), [-1.0, -2.0]),
            "field 'step_log_scores': expected one value per step (1)",
        ),
        (
            Trajectory,
            set_field(TRAJECTORY_JSON, ("answer_flags",), []),
            "field 'answer_flags': expected one value per step (1), got list []",
        ),
        (
            Trajectory,
            set_field(TRAJECTORY_JSON, ("reference_step_logprobs",), [-1.0, -1.0]),
            "field 'reference_step_logprobs': expected one value per step (1)",
        ),
    ],
)
def test_a_bad_field_is_reported_with_file_line_and_field(record_type, obj, message):
    assert _error(record_type, obj).startswith(f"runs/x/part-0/records.jsonl:12: {message}")


def test_non_finite_log_reward_and_non_object_records_are_refused():
    assert _error(Trajectory, {**TRAJECTORY_JSON, "log_reward": math.inf}).endswith(
        "field 'log_reward': expected a finite number, got float Infinity"
    )
    assert "got float NaN" in _error(Trajectory, {**TRAJECTORY_JSON, "log_reward": math.nan})
    assert (
        _error(MCTSRecord, [1, 2])
        == "runs/x/part-0/records.jsonl:12: expected a JSON object (MCTSRecord), got list [1, 2]"
    )


def test_long_values_are_cut_in_messages():
    message = _error(PRMExample, {**PRM_JSON, "step": ["x" * 10_000] * 100})
    assert message.startswith("runs/x/part-0/records.jsonl:12: field 'step': expected a non-empty string, got list [")
    assert message.endswith("...") and len(message) < 200


def test_check_is_the_cross_field_hook_and_names_its_field():
    record = MCTSRecord("p", "q", [], "s", 0.5, 3, 2, [], 1)  # built in code: not validated until read
    with pytest.raises(FieldError, match=r"^field 'n_correct': expected at most n_rollouts \(2\), got int 3$"):
        record.check()


@dataclass(frozen=True)
class Misdeclared(Record):
    count: int = field(metadata=rules(non_empty=True))


def test_a_rule_that_cannot_apply_to_its_field_is_refused_when_the_class_is_first_used():
    with pytest.raises(TypeError, match=r"Misdeclared.count: rules \['non_empty'\] do not apply to int"):
        Misdeclared.from_json({"count": 1})


def test_a_float_field_set_from_an_int_in_code_is_written_as_a_float():
    assert json.dumps(PRMExample("p", "q", [], "s", 1, "mcts").to_json()["label"]) == "1.0"
    assert json.dumps(Sample("p", "m", 0, ["a"], None, True, step_scores=[1]).to_json()["step_scores"]) == "[1.0]"


def test_read_records_reports_the_line_of_the_bad_record(tmp_path):
    path = tmp_path / "samples.jsonl"
    path.write_text(json.dumps(SAMPLE_JSON) + "\n\n" + json.dumps({**SAMPLE_JSON, "correct": "true"}) + "\n")
    with pytest.raises(RecordError, match="^" + re.escape(f"{path}:3: field 'correct': expected true or false")):
        list(read_records(path, Sample))


# ----------------------------------------------------------------------------- the on-disk formats did not change
# The files under tests/data/records were written from the inputs built below by the dict-based
# writers the typed records replaced; the typed code must write them byte for byte. The one
# intended change: samples now carry "finished" (absent in older files, and still read).

GOLD_PATH = ["Ann has 3 boxes × 4 pens.", "3 × 4 = 12 pens", "12 − 5 = 7 pens are left", "The answer is 7"]


def golden_problems():
    return [
        Problem(
            "tiny-g-0",
            "Ann has 3 boxes of 4 pens and gives away 5. How many are left?",
            "7",
            "tiny",
            {"solutions": [GOLD_PATH], "level": 2},
        ),
        Problem(
            "sat_math-g-1",
            "Which is $\\frac{1}{2}$ of 10? «café»",
            "B",
            "sat_math",
            {"options": {"A": "2", "B": "5"}, "id": 1},
        ),
        Problem("gsm8k-g-2", "What is 2 + 2?", "", "gsm8k"),
    ]


def golden_rollouts(prefix):
    """Eight rollouts from a prefix, deterministic: on the gold path 3 of 8 succeed and the
    others follow it for 0-2 more steps, then slip; every fourth one gives no answer."""
    on_gold = list(prefix) == GOLD_PATH[: len(prefix)]
    rest = GOLD_PATH[len(prefix) :] or ["The answer is 7"]
    out = []
    for j in range(8):
        if on_gold and j < 3:
            out.append(Rollout(list(rest), "7", True, num_tokens=5 * len(rest)))
            continue
        kept = rest[: j % 3] if on_gold else []
        steps = (
            kept
            + [f"{len(prefix) + 3} × {j} = {j + 1} slip"]
            + [f"filler {k} ½" for k in range(len(rest) - len(kept) - 1)]
        )
        out.append(Rollout(steps, None if j % 4 == 3 else str(j), False, num_tokens=5 * len(steps) + j))
    return out


def golden_mcts_results():
    results = []
    params = MCTSConfig(k=8, max_iterations=3, max_rollouts=10_000)
    run_mcts(
        [(p.problem_id, p.question) for p in golden_problems()[:2]],
        params,
        lambda requests: [golden_rollouts(prefix) for _, prefix in requests],
        results.append,
    )
    return results


class CannedSampler:
    """Completions by prompt and sample position: finished answers, a cut-off one, an empty one."""

    tokenizer = None
    canned = [
        ("x = 3 × 4 = 12\n12 − 5 = 7\nThe answer is 7", "eos"),
        ("x = 12\nThe answer is", "length"),
        ("", "stop"),
        ("The answer is B", "eos"),
    ]

    def generate(self, prompts, n=1, temperature=1.0, top_p=1.0, max_new_tokens=256, stop=None, seed=None):
        shift = 1 if temperature == 0 else 0
        return [[Completion(*self.pick(p + j + shift)) for j in range(n)] for p in range(len(prompts))]

    def pick(self, index):
        text, finish_reason = self.canned[index % len(self.canned)]
        return text, [1, 2], finish_reason


def golden_eval_config():
    return load_config(None, ["eval.k=3", "eval.greedy=true", "format.use_chat_template=false"])


def _bytes(path: Path) -> bytes:
    return path.read_bytes()


def test_problems_mcts_and_prm_files_are_written_byte_for_byte_as_before(tmp_path):
    write_problems_jsonl(golden_problems(), tmp_path / "problems.jsonl")
    assert _bytes(tmp_path / "problems.jsonl") == _bytes(GOLDEN / "problems.jsonl")

    with ShardWriter(tmp_path / "shards") as writer:
        for result in golden_mcts_results():
            writer.add(result.summary.problem_id, records=result.records, summaries=[result.summary])
    (shard,) = sorted((tmp_path / "shards").glob("part-*"))
    assert _bytes(shard / "records.jsonl") == _bytes(GOLDEN / "mcts_records.jsonl")
    assert _bytes(shard / "summaries.jsonl") == _bytes(GOLDEN / "mcts_summaries.jsonl")

    # the hand-written input holds int and float answers, an int mc and an unknown key
    records = [
        *read_records(GOLDEN / "mcts_records.jsonl", MCTSRecord),
        *read_records(GOLDEN / "mcts_handwritten.jsonl", MCTSRecord),
    ]
    write_records_atomic(tmp_path / "prm_examples.jsonl", augment_records(records))
    assert _bytes(tmp_path / "prm_examples.jsonl") == _bytes(GOLDEN / "prm_examples.jsonl")


@pytest.mark.parametrize(
    "name, record_type",
    [
        ("problems", Problem),
        ("mcts_records", MCTSRecord),
        ("mcts_summaries", MCTSSummary),
        ("prm_examples", PRMExample),
        ("samples", Sample),
    ],
)
def test_reading_and_rewriting_a_golden_file_changes_no_byte(tmp_path, name, record_type):
    write_records_atomic(tmp_path / "copy.jsonl", read_records(GOLDEN / f"{name}.jsonl", record_type))
    assert _bytes(tmp_path / "copy.jsonl") == _bytes(GOLDEN / f"{name}.jsonl")


def test_samples_are_written_as_before_plus_finished(tmp_path):
    samples = generate_samples(CannedSampler(), golden_problems(), problem_kind, golden_eval_config(), "base")
    write_records_atomic(tmp_path / "samples.jsonl", samples)
    new_lines = (tmp_path / "samples.jsonl").read_text(encoding="utf-8").splitlines()
    old_lines = (GOLDEN / "samples.jsonl").read_text(encoding="utf-8").splitlines()
    assert len(new_lines) == len(old_lines) == 12
    for new, old in zip(new_lines, old_lines):
        obj = json.loads(new)
        assert list(obj)[-1] == "finished"
        finished = obj.pop("finished")
        assert json.dumps(obj, ensure_ascii=False) == old  # every other key, value and their order unchanged
        assert finished is (obj["steps"] != ["x = 12", "The answer is"])  # the canned "length" completion

"""PRM data in and out: human step ratings (PRM800K's format) train our PRM; our PRM data is
written as TRL's stepwise-supervision dataset with its labels where ours are."""

from __future__ import annotations

import json
from collections import Counter

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from pipeline.records import PRMExample, RecordError
from pipeline.steps import join_steps
from prm.prm800k import is_prm800k_file, load_prm800k, prm800k_examples, rating_label, read_training_records
from prm.trl_export import stepwise_rows

REPO_CONFIG = "configs/tiny.yaml"


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def sample(benchmarks_dir):
    return benchmarks_dir / "prm800k_phase2_sample.jsonl"


# ----------------------------------------------------------------------------- PRM800K -> our records


def test_prm800k_ratings_become_labels_along_the_labelled_path(sample):
    records = prm800k_examples(sample)
    solutions = load_prm800k(sample)
    assert is_prm800k_file(sample) and read_training_records(sample) == records
    assert {r.origin for r in records} == {"human"} and all(r.problem_id.startswith("prm800k-") for r in records)
    # every step of every labelled path (the validation's first-error path) is a record with its rating mapped
    by_path = {(r.question, r.path): r.label for r in records}
    for solution in solutions:
        for k, (step, rating) in enumerate(zip(solution.steps, solution.ratings)):
            assert by_path[(solution.question, (*solution.steps[:k], step))] == rating_label(rating)
    # and the rated alternatives the labeler did not choose, each after the same prefix
    assert len(records) == 107 > sum(len(s.steps) for s in solutions) == 76
    assert Counter(r.label for r in records) == {1.0: 86, 0.0: 21}
    assert len({r.problem_id for r in records}) == len({s.question for s in solutions})
    neutral = prm800k_examples(sample, neutral_label=0.0)  # TRL's conversion: only a rating of 1 is positive
    assert Counter(r.label for r in neutral)[1.0] < 86 and all(r.label in (0.0, 1.0) for r in neutral)
    assert rating_label(0, 0.5) == 0.5 and rating_label(-1) == 0.0


def test_a_bad_prm800k_line_names_the_file_and_line(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(
        json.dumps({"question": {"problem": "Q"}, "label": {"steps": [{"completions": [{"text": "s", "rating": 2}]}]}})
        + "\n"
    )
    with pytest.raises(RecordError, match=r"bad.jsonl:1: field 'label.steps\[0\].completions\[0\].rating'"):
        prm800k_examples(bad)


@pytest.mark.parametrize("rating", [True, 0.5, 5, "1"])
def test_a_prm800k_rating_that_is_not_minus_one_zero_or_one_names_the_file_line_and_field(tmp_path, rating):
    step = {"completions": [{"text": "s", "rating": 1}], "chosen_completion": 0}
    good = {"question": {"problem": "Q"}, "label": {"steps": [step]}}
    rated = {**step, "completions": [{"text": "t", "rating": rating}]}
    human = {"completions": [], "human_completion": {"text": "h", "rating": rating}}
    cases = [
        (2, r"label.steps\[1\].completions\[0\].rating", {**good, "label": {"steps": [step, rated]}}),
        (3, r"label.steps\[0\].human_completion.rating", {**good, "label": {"steps": [human]}}),
    ]
    for line_no, field, bad_line in cases:
        bad = tmp_path / "bad.jsonl"
        bad.write_text("".join(json.dumps(obj) + "\n" for obj in [good] * (line_no - 1) + [bad_line]))
        with pytest.raises(RecordError, match=rf"^{bad}:{line_no}: field '{field}': expected -1, 0, 1 or null"):
            read_training_records(bad)
        with pytest.raises(RecordError, match=rf"^{bad}:{line_no}: field '{field}'"):
            load_prm800k(bad)


@pytest.mark.parametrize("label", ["1.5", "-0.25", "NaN", "Infinity", "-Infinity"])
def test_a_prm_label_outside_zero_one_names_the_file_line_and_field(tmp_path, label):
    """What train_prm and export_trl read (make augment's records): a label that is no probability is refused
    where the file is read, naming the file, the line and the field."""
    good = {"problem_id": "p", "question": "q", "prefix_steps": [], "step": "s", "label": 0.5, "origin": "augmented"}
    path = tmp_path / "prm_train.jsonl"
    text = json.dumps(good) + "\n\n" + json.dumps(good).replace('"label": 0.5', f'"label": {label}') + "\n"
    path.write_text(text)  # a blank line 2: the bad label is on line 3
    with pytest.raises(RecordError, match=rf"^{path}:3: field 'label': expected a number in \[0, 1\], got float"):
        read_training_records(path)


def english_tokenizer(texts) -> PreTrainedTokenizerFast:
    """A byte-level BPE trained here on the sample's own text (no download)."""
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=600, special_tokens=["[PAD]", "[EOS]"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    backend.train_from_iterator(texts, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="[PAD]", eos_token="[EOS]")


def test_the_prm_stage_trains_on_human_labels(sample, tmp_path):
    from stages import train_prm as stage

    records = prm800k_examples(sample)
    run_dir = tmp_path / "runs" / "h"
    tokenizer = english_tokenizer([r.question for r in records] + [r.step for r in records])
    torch.manual_seed(0)
    lm = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=len(tokenizer),
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=4,
            max_position_embeddings=4096,
        )
    )
    lm.save_pretrained(run_dir / "bootstrap" / "model")
    tokenizer.save_pretrained(run_dir / "bootstrap" / "model")
    result = stage.main(
        [
            "--config",
            REPO_CONFIG,
            f"runs_root={tmp_path / 'runs'}",
            "run=h",
            f"prm.train_path={sample}",
            f"prm.val_path={sample}",
            "prm.kind=math",
            "prm.epochs=1",
            "prm.batch_size=8",
            "prm.micro_batch_size=4",
            "prm.max_length=4096",
            "prm.corrupt_examples=5",
        ]
    )
    train = result["train"]
    assert train["n_train_records"] == len(records) and train["dropped_labels"] == 0 and train["steps"] >= 1
    validation = json.loads((run_dir / "prm" / "validation.json").read_text())
    assert validation["n_records"] == len(records) and 0.0 <= validation["auc"] <= 1.0


# ----------------------------------------------------------------------------- our records -> TRL


def rendered(row: dict, upto: int, separator: str = "\n") -> str:
    """The text TRL's PRMTrainer puts before (and including) the label of completion ``upto``."""
    return row["prompt"] + join_steps(row["completions"][: upto + 1], separator)


def test_trl_rows_put_every_label_after_the_same_text_as_ours():
    q = "What is 1 + 2 ?"
    records = [
        PRMExample("p", q, [], "x = 1 + 2 = 3", 1.0, "mcts"),
        PRMExample(
            "p", q, ["x = 1 + 2 = 3", "x = 3 + 1 = 4"], "x = 4 + 1 = 6", 0.2, "mcts"
        ),  # its prefix step 2 has no label
        PRMExample(
            "p", q, ["x = 1 + 2 = 3", "x = 3 + 1 = 4", "x = 4 + 1 = 6"], "The answer is 6", 0.0, "augmented", "g1"
        ),
        PRMExample(
            "p", q, ["x = 1 + 2 = 3", "x = 3 + 1 = 4", "x = 4 + 1 = 6"], "The answer is 6", 1.0, "augmented", "g2"
        ),
        PRMExample("r", "What is 2 + 2 ?", [], "x = 2 + 2 = 4", 0.75, "mcts"),
    ]
    rows = list(stepwise_rows(records))
    assert rows[0] == {
        "prompt": q,
        "completions": ["x = 1 + 2 = 3"],
        "labels": [True],
        "soft_labels": [1.0],
        "problem_id": "p",
    }
    assert rows[1] == {
        "prompt": q + "x = 1 + 2 = 3\nx = 3 + 1 = 4\n",
        "completions": ["x = 4 + 1 = 6", "The answer is 6"],
        "labels": [False, False],
        "soft_labels": [0.2, 0.5],
        "problem_id": "p",
    }  # two records at one step: their mean
    assert rows[2]["labels"] == [True] and len(rows) == 3
    # every record's label sits after exactly its own question, prefix and step
    placed = {
        (row["problem_id"], rendered(row, k)): row["soft_labels"][k]
        for row in rows
        for k in range(len(row["completions"]))
    }
    for record in records:
        assert (record.problem_id, record.question + join_steps(record.path)) in placed


def test_export_trl_writes_both_splits(sample, tmp_path):
    from stages import export_trl

    augment = tmp_path / "runs" / "x" / "augment"
    augment.mkdir(parents=True)
    for name in ("prm_train", "prm_val"):
        (augment / f"{name}.jsonl").write_text(json.dumps(PRMExample("p", "Q", [], "s", 0.9, "mcts").to_json()) + "\n")
    stats = export_trl.main(["--config", REPO_CONFIG, f"runs_root={tmp_path / 'runs'}", "run=x"])
    out = tmp_path / "runs" / "x" / "export" / "trl"
    assert stats["prm_train"] == {"rows": 1, "records": 1, "steps": 1, "positive": 1}
    row = json.loads((out / "prm_val.jsonl").read_text())
    assert (row["prompt"], row["completions"], row["labels"]) == ("Q", ["s"], [True])
    # human labels go out the same way
    stats = export_trl.main(
        ["--config", REPO_CONFIG, f"runs_root={tmp_path / 'runs'}", "run=x", f"prm.train_path={sample}"]
    )
    distinct = {(r.problem_id, r.path) for r in prm800k_examples(sample)}  # records on one path share its step
    assert stats["prm_train"]["records"] == 107 and stats["prm_train"]["steps"] == len(distinct)

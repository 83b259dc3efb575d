"""TRL itself as the oracle of our TRL interop: its PRMTrainer reads `make export-trl` output with
every label where our scorer reads, trains on it and saves a model that prm.formats.load_scorer
loads (format sniffed) and scores exactly as TRL's own forward does. Tiny random-init models and a
word-level tokenizer built here: nothing is downloaded."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest
import torch
from datasets import load_dataset
from test_prm import arithmetic_solution
from test_prm_formats import config_for, llama_config, word_tokenizer
from transformers import LlamaForTokenClassification
from trl.experimental.prm import PRMConfig, PRMTrainer

from pipeline.records import PRMExample
from prm.adapters import TokenClassificationScorer
from prm.formats import detect_format, load_scorer

REPO_CONFIG = "configs/tiny.yaml"

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def prm_records(n_problems: int, seed: int) -> list[PRMExample]:
    """Each problem: a solution whose every step is labelled (1 until a slip, 0 from it on), and
    a longer branch whose middle step has no label of its own (an MCTS prefix no probe scored),
    so that some exported rows carry earlier steps in their prompt."""
    rng = random.Random(seed)
    records = []
    for i in range(n_problems):
        wrong_at = rng.choice([None, 1, 2])
        question, steps = arithmetic_solution(rng, 3, wrong_at=wrong_at)
        for k, step in enumerate(steps):
            label = 0.0 if wrong_at is not None and k >= wrong_at else 1.0
            records.append(PRMExample(f"p{seed}-{i}", question, steps[:k], step, label, "mcts"))
        _, more = arithmetic_solution(rng, 2)
        records.append(PRMExample(f"p{seed}-{i}", question, [*steps, more[0]], more[1], rng.choice([0.0, 1.0]), "mcts"))
    return records


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """(the records of both splits, the export folder) of `make export-trl` on a few problems."""
    from stages import export_trl

    root = tmp_path_factory.mktemp("trl_export")
    augment = root / "runs" / "x" / "augment"
    augment.mkdir(parents=True)
    records = {"prm_train": prm_records(8, seed=0), "prm_val": prm_records(4, seed=1)}
    for name, split in records.items():
        (augment / f"{name}.jsonl").write_text("".join(json.dumps(r.to_json()) + "\n" for r in split))
    export_trl.main(["--config", REPO_CONFIG, f"runs_root={root / 'runs'}", "run=x"])
    return [r for split in records.values() for r in split], root / "runs" / "x" / "export" / "trl"


def exported_dataset(folder):
    return load_dataset(
        "json", data_files={"train": str(folder / "prm_train.jsonl"), "test": str(folder / "prm_val.jsonl")}
    )


def trl_tokenize(row: dict, tokenizer) -> dict:
    """TRL's own PRMTrainer.tokenize_row, as its trainer calls it on a training row (no truncation)."""
    return PRMTrainer.tokenize_row(
        row,
        tokenizer,
        step_separator="\n",
        max_length=None,
        max_completion_length=None,
        train_on_last_step_only=False,
        is_eval=False,
    )


def whole_solution(row: dict, questions: dict) -> tuple[str, list[str]]:
    """The question and every step up to the row's last completion (its prompt holds the earlier ones)."""
    question = questions[row["problem_id"]]
    earlier = row["prompt"][len(question) :]
    return question, [step for step in earlier.split("\n") if step] + list(row["completions"])


def test_trl_tokenizes_every_exported_label_where_our_scorer_reads(exported):
    records, folder = exported
    questions = {r.problem_id: r.question for r in records}
    expected: dict[tuple, list[float]] = {}  # (problem, path) -> its records' labels
    for r in records:
        expected.setdefault((r.problem_id, tuple(r.path)), []).append(r.label)
    seen = set()
    tokenizer = word_tokenizer(bos=True)
    scorer = TokenClassificationScorer(LlamaForTokenClassification(llama_config(tokenizer, num_labels=2)), tokenizer)
    dataset = exported_dataset(folder)
    rows = [*dataset["train"], *dataset["test"]]
    assert any(row["prompt"] not in questions.values() for row in rows)  # some prompts carry earlier steps
    for row in rows:
        tokenized = trl_tokenize(row, tokenizer)
        placed = [(i, label) for i, label in enumerate(tokenized["labels"]) if label != -100]
        question, steps = whole_solution(row, questions)
        paths = [
            (row["problem_id"], tuple(steps[: len(steps) - len(row["completions"]) + j + 1]))
            for j in range(len(row["completions"]))
        ]
        assert [label for _, label in placed] == [int(np.mean(expected[path]) > 0.5) for path in paths]  # none flipped
        seen.update(paths)
        ids, positions = scorer.encode(question, steps)
        # the completions: the tokens our scorer reads, with the labels where it reads them (counted from the end)
        first = len(tokenizer(row["completions"][0], add_special_tokens=False)["input_ids"]) + len(scorer.separator_ids)
        tail = len(ids) - (positions[-len(row["completions"])] + 1 - first)
        assert tokenized["input_ids"][-tail:] == ids[-tail:]
        assert [len(tokenized["input_ids"]) - i for i, _ in placed] == [
            len(ids) - p for p in positions[-len(row["completions"]) :]
        ]
        if row["prompt"] in questions.values():  # TRL tokenizes a prompt as one string: ours is the question alone
            assert tokenized["input_ids"] == ids
    assert seen == set(expected)  # none lost


def test_trl_prm_trainer_trains_on_the_export_and_load_scorer_reads_its_model(exported, tmp_path):
    records, folder = exported
    questions = {r.problem_id: r.question for r in records}
    tokenizer = word_tokenizer(bos=True)
    torch.manual_seed(0)
    model = LlamaForTokenClassification(llama_config(tokenizer, num_labels=2))
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    dataset = exported_dataset(folder)
    args = PRMConfig(
        output_dir=str(tmp_path / "out"),
        max_steps=3,
        per_device_train_batch_size=4,
        learning_rate=1e-2,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        bf16=False,
        gradient_checkpointing=False,
        step_separator="\n",
        dataloader_num_workers=0,
        seed=0,
    )
    trainer = PRMTrainer(
        model=model, args=args, train_dataset=dataset["train"], eval_dataset=dataset["test"], processing_class=tokenizer
    )
    # TRL's own dataset processing kept every exported label
    assert sum(label != -100 for row in trainer.train_dataset["labels"] for label in row) == sum(
        len(r) for r in dataset["train"]["labels"]
    )
    trainer.train()
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    assert trainer.state.global_step == 3 and len(losses) == 3 and all(np.isfinite(losses))
    assert any(not torch.equal(before[name], p) for name, p in trainer.model.named_parameters())
    trainer.save_model(str(tmp_path / "trl_prm"))

    assert detect_format(str(tmp_path / "trl_prm")) == "token_classification"
    scorer = load_scorer(tmp_path / "trl_prm", config_for())
    assert isinstance(scorer, TokenClassificationScorer)
    trained = trainer.model.eval()
    rows = [
        row for row in dataset["test"] if row["prompt"] in questions.values()
    ]  # the same input ids (the test above)
    assert len(rows) >= 3
    for row in rows:
        question, steps = whole_solution(row, questions)
        tokenized = trl_tokenize(row, tokenizer)
        positions = [i for i, label in enumerate(tokenized["labels"]) if label != -100]
        with torch.no_grad():
            logits = trained(input_ids=torch.tensor([tokenized["input_ids"]])).logits[0, positions]
        ours = scorer.score(question, steps)[-len(positions) :]
        assert np.allclose(ours, logits.softmax(-1)[:, 1].tolist(), atol=1e-5)

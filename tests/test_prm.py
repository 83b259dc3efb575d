"""The process reward model: one-pass scoring, loss, training, save/load, validation metrics."""

from __future__ import annotations

import itertools
import json
import logging
import math
import random
import re

import numpy as np
import pytest
import torch

from pipeline.config.loader import ConfigError, load_config
from pipeline.config.schema import FormatConfig, TinyWorldConfig
from pipeline.datasets.problems import write_problems_jsonl
from pipeline.records import PRMExample, Problem, RecordError
from pipeline.stats import grouped_mean_interval, mann_whitney_auc
from pipeline.storage.files import read_records
from pipeline.tinyworld.checker import corrected_step
from pipeline.tinyworld.problems import generate_splits
from pipeline.training import checkpoint_io
from prm.data import PRMCollator, PRMDataset, group_records, iter_training_batches
from prm.exact_check import PolicySample, exact_check, exact_paths, matched_pairs, pair_auc
from prm.model import PRMInfo, ProcessRewardModel
from prm.prm800k import load_prm800k
from prm.scorer import PRMScorer
from prm.train import prm_bce_loss, train_prm, training_targets
from prm.validation import (
    corrupt_step,
    corruption_check,
    expected_calibration_error,
    first_error_accuracy,
    reliability_table,
    validate_prm,
)

FORMAT = FormatConfig(separator="\n", prompt_template="Question: {question}\nAnswer:\n", use_chat_template=False)
WORDS = ["Question:", "Answer:", "What", "is", "x", "y", "=", "+", "-", "?", "The", "answer", "then"]


def make_tokenizer():
    """Word-level tokenizer: spaces separate words, every newline is a token of its own."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(["[PAD]", "[UNK]", "[EOS]", "\n", *WORDS, *map(str, range(40))])}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(r"[^\S\n]+"), behavior="removed"),
            pre_tokenizers.Split(Regex("\n"), behavior="isolated"),
        ]
    )
    return PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="[PAD]", eos_token="[EOS]", unk_token="[UNK]")


def make_prm(tokenizer, seed: int = 0, hidden: int = 32) -> ProcessRewardModel:
    from transformers import LlamaConfig, LlamaModel

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=256,
        attn_implementation="eager",
    )
    return ProcessRewardModel(LlamaModel(config), PRMInfo.from_format(FORMAT, "tiny"))


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def tokenizer():
    return make_tokenizer()


def arithmetic_solution(rng: random.Random, n_steps: int, wrong_at: int | None = None) -> tuple[str, list[str]]:
    a, b = rng.randint(0, 4), rng.randint(0, 4)
    question = f"What is {a} + {b} ?"
    steps, value = [], a
    for k in range(n_steps):
        c = rng.randint(0, 4)
        result = value + c + (rng.randint(1, 3) if k == wrong_at else 0)
        steps.append(f"x = {value} + {c} = {result}")
        value = result
    return question, steps


def arithmetic_records(n: int, seed: int, top: int = 4) -> list[PRMExample]:
    """One-step problems 'x = a + b = c' (a, b <= top), labelled 1 when c is right, 0 when it is off by 1-3."""
    rng = random.Random(seed)
    records = []
    for i in range(n):
        a, b = rng.randint(0, top), rng.randint(0, top)
        correct = rng.random() < 0.5
        c = a + b if correct else a + b + rng.randint(1, 3)
        records.append(
            PRMExample(
                f"p{seed}-{i}", f"What is {a} + {b} ?", [], f"x = {a} + {b} = {c}", 1.0 if correct else 0.0, "mcts"
            )
        )
    return records


def tiny_config(**prm):
    config = load_config(
        None,
        [
            "model.device=cpu",
            "model.dtype=float32",
            "model.attn_implementation=eager",
            "format.use_chat_template=false",
        ],
    )
    for key, value in prm.items():
        setattr(config.prm, key, value)
    return config


# ----------------------------------------------------------------------------- model and scorer


def test_one_pass_scores_equal_scoring_each_prefix(tokenizer):
    scorer = PRMScorer(make_prm(tokenizer), tokenizer, FORMAT, "tiny", batch_size=4)
    rng = random.Random(0)
    solutions = [arithmetic_solution(rng, n) for n in (1, 3, 5, 8)]
    one_pass = scorer.score_many(solutions)
    for (question, steps), scores in zip(solutions, one_pass):
        assert len(scores) == len(steps)
        for k in range(len(steps)):
            alone = scorer.score(question, steps[: k + 1])[-1]  # the prefix in a batch of its own
            assert abs(alone - scores[k]) < 1e-5
    logs = scorer.log_scores_many(solutions)
    for scores, log_scores in zip(one_pass, logs):
        assert np.allclose(np.log(scores), log_scores, atol=1e-6)
    assert scorer.score_many([("What is 1 + 1 ?", [])]) == [[]]


def test_save_and_reload_give_identical_scores(tokenizer, tmp_path):
    model = make_prm(tokenizer, seed=1)
    torch.nn.init.normal_(model.head.weight, std=0.5)  # non-trivial scores
    scorer = PRMScorer(model, tokenizer, FORMAT, "tiny")
    solutions = [arithmetic_solution(random.Random(i), 4) for i in range(5)]
    before = scorer.score_many(solutions)
    model.save_pretrained(tmp_path / "prm", tokenizer=tokenizer)
    saved = json.loads((tmp_path / "prm" / "prm_config.json").read_text())
    assert (saved["separator"], saved["kind"], saved["base_architecture"]) == ("\n", "tiny", "LlamaModel")
    config = tiny_config()
    reports = logging.Handler()  # transformers' own handler writes to the stderr it found first: listen on its logger
    reports.emit = lambda record: messages.append(record.getMessage())
    messages: list[str] = []
    logging.getLogger("transformers").addHandler(reports)
    try:
        reloaded = PRMScorer.from_pretrained(tmp_path / "prm", config)
    finally:
        logging.getLogger("transformers").removeHandler(reports)
    assert not [m for m in messages if "LOAD REPORT" in m]  # every weight of the folder is expected: nothing to report
    assert reloaded.kind == "tiny" and reloaded.format_config.prompt_template == FORMAT.prompt_template
    assert reloaded.score_many(solutions) == before
    # damaged files are named, not reported as a bare JSONDecodeError or "invalid header length"
    from pipeline.storage.model_folders import FolderError

    (tmp_path / "prm" / "prm_config.json").write_text('{"kind": ')
    with pytest.raises(FolderError, match=r"prm_config\.json:1: not valid JSON"):
        PRMScorer.from_pretrained(tmp_path / "prm", config)
    model.save_pretrained(tmp_path / "prm", tokenizer=tokenizer)
    weights = tmp_path / "prm" / "model.safetensors"  # the token-classification layout: one weights file
    weights.write_bytes(weights.read_bytes()[:409])
    with pytest.raises(FolderError, match=r"prm/model\.safetensors: .*truncated"):
        PRMScorer.from_pretrained(tmp_path / "prm", config)


def test_lora_adapters_are_merged_on_save(tokenizer, tmp_path):
    model = make_prm(tokenizer, seed=2)
    model.add_lora(r=4, alpha=8, dropout=0.0, target_modules=["q_proj", "v_proj"])
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(std=0.2)  # peft initialises B to 0: make the adapter matter
    model.eval()
    solutions = [arithmetic_solution(random.Random(i), 3) for i in range(3)]
    before = PRMScorer(model, tokenizer, FORMAT, "tiny").score_many(solutions)
    model.save_pretrained(tmp_path / "lora", tokenizer=tokenizer)
    after = PRMScorer.from_pretrained(tmp_path / "lora", tiny_config()).score_many(solutions)
    assert not PRMScorer(make_prm(tokenizer, seed=2), tokenizer, FORMAT, "tiny").score_many(solutions) == before
    assert np.allclose(np.concatenate(before), np.concatenate(after), atol=1e-5)


# ----------------------------------------------------------------------------- data


def test_records_that_are_prefixes_share_one_sequence():
    def example(prefix_steps, step, label):
        return PRMExample("p", "q", prefix_steps, step, label, "mcts")

    records = [
        example([], "a", 1.0),
        example(["a", "b"], "c", 0.5),
        example(["a"], "b", 0.2),
        example(["a"], "b", 0.4),  # same path: mean label, weight 2
        example(["a"], "z", 0.0),  # a branch: its own sequence
    ]
    sequences, slots = group_records(records)
    assert [s.steps for s in sequences] == [["a", "b", "c"], ["a", "z"]]
    assert sequences[0].labels == {0: (1.0, 1.0), 1: (pytest.approx(0.3), 2.0), 2: (0.5, 1.0)}
    assert slots == [(0, 0), (0, 2), (0, 1), (0, 1), (1, 1)]
    unmerged, _ = group_records(records, merge_prefixes=False)
    assert len(unmerged) == 4


def test_collator_puts_labels_at_each_steps_last_token(tokenizer):
    records = [
        PRMExample("p", "What is 1 + 2 ?", ["x = 1 + 2 = 3"], "x = 3 + 1 = 4", 0.75, "augmented", "p:k:1:0"),
        PRMExample("p", "What is 1 + 2 ?", [], "x = 1 + 2 = 3", 1.0, "mcts"),
    ]
    dataset = PRMDataset(records, tokenizer, FORMAT, "tiny", max_length=512)
    assert len(dataset) == 1
    batch = PRMCollator(tokenizer.pad_token_id)([dataset[0]])
    newline = tokenizer.convert_tokens_to_ids("\n")
    positions = batch["score_positions"][0].tolist()
    assert [batch["input_ids"][0, p].item() for p in positions] == [newline, newline]
    assert batch["labels"][0].tolist() == [1.0, 0.75]
    short = PRMDataset(records, tokenizer, FORMAT, "tiny", max_length=positions[0] + 1)
    assert short.dropped_labels == 1 and short[0].labels == [1.0] and len(short[0]) == positions[0] + 1


def test_training_batches_mix_lengths_unless_grouped_by_length():
    # Half the sequences short, half long: a PRM sequence's length predicts its labels, so a
    # default micro-batch must mix both (length-sorted batches trained the tiny PRM to AUC 0.67
    # where shuffled ones reached 0.84, docs/prm.md "Batching").
    lengths = [10] * 320 + [100] * 320

    def mixed_share(group_by_length):
        batches = list(iter_training_batches(lengths, 16, 40, seed=0, group_by_length=group_by_length))
        assert sorted(i for b in batches for i in b) == list(range(640))  # one epoch: every item once
        return np.mean([len({lengths[i] for i in b}) == 2 for b in batches])

    assert mixed_share(False) > 0.9
    assert mixed_share(True) < 0.2
    # the stream is reproducible from the seed (a resumed run sees the same batches)
    assert list(iter_training_batches(lengths, 16, 60, 3)) == list(iter_training_batches(lengths, 16, 60, 3))


def test_malformed_record_names_file_line_and_field(tmp_path):
    good = {"problem_id": "p", "question": "q", "prefix_steps": [], "step": "s", "label": 0.5, "origin": "mcts"}
    path = tmp_path / "prm_train.jsonl"
    path.write_text(json.dumps(good) + "\n" + json.dumps({**good, "label": 1.5}) + "\n")
    with pytest.raises(RecordError, match=rf"^{path}:2: field 'label': expected a number in \[0, 1\]"):
        list(read_records(path, PRMExample))
    path.write_text(json.dumps({k: v for k, v in good.items() if k != "origin"}) + "\n")
    with pytest.raises(RecordError, match=rf"^{path}:1: missing field 'origin'"):
        list(read_records(path, PRMExample))
    path.write_text(json.dumps({**good, "prefix_steps": "s"}) + "\n")
    with pytest.raises(RecordError, match=rf"^{path}:1: field 'prefix_steps'"):
        list(read_records(path, PRMExample))


# ----------------------------------------------------------------------------- loss and training


def test_bce_loss_on_a_hand_example():
    logits = torch.tensor([[0.0, 2.0, -1.0], [1.5, 0.3, 0.0]])
    labels = torch.tensor([[0.5, 1.0, 0.2], [0.0, 0.9, 0.0]])
    mask = torch.tensor([[True, True, True], [True, False, False]])
    # BCE(x, y) = -(y log s(x) + (1 - y) log(1 - s(x))), s = sigmoid, written out:
    #   (0, .5): log 2 = 0.693147;  (2, 1): log(1 + e^-2) = 0.126928
    #   (-1, .2): .2 log(1 + e) + .8 log(1 + e^-1) = 0.262652 + 0.250609 = 0.513262;  (1.5, 0): log(1 + e^1.5) = 1.701413
    expected = (0.693147 + 0.126928 + 0.513262 + 1.701413) / 4
    loss = prm_bce_loss(logits, labels, mask)
    assert loss.item() == pytest.approx(expected, abs=1e-5)
    reference = torch.nn.BCEWithLogitsLoss()(logits[mask], labels[mask])
    assert loss.item() == pytest.approx(reference.item(), abs=1e-6)
    # A weight of 2 counts a position twice.
    weights = mask.float()
    weights[0, 1] = 2.0
    doubled = torch.nn.BCEWithLogitsLoss()(
        torch.cat([logits[mask], logits[0, 1:2]]), torch.cat([labels[mask], labels[0, 1:2]])
    )
    assert prm_bce_loss(logits, labels, weights).item() == pytest.approx(doubled.item(), abs=1e-6)


@pytest.mark.slow
def test_tiny_prm_learns_a_separable_step_dataset(tokenizer, tmp_path):
    """Three seeds (model init and batch order): a single seed can stall on a plateau (measured:
    one of five seeds ended at loss 0.34, AUC 0.92, the others at AUC >= 0.985), so the claim is
    on the median, and no seed may fail outright."""
    train, val = arithmetic_records(400, seed=1, top=3), arithmetic_records(200, seed=2, top=3)
    aucs = []
    for seed in range(3):
        config = tiny_config(
            lr=3e-3,
            batch_size=32,
            micro_batch_size=32,
            epochs=20.0,
            warmup_ratio=0.05,
            log_every=20,
            weight_decay=0.0,
            seed=seed,
        )
        out = tmp_path / str(seed)
        metrics = train_prm(
            config,
            train,
            val,
            out,
            model=make_prm(tokenizer, seed=seed, hidden=64),
            tokenizer=tokenizer,
            kind="tiny",
            progress=False,
        )
        report = validate_prm(PRMScorer.from_pretrained(out / "model", config), val, corrupt_examples=50)
        aucs.append(report["auc"])
        assert report["corruption"]["n"] > 0 and report["corruption"]["mean_drop"] > 0
        lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        assert lines[-1]["step"] == metrics["steps"] and {"loss", "lr", "examples_per_s"} <= set(lines[-1])
    assert sorted(aucs)[1] > 0.95 and min(aucs) > 0.85, aucs
    assert metrics["val_bce"] < 0.5


def test_interrupted_training_resumes_to_the_same_model(tokenizer, tmp_path, monkeypatch):
    config = tiny_config(lr=1e-2, batch_size=8, micro_batch_size=4, epochs=1.0, save_every=2, log_every=1)
    train = arithmetic_records(40, seed=3)
    solutions = [arithmetic_solution(random.Random(i), 2) for i in range(4)]

    def final_scores(directory):
        return PRMScorer.from_pretrained(directory / "model", config).score_many(solutions)

    straight = train_prm(
        config, train, None, tmp_path / "straight", model=make_prm(tokenizer), tokenizer=tokenizer, progress=False
    )
    assert (straight["steps"], straight["micro_batches"], straight["accumulation"]) == (5, 10, 2)

    def crash(*args, **kwargs):
        raise KeyboardInterrupt

    with monkeypatch.context() as patch:  # killed after the last checkpoint (step 4), before model/ is written
        patch.setattr(ProcessRewardModel, "save_pretrained", crash)
        with pytest.raises(KeyboardInterrupt):
            train_prm(
                config,
                train,
                None,
                tmp_path / "resumed",
                model=make_prm(tokenizer),
                tokenizer=tokenizer,
                progress=False,
            )
    last = checkpoint_io.latest(tmp_path / "resumed" / "checkpoints")
    assert last.name == "step-00000004" and checkpoint_io.read_state(last, "trainer")["step"] == 4
    resumed = train_prm(
        config,
        train,
        None,
        tmp_path / "resumed",
        model=make_prm(tokenizer, seed=9),
        tokenizer=tokenizer,
        progress=False,
    )
    assert (resumed["resumed_from"], resumed["steps"], resumed["micro_batches"]) == (4, 5, 2)
    assert not (tmp_path / "resumed" / "checkpoints").exists()
    assert np.allclose(
        np.concatenate(final_scores(tmp_path / "straight")),
        np.concatenate(final_scores(tmp_path / "resumed")),
        atol=1e-6,
    )
    steps_logged = [
        json.loads(line)["step"] for line in (tmp_path / "resumed" / "metrics.jsonl").read_text().splitlines()
    ]
    assert steps_logged == [1, 2, 3, 4, 5]


# ----------------------------------------------------------------------------- validation metrics


def test_auc_matches_brute_force_pair_counting():
    rng = np.random.default_rng(0)
    for _ in range(20):
        n = int(rng.integers(2, 40))
        scores = np.round(rng.random(n), 1)  # many ties
        positive = rng.random(n) < 0.5
        pairs = [(p, q) for p, q in itertools.product(scores[positive], scores[~positive])]
        if not pairs:
            assert math.isnan(mann_whitney_auc(scores, positive))
            continue
        brute = sum(1.0 if p > q else 0.5 if p == q else 0.0 for p, q in pairs) / len(pairs)
        assert mann_whitney_auc(scores, positive) == pytest.approx(brute, abs=1e-12)


def test_grouped_bootstrap_auc_resamples_problems_and_brackets_the_auc():
    from pipeline.stats import grouped_bootstrap_auc

    rng = np.random.default_rng(3)
    groups = np.repeat(np.arange(30), 6)  # 30 problems of 6 steps
    positive = rng.random(groups.size) < 0.6
    scores = positive * 0.5 + rng.random(groups.size)  # informative, not perfect
    auc, lo, hi = grouped_bootstrap_auc(scores, positive, groups, n_resamples=400, seed=1)
    assert auc == pytest.approx(mann_whitney_auc(scores, positive)) and lo < auc < hi and 0.5 < lo
    assert grouped_bootstrap_auc(scores, positive, groups, n_resamples=400, seed=1) == (auc, lo, hi)  # seeded
    assert grouped_bootstrap_auc(scores, positive, np.zeros_like(groups))[1:] == (None, None)


def test_ece_on_a_hand_example():
    scores, labels = [0.05, 0.15, 0.15, 0.95], [0.0, 1.0, 0.0, 1.0]
    # bins [0, .1): |0 - .05| x 1/4; [.1, .2): |.5 - .15| x 2/4; [.9, 1]: |1 - .95| x 1/4
    assert expected_calibration_error(scores, labels) == pytest.approx(0.0125 + 0.175 + 0.0125)
    table = reliability_table(scores, labels)
    assert [row["count"] for row in table] == [1, 2, 0, 0, 0, 0, 0, 0, 0, 1]
    assert table[1]["mean_label"] == 0.5 and table[2]["mean_score"] is None
    assert expected_calibration_error([1.0], [1.0]) == 0.0


def test_plus_minus_one_corruption_moves_the_last_result_by_one():
    corrupted = [corrupt_step(f"Step {i}: 3 + 4 = 7", seed=i, corruption="pm1") for i in range(40)]
    assert {int(step.rsplit("=", 1)[1]) for step in corrupted} == {6, 8}  # both signs occur, never another size
    with pytest.raises(ValueError, match="corruption"):
        corrupt_step("x = 1", corruption="2to5")


def test_symmetric_corruption_moves_results_both_ways_and_never_below_zero():
    up_down = [
        int(corrupt_step(f"Step {i}: 30 + 4 = 34", seed=i, corruption="pm1to9").rsplit("=", 1)[1]) for i in range(200)
    ]
    assert {v - 34 for v in up_down} == set(range(-9, 0)) | set(range(1, 10))  # every size, both directions
    small = [
        int(corrupt_step(f"Step {i}: 1 + 1 = 2", seed=i, corruption="pm1to9").rsplit("=", 1)[1]) for i in range(200)
    ]
    assert min(small) >= 0 and 1 in small and 0 in small and max(small) > 3  # down only where it stays >= 0


GOLD = ["Ann buys 3 * 4 = 12 apples.", "Ann has 5 + 12 = 17 apples.", "Ann has 17 - 2 = 15 apples.", "The answer is 15"]
OTHER = ["Ann has 5 - 2 = 3 apples.", "Ann buys 3 * 4 = 12 apples.", "Ann has 3 + 12 = 15 apples.", "The answer is 15"]


def tiny_problem(problem_id: str) -> Problem:
    return Problem(problem_id, f"question {problem_id}", "15", "tiny", {"solutions": [GOLD, OTHER]})


def exact_samples() -> list[PolicySample]:
    p1, p2 = tiny_problem("p1"), tiny_problem("p2")
    return [
        PolicySample(p1, "q1", list(GOLD)),  # every step right
        PolicySample(
            p1, "q1", [GOLD[0], "Ann has 5 + 12 = 18 apples.", "Ann has 18 - 2 = 16 apples.", "The answer is 16"]
        ),  # a slip
        PolicySample(p2, "q2", ["Ann has 5 + 2 = 8 apples.", "Ann has 8 - 2 = 6 apples."]),  # wrong operand and result
        PolicySample(p2, "q2", [OTHER[0], "I like apples.", OTHER[1]]),  # wrong without a calculation
        PolicySample(p2, "q2", []),  # an empty sample: checked, no step
        PolicySample(
            Problem("m1", "What is 2 + 2?", "4", "math"), "m", ["2 + 2 = 5", "The answer is 5"]
        ),  # no exact labeller
    ]


def test_exact_paths_end_on_the_first_wrong_step_and_pair_only_a_slip_the_correction_makes_right():
    paths, labels, groups, pairs, left_out = exact_paths(exact_samples())
    assert paths == [
        ("q1", GOLD),
        ("q1", [GOLD[0], "Ann has 5 + 12 = 18 apples."]),
        ("q2", ["Ann has 5 + 2 = 8 apples."]),
        ("q2", [OTHER[0], "I like apples."]),
    ]  # what follows a first wrong step is left out; the math sample skipped
    assert labels == [True] * 4 + [True, False] + [False] + [True, False]
    assert groups == ["p1"] * 6 + ["p2"] * 3
    assert [(p.group, p.question, p.prefix, p.slip, p.counterpart, p.path) for p in pairs] == [
        ("p1", "q1", [GOLD[0]], "Ann has 5 + 12 = 18 apples.", GOLD[1], 1)
    ]
    assert left_out == 1  # "5 + 2 = 7" is still wrong (a wrong operand): no pair


class TextScores:
    """A PRM whose score of a step is looked up by its text (default 0.5)."""

    def __init__(self, table):
        self.table = table

    def score_many(self, pairs):
        return [[self.table.get(step, 0.5) for step in steps] for _, steps in pairs]


def test_exact_check_scores_the_labelled_steps_and_the_slip_pairs():
    table = {
        GOLD[0]: 0.9,
        GOLD[1]: 0.8,
        GOLD[2]: 0.7,
        GOLD[3]: 0.6,
        OTHER[0]: 0.3,
        "Ann has 5 + 12 = 18 apples.": 0.4,
        "Ann has 5 + 2 = 8 apples.": 0.2,
        "I like apples.": 0.1,
    }
    result = exact_check(TextScores(table), exact_samples())
    exact, pair = result["exact"], result["slip_pair"]
    correct = [0.9, 0.8, 0.7, 0.6, 0.9, 0.3]  # six correct steps after a correct prefix, three first wrong steps
    wrong = [0.4, 0.2, 0.1]
    assert exact["auc"] == pytest.approx(mann_whitney_auc(correct + wrong, [True] * 6 + [False] * 3))
    assert exact["auc"] == pytest.approx(17 / 18)  # 0.3 loses to 0.4: one pair of 18
    assert (exact["n_correct"], exact["n_wrong"], exact["n_solutions"]) == (6, 3, 5)
    assert exact["mean_correct"] == pytest.approx(np.mean(correct)) and exact["mean_wrong"] == pytest.approx(
        np.mean(wrong)
    )
    assert exact["interval"][0] <= exact["auc"] <= exact["interval"][1]
    # matched in problem and depth: p1's slip (0.4) against p1's right step 2 (0.8), p2's wrong first
    # step (0.2) against p2's right one (0.3); "I like apples." has no right step at its depth. The
    # pair 0.3 < 0.4 that cost the pooled AUC compares steps of two problems and is not one of them
    assert exact["matched"]["n_pairs"] == 2 and exact["matched"]["auc"] == 1.0
    assert (pair["n_pairs"], pair["auc"], pair["mean_slip"], pair["mean_counterpart"]) == (1, 1.0, 0.4, 0.8)
    assert pair["interval"] == [None, None]  # one problem: nothing to resample
    assert pair["n_left_out"] == 1 and pair["examples"][0]["counterpart"] == GOLD[1]
    reader = TextScores({**table, GOLD[1]: 0.4})  # a PRM blind to the result: the counterpart ties with the slip
    assert exact_check(reader, exact_samples())["slip_pair"]["auc"] == 0.5
    assert exact_check(TextScores(table), exact_samples()[-1:]) is None  # no sample of a kind with a labeller


def test_corruption_check_reports_the_means_before_and_after_with_problem_resampled_intervals():
    records = [
        PRMExample("p1", "q1", [], GOLD[0], 1.0, "mcts"),
        PRMExample("p1", "q1", [GOLD[0]], GOLD[1], 0.95, "mcts"),
        PRMExample("p2", "q2", [], OTHER[0], 1.0, "mcts"),
        PRMExample("p2", "q2", [], "The answer is 15", 1.0, "mcts"),  # no result to corrupt
        PRMExample("p3", "q3", [], OTHER[1], 0.5, "mcts"),  # label below 0.9: not a correct step
    ]

    class ResultReader:
        """0.9 for the three original steps, 0.2 for any other text (their corruptions); p2's step 0.6."""

        def score_many(self, pairs):
            table = {GOLD[0]: 0.9, GOLD[1]: 0.9, OTHER[0]: 0.6}
            return [[table.get(step, 0.2) for step in steps] for _, steps in pairs]

    result = corruption_check(ResultReader(), records, seed=3)
    assert result["n"] == 3 and result["mean_original"] == pytest.approx(0.8)
    assert result["mean_corrupted"] == pytest.approx(0.2) and result["mean_drop"] == pytest.approx(0.6)
    # problems resampled whole: p1's drops (0.7, 0.7) and p2's (0.4); a resample holds only p1 or only p2 at the ends
    lo, hi = result["intervals"]["drop"]
    assert lo == pytest.approx(0.4) and hi == pytest.approx(0.7)
    assert result["intervals"]["corrupted"] == [pytest.approx(0.2), pytest.approx(0.2)]
    assert corruption_check(ResultReader(), records[:2])["intervals"]["drop"] == [None, None]  # one problem


def test_grouped_mean_interval_resamples_whole_groups():
    values = [1.0, 1.0, 0.0, 0.5]
    mean, lo, hi = grouped_mean_interval(values, ["a", "a", "b", "c"], n_resamples=4000, seed=0)
    assert mean == pytest.approx(0.625)
    # the extremes: only a's items (mean 1) or only b's (0) are drawn; a resample's mean is a
    # mean over its drawn items, so a's two items weigh twice
    assert 0.0 <= lo < mean < hi <= 1.0
    assert grouped_mean_interval([], []) == (None, None, None)
    assert grouped_mean_interval([0.3, 0.5], ["a", "a"]) == (pytest.approx(0.4), None, None)


def test_matched_pairs_are_every_wrong_and_correct_step_of_one_problem_and_depth():
    rng = np.random.default_rng(1)
    correct = rng.random(60) < 0.6
    groups = rng.integers(0, 5, 60)
    depths = rng.integers(0, 3, 60)
    brute = sorted(
        (i, j)
        for i in range(60)
        for j in range(60)
        if not correct[i] and correct[j] and groups[i] == groups[j] and depths[i] == depths[j]
    )
    assert sorted(matched_pairs(correct, groups, depths)) == brute and brute


def test_pair_auc_is_the_share_of_counterparts_above_their_slips_with_problems_resampled():
    rng = np.random.default_rng(0)
    slip = rng.integers(0, 6, 300) / 5  # coarse scores: many ties
    counterpart = rng.integers(0, 6, 300) / 5
    groups = rng.integers(0, 40, 300)
    brute = (
        sum(1.0 if float(c) > float(s) else 0.5 if float(c) == float(s) else 0.0 for s, c in zip(slip, counterpart))
        / 300
    )
    auc, lo, hi = pair_auc(slip, counterpart, groups, n_resamples=300, seed=1)
    assert auc == pytest.approx(brute, abs=1e-12) and lo < auc < hi
    assert pair_auc(slip, counterpart, groups, n_resamples=300, seed=1) == (auc, lo, hi)  # seeded
    # two problems, one whose counterparts all win and one whose all lose: resampling problems
    # (not pairs) spans 0 to 1
    assert pair_auc([0.1] * 10 + [0.9] * 10, [0.9] * 10 + [0.1] * 10, ["a"] * 10 + ["b"] * 10, n_resamples=200) == (
        0.5,
        0.0,
        1.0,
    )
    assert pair_auc([], [], []) == (None, None, None)


def test_the_corrected_step_replaces_only_a_wrong_result():
    assert corrected_step("Ann has 5 + 12 = 18 apples.") == "Ann has 5 + 12 = 17 apples."
    assert corrected_step("Ben buys 3 * 4 = 13 pens.") == "Ben buys 3 * 4 = 12 pens."
    assert corrected_step("Cara has 3 - 5 = 1 cards.") == "Cara has 3 - 5 = -2 cards."
    assert corrected_step("Ann has 5 + 12 = 17 apples.") is None  # nothing wrong
    assert corrected_step("The answer is 16") is None  # no calculation
    assert (
        corrected_step("x: 2 + 2 = 4, then 4 * 3 = 13") == "x: 2 + 2 = 4, then 4 * 3 = 12"
    )  # only the wrong one changes


def test_hard_labels_are_one_above_the_threshold_and_soft_labels_stay():
    records = [PRMExample("p", "q", [], f"s{i}", label, "mcts") for i, label in enumerate([0.0, 0.125, 0.5, 1.0])]
    assert [r.label for r in training_targets(records, "soft")] == [0.0, 0.125, 0.5, 1.0]
    assert [r.label for r in training_targets(records, "hard", 0.0)] == [0.0, 1.0, 1.0, 1.0]  # MC > 0
    assert [r.label for r in training_targets(records, "hard", 0.5)] == [0.0, 0.0, 0.0, 1.0]
    assert [r.label for r in records] == [0.0, 0.125, 0.5, 1.0]  # the stored labels are left alone
    with pytest.raises(ConfigError, match="prm.labels must be one of soft, hard, got 'medium'"):
        training_targets(records, "medium")


def test_a_prm_label_choice_that_does_not_exist_is_refused_by_key():
    assert load_config(None, ["prm.labels=hard"]).prm.labels == "hard"
    with pytest.raises(ConfigError, match=r"command line: prm.labels must be one of soft, hard, got"):
        load_config(None, ["prm.labels=binary"])
    with pytest.raises(ConfigError, match=r"prm.hard_label_threshold"):
        load_config(None, ["prm.hard_label_threshold=1.0"])


def test_training_reads_the_hard_targets(tokenizer, monkeypatch, tmp_path):
    import prm.train as train

    seen = []

    class Stop(Exception):
        pass

    def dataset(records, *args, **kwargs):
        seen.append([r.label for r in records])
        raise Stop

    monkeypatch.setattr(train, "PRMDataset", dataset)
    config = load_config(None, ["prm.labels=hard", "prm.hard_label_threshold=0.25", "model.device=cpu"])
    records = arithmetic_records(6, seed=1)
    records = [
        PRMExample(r.problem_id, r.question, r.prefix_steps, r.step, mc, "mcts")
        for r, mc in zip(records, [0, 0.2, 0.3, 1, 0.5, 0.25])
    ]
    with pytest.raises(Stop):
        train_prm(
            config,
            records,
            None,
            tmp_path / "prm",
            model=make_prm(tokenizer),
            tokenizer=tokenizer,
            kind="tiny",
            progress=False,
        )
    assert seen == [[0.0, 0.0, 1.0, 1.0, 1.0, 0.0]]


def test_corruption_changes_the_result_of_the_last_calculation():
    step = "x = 3 + 4 = 7"
    corrupted = corrupt_step(step, seed=0)
    assert corrupted.startswith("x = 3 + 4 = ") and 8 <= int(corrupted.rsplit(" ", 1)[1]) <= 16
    assert corrupt_step(step, seed=0) == corrupted  # deterministic
    assert corrupt_step("So $2 \\cdot 5 = 10$ apples, and 10 - 4 = 6 remain.", seed=3).endswith("remain.")
    assert "10 - 4 = 6 " not in corrupt_step("So $2 \\cdot 5 = 10$ apples, and 10 - 4 = 6 remain.", seed=3)
    assert corrupt_step("The price is $x = 2.50$", seed=1) != "The price is $x = 2.50$"
    assert corrupt_step("no calculation here", seed=0) is None


class FixedScorer:
    """Scores step k of every solution from a table, for testing the bookkeeping."""

    def __init__(self, rows):
        self.rows = rows

    def score_many(self, solutions):
        return [row[: len(steps)] for row, (_, steps) in zip(self.rows, solutions)]


def test_prm800k_sample_parses_and_first_error_accuracy(benchmarks_dir):
    solutions = load_prm800k(benchmarks_dir / "prm800k_phase2_sample.jsonl")
    assert len(solutions) == 9
    raw = [
        json.loads(line)
        for line in (benchmarks_dir / "prm800k_phase2_sample.jsonl").read_text().splitlines()
        if line.strip()
    ]
    for solution, record in zip(solutions, raw):
        assert solution.question == record["question"]["problem"]
        assert len(solution.steps) == len(record["label"]["steps"])  # each sample ends on the error found
        assert solution.first_error == len(solution.steps) - 1
        assert solution.ratings[-1] == -1 and all(r in (0, 1) for r in solution.ratings[:-1])
    # A PRM that flags exactly the last step agrees everywhere; one that flags nothing, nowhere.
    perfect = FixedScorer([[0.9] * (len(s.steps) - 1) + [0.1] for s in solutions])
    assert first_error_accuracy(perfect, solutions)["accuracy"] == 1.0
    assert first_error_accuracy(FixedScorer([[0.9] * len(s.steps) for s in solutions]), solutions)["accuracy"] == 0.0


def test_stage_trains_validates_and_writes_outputs(tokenizer, tmp_path, benchmarks_dir, capsys, monkeypatch):
    from transformers import LlamaConfig, LlamaForCausalLM

    from stages import train_prm as stage

    run_dir = tmp_path / "runs" / "t"
    torch.manual_seed(0)
    lm = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=len(tokenizer),
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=4,
            max_position_embeddings=256,
        )
    )
    lm.save_pretrained(run_dir / "bootstrap" / "model")
    tokenizer.save_pretrained(run_dir / "bootstrap" / "model")
    for name, records in (("prm_train", arithmetic_records(40, 1)), ("prm_val", arithmetic_records(20, 2))):
        path = run_dir / "augment" / f"{name}.jsonl"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("".join(json.dumps(r.to_json()) + "\n" for r in records))
    held_out = generate_splits(TinyWorldConfig(n_train=1, n_val=3, n_test=1))["val"]
    write_problems_jsonl(held_out, run_dir / "bootstrap" / "problems_val.jsonl")
    args = [
        "--config",
        "configs/tiny.yaml",
        f"runs_root={tmp_path / 'runs'}",
        "run=t",
        "prm.kind=tiny",
        "prm.epochs=1",
        "prm.batch_size=8",
        "prm.micro_batch_size=4",
        "prm.corrupt_examples=5",
        f"prm.prm800k_path={benchmarks_dir / 'prm800k_phase2_sample.jsonl'}",
        "prm.exact_check_samples=2",
        "generation.max_new_tokens=24",
        "prm.torch_threads=2",
    ]
    threads_while_training = []
    real_train = stage.train_prm

    def recording_train(*args, **kwargs):
        threads_while_training.append(torch.get_num_threads())
        return real_train(*args, **kwargs)

    monkeypatch.setattr(stage, "train_prm", recording_train)
    result = stage.main(args)
    # the training loop has prm.torch_threads, the rest of the stage model.torch_threads (tiny.yaml: 1)
    assert threads_while_training == [2] and torch.get_num_threads() == 1
    assert "generate: 100%" in capsys.readouterr().err  # the exact check's sampling shows its progress
    out = run_dir / "prm"
    for name in (
        "model/prm_config.json",
        "model/config.json",
        "model/model.safetensors",
        "model/README.md",
        "metrics.jsonl",
        "validation.json",
        "calibration.png",
        "config.yaml",
    ):
        assert (out / name).exists(), name
    assert result["train"]["steps"] == 5
    report = json.loads((out / "validation.json").read_text())
    assert report["n_records"] == 20 and 0.0 <= report["auc"] <= 1.0 and report["prm800k"]["n"] == 9
    assert report["exact"]["n_solutions"] == 3 * 2  # the policy's own samples of the held-out problems
    assert report["slip_pair"]["n_pairs"] >= 0 and result["train"]["labels"] == "soft"
    assert report["corruption"]["corruption"] == "1to9" and report["corruption_pm1"]["corruption"] == "pm1"
    again = stage.main(args + ["prm.eval_only=true", "prm.corrupt_examples=0"])
    assert "train" not in again and again["validation"]["bce"] == pytest.approx(report["bce"], abs=1e-6)
    # started again, the finished stage says so and trains nothing (rather than retraining from step 0)
    metrics_before = (out / "metrics.jsonl").read_bytes()
    assert stage.main(args) == json.loads((out / "summary.json").read_text())
    assert (out / "metrics.jsonl").read_bytes() == metrics_before and json.loads(
        (out / "model" / "manifest.json").read_text()
    )["steps"] == 5
    # an empty validation file is refused by name, before anything loads (it gave NaN validation, exit 0)
    (run_dir / "augment" / "prm_val.jsonl").write_text("")
    with pytest.raises(SystemExit, match=r"prm_val\.jsonl: no records"):
        stage.main(args + ["prm.retrain=true"])
    assert (out / "model" / "manifest.json").exists()  # nothing removed: the error came first


def test_one_pass_bench_runs_and_checks_agreement(tokenizer):
    from perf.prm_one_pass import bench_prm_one_pass, synthetic_solutions

    solutions = synthetic_solutions(3, 8, seed=1)
    assert all(len(steps) == 8 for _, steps in solutions)
    result = bench_prm_one_pass(
        PRMScorer(make_prm(tokenizer), tokenizer, FORMAT, "tiny"), n_solutions=2, n_steps=3, repeats=1
    )
    assert set(result) == {"name", "ours_s", "reference_s", "ratio", "goal", "reference"} and result["ours_s"] > 0


def test_control_records_label_gold_steps_one_and_corrupted_siblings_zero(tmp_path):
    from pipeline.config.schema import TinyWorldConfig
    from pipeline.datasets.problems import write_problems_jsonl
    from pipeline.tinyworld.checker import arithmetic_errors
    from pipeline.tinyworld.problems import generate_splits
    from prm.control import control_records
    from prm.control import main as control_main

    splits = generate_splits(TinyWorldConfig(seed=5, n_train=30, n_val=10, n_test=10))
    (tmp_path / "bootstrap").mkdir()
    for split in ("train", "val"):
        write_problems_jsonl(splits[split], tmp_path / "bootstrap" / f"problems_{split}.jsonl")
    control_main([str(tmp_path), "--problems", "20"])
    records = list(read_records(tmp_path / "augment" / "prm_train.jsonl", PRMExample))  # every line validated
    gold = {
        (p.question, tuple(steps[:i]), steps[i])
        for p in splits["train"][:20]
        for steps in [p.meta["solutions"][0]]
        for i in range(len(steps))
    }
    ones = [r for r in records if r.label == 1.0]
    zeros = [r for r in records if r.label == 0.0]
    assert {(r.question, tuple(r.prefix_steps), r.step) for r in ones} == gold
    assert zeros and all(arithmetic_errors([r.step]) for r in zeros if "=" in r.step)
    assert all(r.step != g for r in zeros for (q, pre, g) in gold if q == r.question and list(pre) == r.prefix_steps)
    with pytest.raises(SystemExit, match="already exist"):  # never overwrites a run's data
        control_main([str(tmp_path)])
    symmetric = control_records(splits["train"][:20], seed=0, corruption="pm1to9")
    right = {(r.question, tuple(r.prefix_steps)): r.step for r in symmetric if r.label == 1.0}
    moved = [
        float(re.findall(r"= (\d+)", r.step)[-1])
        - float(re.findall(r"= (\d+)", right[(r.question, tuple(r.prefix_steps))])[-1])
        for r in symmetric
        if r.label == 0.0
    ]
    assert any(d < 0 for d in moved) and any(d > 0 for d in moved)  # the default only ever raises

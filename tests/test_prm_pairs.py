"""The PRM's sibling-pair ranking loss against a float64 reference, and the pairs it reads: steps
that share a prefix in MCTS-style records and whose labels differ."""

from __future__ import annotations

import math
import random

import pytest
import torch
from test_prm import FORMAT, make_prm, make_tokenizer, tiny_config

from pipeline.records import PRMExample
from prm.data import PRMCollator, PRMDataset, group_records, iter_training_batches, sibling_pairs
from prm.train import prm_pair_loss, train_prm
from prm.validation import mc_pair_check

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def brute_pair_loss(logits, better, worse, gap):
    """sum_p gap_p * -log sigmoid(z_better - z_worse) / sum_p gap_p, with Python floats."""
    logits = logits.double().tolist()
    numerator = denominator = 0.0
    for (rb, sb), (rw, sw), g in zip(better.tolist(), worse.tolist(), gap.double().tolist()):
        margin = logits[rb][sb] - logits[rw][sw]
        numerator += g * -math.log(1.0 / (1.0 + math.exp(-margin)))
        denominator += g
    return numerator / denominator


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_pair_loss_matches_float64_brute_force(seed):
    generator = torch.Generator().manual_seed(seed)
    logits = 4.0 * torch.randn(5, 6, generator=generator, dtype=torch.float64)
    logits[3, 4:] = 1e6  # padding slots no pair points at: must not leak into the loss
    n = 9
    rows = torch.randint(0, 5, (n, 2), generator=generator)
    slots = torch.randint(0, 4, (n, 2), generator=generator)
    better = torch.stack([rows[:, 0], slots[:, 0]], 1)
    worse = torch.stack([rows[:, 1], slots[:, 1]], 1)
    gap = torch.rand(n, generator=generator, dtype=torch.float64)
    gap[0] = 1.0  # the edge values of a label gap
    gap[1] = 1e-3
    loss = prm_pair_loss(logits, better, worse, gap)
    assert loss.item() == pytest.approx(brute_pair_loss(logits, better, worse, gap), rel=1e-12)
    # float32, as the trainer calls it
    assert prm_pair_loss(logits.float(), better, worse, gap.float()).item() == pytest.approx(loss.item(), rel=1e-5)


def test_pair_loss_pushes_the_better_step_up_and_the_worse_down():
    logits = torch.zeros(2, 3, requires_grad=True)
    better, worse = torch.tensor([[0, 1]]), torch.tensor([[1, 2]])
    prm_pair_loss(logits, better, worse, torch.tensor([0.5])).backward()
    # d/dz_b softplus(z_w - z_b) = -sigmoid(z_w - z_b) = -1/2 at zero; the gap of a lone pair cancels in the mean
    assert logits.grad[0, 1].item() == pytest.approx(-0.5)
    assert logits.grad[1, 2].item() == pytest.approx(0.5)
    assert logits.grad.abs().sum().item() == pytest.approx(1.0)
    # a micro-batch without pairs adds nothing, and still backpropagates
    empty = prm_pair_loss(
        logits, torch.zeros(0, 2, dtype=torch.long), torch.zeros(0, 2, dtype=torch.long), torch.zeros(0)
    )
    assert empty.item() == 0.0 and empty.requires_grad


def mcts_records():
    """A small MCTS-style record set: two rollouts' first steps from the root, three children of
    'A' (two of equal MC value), a deeper step, a repeated record, and a second problem with the
    same step texts (never paired across problems)."""

    def record(problem, prefix, step, label):
        return PRMExample(problem, f"question {problem}", prefix, step, label, "mcts")

    return [
        record("p", [], "A", 0.75),
        record("p", [], "B", 0.25),
        record("p", ["A"], "C", 1.0),
        record("p", ["A"], "D", 0.0),
        record("p", ["A"], "E", 1.0),  # ties with C: no pair between them
        record("p", ["A", "C"], "F", 1.0),  # a single child: no pair
        record("p", ["A"], "D", 0.5),  # the same path again: its mean label 0.25 is what pairs
        record("q", [], "A", 1.0),
        record("q", [], "Z", 1.0),  # equal labels: no pair
    ]


def named(sequences, slot):
    seq, step = slot
    return sequences[seq].problem_id, tuple(sequences[seq].steps[: step + 1])


def test_sibling_pairs_are_the_steps_under_one_prefix_whose_labels_differ():
    records = mcts_records()
    sequences, _ = group_records(records)
    found = {(named(sequences, p.better), named(sequences, p.worse), round(p.gap, 6)) for p in sibling_pairs(sequences)}
    assert found == {
        (("p", ("A",)), ("p", ("B",)), 0.5),
        (("p", ("A", "C")), ("p", ("A", "D")), 0.75),
        (("p", ("A", "E")), ("p", ("A", "D")), 0.75),
    }
    assert len(sibling_pairs(sequences, min_gap=0.6)) == 2


def test_a_micro_batch_carries_the_pairs_it_holds_and_sibling_batches_keep_groups_whole():
    tokenizer = make_tokenizer()
    dataset = PRMDataset(mcts_records(), tokenizer, FORMAT, "tiny", max_length=512)
    assert len(dataset.pairs) == 3
    groups = dataset.sibling_groups()
    assert sorted(i for g in groups for i in g) == list(range(len(dataset)))
    everything = list(range(len(dataset)))
    batch = PRMCollator(tokenizer.pad_token_id)([dataset[i] for i in everything], dataset.pairs_within(everything))
    assert batch["pair_better"].shape == (3, 2) and batch["pair_gap"].tolist() == pytest.approx([0.5, 0.75, 0.75])
    # each pair points at labelled slots, the better one labelled higher by its gap
    labels = batch["labels"]
    for (rb, sb), (rw, sw), gap in zip(
        batch["pair_better"].tolist(), batch["pair_worse"].tolist(), batch["pair_gap"].tolist()
    ):
        assert batch["label_mask"][rb, sb] > 0 and batch["label_mask"][rw, sw] > 0
        assert labels[rb, sb] - labels[rw, sw] == pytest.approx(gap)
    # a micro-batch that holds only one side of a pair carries none of it
    lone = [groups[0][0]]
    assert dataset.pairs_within(lone) == []
    # batches as large as the largest group keep every group in one batch (shuffled groups laid end to end)
    size = max(len(g) for g in groups)
    for batch_indices in iter_training_batches(
        dataset.lengths, size, 6, seed=1, groups=[[i] for i in range(len(dataset))]
    ):
        assert len(batch_indices) <= size
    lengths = [5] * 40
    many = [list(range(k, k + 4)) for k in range(0, 40, 4)]
    for batch_indices in iter_training_batches(lengths, 8, 25, seed=3, groups=many):
        assert all({i // 4 * 4 + j for j in range(4)} <= set(batch_indices) for i in batch_indices)
    with pytest.raises(ValueError, match="group_by_length"):
        next(iter_training_batches(lengths, 8, 1, seed=0, group_by_length=True, groups=many))


class FixedScorer:
    """logits_many gives each step the number its text ends with (a stand-in PRM)."""

    def logits_many(self, solutions):
        return [torch.tensor([float(step.split()[-1]) for step in steps]) for _, steps in solutions]


def test_mc_pair_accuracy_counts_siblings_ordered_as_their_labels():
    def record(prefix, step, label):
        return PRMExample("p", "q", prefix, step, label, "mcts")

    records = [record([], "a 2", 1.0), record([], "b 1", 0.5), record([], "c 3", 0.0), record(["a 2"], "d 0", 1.0)]
    report = mc_pair_check(FixedScorer(), records)
    # pairs (a > b: right), (a > c: wrong), (b > c: wrong); gaps 0.5, 1.0, 0.5
    assert report["n_pairs"] == 3 and report["n_prefixes"] == 1
    assert report["accuracy"] == pytest.approx(1 / 3)
    assert report["interval"] == [None, None]  # one problem: nothing to resample
    assert report["gap_weighted_accuracy"] == pytest.approx(0.5 / 2.0)


def test_training_with_the_pair_loss_trains_on_sibling_pairs(tmp_path):
    tokenizer = make_tokenizer()
    rng = random.Random(0)
    records = []
    for i in range(12):  # per problem: the right step and a slip under the same (empty) prefix
        a, b = rng.randint(0, 4), rng.randint(0, 4)
        question = f"What is {a} + {b} ?"
        records.append(PRMExample(f"p{i}", question, [], f"x = {a} + {b} = {a + b}", 0.875, "mcts"))
        records.append(PRMExample(f"p{i}", question, [], f"x = {a} + {b} = {a + b + 1}", 0.125, "mcts"))
    config = tiny_config(lr=1e-2, batch_size=8, micro_batch_size=8, epochs=1.0, log_every=1, pair_loss_weight=1.0)
    metrics = train_prm(
        config,
        records,
        None,
        tmp_path / "pairs",
        model=make_prm(tokenizer),
        tokenizer=tokenizer,
        kind="tiny",
        progress=False,
    )
    assert metrics["n_train_sibling_pairs"] == 12
    assert metrics["sibling_pairs_trained"] == 12  # every pair's two sequences rode in one micro-batch
    config = tiny_config(lr=1e-2, batch_size=8, micro_batch_size=8, epochs=1.0, log_every=1)
    plain = train_prm(
        config,
        records,
        None,
        tmp_path / "plain",
        model=make_prm(tokenizer),
        tokenizer=tokenizer,
        kind="tiny",
        progress=False,
    )
    assert plain["sibling_pairs_trained"] == 0 and plain["train_loss"] != metrics["train_loss"]

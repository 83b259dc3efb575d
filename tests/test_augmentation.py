"""Similarity-grouped augmentation (paper 3.2): step similarity, grouping and labels, stats,
the problem-level split and reading MCTS records."""

from __future__ import annotations

import json
import re
from fractions import Fraction

import Levenshtein
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_records import set_field

import pipeline.rollouts.augmentation as augmentation
from pipeline.records import MCTSRecord, PRMExample, RecordError
from pipeline.rollouts.augmentation import (
    Candidate,
    augment_records,
    augmentation_stats,
    greedy_similarity_groups,
    is_validation_problem,
    label_rollout_steps,
    rollout_reuse_candidates,
    split_by_problem,
)
from pipeline.rollouts.similarity import calculation_signature, step_signature, step_similarity, steps_consistent
from pipeline.storage.files import read_records

F = Fraction

# ---------------------------------------------------------------- calculation signatures


def written(step):
    """A step's calculation signature as text: (its equation chains joined by " ; ", the numbers
    outside them); a number is its exact value (str(Fraction): "1/4" is one number, "1 / 4" the
    fraction literal 1/4, written as the division it is)."""
    signature = calculation_signature(step)
    return (
        " ; ".join(" ".join(map(str, chain)) for chain in signature.equations),
        " ".join(map(str, signature.numbers)),
    )


@pytest.mark.parametrize(
    "step, equations, numbers",
    [
        ("3 * 4 = 12", "3 * 4 = 12", ""),
        ("24 - 6 = 18", "24 - 6 = 18", ""),  # the '-' is subtraction, not a sign
        ("2 + 3 = 5 + 1 = 6", "2 + 3 = 5 + 1 = 6", ""),  # one chain, every operand and result
        ("3 * 4 = 12, so 12 + 5 = 17", "3 * 4 = 12 ; 12 + 5 = 17", ""),  # two chains
        ("12 + 5 = 17 after 3 * 4 = 12", "3 * 4 = 12 ; 12 + 5 = 17", ""),  # a multiset: sorted
        ("So 3 x 4 = 12, the total cost in dollars.", "3 * 4 = 12", ""),  # 'x' as times
        ("Total: 3 × 4 = 12 pens", "3 * 4 = 12", ""),
        ("[3 + 4] * 2 = 14", "( 3 + 4 ) * 2 = 14", ""),
        ("(-3) * 2 = -6", "( -3 ) * 2 = -6", ""),
        ("1/2 + 1/4 = 3/4", "1 / 2 + 1 / 4 = 3 / 4", ""),  # a fraction is the division it writes
        ("12 / 4 = 3 apples each", "12 / 4 = 3", ""),
        ("5/0 = 5", "5 / 0 = 5", ""),  # never divided
        ("x = 0.50", "= 1/2", ""),  # 'x' before '=' dangles: "x = 5" is "= 5", like "y = 5"
        ("x = .5", "= 1/2", ""),
        ("x = \\frac{3}{4}", "= 3 / 4", ""),
        ("x = -\\frac{1}{2}", "= -1 / 2", ""),
        ("$y = \\dfrac{10}{4}$", "= 10 / 4", ""),
        ("The bill = -1,500.25 dollars", "= -6001/4", ""),
        ("x = 2\\frac{1}{0}", "= 2 1 / 0", ""),  # no division by zero
        ("__import__('os').system('true') = 5", "= 5", ""),  # parsed, never evaluated
        ("Tom has 5 apples, so 5 + 3 = 8", "5 + 3 = 8", "5"),  # numbers outside the equations too
        # no '=': the numbers in order, with the operators written between them
        ("Adding 3 and 4 gives 8 apples on day 2.", "", "3 4 8 2"),
        ("The total is 3 + 4", "", "3 + 4"),
        ("The discount is 25%", "", "1/4"),
        ("The rate is 12.5 \\% per year", "", "1/8"),
        ("He has 1,234 apples", "", "1234"),
        ("Each costs \\$1{,}200", "", "1200"),
        ("She used 2\\frac{1}{2} cups", "", "5 / 2"),  # a mixed number reads as 5/2
        ("The answer is \\boxed{42}.", "", "42"),
        ("The temperature falls to −7 degrees.", "", "-7"),
        # no number: the empty signature
        ("Let x be the number of pens.", "", ""),
        ("x = y + z", "", ""),
        ("= " + "1" * 5000, "", ""),  # a degenerate digit run is text (int() would refuse it)
    ],
)
def test_calculation_signature(step, equations, numbers):
    assert written(step) == (equations, numbers)


# ---------------------------------------------------------------- step similarity

TABLE_1_A = "The total cost is 3 * 4 = 12 dollars."
TABLE_1_B = "So 3 x 4 = 12, the total cost in dollars."
TEXT = "Levenshtein.ratio of the two steps"


@pytest.mark.parametrize(
    "a, b, expected",
    [
        # Table 1 style: the same calculation phrased twice -> text similarity decides.
        (TABLE_1_A, TABLE_1_B, TEXT),
        # different results -> 0 however close the text
        ("24 - 6 = 18", "24 - 6 = 16", 0.0),
        ("3 * 4 = 12, so 12 + 5 = 17", "3 * 4 = 12, so 12 + 5 = 18", 0.0),
        ("3 * 4 = 12 and 12 * 1 = 12", "3 * 4 = 12 and 12 * 1", 0.0),
        ("x = \\frac{1}{2}", "x = \\frac{1}{3}", 0.0),
        # slips a looser rule would group with the correct step: a slip the result does not show -> 0
        ("Adding 3 and 4 gives 8 apples on day 2.", "Adding 3 and 4 gives 7 apples on day 2.", 0.0),
        ("2 + 3 = 6 + 1 = 7", "2 + 3 = 5 + 2 = 7", 0.0),  # inside a chain
        ("8 + 8 = 15", "8 + 7 = 15", 0.0),  # an operand
        ("6 / 2 = 3 each", "9 / 3 = 3 each", 0.0),  # the operands of a fraction-like division
        ("Tom has 5 apples, so 5 + 3 = 8", "Tom has 6 apples, so 5 + 3 = 8", 0.0),  # outside the equation
        ("The total is 3 + 4", "The total is 3 * 4", 0.0),  # an operator, no '='
        ("We need 3 + 4 = 7 apples.", "We need 4 + 3 = 7 apples.", 0.0),  # operands as written
        # a number and no number -> 0
        ("Multiply the price by the quantity.", "3 * 4 = 12", 0.0),
        (
            "Add the apples picked on both days to get the total",
            "Add the apples picked on both days to get the total: 3 + 4 = 8",
            0.0,
        ),
        # the same values in another spelling, or the same calculations in another order -> text
        ("x = 0.5", "x = .50", TEXT),
        ("x = 50%", "x = 0.5", TEXT),
        ("x = 1/2", "x = \\frac{1}{2}", TEXT),
        ("x = 1/2", "x = 0.5", 0.0),  # a fraction is a division, 0.5 a number
        ("3 * 4 = 12, then 12 + 5 = 17", "12 + 5 = 17 after 3 * 4 = 12", TEXT),
        # no numbers on either side -> text similarity
        ("Add the two amounts together.", "Add the two amounts.", TEXT),
        # whitespace is normalised away
        ("3 * 4 = 12", "  3  *  4 =\t12 ", 1.0),
        ("", "", 1.0),
    ],
)
def test_step_similarity_table(a, b, expected):
    if expected == TEXT:
        expected = Levenshtein.ratio(a, b)
        assert expected > 0.0
    assert step_similarity(a, b) == pytest.approx(expected)
    assert step_similarity(b, a) == pytest.approx(expected)


@pytest.mark.parametrize(
    "a, b",
    [
        (TABLE_1_A, "The total cost is 3 x 4 = 12 dollars"),
        ("12 - 5 = 7 pens are left over.", "12 - 5 = 7 pens are left."),
        ("The answer is \\boxed{7}.", "The answer is \\boxed{7}"),
        ("Half of 10 is 10 / 2 = 5 apples.", "Half of 10 is 10/2 = 5 apples."),
    ],
)
def test_close_paraphrases_with_the_same_calculation_are_consistent(a, b):
    assert step_similarity(a, b) >= 0.85
    assert steps_consistent(step_signature(a), step_signature(b), 0.85)


def test_table_1_pair_is_similar_but_below_the_default_threshold():
    similarity = step_similarity(TABLE_1_A, TABLE_1_B)
    assert 0.0 < similarity < 0.85


def test_consistency_needs_equal_signatures_even_at_threshold_zero():
    assert steps_consistent(step_signature("8 + 8 = 15"), step_signature("8 + 8 = 15 apples"), 0.0)
    assert not steps_consistent(step_signature("8 + 8 = 15"), step_signature("8 + 7 = 15"), 0.0)


@settings(max_examples=200, deadline=None)
@given(st.text(alphabet=st.sampled_from(list("0123456789 .,/=-+*x%$\\{}()abc")), max_size=40), st.text(max_size=40))
def test_similarity_is_total_bounded_and_symmetric(a, b):
    signature = calculation_signature(a)
    elements = [element for chain in signature.equations for element in chain] + list(signature.numbers)
    assert all(isinstance(element, (Fraction, str)) for element in elements)
    assert calculation_signature(a) == signature and hash(calculation_signature(a)) == hash(signature)
    value = step_similarity(a, b)
    assert 0.0 <= value <= 1.0
    assert value == step_similarity(b, a)
    assert step_similarity(a, a) == 1.0


# ---------------------------------------------------------------- candidates, groups, labels


def rollout(steps, correct):
    return {"steps": steps, "answer": steps[-1].split()[-1].rstrip("."), "correct": correct}


def pens_record(mc=0.5) -> MCTSRecord:
    """The MCTS record of pens_json."""
    return MCTSRecord.from_json(pens_json(mc))


def with_rollouts(rollouts) -> MCTSRecord:
    return MCTSRecord.from_json({**pens_json(), "rollouts": rollouts})


def pens_json(mc=0.5):
    """k = 4 rollouts of 'Tom buys 3 boxes of 4 pens and gives away 5':

    position 1: rollouts 0, 1, 2 compute 12 (2 correct, 1 incorrect -> mixed -> mc);
                rollout 3 computes 7 (alone, incorrect -> 0, so its later steps are dropped)
    position 2: rollouts 0, 1 compute 7 (both correct -> 1); rollout 2 computes 8 (-> 0)
    position 3: rollouts 0, 1 answer 7 (-> 1); rollout 2's answer is dropped
    """
    return {
        "problem_id": "p1",
        "question": "Tom buys 3 boxes of 4 pens and gives away 5. How many pens are left?",
        "prefix_steps": ["Tom has 3 boxes."],
        "step": "Each box holds 4 pens.",
        "mc": mc,
        "n_correct": 2,
        "n_rollouts": 4,
        "depth": 2,
        "rollouts": [
            rollout(["3 * 4 = 12 pens in total.", "12 - 5 = 7 pens are left over.", "The answer is 7."], True),
            rollout(["3 * 4 = 12 pens in total.", "12 - 5 = 7 pens are left.", "The answer is 7."], True),
            rollout(["3 * 4 = 12 pens in total!", "12 - 5 = 8 pens are left.", "The answer is 8."], False),
            rollout(["3 + 4 = 7 pens in total.", "7 - 5 = 2 pens are left.", "The answer is 2."], False),
        ],
    }


def test_rollout_reuse_candidates_extend_the_evaluated_state():
    record = pens_record()
    candidates = rollout_reuse_candidates(record)
    assert len(candidates) == 12
    state = ("Tom has 3 boxes.", "Each box holds 4 pens.")
    third = [c for c in candidates if c.rollout_index == 2]
    assert [c.position for c in third] == [1, 2, 3]
    assert third[0].prefix_steps == state
    assert third[2].prefix_steps == state + ("3 * 4 = 12 pens in total!", "12 - 5 = 8 pens are left.")
    assert third[2].step == "The answer is 8."
    assert all(c.rollout_correct is False for c in third)


def test_groups_and_labels_of_the_hand_built_rollouts():
    groups = label_rollout_steps(pens_record(mc=0.5))
    summary = [(g.position, g.index, [m.rollout_index for m in g.members], g.label) for g in groups]
    assert summary == [
        (1, 0, [0, 1, 2], 0.5),  # mixed -> the record's mc (not the group's own 2/3)
        (1, 1, [3], 0.0),  # all incorrect -> 0
        (2, 0, [0, 1], 1.0),  # all correct -> 1; rollout 3 dropped after its 0
        (2, 1, [2], 0.0),
        (3, 0, [0, 1], 1.0),  # rollout 2 dropped after its 0 at position 2
    ]


def test_a_first_error_record_is_one_example_and_its_rollouts_are_not_reused():
    # A record with mc 0 (the first error MCTS found) keeps rollouts that all failed; their steps
    # come after the error, so reusing them would label steps Algorithm 1 never keeps.
    first_error = MCTSRecord.from_json(
        {**pens_json(mc=0.0), "n_correct": 0, "rollouts": [{**r, "correct": False} for r in pens_json()["rollouts"]]}
    )
    assert label_rollout_steps(first_error) == []
    examples = list(augment_records([first_error, pens_record(mc=0.5)]))
    assert [(e.origin, e.step, e.label) for e in examples[:2]] == [
        ("mcts", "Each box holds 4 pens.", 0.0),
        ("mcts", "Each box holds 4 pens.", 0.5),
    ]
    assert len(examples) == 1 + 9  # the mc 0.5 record's rollouts are reused as before
    assert list(augment_records([first_error], include_mcts=False)) == []
    first_error_stats = augmentation_stats(augment_records([first_error]), n_mcts_records=1)
    assert first_error_stats["label_bins"] == {"zero": 1, "between": 0, "one": 0}


def test_threshold_is_configurable():
    groups = label_rollout_steps(pens_record(), threshold=1.0)
    position_1 = [([m.rollout_index for m in g.members], g.label) for g in groups if g.position == 1]
    # at threshold 1.0 "…total!" does not match "…total.": rollout 2 stands alone, is labelled 0, and is dropped.
    assert position_1 == [([0, 1], 1.0), ([2], 0.0), ([3], 0.0)]
    assert all(2 not in [m.rollout_index for m in g.members] for g in groups if g.position > 1)


def test_a_step_joins_a_group_only_when_consistent_with_every_member():
    record = with_rollouts([rollout([text], True) for text in ("aaaaaaaaaa", "aaaaaaaaab", "aaaaaaaabb")])
    # sim(1st, 2nd) = sim(2nd, 3rd) = 0.9 but sim(1st, 3rd) = 0.8: no chaining through the 2nd.
    groups = greedy_similarity_groups(rollout_reuse_candidates(record), threshold=0.85)
    assert [[c.step for c in g] for g in groups] == [["aaaaaaaaaa", "aaaaaaaaab"], ["aaaaaaaabb"]]


def candidates_of(*steps, correct=None):
    correct = correct or [True] * len(steps)
    return [Candidate((), step, 1, i, ok) for i, (step, ok) in enumerate(zip(steps, correct))]


def grouped(steps, threshold=0.85):
    return [[c.step for c in group] for group in greedy_similarity_groups(candidates_of(*steps), threshold)]


NUMBERLESS = "Add the apples picked on both days to get the total"


@pytest.mark.parametrize(
    "steps, threshold",
    [
        # the first member has no number: both versions are 0.90 similar to it, and only the numbers tell them apart
        ([NUMBERLESS, NUMBERLESS + ": 3 + 4 = 8", NUMBERLESS + ": 3 + 4 = 7"], 0.85),
        # no '=': the last number alone was compared (0.974)
        (["Adding 3 and 4 gives 8 apples on day 2.", "Adding 3 and 4 gives 7 apples on day 2."], 0.85),
        # a slip inside a chain with the right result (0.882)
        (["2 + 3 = 6 + 1 = 7", "2 + 3 = 5 + 2 = 7"], 0.85),
        # an operand slip with the right result (0.9)
        (["8 + 8 = 15", "8 + 7 = 15"], 0.85),
    ],
)
def test_slips_with_the_correct_steps_operands_form_groups_of_their_own(steps, threshold):
    assert grouped(steps, threshold) == [[step] for step in steps]


def test_the_same_calculations_in_another_order_group_when_the_text_is_close_enough():
    same = ["So 3 * 4 = 12 and 12 + 5 = 17 pens.", "So 12 + 5 = 17 and 3 * 4 = 12 pens."]  # ratio 0.743
    assert grouped(same, threshold=0.7) == [same]
    assert grouped(same, threshold=0.85) == [[same[0]], [same[1]]]
    slip = "So 12 + 5 = 18 and 3 * 4 = 12 pens."
    assert grouped([*same, slip], threshold=0.7) == [same, [slip]]


def test_a_slip_next_to_a_numberless_step_keeps_its_own_label():
    steps = [NUMBERLESS, NUMBERLESS + ": 3 + 4 = 7", NUMBERLESS + ": 3 + 4 = 8"]
    record = with_rollouts([rollout([steps[0]], True), rollout([steps[1]], True), rollout([steps[2]], False)])
    groups = label_rollout_steps(record)
    assert [([m.step for m in g.members], g.label) for g in groups] == [
        ([steps[0]], 1.0),
        ([steps[1]], 1.0),
        ([steps[2]], 0.0),  # three groups, not one labelled mc
    ]


GROUPING_STEPS = st.one_of(
    st.builds(
        "{}{} {} {} = {}{}".format,
        st.sampled_from(["", "So ", "Then we get "]),
        st.integers(0, 9),
        st.sampled_from(["+", "-", "*", "x"]),
        st.integers(0, 9),
        st.integers(0, 18),
        st.sampled_from(["", ".", " apples.", " apples in total."]),
    ),
    st.builds(
        "Adding {} and {} gives {} apples{}".format,
        st.integers(0, 9),
        st.integers(0, 9),
        st.integers(0, 18),
        st.sampled_from(["", ".", " on day 2."]),
    ),
    st.builds("{}{}".format, st.just(NUMBERLESS), st.sampled_from(["", ".", ": 3 + 4 = 7", ": 3 + 4 = 8", " now"])),
    st.sampled_from(["aaaaaaaaaa", "aaaaaaaaab", "aaaaaaaabb", "Add them.", "Add them up."]),
)


@settings(max_examples=150, deadline=None)
@given(st.lists(GROUPING_STEPS, max_size=24), st.sampled_from([0.0, 0.5, 0.8, 0.85, 0.95, 1.0]))
def test_every_pair_inside_every_group_is_consistent(steps, threshold):
    candidates = candidates_of(*steps)
    groups = greedy_similarity_groups(candidates, threshold)
    assert sorted(c.rollout_index for g in groups for c in g) == list(range(len(steps)))  # a partition
    signatures = [[step_signature(c.step) for c in g] for g in groups]
    for members in signatures:
        assert all(steps_consistent(a, b, threshold) for a in members for b in members)
    # Greedy: a candidate is in the first group it was consistent with, every member before it.
    for g, group in enumerate(groups):
        for member in group:
            for earlier in groups[:g]:
                before = [c for c in earlier if c.rollout_index < member.rollout_index]
                assert not all(
                    steps_consistent(step_signature(c.step), step_signature(member.step), threshold) for c in before
                )


def test_consistency_is_only_tested_within_a_record_and_position(monkeypatch):
    pairs = []
    real = augmentation.steps_consistent

    def counting(a, b, threshold):
        pairs.append((a.text, b.text))
        return real(a, b, threshold)

    monkeypatch.setattr(augmentation, "steps_consistent", counting)
    records = []
    for r in range(2):
        # Within a bucket the steps share one calculation signature (the record and position
        # numbers); "rollout a" .. "rollout f" keep the texts close, so every test is needed.
        records.append(
            with_rollouts(
                [
                    rollout([f"record {r} step {j} rollout {'abcdef'[i]} adds them" for j in range(1, 4)], True)
                    for i in range(6)
                ]
            )
        )
    list(augment_records(records))
    assert 0 < len(pairs) <= 2 * 3 * (6 * 5 // 2)  # records x positions x k(k-1)/2
    for a, b in pairs:
        assert a.split(" rollout ")[0] == b.split(" rollout ")[0]


def test_augment_records_emits_mcts_and_augmented_examples():
    examples = list(augment_records(iter([pens_record(mc=0.5)])))
    emitted = [(e.origin, e.step, e.label, len(e.prefix_steps)) for e in examples]
    assert emitted == [
        ("mcts", "Each box holds 4 pens.", 0.5, 1),
        ("augmented", "3 * 4 = 12 pens in total.", 0.5, 2),  # rollouts 0 and 1 deduped to one
        ("augmented", "3 * 4 = 12 pens in total!", 0.5, 2),
        ("augmented", "3 + 4 = 7 pens in total.", 0.0, 2),
        ("augmented", "12 - 5 = 7 pens are left over.", 1.0, 3),
        ("augmented", "12 - 5 = 7 pens are left.", 1.0, 3),
        ("augmented", "12 - 5 = 8 pens are left.", 0.0, 3),
        ("augmented", "The answer is 7.", 1.0, 4),  # prefixes differ: both kept
        ("augmented", "The answer is 7.", 1.0, 4),
    ]
    assert examples[0].group_id is None and "group_id" not in examples[0].to_json()
    assert all(e.problem_id == "p1" and e.question.startswith("Tom buys") for e in examples)
    key = augmentation.record_key(pens_record())
    assert [e.group_id for e in examples[1:]] == [
        f"p1:{key}:1:0",
        f"p1:{key}:1:0",
        f"p1:{key}:1:1",
        f"p1:{key}:2:0",
        f"p1:{key}:2:0",
        f"p1:{key}:2:1",
        f"p1:{key}:3:0",
        f"p1:{key}:3:0",
    ]
    assert [PRMExample.from_json(json.loads(json.dumps(e.to_json()))) for e in examples] == examples  # JSON-ready
    assert list(augment_records([pens_record(mc=0.5)])) == examples  # deterministic


def test_augment_records_options_and_duplicate_records():
    without_dedupe = list(augment_records([pens_record()], dedupe=False))
    assert len(without_dedupe) == 10
    no_mcts = list(augment_records([pens_record()], include_mcts=False))
    assert {e.origin for e in no_mcts} == {"augmented"} and len(no_mcts) == 8
    twice = list(augment_records([pens_record(), pens_record()], include_mcts=False))
    first_ids = {e.group_id for e in twice[:8]}
    second_ids = {e.group_id for e in twice[8:]}
    assert first_ids.isdisjoint(second_ids)  # group ids stay unique even for a repeated record


def test_augmentation_stats_counts_bins_and_expansion():
    examples = list(augment_records([pens_record(mc=0.5)]))
    stats = augmentation_stats(iter(examples), n_mcts_records=1)
    assert stats["n_examples"] == 9
    assert stats["expansion_factor"] == 9.0
    assert stats["by_origin"] == {"mcts": 1, "augmented": 8}
    assert stats["label_bins"] == {"zero": 2, "between": 3, "one": 4}
    assert stats["label_fractions"]["one"] == pytest.approx(4 / 9)
    assert stats["label_bins_by_origin"]["mcts"] == {"zero": 0, "between": 1, "one": 0}
    assert stats["label_histogram"]["counts"] == [2, 0, 0, 0, 0, 3, 0, 0, 0, 4]
    assert len(stats["label_histogram"]["edges"]) == 11
    tenths = [PRMExample("p", "q", [], "s", n / 10, "mcts") for n in range(11)]
    assert augmentation_stats(tenths, 11)["label_histogram"]["counts"] == [1] * 9 + [2]
    empty = augmentation_stats([], n_mcts_records=0)
    assert empty["n_examples"] == 0 and empty["expansion_factor"] is None


# ---------------------------------------------------------------- split by problem


def test_split_by_problem_keeps_problems_whole_and_is_stable():
    records = [PRMExample(f"p{i:03d}", "q", [], f"s{j}", 0.5, "mcts") for i in range(200) for j in range(3)]
    train, val = split_by_problem(records, val_fraction=0.2, seed=0)
    train_ids = {r.problem_id for r in train}
    val_ids = {r.problem_id for r in val}
    assert train_ids.isdisjoint(val_ids)
    assert len(train) + len(val) == len(records)
    assert 20 <= len(val_ids) <= 60
    assert split_by_problem(list(reversed(records)), 0.2, 0)[1] == list(reversed(val))
    # Pinned: the split of a problem must not change between runs or versions.
    assert [f"p{i:03d}" for i in range(40) if is_validation_problem(f"p{i:03d}", 0.2, 0)] == [
        "p001",
        "p004",
        "p007",
        "p009",
        "p019",
        "p033",
        "p037",
    ]
    assert {r.problem_id for r in split_by_problem(records, 0.2, seed=1)[1]} != val_ids
    assert split_by_problem(records, 0.0, 0)[1] == [] and split_by_problem(records, 1.0, 0)[0] == []
    with pytest.raises(ValueError):
        split_by_problem(records, 1.5, 0)


# ---------------------------------------------------------------- reading MCTS records


@pytest.mark.parametrize(
    "path, value, field, expected",
    [
        (("mc",), KeyError, "'mc'", "a number in [0, 1]"),
        (("mc",), 1.5, "'mc'", "a number in [0, 1]"),
        (("mc",), "0.5", "'mc'", "a number in [0, 1]"),
        (("problem_id",), 7, "'problem_id'", "a non-empty string"),
        (("prefix_steps",), "ok", "'prefix_steps'", "a list of strings"),
        (("prefix_steps",), ["ok", 3], "'prefix_steps[1]'", "a string"),
        (("n_correct",), 9, "'n_correct'", "at most n_rollouts (4)"),
        (("depth",), True, "'depth'", "an integer >= 0"),
        (("rollouts",), "none", "'rollouts'", "a list of objects {steps, answer, correct}"),
        (("rollouts", 1), ["3 * 4 = 12"], "'rollouts[1]'", "an object {steps, answer, correct}"),
        (("rollouts", 1, "correct"), KeyError, "'rollouts[1].correct'", "true or false"),
        (("rollouts", 2, "correct"), "yes", "'rollouts[2].correct'", "true or false"),
        (("rollouts", 0, "steps"), "3 * 4 = 12", "'rollouts[0].steps'", "a list of strings"),
        (("rollouts", 3, "answer"), ["2"], "'rollouts[3].answer'", "a string, a number or null"),
    ],
)
def test_malformed_mcts_record_names_file_line_and_field(tmp_path, path, value, field, expected):
    good = pens_json()
    bad = set_field(good, path, value)
    file = tmp_path / "mcts.jsonl"
    file.write_text(json.dumps(good) + "\n\n" + json.dumps(bad) + "\n", encoding="utf-8")
    with pytest.raises(ValueError) as info:
        list(read_records(file, MCTSRecord))
    message = str(info.value)
    assert isinstance(info.value, RecordError)
    assert message.startswith(f"{file}:3:")  # the blank line 2 is skipped but still counted
    assert field in message and expected in message


def test_non_json_line_names_file_and_line(tmp_path):
    file = tmp_path / "mcts.jsonl"
    file.write_text(json.dumps(pens_json()) + "\n{not json\n", encoding="utf-8")
    with pytest.raises(ValueError, match="^" + re.escape(f"{file}:2: ")):
        list(read_records(file, MCTSRecord))


def test_valid_records_are_read_and_augmented(tmp_path):
    file = tmp_path / "mcts.jsonl"
    file.write_text("".join(json.dumps(pens_json(mc)) + "\n" for mc in (0.5, 0.25)), encoding="utf-8")
    records = list(read_records(file, MCTSRecord))
    assert [r.mc for r in records] == [0.5, 0.25]
    assert MCTSRecord.from_json({**pens_json(), "extra": 1}) == records[0]  # extra fields are ignored
    labels = [e.label for e in augment_records(records) if e.step.startswith("3 * 4")]
    assert labels == [0.5, 0.5, 0.25, 0.25]

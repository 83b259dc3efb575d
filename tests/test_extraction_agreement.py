"""Our answer extraction against Math-Verify's parse: they agree on every MATH-500 gold solution
(measured: 500/500) and on the MATH test solutions whose answer is several boxes of one sentence,
which a last-box-only extraction would cut to the last box (docs/evaluation.md, "Answer extraction against
Math-Verify"); `python -m eval.extraction_agreement` reruns the whole measurement."""

from __future__ import annotations

import json

from conftest import REPO

from eval.extraction_agreement import compare, math_texts, math_verify_answer, same_answer, sample_texts
from pipeline.grading import answers_equal, extract_answer

# MATH test solutions (idx) whose final sentence boxes each of several answers; the problem asks for all of them
SEVERAL_BOXES = {
    414: "-2, 1",
    2152: "5 - 10i, 11, -3 + 6i",
    2549: "-\\tfrac32, -\\tfrac34",
    2703: "3, \\frac{2}{5}",
    4559: "-1, 2",
    4860: "\\frac{\\pi}{4}, \\frac{5\\pi}{4}",
}


def test_boxes_of_one_sentence_are_one_answer():
    assert extract_answer("So the solutions are $\\boxed{-2}$ and $\\boxed{1}$.", "math") == "-2, 1"
    assert answers_equal(
        extract_answer("so $x = \\boxed{3}$ or $x = \\boxed{\\frac{2}{5}}$.", "math"), "3, \\frac{2}{5}", "math"
    )
    # boxes of different sentences, far apart, or one inside another stay the last answer alone
    assert extract_answer("First $\\boxed{3}$. Then the answer is $\\boxed{4}$.", "math") == "4"
    assert extract_answer("If $r = 1$, $b = \\boxed{3}$; if $r = 2$, then $b = \\boxed{4}$", "math") == "4"
    assert extract_answer("$\\boxed{3}$" + " and so on" * 20 + " $\\boxed{4}$", "math") == "4"
    assert extract_answer("$\\boxed{\\boxed{5}}$", "math") == "5"
    assert (
        extract_answer("The sum is $\\boxed{3}$ and $\\boxed{4}$.", "gsm8k") == "4"
    )  # numbers: the last one, as before


def test_our_extraction_agrees_with_math_verify_on_math500_gold_solutions(benchmarks_dir):
    texts, golds, ids = math_texts(benchmarks_dir / "math500_test.jsonl")
    result = compare(texts, "math", golds, ids)
    assert result["n"] == 500 and result["agree"] == 500, result["disagreements"]


def test_several_boxed_answers_are_read_whole_as_math_verify_reads_them(benchmarks_dir):
    rows = {}
    with (benchmarks_dir / "math_test.jsonl").open(encoding="utf-8") as handle:
        for line in handle:
            row = json.loads(line)
            if row["idx"] in SEVERAL_BOXES:
                rows[row["idx"]] = row["solution"]
    assert set(rows) == set(SEVERAL_BOXES)
    for idx, expected in SEVERAL_BOXES.items():
        ours = extract_answer(rows[idx], "math")
        assert answers_equal(ours, expected, "math"), (idx, ours)
        assert same_answer(ours, math_verify_answer(rows[idx])), (idx, ours)


def test_on_the_tests_policy_samples_they_differ_only_where_no_answer_is_stated():
    data = REPO / "tests" / "data" / "records"
    for kind, (texts, golds, ids) in sample_texts(data / "samples.jsonl", data / "problems.jsonl").items():
        result = compare(texts, kind, golds, ids)
        for row in result[
            "disagreements"
        ]:  # "The answer is" with nothing after: Math-Verify falls back to the last number
            assert row["ours"] is None and not row["theirs_right"]

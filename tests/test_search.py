"""PRM-guided search (the prm.search package) with a fake policy and a fake PRM whose outputs are known.

The fake policy's candidates depend only on the prompt (a table: solution prefix -> candidate
continuations, cycled when n exceeds them), so a batched search and one problem at a time must
agree exactly. The fake PRM scores a step by its text.
"""

from __future__ import annotations

import pytest

from pipeline.config.schema import SearchConfig
from pipeline.generation.base import Completion, truncate_at_stop
from pipeline.steps import join_steps, split_steps
from prm.search import search, search_many
from prm.search.candidates import STRATEGIES, SearchResult, SearchSettings, aggregate
from prm.search.summary import grade_results, summarize_search

EOS, STOP, LENGTH = "eos", "stop", "length"

# Q1: a step tree. Root candidates, then the continuations of each prefix.
TREE_Q1 = {
    (): [("a1\n", STOP), ("a2\n", STOP), ("a3\n", STOP), ("a4\n", STOP)],
    ("a1",): [("b1\n", STOP), ("The answer is 5", EOS)],
    ("a3",): [("d1\n", STOP), ("d2\n", STOP)],
    ("a3", "d1"): [("The answer is 9", EOS), ("e2\n", STOP)],
    ("a1", "b1"): [("The answer is 6", EOS), ("f2\n", STOP)],
}
# Q2: whole solutions at the root (the step-level strategies see only their first line).
TREE_Q2 = {
    (): [
        ("x1\nThe answer is 3", EOS),
        ("x2\nThe answer is 4", EOS),
        ("x3\nThe answer is 3", EOS),
        ("x4\nThe answer is 3", EOS),
        ("y1\ny2", LENGTH),  # unfinished, with the best scores of all
    ],
}
# A stop candidate (the end token on a partial without an answer) beside continuations.
TREE_STOP = {  # after a1 the policy may stop with no answer (scored as a1, 0.9) or go on with b1 (0.6)
    (): [("a1\n", STOP), ("a2\n", STOP)],
    ("a1",): [("", EOS), ("b1\n", STOP)],
    ("a1", "b1"): [("The answer is 6", EOS)],
}
TREE_ANSWERED = {  # after a1: stop (0.9), an answer (0.8) and a continuation (0.6)
    (): [("a1\n", STOP)],
    ("a1",): [("", EOS), ("The answer is 2", EOS), ("b1\n", STOP)],
}
TREE_LONG = {  # a short wrong answer (0.7) against a longer right one (0.9, 0.6, 0.9)
    (): [("The answer is 7", EOS), ("c1\n", STOP)],
    ("c1",): [("c2\n", STOP)],
    ("c1", "c2"): [("The answer is 8", EOS)],
}
TREE_NO_ANSWER_AFTER_A1 = {(): [("a1\n", STOP)], ("a1",): [("", EOS), ("z1", EOS)]}
TREE_NO_ANSWER_AT_ALL = {(): [("z1", EOS), ("z2", EOS)]}
TREE_WHOLE = {(): [("y1\ny2", EOS), ("x2\nThe answer is 4", EOS)]}  # answerless (0.99) vs answered
SCORES = {
    "a1": 0.9,
    "a2": 0.5,
    "a3": 0.7,
    "a4": 0.1,
    "b1": 0.6,
    "The answer is 5": 0.4,
    "d1": 0.95,
    "d2": 0.3,
    "The answer is 9": 0.8,
    "e2": 0.25,
    "The answer is 6": 0.85,
    "f2": 0.2,
    "x1": 0.9,
    "x2": 0.8,
    "x3": 0.6,
    "x4": 0.5,
    "The answer is 3": 0.2,
    "The answer is 4": 0.95,
    "y1": 0.99,
    "y2": 0.99,
    "The answer is 2": 0.8,
    "c1": 0.9,
    "c2": 0.6,
    "The answer is 7": 0.7,
    "The answer is 8": 0.9,
    "z1": 0.3,
}
TREES = {
    "Q1": TREE_Q1,
    "Q2": TREE_Q2,
    "QSTOP": TREE_STOP,
    "QANSWERED": TREE_ANSWERED,
    "QLONG": TREE_LONG,
    "QNOANSWER1": TREE_NO_ANSWER_AFTER_A1,
    "QNOANSWER0": TREE_NO_ANSWER_AT_ALL,
    "QWHOLE": TREE_WHOLE,
}
PROMPTS = {q: f"Question: {q}\nAnswer:\n" for q in TREES}


class FakePolicy:
    """Candidates from TREES by (question, prefix); one token per character; records calls."""

    tokenizer = None

    def __init__(self):
        self.calls: list[tuple[int, int]] = []  # (prompts, n) per generate call

    def generate(self, prompts, n=1, temperature=1.0, top_p=1.0, max_new_tokens=256, stop=None, seed=None):
        self.calls.append((len(prompts), n))
        out = []
        for prompt in prompts:
            question = next(q for q, base in PROMPTS.items() if prompt.startswith(base))
            prefix = tuple(split_steps(prompt[len(PROMPTS[question]) :]))
            table = TREES[question].get(prefix, [("\n", STOP)])  # unknown prefix: an empty line
            completions = []
            for i in range(n):
                text, reason = table[i % len(table)]
                text, stopped = truncate_at_stop(text, stop or [])
                completions.append(Completion(text, list(range(len(text))), STOP if stopped else reason))
            out.append(completions)
        return out


class FakePRM:
    def __init__(self):
        self.calls: list[int] = []  # solutions per score_many call

    def score_many(self, solutions):
        self.calls.append(len(solutions))
        return [[SCORES.get(step, 0.5) for step in steps] for _, steps in solutions]


def run(questions, strategy, k, **settings):
    settings = {"kind": "tiny", "max_depth": 6, "beam_width": 2, "aggregation": "min", **settings}
    return search_many(
        questions, FakePolicy(), FakePRM(), strategy, k, prompts=[PROMPTS[q] for q in questions], **settings
    )


def test_aggregate():
    assert aggregate([0.5, 0.2, 0.8], "last") == 0.8
    assert aggregate([0.5, 0.2, 0.8], "min") == 0.2
    assert aggregate([0.5, 0.2, 0.8], "prod") == pytest.approx(0.08)
    assert aggregate([0.5, 0.2, 0.8], "mean") == pytest.approx(0.5)
    assert aggregate([], "min") == aggregate([], "mean") == float("-inf")
    with pytest.raises(ValueError, match="aggregation"):
        aggregate([0.5], "median")


def test_step_best_of_k_keeps_the_best_step_until_a_finished_one_wins():
    # root: a1 (0.9) beats a2..a4; after a1: b1 (0.6) beats the finished "5" (0.4); after b1 the
    # finished "6" (0.85) wins.
    (result,) = run(["Q1"], "step_best_of_k", 4)
    assert result.steps == ["a1", "b1", "The answer is 6"]
    assert result.step_scores == [0.9, 0.6, 0.85]
    assert result.finished and result.answer == "6"
    # one token per character: 4 x "aN\n", then b1/5 twice, then 6/f2 twice
    assert result.tokens_generated == 4 * 3 + 2 * (3 + 15) + 2 * (15 + 3)


def test_beam_keeps_the_top_partials_by_aggregated_score():
    # root expanded with k=4; a1 (0.9) and a3 (0.7) kept, each expanded with k/width = 2:
    # min scores a3,d1 0.7 > a1,b1 0.6 > a1,"5" 0.4 > a3,d2 0.3; then "9" (min 0.7) beats "6" (0.6)
    (result,) = run(["Q1"], "beam", 4)
    assert result.steps == ["a3", "d1", "The answer is 9"]
    assert result.finished and result.answer == "9"
    assert result.tokens_generated == 4 * 3 + (3 + 15) + (3 + 3) + (15 + 3) + (15 + 3)


def test_whole_solution_strategies():
    # answers 3, 4, 3, 3, unfinished; min scores 0.2, 0.8, 0.2, 0.2, 0.99
    (majority,) = run(["Q2"], "majority", 5)
    assert majority.answer == "3" and majority.steps == ["x1", "The answer is 3"]
    assert majority.step_scores == []
    (best,) = run(["Q2"], "best_of_n", 5)  # the unfinished y1,y2 scores higher but is not taken
    assert best.answer == "4" and best.finished and best.step_scores == [0.8, 0.95]
    (weighted,) = run(["Q2"], "weighted_vote", 5)  # bucket 4: 0.8 > bucket 3: 3 x 0.2
    assert weighted.answer == "4"
    (weighted_last,) = run(["Q2"], "weighted_vote", 5, aggregation="last")  # 0.95 vs 3 x 0.2
    assert weighted_last.answer == "4"
    (single,) = run(["Q2"], "majority", 1)  # pass@1 of one sample
    assert single.answer == "3"
    expected_tokens = sum(len(text) for text, _ in TREE_Q2[()])
    assert best.tokens_generated == majority.tokens_generated == expected_tokens


def test_only_unfinished_solutions_come_back_flagged():
    (result,) = run(["Q2"], "best_of_n", 5, kind=None)  # no kind: the end token still finishes
    assert result.finished and result.steps[0] == "x2"
    tree = {(): [("y1\ny2", LENGTH)]}
    TREES["Q3"], PROMPTS["Q3"] = tree, "Question: Q3\nAnswer:\n"
    try:
        (result,) = run(["Q3"], "best_of_n", 2)
        assert not result.finished and result.answer is None and result.steps == ["y1", "y2"]
        (result,) = run(["Q3"], "weighted_vote", 2)
        assert not result.finished and result.answer is None
    finally:
        del TREES["Q3"], PROMPTS["Q3"]


def test_a_finished_candidate_is_preferred_whenever_one_exists():
    # max_depth 2: b1 beats the finished "5" at depth 2, and the search stops there -> "5" comes back
    (result,) = run(["Q1"], "step_best_of_k", 4, max_depth=2)
    assert result.finished and result.steps == ["a1", "The answer is 5"] and result.answer == "5"
    # max_depth 1: nothing finished, the best partial comes back flagged
    (result,) = run(["Q1"], "step_best_of_k", 4, max_depth=1)
    assert not result.finished and result.steps == ["a1"] and result.answer is None
    # dead end (Q2's first lines have no continuation): the best partial, flagged
    (result,) = run(["Q2"], "beam", 4)
    assert not result.finished and result.answer is None and result.steps == ["x1"]


@pytest.mark.parametrize("aggregation", ["last", "min"])
def test_an_answerless_stop_never_beats_a_continuation(aggregation):
    # after a1 the stop candidate (no answer, scored as a1: 0.9) would beat b1 (0.6) if answerless stops were kept
    # and the search returned ["a1"] with no answer; b1 goes on to state the right answer
    for strategy, k in (("step_best_of_k", 2), ("step_best_of_k", 4), ("beam", 4)):
        (result,) = run(["QSTOP"], strategy, k, aggregation=aggregation)
        assert result.steps == ["a1", "b1", "The answer is 6"], (strategy, k)
        assert result.finished and result.answer == "6"
        assert grade_results([result], ["6"], "tiny") == [True]


def test_an_answered_finished_candidate_still_beats_a_lower_continuation():
    # after a1: the answerless stop (0.9) is set aside; "The answer is 2" (0.8) beats b1 (0.6)
    for strategy, k in (("step_best_of_k", 3), ("beam", 6)):
        (result,) = run(["QANSWERED"], strategy, k, aggregation="last")
        assert result.steps == ["a1", "The answer is 2"] and result.finished and result.answer == "2", strategy


def test_beam_aggregations_that_do_not_reward_brevity():
    # width 2: the short "7" (0.7) is kept at depth 1; c1, c2, "8" (0.9, 0.6, 0.9) finishes at
    # depth 3. min (0.6) and prod (0.486) fall with every step and keep the short wrong answer;
    # last (0.9) and mean (0.8) take the longer right one.
    expected = {"min": "7", "prod": "7", "last": "8", "mean": "8"}
    for aggregation, answer in expected.items():
        (result,) = run(["QLONG"], "beam", 2, aggregation=aggregation)
        assert result.finished and result.answer == answer, aggregation
    # the default (SearchSettings and SearchConfig) is last
    assert SearchSettings().aggregation == SearchConfig().aggregation == "last"
    (result,) = search_many(
        ["QLONG"], FakePolicy(), FakePRM(), "beam", 2, prompts=[PROMPTS["QLONG"]], kind="tiny", beam_width=2
    )
    assert result.steps == ["c1", "c2", "The answer is 8"]


def test_only_answerless_stops_are_graded_wrong():
    # after a1 every candidate is an answerless stop: the partial a1 comes back unfinished
    for strategy in ("step_best_of_k", "beam"):
        (result,) = run(["QNOANSWER1"], strategy, 2)
        assert result.steps == ["a1"] and not result.finished and result.answer is None, strategy
        assert grade_results([result], ["6"], "tiny") == [False]
    # nothing but answerless stops from the root: one of them comes back, with no answer
    results = [run(["QNOANSWER0"], strategy, 2)[0] for strategy in STRATEGIES]
    assert all(r.answer is None and r.steps in (["z1"], ["z2"]) for r in results)
    assert grade_results(results, ["6"] * len(results), "tiny") == [False] * len(results)


def test_best_of_n_prefers_an_answered_sample_over_an_answerless_one():
    # y1, y2 ended with the end token and no answer (0.99, 0.99); x2, "4" (0.8, 0.95) answers
    for aggregation in ("last", "min"):
        for strategy in ("best_of_n", "weighted_vote"):
            (result,) = run(["QWHOLE"], strategy, 2, aggregation=aggregation)
            assert result.steps == ["x2", "The answer is 4"] and result.answer == "4", (strategy, aggregation)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_batched_equals_one_problem_at_a_time(strategy):
    questions = ["Q1", "Q2", "Q1"]
    batched = run(questions, strategy, 4, temperature=0.0)
    single = [run([q], strategy, 4, temperature=0.0)[0] for q in questions]
    assert batched == single
    assert all(isinstance(r, SearchResult) for r in batched)


def test_one_generate_and_one_score_call_per_depth():
    policy, prm = FakePolicy(), FakePRM()
    results = search_many(
        ["Q1", "Q2"],
        policy,
        prm,
        "beam",
        4,
        prompts=[PROMPTS["Q1"], PROMPTS["Q2"]],
        kind="tiny",
        beam_width=2,
        max_depth=6,
        aggregation="min",
    )
    # depth 1: both roots; depth 2: two partials each (Q2's lead nowhere); depth 3: Q1's two
    assert policy.calls == [(2, 4), (4, 2), (2, 2)]
    assert len(prm.calls) == 3
    assert results[0].answer == "9"
    policy, prm = FakePolicy(), FakePRM()
    search_many(["Q1", "Q2"], policy, prm, "weighted_vote", 3, prompts=[PROMPTS["Q1"], PROMPTS["Q2"]], kind="tiny")
    assert policy.calls == [(2, 3)] and len(prm.calls) == 1


def test_single_search_and_default_prompts():
    # prompts built by the one prompt builder (plain template, tokenizer None) match PROMPTS
    result = search("Q1", FakePolicy(), FakePRM(), "step_best_of_k", 4, kind="tiny")
    assert result.answer == "6"
    with pytest.raises(ValueError, match="strategy"):
        search("Q1", FakePolicy(), FakePRM(), "mcts", 4, kind="tiny")
    with pytest.raises(TypeError, match="unknown setting"):
        search("Q1", FakePolicy(), FakePRM(), "beam", 4, beam=3)


def test_bench_batched_search_reports_both_timings():
    from perf.search_batched import bench_batched_search

    result = bench_batched_search(
        ["Q1", "Q2"],
        FakePolicy(),
        FakePRM(),
        "beam",
        4,
        prompts=[PROMPTS["Q1"], PROMPTS["Q2"]],
        kind="tiny",
        beam_width=2,
    )
    assert (
        set(result) >= {"ours_s", "reference_s", "ratio"}
        and result["ratio"] == result["reference_s"] / result["ours_s"]
    )
    assert result["tokens_generated"] > 0
    assert join_steps(["a"]) == "a\n"  # the step format the fake policy assumes


def test_summarize_search_counts_unfinished_as_wrong():
    results = [
        SearchResult(["The answer is 6"], [0.9], True, "6", 10),
        SearchResult(["The answer is 6"], [0.9], False, "6", 20),  # unfinished: wrong even if right
        SearchResult(["The answer is 5"], [0.9], True, "5", 30),
    ]
    summary = summarize_search(results, ["6", "6", "6"], "tiny", n_resamples=200)
    assert summary["accuracy"]["mean"] == pytest.approx(1 / 3)
    assert summary["tokens_per_problem"] == 20 and summary["finished_fraction"] == pytest.approx(2 / 3)


def test_stage_writes_results_table_and_plot(tmp_path, monkeypatch, capsys):
    """stages.search end to end with the fake models patched in (no trained model needed)."""
    import json

    import stages.search as stage
    from pipeline.datasets.problems import write_problems_jsonl
    from pipeline.records import Problem

    path = tmp_path / "problems.jsonl"
    write_problems_jsonl([Problem("p1", "Q1", "6", "tiny"), Problem("p2", "Q2", "4", "tiny")], path)
    (tmp_path / "prm").mkdir()
    monkeypatch.setattr(stage, "build_generator", lambda config: FakePolicy())
    monkeypatch.setattr(stage, "load_scorer", lambda path, config: FakePRM())
    summary = stage.main(
        [
            "--config",
            "configs/tiny.yaml",
            f"runs_root={tmp_path}",
            "run=t",
            f"model.prm={tmp_path}/prm",
            "search.benchmark=problems",
            f"search.benchmark_path={path}",
            "search.ks=[1,4]",
            "search.beam_width=2",
            "search.strategies=[step_best_of_k,beam,best_of_n,weighted_vote]",
        ]
    )
    out = tmp_path / "t" / "search"
    rows = json.loads((out / "results.json").read_text())["rows"]
    assert [(r["strategy"], r["k"]) for r in rows][:2] == [("majority", 1), ("majority", 4)]
    assert len(rows) == 10 == len(summary["rows"])
    assert "search runs: 100%" in capsys.readouterr().err  # a bar over the (strategy, k) runs
    step_k4 = next(r for r in rows if r["strategy"] == "step_best_of_k" and r["k"] == 4)
    assert step_k4["accuracy"]["mean"] == 0.5  # Q1 -> 6 (right), Q2 -> dead end (unfinished)
    assert (out / "table.md").read_text().startswith("| strategy")
    # the problems carry no valid solutions to label against: the wrong steps are not counted
    assert step_k4["wrong_steps"]["n_wrong"] is None and "cannot read problem 'p1'" in step_k4["wrong_steps"]["note"]
    assert (out / "table.md").read_text().splitlines()[2].endswith("| - |")
    assert (out / "accuracy_vs_k.png").stat().st_size > 0
    # what the PRM adds over counting, at each k, paired on the same samples
    votes = json.loads((out / "results.json").read_text())["weighted_vote_vs_majority"]
    assert [v["k"] for v in votes] == [1, 4] and all(v["difference"]["n_problems"] == 2 for v in votes)
    accuracy = {(r["strategy"], r["k"]): r["accuracy"]["mean"] for r in rows}
    for v in votes:
        assert v["difference"]["mean"] == pytest.approx(
            accuracy[("weighted_vote", v["k"])] - accuracy[("majority", v["k"])]
        )
    assert "PRM-weighted voting minus majority voting" in (out / "table.md").read_text()


def test_paired_difference_against_a_per_problem_loop():
    """paired_difference is the mean of per-problem differences (float64 by hand), its interval brackets it,
    and a missing row gives None; vote_comparisons pairs weighted_vote with majority at each k."""
    import numpy as np

    from prm.search.summary import paired_difference, vote_comparisons

    rng = np.random.default_rng(3)
    a, b = rng.random(50) < 0.6, rng.random(50) < 0.4
    rows = [
        {"strategy": "weighted_vote", "k": 4, "correct": a.tolist()},
        {"strategy": "majority", "k": 4, "correct": b.tolist()},
        {"strategy": "majority", "k": 1, "correct": b.tolist()},
    ]
    by_hand = sum(float(x) - float(y) for x, y in zip(a, b)) / 50
    d = paired_difference(rows, ("weighted_vote", 4), ("majority", 4), n_resamples=500)
    assert d["mean"] == pytest.approx(by_hand, abs=1e-12) and d["lo"] <= by_hand <= d["hi"] and d["n_problems"] == 50
    assert paired_difference(rows, ("weighted_vote", 16), ("majority", 4)) is None
    assert paired_difference(rows, ("majority", 4), ("majority", 4))["hi"] == 0.0  # a row against itself
    assert [c["k"] for c in vote_comparisons(rows, [1, 4, 16])] == [4]  # k = 1 has no weighted_vote row here
    with pytest.raises(ValueError, match="the same"):
        paired_difference([*rows, {"strategy": "beam", "k": 4, "correct": [True]}], ("beam", 4), ("majority", 4))


def test_real_backends_batched_equals_single_at_temperature_zero():
    """The HF generator and the PRMScorer on random tiny models: the same code path as the stage."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from pipeline.generation.hf import HFGenerator
    from prm.scorer import PRMScorer
    from tests.test_prm import FORMAT, make_prm, make_tokenizer

    tokenizer = make_tokenizer()
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=256,
        attn_implementation="eager",
    )
    policy = HFGenerator(LlamaForCausalLM(config).eval(), tokenizer)
    prm = PRMScorer(make_prm(tokenizer), tokenizer, FORMAT, "tiny")
    questions = ["What is 1 + 2 ?", "What is 3 + 4 ?"]
    settings = {
        "kind": "tiny",
        "format_config": FORMAT,
        "max_depth": 2,
        "max_step_tokens": 6,
        "max_new_tokens": 12,
        "beam_width": 2,
        "temperature": 0.0,
    }
    for strategy in ("beam", "weighted_vote"):
        batched = search_many(questions, policy, prm, strategy, 2, **settings)
        single = [search_many([q], policy, prm, strategy, 2, **settings)[0] for q in questions]
        assert [r.steps for r in batched] == [r.steps for r in single]
        assert all(r.tokens_generated > 0 and len(r.step_scores) == len(r.steps) for r in batched)

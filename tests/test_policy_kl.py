"""Each learner's KL to the base from its draw at temperature 1 (eval/policy_kl.py, make policy-kl)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from eval.policy_kl import draw_log_ratios, kl_estimate, solution_logprobs
from pipeline.records import Problem, Sample
from pipeline.stats import bootstrap_ci

REPO = Path(__file__).resolve().parents[1]


def test_kl_estimate_averages_each_problem_first_then_over_problems():
    rng = np.random.default_rng(0)
    samples = [(f"p{i % 5}", float(v)) for i, v in enumerate(rng.normal(0.3, 1.0, size=23))]
    estimate = kl_estimate(samples, n_resamples=500, seed=2)
    per_problem = np.array([np.mean([v for p, v in samples if p == f"p{i}"]) for i in range(5)], dtype=np.float64)
    mean, lo, hi = bootstrap_ci(per_problem, n_resamples=500, seed=2)
    assert (estimate["mean"], estimate["lo"], estimate["hi"]) == pytest.approx((mean, lo, hi), abs=1e-12)
    assert (estimate["n_problems"], estimate["n_samples"]) == (5, 23)
    assert kl_estimate([]) is None
    with pytest.raises(ValueError, match="non-finite"):
        kl_estimate([("p0", float("inf"))])


@pytest.fixture(scope="module")
def two_policies(random_tiny_world):
    from pipeline.config.schema import BootstrapConfig
    from pipeline.finetune.policy import LMPolicy
    from pipeline.modeling import load_tokenizer
    from pipeline.tinyworld.model import build_model

    tokenizer = load_tokenizer(str(random_tiny_world / "policy"))
    models = [
        build_model(BootstrapConfig(hidden_size=32, intermediate_size=64, num_layers=2, num_heads=2, seed=s), tokenizer)
        for s in (3, 4)
    ]
    return [LMPolicy(m.eval(), tokenizer) for m in models], tokenizer


def brute_force_logprob(policy, tokenizer, prompt: str, steps: list[str], ended: bool) -> float:
    """Float64 loop: the sum of the completion's token log-probabilities, one forward per token."""
    from pipeline.steps import encode_prompt, encode_trajectory

    encoded = encode_trajectory(
        tokenizer, prompt, steps, "\n", add_end=True, prompt_ids=encode_prompt(tokenizer, prompt)
    )
    ids = [int(i) for i in encoded.input_ids]
    start = encoded.prompt_len
    stop = len(ids) if ended else len(ids) - 1  # a cut-off solution: no end token
    total = 0.0
    with torch.no_grad():
        for t in range(start, stop):
            logits = policy.model(torch.tensor([ids[:t]])).logits[0, -1].double()
            total += float(torch.log_softmax(logits, -1)[ids[t]])
    return total


def test_a_solution_log_probability_is_its_tokens_summed_and_the_stop_only_where_it_ended(two_policies):
    (policy, _), tokenizer = two_policies
    prompt = "Question: Ann has 3 apples and buys 4 more. How many apples does she have?\nAnswer:\n"
    steps = ["Ann has 3 + 4 = 7 apples.", "The answer is 7."]
    ended, cut = solution_logprobs(policy, [prompt, prompt], [steps, steps], [True, False], micro_batch=1)
    assert ended == pytest.approx(brute_force_logprob(policy, tokenizer, prompt, steps, True), abs=1e-4)
    assert cut == pytest.approx(brute_force_logprob(policy, tokenizer, prompt, steps, False), abs=1e-4)
    assert ended < cut  # the stop's log-probability is negative


def test_kl_of_a_model_to_itself_is_zero_and_to_another_is_the_mean_log_ratio(two_policies):
    (first, second), tokenizer = two_policies
    problems = {
        p: Problem(problem_id=p, question=f"Tom has {n} marbles. How many?", answer=str(n), source="tiny")
        for p, n in (("a", 3), ("b", 5))
    }

    def sample(problem_id, index, steps, answer, finished=True):
        return Sample(
            problem_id=problem_id,
            model="gfn",
            sample_idx=index,
            steps=steps,
            final_answer=answer,
            correct=answer is not None,
            finished=finished,
        )

    draw = [
        sample("a", 0, ["Tom has 3 marbles.", "The answer is 3."], "3"),
        sample("a", 1, ["The answer is 3."], "3", finished=False),
        sample("b", 0, ["The answer is 5."], "5"),
        sample("b", 1, [], None),
    ]

    def prompt_of(problem, tokenizer):
        return f"Question: {problem.question}\nAnswer:\n"

    same = draw_log_ratios(draw, problems, {"model": first, "reference": first}, prompt_of, micro_batch=2)
    assert [p for p, _ in same] == ["a", "a", "b"]  # the sample without a step is left out
    assert all(value == pytest.approx(0.0, abs=1e-9) for _, value in same)
    other = draw_log_ratios(draw, problems, {"model": first, "reference": second}, prompt_of, micro_batch=2)
    for (problem_id, value), sample in zip(other, draw[:3]):
        prompt = prompt_of(problems[problem_id], tokenizer)
        expected = brute_force_logprob(first, tokenizer, prompt, sample.steps, sample.finished) - brute_force_logprob(
            second, tokenizer, prompt, sample.steps, sample.finished
        )
        assert value == pytest.approx(expected, abs=1e-4)
    estimate = kl_estimate(other, n_resamples=200)
    assert estimate["mean"] == pytest.approx((np.mean([v for p, v in other if p == "a"]) + other[2][1]) / 2)


def test_make_policy_kl_reads_the_draws_of_a_finished_evaluation(random_tiny_world, tmp_path, monkeypatch):
    from stages.policy_kl import main

    monkeypatch.chdir(tmp_path)
    world = random_tiny_world
    problems = [json.loads(line) for line in (world / "problems_train.jsonl").read_text().splitlines()][:2]
    samples = tmp_path / "reports" / "k" / "samples"
    samples.mkdir(parents=True)
    for model in ("base", "gfn"):
        rows = [
            {
                "problem_id": p["problem_id"],
                "model": model,
                "sample_idx": i,
                "steps": ["The answer is 4."],
                "final_answer": "4",
                "correct": False,
                "finished": True,
            }
            for p in problems
            for i in range(2)
        ]
        (samples / f"{model}__tiny_test.temperature_1.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    argv = [
        "--config",
        str(REPO / "configs" / "tiny.yaml"),
        "run=k",
        f"runs_root={tmp_path / 'runs'}",
        f"eval.models={{base: {world / 'policy'}, gfn: {world / 'policy'}, ppo: {tmp_path / 'absent'}}}",
        f"eval.benchmark_paths={{tiny_test: {world / 'problems_train.jsonl'}}}",
        "eval.max_problems=2",
        "eval.bootstrap_resamples=50",
    ]
    path = main(argv)
    kl = json.loads(path.read_text())["tiny_test"]
    assert kl["reference"] == "base" and list(kl["models"]) == ["gfn"]  # ppo has no model and no draw
    assert kl["models"]["gfn"]["mean"] == pytest.approx(0.0, abs=1e-6)  # the same weights as the base
    assert kl["models"]["gfn"]["n_samples"] == 4 and kl["models"]["gfn"]["n_problems"] == 2
    (samples / "base__tiny_test.temperature_1.jsonl").unlink()
    (samples / "gfn__tiny_test.temperature_1.jsonl").unlink()
    with pytest.raises(SystemExit, match="no draw at temperature 1"):
        main(argv)

"""The tiny world: problem generator, tokenizer, and a reduced bootstrap end to end."""

from __future__ import annotations

import dataclasses

import json
import re
from pathlib import Path

import pytest

from pipeline.config import FormatConfig, TinyWorldConfig
from pipeline.grading import grade
from pipeline.prompts import prompt_from_config
from pipeline.steps import encode_trajectory, join_steps
from pipeline.tinyworld.problems import (
    Event,
    Story,
    arithmetic_errors,
    generate_splits,
    make_problem,
    num_strategies,
    solution_strategy,
    strategy_of,
    step_equations,
    valid_step_orders,
)

REPO = Path(__file__).resolve().parents[1]
SMALL = TinyWorldConfig(seed=3, n_train=400, n_val=50, n_test=50, n_rl=60)
APPLY = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}


@pytest.fixture(scope="module")
def splits():
    return generate_splits(SMALL)


@pytest.fixture(scope="module")
def tokenizer(splits):
    from pipeline.tinyworld.tokenizer import tokenizer_corpus, train_tokenizer

    return train_tokenizer(tokenizer_corpus(splits["train"], FormatConfig()), vocab_size=512)


def all_problems(splits):
    return [p for split in ("train", "val", "test", "rl") for p in splits[split]]


# Ann has 5 apples, buys 3 bags with 4 apples each, gives away 2.
EXAMPLE = Story(name=0, item=0, start=5, events=(Event(1, 3, 4, 0, 0), Event(-1, 2, 1, 0, 0)))


def example_problem(swap=False):
    return make_problem(EXAMPLE, "tiny-example-00000", max_result=50, swap=swap)


# ----------------------------------------------------------------------------- generator


def test_generator_is_deterministic_in_the_seed(splits):
    again = generate_splits(SMALL)
    assert {k: [p.to_json() for p in v] for k, v in again.items()} == {k: [p.to_json() for p in v] for k, v in splits.items()}
    other = generate_splits(TinyWorldConfig(seed=4, n_train=400, n_val=50, n_test=50, n_rl=60))
    assert [p.question for p in other["test"]] != [p.question for p in splits["test"]]


def test_test_split_does_not_depend_on_train_size(splits):
    bigger = generate_splits(TinyWorldConfig(seed=3, n_train=800, n_val=50, n_test=50, n_rl=60))
    assert [p.to_json() for p in bigger["test"]] == [p.to_json() for p in splits["test"]]


def test_held_out_splits_do_not_depend_on_the_sizes_drawn_after_them(splits):
    # test, val and the reinforcement-learning split are drawn before the bootstrap's training
    # problems: a bigger training set changes none of them, a bigger rl split neither test nor val
    bigger_train = generate_splits(TinyWorldConfig(seed=3, n_train=800, n_val=50, n_test=50, n_rl=60))
    bigger_rl = generate_splits(TinyWorldConfig(seed=3, n_train=400, n_val=50, n_test=50, n_rl=120))
    for split in ("test", "val", "rl"):
        assert [p.to_json() for p in bigger_train[split]] == [p.to_json() for p in splits[split]], split
    for split in ("test", "val"):
        assert [p.to_json() for p in bigger_rl[split]] == [p.to_json() for p in splits[split]], split
    assert [p.to_json() for p in bigger_rl["rl"][:60]] == [p.to_json() for p in splits["rl"]]


def test_splits_are_disjoint_and_well_formed(splits):
    assert {k: len(v) for k, v in splits.items()} == {"train": 400, "val": 50, "test": 50, "rl": 60}
    questions = [set(p.question for p in splits[k]) for k in ("train", "val", "test", "rl")]
    assert len(set().union(*questions)) == sum(len(q) for q in questions) == 560  # distinct within and across splits
    for split, problems in splits.items():
        for index, problem in enumerate(problems):
            assert problem.problem_id == f"tiny-{split}-{index:05d}"
            assert problem.source == "tiny" and problem.kind == "tiny"
            assert set(problem.meta) == {"solutions", "num_ops"}
            assert SMALL.min_ops <= problem.meta["num_ops"] <= SMALL.max_ops


def test_every_gold_solution_computes_and_reaches_the_answer(splits):
    for problem in all_problems(splits):
        answer = int(problem.answer)
        assert 0 <= answer <= SMALL.max_result
        assert all(int(n) <= SMALL.max_operand for n in re.findall(r"\d+", problem.question))
        solutions = valid_step_orders(problem)
        assert len(solutions) == num_strategies(problem) >= 1
        assert len({tuple(s) for s in solutions}) == len(solutions)
        for steps in solutions:
            assert steps[-1] == f"The answer is {answer}"
            equations = step_equations(steps)
            assert len(equations) == problem.meta["num_ops"] == len(steps) - 1  # one calculation per step
            assert arithmetic_errors(steps) == []
            for a, op, b, c in equations:
                assert APPLY[op](a, b) == c and 0 <= c <= SMALL.max_result
            assert equations[-1][3] == answer  # the last calculation is the running total
            # the products are the same in every order; only their place changes
            products = sorted(e for e in equations if e[1] == "*")
            assert products == sorted(e for e in step_equations(solutions[0]) if e[1] == "*")


def told_amounts(problem) -> list[int]:
    """The amount of every event, in the order the question tells them."""
    events = re.findall(r"(\d+) (?:\w+ with (\d+))?", problem.question.split(".", 1)[1])
    return [int(a) * int(b) if b else int(a) for a, b in events]


def applied_amounts(steps) -> list[int]:
    """The amount each running-total step of a solution adds or removes, in order."""
    return [b for a, op, b, c in step_equations(steps) if op != "*"]


def test_gold_solutions_use_the_told_or_the_reverse_order(splits):
    train = splits["train"]
    assert sum(num_strategies(p) > 1 for p in train) > len(train) // 2
    reversible, reversed_gold = 0, 0
    for problem in train:
        told = told_amounts(problem)
        gold = applied_amounts(problem.meta["solutions"][0])
        assert gold in (told, told[::-1])
        if told != told[::-1] and any(applied_amounts(s) == told[::-1] for s in problem.meta["solutions"]):
            reversible += 1
            reversed_gold += gold == told[::-1]
    # swap_fraction = 0.5: about half the problems whose reverse order is valid train on it
    assert 0.35 * reversible < reversed_gold < 0.65 * reversible


def test_grader_accepts_every_gold_solution(splits):
    for problem in all_problems(splits):
        for steps in valid_step_orders(problem):
            assert grade(join_steps(steps), problem.answer, "tiny")
        assert not grade(join_steps(["The answer is 999"]), problem.answer, "tiny")


def test_the_two_orders_of_the_example():
    problem = example_problem()
    assert problem.question == (
        "Ann has 5 apples. She buys 3 bags with 4 apples each. She gives away 2 apples. "
        "How many apples does Ann have now?"
    )
    assert problem.answer == "15"
    assert valid_step_orders(problem) == [
        ["Ann buys 3 * 4 = 12 apples.", "Ann has 5 + 12 = 17 apples.", "Ann has 17 - 2 = 15 apples.", "The answer is 15"],
        ["Ann has 5 - 2 = 3 apples.", "Ann buys 3 * 4 = 12 apples.", "Ann has 3 + 12 = 15 apples.", "The answer is 15"],
    ]
    assert num_strategies(problem) == 2
    # swapped: the gold solution (listed first) applies the events in the reverse order
    assert valid_step_orders(example_problem(swap=True)) == valid_step_orders(problem)[::-1]
    # the strategy of a solution is read from its calculations, wording aside
    assert solution_strategy(problem, ["5 - 2 = 3", "3 * 4 = 12", "So 3 + 12 = 15", "The answer is 15"]) == 1
    assert solution_strategy(problem, ["Ann buys 3 * 4 = 12 apples.", "Ann has 5 + 12 = 17 apples.", "Ann has 17 - 2 = 15 apples."]) == 0
    assert solution_strategy(problem, ["Ann buys 3 * 4 = 12 apples.", "Ann has 5 + 12 = 18 apples.", "The answer is 16"]) is None
    # its name: meta["strategies"] at that index, the index itself for a problem without names
    assert strategy_of(problem, ["5 - 2 = 3", "3 * 4 = 12", "So 3 + 12 = 15", "The answer is 15"]) == "1"
    named = dataclasses.replace(problem, meta={**problem.meta, "strategies": ["narrative", "reversed"]})
    assert strategy_of(named, ["5 - 2 = 3", "3 * 4 = 12", "So 3 + 12 = 15", "The answer is 15"]) == "reversed"
    assert strategy_of(named, ["Ann buys 3 * 4 = 12 apples.", "Ann has 5 + 12 = 18 apples.", "The answer is 16"]) is None
    assert arithmetic_errors(["Ann has 5 + 12 = 18 apples.", "Ann buys 3 * 4 = 12 apples."]) == ["Ann has 5 + 12 = 18 apples."]


def test_orders_that_leave_the_range_are_not_valid():
    # 5 - 6 would go below zero before the gain: only the narrative order is valid
    story = Story(name=1, item=1, start=5, events=(Event(1, 10, 1, 0, 0), Event(-1, 6, 1, 0, 0)))
    problem = make_problem(story, "tiny-example-00001", max_result=50, swap=True)
    assert valid_step_orders(problem) == [["Ben has 5 + 10 = 15 pens.", "Ben has 15 - 6 = 9 pens.", "The answer is 9"]]


def test_bad_ranges_are_refused():
    with pytest.raises(ValueError, match="min_ops"):
        generate_splits(TinyWorldConfig(min_ops=3, max_ops=2))
    with pytest.raises(ValueError, match="max_result"):
        generate_splits(TinyWorldConfig(max_operand=15, max_result=20))


# ----------------------------------------------------------------------------- tokenizer


def test_tokenizer_round_trips_prompts_and_every_gold_solution(splits, tokenizer):
    fmt = FormatConfig()
    newline = tokenizer.convert_tokens_to_ids(tokenizer.tokenize("\n"))
    assert len(newline) == 1
    for problem in all_problems(splits):
        prompt = prompt_from_config(problem.question, problem.kind, tokenizer, fmt)
        assert tokenizer.decode(tokenizer(prompt)["input_ids"], skip_special_tokens=True) == prompt
        for steps in valid_step_orders(problem):
            text = join_steps(steps)
            ids = tokenizer(text, add_special_tokens=False)["input_ids"]
            assert tokenizer.decode(ids) == text
            assert ids.count(newline[0]) == len(steps)  # the separator is always its own token


def test_numbers_are_read_digit_by_digit(tokenizer):
    pieces = tokenizer.tokenize("Ann has 17 + 305 = 322 apples.")
    digits = [p for p in pieces if any(ch.isdigit() for ch in p)]
    assert all(sum(ch.isdigit() for ch in p) == 1 for p in digits)
    assert len(digits) == 8


def test_special_tokens_and_segment_by_segment_ids(splits, tokenizer):
    assert tokenizer.convert_ids_to_tokens([tokenizer.pad_token_id, tokenizer.bos_token_id, tokenizer.eos_token_id]) == ["<pad>", "<s>", "</s>"]
    problem = splits["test"][0]
    prompt = prompt_from_config(problem.question, problem.kind, tokenizer, FormatConfig())
    steps = valid_step_orders(problem)[0]
    segmented = encode_trajectory(tokenizer, prompt, steps, "\n")
    assert segmented.input_ids[0] == tokenizer.bos_token_id
    assert segmented.input_ids[-1] == tokenizer.eos_token_id
    # the whole text tokenizes exactly as the segments do: step boundaries are the same
    assert tokenizer(prompt + join_steps(steps))["input_ids"] + [tokenizer.eos_token_id] == segmented.input_ids
    assert tokenizer.decode(segmented.input_ids[segmented.prompt_len:], skip_special_tokens=True) == join_steps(steps)


def test_tokenizer_reloads_with_the_same_ids(splits, tokenizer, tmp_path):
    from transformers import AutoTokenizer

    from pipeline.config import BootstrapConfig
    from pipeline.modeling import load_tokenizer
    from pipeline.tinyworld.model import model_config

    tokenizer.save_pretrained(tmp_path)
    model_config(BootstrapConfig(), tokenizer).save_pretrained(tmp_path)  # as beside the model
    texts = [prompt_from_config(p.question, p.kind, None, FormatConfig()) + join_steps(valid_step_orders(p)[0]) for p in splits["val"]]
    expected = [tokenizer(t)["input_ids"] for t in texts]
    for reloaded in (AutoTokenizer.from_pretrained(tmp_path), load_tokenizer(str(tmp_path))):
        assert [reloaded(t)["input_ids"] for t in texts] == expected
        assert (reloaded.pad_token_id, reloaded.bos_token_id, reloaded.eos_token_id) == (
            tokenizer.pad_token_id, tokenizer.bos_token_id, tokenizer.eos_token_id,
        )
        assert [reloaded.decode(ids, skip_special_tokens=True) for ids in expected] == texts


# ----------------------------------------------------------------------------- model


def test_training_examples_mask_the_prompt(splits, tokenizer):
    from pipeline.tinyworld.model import IGNORE_INDEX, training_examples

    problem = splits["train"][0]
    (example,) = training_examples([problem], tokenizer, FormatConfig())
    prompt = prompt_from_config(problem.question, problem.kind, tokenizer, FormatConfig())
    prompt_len = len(tokenizer(prompt)["input_ids"])
    assert example.labels[:prompt_len] == [IGNORE_INDEX] * prompt_len
    assert example.labels[prompt_len:] == example.input_ids[prompt_len:]
    assert tokenizer.decode(example.input_ids[prompt_len:], skip_special_tokens=True) == join_steps(problem.meta["solutions"][0])
    with pytest.raises(ValueError, match="max_position_embeddings"):
        training_examples([problem], tokenizer, FormatConfig(), max_length=10)


@pytest.mark.slow
def test_reduced_bootstrap_runs_and_the_model_reloads_like_a_hub_model(tmp_path):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from stages.bootstrap import main

    argv = [
        "--config", str(REPO / "configs" / "tiny.yaml"), f"runs_root={tmp_path}", "run=t",
        "tinyworld.n_train=300", "tinyworld.n_val=10", "tinyworld.n_test=20", "tinyworld.n_rl=30",
        "bootstrap.max_train_steps=150", "bootstrap.hidden_size=32", "bootstrap.num_layers=2",
        "bootstrap.num_heads=2", "bootstrap.intermediate_size=64", "bootstrap.batch_size=16",
        "bootstrap.warmup_steps=5", "bootstrap.eval_problems=8", "bootstrap.eval_samples=2",
        "bootstrap.mc_problems=2", "bootstrap.mc_rollouts=2", "generation.max_new_tokens=48",
    ]
    metrics = main(argv)
    out = tmp_path / "t" / "bootstrap"
    for name in ("problems_train.jsonl", "problems_val.jsonl", "problems_test.jsonl", "problems_rl.jsonl", "metrics.json", "config.yaml"):
        assert (out / name).is_file(), name
    assert len((out / "problems_test.jsonl").read_text().splitlines()) == 20
    assert len((out / "problems_rl.jsonl").read_text().splitlines()) == 30
    assert len((out / "problems_train.jsonl").read_text().splitlines()) == 300  # the bootstrap trains on these only
    assert json.loads((out / "metrics.json").read_text()) == metrics
    assert metrics["train_steps"] > 0 and metrics["parameters"] > 0
    for key in ("greedy_accuracy", "sampled_accuracy", "pass@2", "maj@2", "mc_prefixes", "step_arithmetic_error_rate"):
        assert key in metrics
    assert 0.0 <= metrics["greedy_accuracy"] <= 1.0
    assert (out / "model" / "model.safetensors").is_file()

    tokenizer = AutoTokenizer.from_pretrained(out / "model")
    model = AutoModelForCausalLM.from_pretrained(out / "model")
    prompt = prompt_from_config("Ann has 5 apples. She buys 3 apples. How many apples does Ann have now?", "tiny", tokenizer, FormatConfig())
    inputs = tokenizer(prompt, return_tensors="pt")
    with torch.no_grad():
        generated = model.generate(**inputs, max_new_tokens=6, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    assert generated.shape[1] == inputs["input_ids"].shape[1] + 6 or generated[0, -1] == tokenizer.eos_token_id

    # a second run with the same config finds the work done and returns the same metrics
    assert main(argv) == metrics


def test_the_model_size_in_readme_and_docs_is_the_tiny_configs_model():
    """README.md, configs/tiny.yaml and docs/tinyworld.md state the tiny policy's size; it is the
    count of the model bootstrap builds from configs/tiny.yaml (random init: the size, not the weights)."""
    from pipeline.config import load_config
    from pipeline.tinyworld.bootstrap import untrained_policy
    from pipeline.tinyworld.model import count_parameters

    config = load_config(REPO / "configs" / "tiny.yaml")
    _, model = untrained_policy(config, generate_splits(config.tinyworld))
    stated = f"{count_parameters(model):,}"
    readme = (REPO / "README.md").read_text()
    assert re.findall(r"([\d,]+)-parameter", readme) == [stated]
    assert f"# {stated} parameters" in (REPO / "configs" / "tiny.yaml").read_text()
    assert set(re.findall(r"([\d,.]+M?)[ -]parameter", (REPO / "docs" / "tinyworld.md").read_text())) == {stated, "1.85M"}  # 1.85M: an earlier config

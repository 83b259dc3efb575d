"""The tiny world: problem generator, tokenizer, and a reduced bootstrap end to end."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import pytest

from pipeline.config.schema import FormatConfig, TinyWorldConfig
from pipeline.grading import grade
from pipeline.prompts import prompt_from_config
from pipeline.steps import encode_trajectory, join_steps
from pipeline.tinyworld.checker import (
    arithmetic_errors,
    first_wrong_step,
    num_strategies,
    solution_strategy,
    step_equations,
    strategy_names,
    strategy_of,
    valid_step_orders,
)
from pipeline.tinyworld.problems import FAMILIES, generate_splits, make_problem
from pipeline.tinyworld.stories import Event, Story

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


def example_problem():
    return make_problem(EXAMPLE, "tiny-example-00000", max_result=50, family="mixed", gold="running_total")


# Ann has 5 apples, buys 3, finds 7, gives away 2 (family gains_losses).
GAINS = Story(name=0, item=0, start=5, events=(Event(1, 3, 1, 0, 0), Event(1, 7, 1, 1, 0), Event(-1, 2, 1, 0, 0)))
# Eva has 5 books, gets 9 bags with 2 books each, gets 6 bags with 2 books each (family shared_containers).
CONTAINERS = Story(name=4, item=6, start=5, events=(Event(1, 9, 2, 2, 0), Event(1, 6, 2, 2, 0)))
STORIES = {"gains_losses": GAINS, "shared_containers": CONTAINERS, "mixed": EXAMPLE}


# ----------------------------------------------------------------------------- generator


def test_generator_is_deterministic_in_the_seed(splits):
    again = generate_splits(SMALL)
    assert {k: [p.to_json() for p in v] for k, v in again.items()} == {
        k: [p.to_json() for p in v] for k, v in splits.items()
    }
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
            assert set(problem.meta) == {"solutions", "strategies", "family", "num_ops"}
            assert problem.meta["family"] in SMALL.families
            assert len(problem.meta["strategies"]) == len(problem.meta["solutions"])
            assert set(problem.meta["strategies"]) <= set(FAMILIES[problem.meta["family"]])
            assert problem.meta["num_ops"] == len(step_equations(problem.meta["solutions"][0]))


def test_every_gold_solution_computes_and_reaches_the_answer(splits):
    for problem in all_problems(splits):
        answer = int(problem.answer)
        assert 0 <= answer <= SMALL.max_result
        assert all(int(n) <= SMALL.max_operand for n in re.findall(r"\d+", problem.question))
        solutions = valid_step_orders(problem)
        assert len(solutions) == num_strategies(problem) >= 1
        assert len({tuple(s) for s in solutions}) == len(solutions)
        for index, steps in enumerate(solutions):
            assert steps[-1] == f"The answer is {answer}"
            equations = step_equations(steps)
            assert len(equations) == len(steps) - 1  # one calculation per step
            assert arithmetic_errors(steps) == []
            for a, op, b, c in equations:
                assert APPLY[op](a, b) == c and 0 <= c <= SMALL.max_result
            assert equations[-1][3] == answer  # the last calculation is the running total
            assert first_wrong_step(problem, steps) == -1
            assert solution_strategy(problem, steps) == index
            assert strategy_of(problem, steps) == problem.meta["strategies"][index]


def test_the_gold_strategy_is_drawn_per_problem(splits):
    """Both strategies of each family are gold for about half its problems, and the question does
    not tell which: the trained policy learns to mix them."""
    train = splits["train"]
    for family in SMALL.families:
        problems = [p for p in train if p.meta["family"] == family]
        assert len(problems) > len(train) // 4
        golds = [p.meta["strategies"][0] for p in problems]
        for strategy in FAMILIES[family]:
            assert 0.35 * len(problems) < golds.count(strategy) < 0.65 * len(problems), (family, strategy)
        # nearly every problem has both strategies among its valid solutions
        assert sum(len(strategy_names(p)) == 2 for p in problems) > 0.95 * len(problems)


def test_the_gold_strategies_can_be_restricted_by_name():
    only = generate_splits(dataclasses.replace(SMALL, n_train=60, strategies=["running_total"]))
    assert {p.meta["strategies"][0] for p in only["train"]} == {"running_total"}
    assert {s for p in only["train"] for s in p.meta["strategies"]} == {
        "running_total",
        "gains_losses",
        "containers_first",
    }
    mixed = generate_splits(dataclasses.replace(SMALL, n_train=60, families=["mixed"]))
    assert {p.meta["family"] for split in mixed.values() for p in split} == {"mixed"}
    assert all(set(p.meta["strategies"]) == {"running_total"} for p in mixed["train"])


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
        [
            "Ann buys 3 * 4 = 12 apples.",
            "Ann has 5 + 12 = 17 apples.",
            "Ann has 17 - 2 = 15 apples.",
            "The answer is 15",
        ],
        ["Ann has 5 - 2 = 3 apples.", "Ann buys 3 * 4 = 12 apples.", "Ann has 3 + 12 = 15 apples.", "The answer is 15"],
    ]
    assert num_strategies(problem) == 2
    assert problem.meta["strategies"] == ["running_total", "running_total"] and strategy_names(problem) == [
        "running_total"
    ]
    # the strategy of a solution is read from its calculations, wording aside
    assert solution_strategy(problem, ["5 - 2 = 3", "3 * 4 = 12", "So 3 + 12 = 15", "The answer is 15"]) == 1
    assert (
        solution_strategy(
            problem, ["Ann buys 3 * 4 = 12 apples.", "Ann has 5 + 12 = 17 apples.", "Ann has 17 - 2 = 15 apples."]
        )
        == 0
    )
    assert (
        solution_strategy(problem, ["Ann buys 3 * 4 = 12 apples.", "Ann has 5 + 12 = 18 apples.", "The answer is 16"])
        is None
    )
    # its name: meta["strategies"] at that index, the index itself for a problem without names
    unnamed = dataclasses.replace(problem, meta={"solutions": problem.meta["solutions"]})
    assert strategy_of(unnamed, ["5 - 2 = 3", "3 * 4 = 12", "So 3 + 12 = 15", "The answer is 15"]) == "1"
    assert strategy_names(unnamed) == ["0", "1"]
    named = dataclasses.replace(problem, meta={**problem.meta, "strategies": ["narrative", "reversed"]})
    assert strategy_of(named, ["5 - 2 = 3", "3 * 4 = 12", "So 3 + 12 = 15", "The answer is 15"]) == "reversed"
    assert (
        strategy_of(named, ["Ann buys 3 * 4 = 12 apples.", "Ann has 5 + 12 = 18 apples.", "The answer is 16"]) is None
    )
    assert arithmetic_errors(["Ann has 5 + 12 = 18 apples.", "Ann buys 3 * 4 = 12 apples."]) == [
        "Ann has 5 + 12 = 18 apples."
    ]


def test_orders_that_leave_the_range_are_not_valid():
    # 5 - 6 would go below zero before the gain: only the narrative order is valid
    story = Story(name=1, item=1, start=5, events=(Event(1, 10, 1, 0, 0), Event(-1, 6, 1, 0, 0)))
    problem = make_problem(story, "tiny-example-00001", max_result=50, family="mixed", gold="running_total")
    assert valid_step_orders(problem) == [["Ben has 5 + 10 = 15 pens.", "Ben has 15 - 6 = 9 pens.", "The answer is 9"]]


TEMPLATES = {
    ("gains_losses", "running_total"): [
        "Ann has 5 + 3 = 8 apples.",
        "Ann has 8 + 7 = 15 apples.",
        "Ann has 15 - 2 = 13 apples.",
        "The answer is 13",
    ],
    ("gains_losses", "gains_losses"): [
        "Ann gets 3 + 7 = 10 apples.",
        "Ann has 5 + 10 = 15 apples.",
        "Ann has 15 - 2 = 13 apples.",
        "The answer is 13",
    ],
    ("shared_containers", "running_total"): [
        "Eva gets 9 * 2 = 18 books.",
        "Eva has 5 + 18 = 23 books.",
        "Eva gets 6 * 2 = 12 books.",
        "Eva has 23 + 12 = 35 books.",
        "The answer is 35",
    ],
    ("shared_containers", "containers_first"): [
        "Eva gets 9 + 6 = 15 bags.",
        "Eva gets 15 * 2 = 30 books.",
        "Eva has 5 + 30 = 35 books.",
        "The answer is 35",
    ],
    ("mixed", "running_total"): [
        "Ann buys 3 * 4 = 12 apples.",
        "Ann has 5 + 12 = 17 apples.",
        "Ann has 17 - 2 = 15 apples.",
        "The answer is 15",
    ],
}


@pytest.mark.parametrize("family, strategy", list(TEMPLATES))
def test_each_strategy_template_is_a_right_solution_and_the_gold_when_drawn(family, strategy):
    problem = make_problem(STORIES[family], "tiny-example-00002", max_result=50, family=family, gold=strategy)
    template = TEMPLATES[family, strategy]
    assert problem.meta["solutions"][0] == template and problem.meta["strategies"][0] == strategy
    assert problem.meta["family"] == family and problem.meta["num_ops"] == len(template) - 1
    assert template[-1] == f"The answer is {problem.answer}"
    assert first_wrong_step(problem, template) == -1
    assert strategy_of(problem, template) == strategy
    assert strategy_names(problem) == [strategy] + [s for s in FAMILIES[family] if s != strategy]
    # the other strategy's template is a right solution too, named by its strategy
    for other in FAMILIES[family]:
        assert strategy_of(problem, TEMPLATES[family, other]) == other
        assert first_wrong_step(problem, TEMPLATES[family, other]) == -1


@pytest.mark.parametrize("family, strategy", list(TEMPLATES))
def test_a_slip_in_each_template_is_located_exactly(family, strategy):
    problem = make_problem(STORIES[family], "tiny-example-00003", max_result=50, family=family, gold=strategy)
    template = TEMPLATES[family, strategy]
    for index, step in enumerate(template[:-1]):
        ((a, op, b, c),) = step_equations([step])
        for wrong in (step.replace(f"= {c}", f"= {c + 1}"), step.replace(f"{a} {op} {b}", f"{a} {op} {b + 1}")):
            slipped = template[:index] + [wrong] + template[index + 1 :]
            assert first_wrong_step(problem, slipped) == index, slipped
            assert strategy_of(problem, slipped) is None
    assert first_wrong_step(problem, template[:-1] + ["The answer is 99"]) == len(template) - 1


def test_other_correct_ways_of_writing_a_strategy_are_right():
    gains = make_problem(GAINS, "tiny-example-00004", max_result=50, family="gains_losses", gold="gains_losses")
    for steps in (
        [
            "Ann gets 7 + 3 = 10 apples.",
            "Ann has 10 + 5 = 15 apples.",
            "Ann has 15 - 2 = 13 apples.",
            "The answer is 13",
        ],  # operands swapped
        [
            "Ann gets 3 + 7 = 10 apples.",
            "Ann has 5 - 2 = 3 apples.",
            "Ann has 3 + 10 = 13 apples.",
            "The answer is 13",
        ],  # losses applied first
        [
            "Ann has 5 - 2 = 3 apples.",
            "Ann gets 3 + 7 = 10 apples.",
            "Ann has 3 + 10 = 13 apples.",
            "The answer is 13",
        ],  # summed after
    ):
        assert first_wrong_step(gains, steps) == -1 and strategy_of(gains, steps) == "gains_losses", steps
    assert (
        strategy_of(
            gains,
            [
                "Ann has 5 + 7 = 12 apples.",
                "Ann has 12 - 2 = 10 apples.",
                "Ann has 10 + 3 = 13 apples.",
                "The answer is 13",
            ],
        )
        == "running_total"
    )  # another event order
    boxes = make_problem(
        CONTAINERS, "tiny-example-00005", max_result=50, family="shared_containers", gold="running_total"
    )
    assert (
        strategy_of(
            boxes,
            [
                "Eva gets 6 + 9 = 15 bags.",
                "Eva gets 2 * 15 = 30 books.",
                "Eva has 5 + 30 = 35 books.",
                "The answer is 35",
            ],
        )
        == "containers_first"
    )
    # a strategy the world does not define (the products first, then their sum) is wrong where it leaves them
    assert (
        first_wrong_step(
            boxes, ["Eva gets 9 * 2 = 18 books.", "Eva gets 6 * 2 = 12 books.", "Eva has 18 + 12 = 30 books."]
        )
        == 1
    )


def test_a_strategy_that_does_not_solve_the_family_is_refused():
    with pytest.raises(ValueError, match="has no strategy 'containers_first'"):
        make_problem(GAINS, "tiny-example-00006", max_result=50, family="gains_losses", gold="containers_first")


def test_unknown_family_or_strategy_names_are_refused_naming_the_key(tmp_path):
    from pipeline.config.loader import ConfigError, load_config

    with pytest.raises(
        ConfigError, match=r"command line: tinyworld\.families\[1\] must be one of .*shared_containers.*got 'nope'"
    ):
        load_config(None, ["tinyworld.families=[gains_losses, nope]"])
    path = tmp_path / "c.yaml"
    path.write_text("tinyworld:\n  strategies: [running_total, sideways]\n")
    with pytest.raises(
        ConfigError, match=rf"{path}: tinyworld\.strategies\[1\] must be one of .*containers_first.*got 'sideways'"
    ):
        load_config(path)
    # names the loader accepts but that leave a family without a gold strategy, or no family at all
    with pytest.raises(
        ValueError, match=r"tinyworld\.strategies: family 'shared_containers' has none of its strategies"
    ):
        generate_splits(dataclasses.replace(SMALL, strategies=["gains_losses"]))
    with pytest.raises(ValueError, match=r"tinyworld\.families: empty"):
        generate_splits(dataclasses.replace(SMALL, families=[]))
    with pytest.raises(ValueError, match=r"tinyworld\.families\[0\]: unknown family 'x'"):
        generate_splits(dataclasses.replace(SMALL, families=["x"]))


def test_the_bootstrap_strategy_metrics_read_the_strategy_names_of_correct_samples():
    from pipeline.records import Sample
    from stages.bootstrap import strategy_metrics

    gains = make_problem(GAINS, "tiny-example-00007", max_result=50, family="gains_losses", gold="running_total")
    mixed = example_problem()  # one strategy name: not in the entropy's average
    rt, gl = TEMPLATES["gains_losses", "running_total"], TEMPLATES["gains_losses", "gains_losses"]
    wrong = ["Ann has 5 + 3 = 9 apples.", "The answer is 14"]

    def sample(problem, index, steps, correct=True):
        return Sample(
            problem_id=problem.problem_id, model="m", sample_idx=index, steps=steps, final_answer=None, correct=correct
        )

    records = [
        sample(gains, -1, gl),
        sample(gains, 0, rt),
        sample(gains, 1, gl),
        sample(gains, 2, gl),
        sample(gains, 3, wrong, False),
        sample(mixed, -1, wrong, False),
        *(sample(mixed, i, valid_step_orders(mixed)[i % 2]) for i in range(4)),
    ]
    metrics = strategy_metrics([gains, mixed], records)
    assert metrics["strategy_entropy_multi"] == pytest.approx(
        0.9183, abs=1e-4
    )  # running_total once, gains_losses twice
    assert metrics["strategy_entropy_problems"] == 1
    assert metrics["family_strategy_entropy"] == {"gains_losses": pytest.approx(0.9183, abs=1e-4)}
    assert metrics["family_accuracy"] == {
        "gains_losses": {"problems": 1, "greedy": 1.0, "sampled": 0.75},
        "mixed": {"problems": 1, "greedy": 0.0, "sampled": 1.0},
    }
    assert metrics["greedy_strategy_counts"] == {"gains_losses": 1}


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
    assert tokenizer.convert_ids_to_tokens(
        [tokenizer.pad_token_id, tokenizer.bos_token_id, tokenizer.eos_token_id]
    ) == ["<pad>", "<s>", "</s>"]
    problem = splits["test"][0]
    prompt = prompt_from_config(problem.question, problem.kind, tokenizer, FormatConfig())
    steps = valid_step_orders(problem)[0]
    segmented = encode_trajectory(tokenizer, prompt, steps, "\n")
    assert segmented.input_ids[0] == tokenizer.bos_token_id
    assert segmented.input_ids[-1] == tokenizer.eos_token_id
    # the whole text tokenizes exactly as the segments do: step boundaries are the same
    assert tokenizer(prompt + join_steps(steps))["input_ids"] + [tokenizer.eos_token_id] == segmented.input_ids
    assert tokenizer.decode(segmented.input_ids[segmented.prompt_len :], skip_special_tokens=True) == join_steps(steps)


def test_tokenizer_reloads_with_the_same_ids(splits, tokenizer, tmp_path):
    from transformers import AutoTokenizer

    from pipeline.config.schema import BootstrapConfig
    from pipeline.modeling import load_tokenizer
    from pipeline.tinyworld.model import model_config

    tokenizer.save_pretrained(tmp_path)
    model_config(BootstrapConfig(), tokenizer).save_pretrained(tmp_path)  # as beside the model
    texts = [
        prompt_from_config(p.question, p.kind, None, FormatConfig()) + join_steps(valid_step_orders(p)[0])
        for p in splits["val"]
    ]
    expected = [tokenizer(t)["input_ids"] for t in texts]
    for reloaded in (AutoTokenizer.from_pretrained(tmp_path), load_tokenizer(str(tmp_path))):
        assert [reloaded(t)["input_ids"] for t in texts] == expected
        assert (reloaded.pad_token_id, reloaded.bos_token_id, reloaded.eos_token_id) == (
            tokenizer.pad_token_id,
            tokenizer.bos_token_id,
            tokenizer.eos_token_id,
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
    assert tokenizer.decode(example.input_ids[prompt_len:], skip_special_tokens=True) == join_steps(
        problem.meta["solutions"][0]
    )
    with pytest.raises(ValueError, match="max_position_embeddings"):
        training_examples([problem], tokenizer, FormatConfig(), max_length=10)


def test_every_strategy_trains_each_strategy_template_of_a_problem(splits, tokenizer):
    from pipeline.tinyworld.checker import strategy_templates
    from pipeline.tinyworld.model import training_examples

    problem = next(p for p in splits["train"] if len(strategy_names(p)) == 2)
    examples = training_examples([problem], tokenizer, FormatConfig(), every_strategy=True)
    prompt_len = len(
        tokenizer(prompt_from_config(problem.question, problem.kind, tokenizer, FormatConfig()))["input_ids"]
    )
    texts = [tokenizer.decode(e.input_ids[prompt_len:], skip_special_tokens=True) for e in examples]
    templates = strategy_templates(problem)
    assert texts == [join_steps(steps) for steps in templates]
    assert templates[0] == problem.meta["solutions"][0]  # the gold first
    assert [strategy_of(problem, steps) for steps in templates] == strategy_names(problem)


@pytest.mark.slow
def test_reduced_bootstrap_runs_and_the_model_reloads_like_a_hub_model(tmp_path):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from stages.bootstrap import main

    argv = [
        "--config",
        str(REPO / "configs" / "tiny.yaml"),
        f"runs_root={tmp_path}",
        "run=t",
        "tinyworld.n_train=300",
        "tinyworld.n_val=10",
        "tinyworld.n_test=20",
        "tinyworld.n_rl=30",
        "bootstrap.max_train_steps=150",
        "bootstrap.hidden_size=32",
        "bootstrap.num_layers=2",
        "bootstrap.num_heads=2",
        "bootstrap.intermediate_size=64",
        "bootstrap.batch_size=16",
        "bootstrap.warmup_steps=5",
        "bootstrap.eval_problems=8",
        "bootstrap.eval_samples=2",
        "bootstrap.mc_problems=2",
        "bootstrap.mc_rollouts=2",
        "generation.max_new_tokens=48",
    ]
    metrics = main(argv)
    out = tmp_path / "t" / "bootstrap"
    for name in (
        "problems_train.jsonl",
        "problems_val.jsonl",
        "problems_test.jsonl",
        "problems_rl.jsonl",
        "metrics.json",
        "config.yaml",
    ):
        assert (out / name).is_file(), name
    assert len((out / "problems_test.jsonl").read_text().splitlines()) == 20
    assert len((out / "problems_rl.jsonl").read_text().splitlines()) == 30
    assert len((out / "problems_train.jsonl").read_text().splitlines()) == 300  # the bootstrap trains on these only
    assert json.loads((out / "metrics.json").read_text()) == metrics
    assert metrics["train_steps"] > 0 and metrics["parameters"] > 0
    for key in (
        "greedy_accuracy",
        "sampled_accuracy",
        "pass@2",
        "maj@2",
        "mc_prefixes",
        "step_arithmetic_error_rate",
        "family_accuracy",
        "strategy_entropy_multi",
        "greedy_strategy_counts",
    ):
        assert key in metrics
    assert 0.0 <= metrics["greedy_accuracy"] <= 1.0
    assert (out / "model" / "model.safetensors").is_file()

    tokenizer = AutoTokenizer.from_pretrained(out / "model")
    model = AutoModelForCausalLM.from_pretrained(out / "model")
    prompt = prompt_from_config(
        "Ann has 5 apples. She buys 3 apples. How many apples does Ann have now?", "tiny", tokenizer, FormatConfig()
    )
    inputs = tokenizer(prompt, return_tensors="pt")
    with torch.no_grad():
        generated = model.generate(**inputs, max_new_tokens=6, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    assert generated.shape[1] == inputs["input_ids"].shape[1] + 6 or generated[0, -1] == tokenizer.eos_token_id

    # a second run with the same config finds the work done and returns the same metrics
    assert main(argv) == metrics


def test_the_model_size_in_readme_and_docs_is_the_tiny_configs_model():
    """README.md, configs/tiny.yaml and docs/tinyworld.md (with docs/results/tinyworld.md) state the tiny
    policy's size; it is the count of the model bootstrap builds from configs/tiny.yaml (random init: the
    size, not the weights)."""
    from pipeline.config.loader import load_config
    from pipeline.tinyworld.bootstrap import untrained_policy
    from pipeline.tinyworld.model import count_parameters

    config = load_config(REPO / "configs" / "tiny.yaml")
    _, model = untrained_policy(config, generate_splits(config.tinyworld))
    stated = f"{count_parameters(model):,}"
    readme = (REPO / "README.md").read_text()
    assert re.findall(r"([\d,]+)-parameter", readme) == [stated]
    assert f"# {stated} parameters" in (REPO / "configs" / "tiny.yaml").read_text()
    docs = "\n".join((REPO / "docs" / page).read_text() for page in ("tinyworld.md", "results/tinyworld.md"))
    assert set(re.findall(r"([\d,.]+M?)[ -]parameter", docs)) == {
        stated,
        "1.85M",
    }  # 1.85M: an earlier config

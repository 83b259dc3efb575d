"""Synthetic multi-step arithmetic word problems with more than one valid step order.

A problem is a start amount and a list of events, each adding or removing items:

    Ann has 5 apples. She buys 3 bags with 4 apples each. She gives away 2 apples.
    How many apples does Ann have now?

An event is simple (``+n`` / ``-n``: one calculation) or grouped (``+a*b`` / ``-a*b``: two
calculations, the product and then its application). A solution applies the events to the
running total in some order, one calculation per step; a grouped event's product is computed
in the step right before it is applied. Every order of the events whose intermediate totals
stay within [0, max_result] is a valid strategy: the example has two,

    Ann buys 3 * 4 = 12 apples.          Ann has 5 - 2 = 3 apples.
    Ann has 5 + 12 = 17 apples.          Ann buys 3 * 4 = 12 apples.
    Ann has 17 - 2 = 15 apples.          Ann has 3 + 12 = 15 apples.
    The answer is 15                     The answer is 15

``meta["solutions"]`` lists every valid strategy's steps; the first is the gold solution the
base policy is trained on (the narrative order, or with probability ``swap_fraction`` another
valid order, so that the training data holds both). Operands are at most ``max_operand``,
products and running totals within [0, max_result]. Everything is deterministic in the seed.
"""

from __future__ import annotations

import itertools
import random
import re
from dataclasses import dataclass
from typing import Sequence

from pipeline.records import Problem

SOURCE = "tiny"
ANSWER_STEP = "The answer is {answer}"

NAMES = [("Ann", "She"), ("Ben", "He"), ("Cara", "She"), ("Dan", "He"), ("Eva", "She"), ("Finn", "He"),
         ("Gina", "She"), ("Hugo", "He"), ("Ivy", "She"), ("Jack", "He"), ("Kim", "She"), ("Leo", "He")]
ITEMS = ["apples", "pens", "cards", "coins", "stickers", "marbles", "books", "eggs", "shells", "stamps"]
CONTAINERS = ["bags", "boxes", "packs"]

# (question verb, step verb); {n} items, or {a} containers "with {b} items each".
GAIN_VERBS = [("buys", "buys"), ("finds", "finds"), ("gets", "gets")]
LOSS_VERBS = [("gives away", "gives away"), ("sells", "sells"), ("loses", "loses")]


@dataclass(frozen=True)
class Event:
    """One change to the amount: sign * count * size (size 1 for a simple event)."""

    sign: int  # +1 gains, -1 loses
    count: int  # n for a simple event, a (containers) for a grouped one
    size: int  # 1 for a simple event, b (items per container) for a grouped one
    verb: int  # index into GAIN_VERBS / LOSS_VERBS
    container: int  # index into CONTAINERS (grouped events)

    @property
    def grouped(self) -> bool:
        return self.size > 1

    @property
    def amount(self) -> int:
        return self.count * self.size

    @property
    def num_ops(self) -> int:
        return 2 if self.grouped else 1


@dataclass(frozen=True)
class Story:
    """The structured form of a problem: who, what, the start amount and the events in the
    order the question tells them."""

    name: int  # index into NAMES
    item: int  # index into ITEMS
    start: int
    events: tuple[Event, ...]

    @property
    def answer(self) -> int:
        return self.start + sum(e.sign * e.amount for e in self.events)

    @property
    def num_ops(self) -> int:
        return sum(e.num_ops for e in self.events)


# ----------------------------------------------------------------------------- text


def _verb(event: Event) -> tuple[str, str]:
    return (GAIN_VERBS if event.sign > 0 else LOSS_VERBS)[event.verb]


def question_text(story: Story) -> str:
    name, pronoun = NAMES[story.name]
    item = ITEMS[story.item]
    sentences = [f"{name} has {story.start} {item}."]
    for event in story.events:
        verb = _verb(event)[0]
        if event.grouped:
            sentences.append(f"{pronoun} {verb} {event.count} {CONTAINERS[event.container]} with {event.size} {item} each.")
        else:
            sentences.append(f"{pronoun} {verb} {event.count} {item}.")
    sentences.append(f"How many {item} does {name} have now?")
    return " ".join(sentences)


def solution_steps(story: Story, order: Sequence[int]) -> list[str]:
    """The steps that apply the events in ``order`` (indices into story.events)."""
    name = NAMES[story.name][0]
    item = ITEMS[story.item]
    total = story.start
    steps = []
    for index in order:
        event = story.events[index]
        amount = event.amount
        if event.grouped:
            steps.append(f"{name} {_verb(event)[1]} {event.count} * {event.size} = {amount} {item}.")
        new_total = total + event.sign * amount
        op = "+" if event.sign > 0 else "-"
        steps.append(f"{name} has {total} {op} {amount} = {new_total} {item}.")
        total = new_total
    steps.append(ANSWER_STEP.format(answer=total))
    return steps


# ----------------------------------------------------------------------------- validity


def order_is_valid(story: Story, order: Sequence[int], max_result: int) -> bool:
    """Every running total of this order stays within [0, max_result]."""
    total = story.start
    for index in order:
        event = story.events[index]
        total += event.sign * event.amount
        if not 0 <= total <= max_result:
            return False
    return True


def valid_orders(story: Story, max_result: int) -> list[tuple[int, ...]]:
    """Every order of the events (as index tuples) whose running totals stay in range,
    narrative order first when valid, the others in lexicographic order. Events that are the
    same calculation (equal sign, count and size) are interchangeable: orders that differ only
    by swapping them give identical steps and are counted once."""
    seen: set[tuple[tuple[int, int, int], ...]] = set()
    orders = []
    for order in itertools.permutations(range(len(story.events))):
        key = tuple((story.events[i].sign, story.events[i].count, story.events[i].size) for i in order)
        if key in seen or not order_is_valid(story, order, max_result):
            continue
        seen.add(key)
        orders.append(order)
    return orders


# ----------------------------------------------------------------------------- sampling


def sample_story(rng: random.Random, num_ops: int, max_operand: int, max_result: int) -> Story:
    """A story with exactly ``num_ops`` calculations whose narrative order is valid.

    The events are drawn along the narrative: a loss never exceeds the running total, a gain
    never pushes it past max_result, a product never exceeds max_result.
    """
    while True:
        start = rng.randint(1, min(max_operand, max_result))
        total, ops_left, events = start, num_ops, []
        while ops_left > 0:
            grouped = ops_left >= 2 and rng.random() < 0.5
            sign = 1 if rng.random() < 0.5 else -1
            room = max_result - total if sign > 0 else total
            if grouped:
                count = rng.randint(2, max_operand)
                max_size = min(max_operand, room // count)
                if max_size < 2:
                    break
                size = rng.randint(2, max_size)
            else:
                if room < 1:
                    break
                count, size = rng.randint(1, min(max_operand, room)), 1
            event = Event(sign, count, size, rng.randrange(len(GAIN_VERBS)), rng.randrange(len(CONTAINERS)))
            events.append(event)
            total += sign * event.amount
            ops_left -= event.num_ops
        if ops_left == 0:
            return Story(rng.randrange(len(NAMES)), rng.randrange(len(ITEMS)), start, tuple(events))


def make_problem(story: Story, problem_id: str, max_result: int, swap: bool) -> Problem:
    """The Problem of a story. Its gold solution (``meta["solutions"][0]``) applies the events in
    the order the question tells them or, with ``swap``, in the reverse order when that order is
    valid: two strategies a small model can learn to tell apart, both in the training data."""
    orders = valid_orders(story, max_result)
    reverse = tuple(reversed(orders[0]))
    if swap and reverse != orders[0] and reverse in orders:
        orders.remove(reverse)
        orders.insert(0, reverse)
    return Problem(
        problem_id=problem_id,
        question=question_text(story),
        answer=str(story.answer),
        source=SOURCE,
        meta={"solutions": [solution_steps(story, order) for order in orders], "num_ops": story.num_ops},
    )


SPLITS = ("test", "val", "train")


def generate_splits(cfg) -> dict[str, list[Problem]]:
    """train / val / test problems (a TinyWorldConfig), disjoint by question text.

    One seeded stream fills test first, then val, then train, so the test set does not change
    when n_train does. Ids are "tiny-<split>-<index:05d>".
    """
    if not 1 <= cfg.min_ops <= cfg.max_ops:
        raise ValueError(f"tinyworld: need 1 <= min_ops <= max_ops, got min_ops={cfg.min_ops} max_ops={cfg.max_ops}")
    if cfg.max_operand < 2 or cfg.max_result < 2 * cfg.max_operand:
        raise ValueError(
            f"tinyworld: need max_operand >= 2 and max_result >= 2 * max_operand, "
            f"got max_operand={cfg.max_operand} max_result={cfg.max_result}"
        )
    rng = random.Random(cfg.seed)
    sizes = {"test": cfg.n_test, "val": cfg.n_val, "train": cfg.n_train}
    seen: set[str] = set()
    splits: dict[str, list[Problem]] = {}
    attempts_left = 50 * sum(sizes.values()) + 1000
    for split in SPLITS:
        problems: list[Problem] = []
        while len(problems) < sizes[split]:
            attempts_left -= 1
            if attempts_left < 0:
                raise ValueError(
                    f"tinyworld: could not draw {sizes[split]} distinct {split} problems; "
                    "widen max_operand / max_result / the ops range or ask for fewer"
                )
            story = sample_story(rng, rng.randint(cfg.min_ops, cfg.max_ops), cfg.max_operand, cfg.max_result)
            swap = rng.random() < cfg.swap_fraction
            problem = make_problem(story, f"tiny-{split}-{len(problems):05d}", cfg.max_result, swap)
            if problem.question in seen:
                continue
            seen.add(problem.question)
            problems.append(problem)
        splits[split] = problems
    return {split: splits[split] for split in ("train", "val", "test")}


# ----------------------------------------------------------------------------- strategies

_EQUATION = re.compile(r"(\d+)\s*([-+*])\s*(\d+)\s*=\s*(\d+)")


def step_equations(steps: Sequence[str]) -> tuple[tuple[int, str, int, int], ...]:
    """The calculations ``(a, op, b, c)`` written in a list of steps, in order."""
    found = []
    for step in steps:
        for a, op, b, c in _EQUATION.findall(step):
            found.append((int(a), op, int(b), int(c)))
    return tuple(found)


def valid_step_orders(problem: Problem) -> list[list[str]]:
    """Every valid strategy's steps (the first is the gold solution)."""
    return [list(steps) for steps in problem.meta["solutions"]]


def num_strategies(problem: Problem) -> int:
    """How many distinct valid strategies (step orders) a problem has."""
    return len(problem.meta["solutions"])


def solution_strategy(problem: Problem, steps: Sequence[str]) -> int | None:
    """Index (into valid_step_orders) of the strategy whose calculations ``steps`` carry out,
    wording aside; None when they match none (a wrong or unfinished solution)."""
    equations = step_equations(steps)
    for index, solution in enumerate(problem.meta["solutions"]):
        if step_equations(solution) == equations:
            return index
    return None


def strategy_of(problem: Problem, steps: Sequence[str]) -> str | None:
    """The name of the strategy a solution carries out (``meta["strategies"]`` at the index
    solution_strategy finds; the index as a string for a problem without names), None when it
    matches no valid solution."""
    index = solution_strategy(problem, steps)
    if index is None:
        return None
    names = problem.meta.get("strategies")
    return str(names[index]) if names else str(index)


def arithmetic_errors(steps: Sequence[str]) -> list[str]:
    """The steps that write a wrong calculation (``a op b = c`` with c not its value)."""
    apply = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}
    return [step for step in steps if any(apply[op](a, b) != c for a, op, b, c in step_equations([step]))]


def first_wrong_step(problem: Problem, steps: Sequence[str]) -> int:
    """Index of the first wrong step of a solution to a tiny-world problem, or -1 when none is
    (ProcessBench's label), exact because the world knows every valid strategy:

    - a step that writes calculations is right while the calculations written so far are the
      start of some valid strategy's (a wrong result, a wrong operand or an order no strategy
      takes is wrong; wording aside, as in solution_strategy);
    - a step without a calculation is right when it is ``The answer is <the answer>``.

        problem with valid strategies [(3*4=12, 5+12=17, 17-2=15), (5-2=3, 3*4=12, 3+12=15)], answer 15
        ["Ann has 5 - 2 = 3 apples.", "Ann buys 3 * 4 = 13 apples.", ...]  ->  1
        ["Ann buys 3 * 4 = 12 apples.", "Ann has 5 + 12 = 17 apples.", "The answer is 17"]  ->  2
    """
    strategies = [step_equations(solution) for solution in problem.meta["solutions"]]
    written: tuple = ()
    for index, step in enumerate(steps):
        equations = step_equations([step])
        if equations:
            written += equations
            if not any(strategy[: len(written)] == written for strategy in strategies):
                return index
        elif step.strip() != ANSWER_STEP.format(answer=problem.answer):
            return index
    return -1


def corrected_step(step: str) -> str | None:
    """The step with the result of each wrong calculation (``a op b = c``, c not its value)
    replaced by the right value, everything else kept; None when no calculation in it is wrong.

        "Ann has 5 + 3 = 9 apples."  ->  "Ann has 5 + 3 = 8 apples."
    """
    apply = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}
    pieces, end = [], 0
    for match in _EQUATION.finditer(step):
        a, op, b, c = match.groups()
        value = apply[op](int(a), int(b))
        if value != int(c):
            pieces += [step[end : match.start(4)], str(value)]
            end = match.end(4)
    return None if not pieces else "".join(pieces) + step[end:]

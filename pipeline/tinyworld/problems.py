"""Synthetic multi-step arithmetic word problems whose correct solutions follow different strategies.

A problem is a start amount and a list of events, each adding or removing items:

    Ann has 5 apples. She buys 3 apples. She finds 7 apples. She gives away 2 apples.
    How many apples does Ann have now?

An event is simple (``+n`` / ``-n``) or grouped (``+a*b`` / ``-a*b``: ``a`` containers with
``b`` items each). Every problem belongs to a *family* (``FAMILIES``), which fixes how its
events are drawn and which *strategies* solve it; each strategy is a fixed step template, one
calculation ``a op b = c`` per step, ending with ``The answer is N``:

- ``running_total`` (every family): apply the events to the running total one at a time; a
  grouped event's product is computed in the step right before it is applied.
- ``gains_losses`` (family ``gains_losses``: simple events, at least two gains or two losses):
  sum the gains, sum the losses, then start + gains - losses.
- ``containers_first`` (family ``shared_containers``: two grouped events with the same sign and
  container size): add the container counts, multiply once, apply.

    running_total                    gains_losses
    Ann has 5 + 3 = 8 apples.        Ann gets 3 + 7 = 10 apples.
    Ann has 8 + 7 = 15 apples.       Ann has 5 + 10 = 15 apples.
    Ann has 15 - 2 = 13 apples.      Ann has 15 - 2 = 13 apples.
    The answer is 13                 The answer is 13

The gold solution (``meta["solutions"][0]``, what the base policy is trained on) is one
strategy's template, the strategy drawn per problem from the seeded stream, independently of the
question text, so the trained policy mixes strategies. ``meta["solutions"]`` also lists every
other solution a correct reasoner could write with the family's strategies (the running total in
every valid event order, the other strategies' sums in any order and with the two totals applied
in either order), ``meta["strategies"]`` their strategy names, ``meta["family"]`` the family.
Calculations are compared up to the order of the operands of + and * (``3 + 7 = 10`` is
``7 + 3 = 10``). Operands are at most ``max_operand``, products and every intermediate result
within [0, max_result]. Everything is deterministic in the seed.
"""

from __future__ import annotations

import itertools
import random
import re
import typing
from collections.abc import Sequence
from dataclasses import dataclass

from pipeline.config.schema import TinyFamily, TinyStrategy
from pipeline.records import Problem

SOURCE = "tiny"
ANSWER_STEP = "The answer is {answer}"

# family -> the strategies that solve its problems, running_total first (every family has it)
FAMILIES: dict[str, tuple[str, ...]] = {
    "gains_losses": ("running_total", "gains_losses"),
    "shared_containers": ("running_total", "containers_first"),
    "mixed": ("running_total",),
}
STRATEGIES = tuple(dict.fromkeys(s for strategies in FAMILIES.values() for s in strategies))
assert set(FAMILIES) == set(typing.get_args(TinyFamily)) and set(STRATEGIES) == set(typing.get_args(TinyStrategy))

NAMES = [
    ("Ann", "She"),
    ("Ben", "He"),
    ("Cara", "She"),
    ("Dan", "He"),
    ("Eva", "She"),
    ("Finn", "He"),
    ("Gina", "She"),
    ("Hugo", "He"),
    ("Ivy", "She"),
    ("Jack", "He"),
    ("Kim", "She"),
    ("Leo", "He"),
]
ITEMS = ["apples", "pens", "cards", "coins", "stickers", "marbles", "books", "eggs", "shells", "stamps"]
CONTAINERS = ["bags", "boxes", "packs"]

# (question verb, step verb); {n} items, or {a} containers "with {b} items each".
GAIN_VERBS = [("buys", "buys"), ("finds", "finds"), ("gets", "gets")]
LOSS_VERBS = [("gives away", "gives away"), ("sells", "sells"), ("loses", "loses")]
# the verb of a step that sums several gains (or losses, or their containers)
SUM_VERBS = {1: "gets", -1: "loses"}


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
            sentences.append(
                f"{pronoun} {verb} {event.count} {CONTAINERS[event.container]} with {event.size} {item} each."
            )
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


# ----------------------------------------------------------------------------- strategies' solutions
#
# Each function returns the strategy's solutions of a story, its template (the gold solution
# when the strategy is drawn) first; an empty list when the strategy does not apply.


def running_total_solutions(story: Story, max_result: int, template_only: bool = False) -> list[list[str]]:
    """The events applied one at a time, in every valid order. Template: the narrative order."""
    if template_only:
        narrative = tuple(range(len(story.events)))
        return [solution_steps(story, narrative)] if order_is_valid(story, narrative, max_result) else []
    return [solution_steps(story, order) for order in valid_orders(story, max_result)]


def _sum_steps(name: str, sign: int, terms: Sequence[int], word: str) -> tuple[list[str], int]:
    """Steps adding ``terms`` left to right ("Ann gets 3 + 7 = 10 apples."), and their sum."""
    steps, total = [], terms[0]
    for term in terms[1:]:
        steps.append(f"{name} {SUM_VERBS[sign]} {total} + {term} = {total + term} {word}.")
        total += term
    return steps, total


def _apply(name: str, item: str, total: int, sign: int, amount: int, max_result: int) -> tuple[str, int] | None:
    """The step applying ``sign * amount`` to ``total`` and the new total; None out of range."""
    new_total = total + sign * amount
    if not 0 <= new_total <= max_result:
        return None
    return f"{name} has {total} {'+' if sign > 0 else '-'} {amount} = {new_total} {item}.", new_total


def _orderings(terms: Sequence[int]) -> list[tuple[int, ...]]:
    """The distinct orders of a list of terms, the given order first."""
    return list(dict.fromkeys(itertools.permutations(terms)))


def gains_losses_solutions(story: Story, max_result: int, template_only: bool = False) -> list[list[str]]:
    """Sum the gains, sum the losses, then combine (simple events; at least two gains or two losses).

    Template: the gains summed in narrative order, then the losses, then start + gains - losses.
    Also valid: the sums in any term order, either sum first, the two totals applied in either
    order (each running total in range), and each total applied right after it is summed.
    """
    if any(e.grouped for e in story.events):
        return []
    blocks = [(sign, [e.count for e in story.events if e.sign == sign]) for sign in (1, -1)]
    blocks = [(sign, terms) for sign, terms in blocks if terms]
    if max(len(terms) for _, terms in blocks) < 2:
        return []
    name, item = NAMES[story.name][0], ITEMS[story.item]
    solutions = []
    all_chains = list(itertools.product(*[_orderings(terms) for _, terms in blocks]))
    for chains in all_chains[:1] if template_only else all_chains:
        summed = [(sign, *_sum_steps(name, sign, chain, item)) for (sign, _), chain in zip(blocks, chains)]
        plans = []  # (blocks in the order they are summed, in the order they are applied, interleaved)
        for sum_order in itertools.permutations(range(len(summed))):
            plans += [(sum_order, apply_order, False) for apply_order in itertools.permutations(range(len(summed)))]
            plans.append((sum_order, sum_order, True))
        for sum_order, apply_order, interleaved in plans[:1] if template_only else plans:
            steps, total = [], story.start
            if not interleaved:
                steps = [step for b in sum_order for step in summed[b][1]]
            for b in apply_order:
                sign, sum_steps, amount = summed[b]
                applied = _apply(name, item, total, sign, amount, max_result)
                if applied is None:
                    break
                steps += (sum_steps if interleaved else []) + [applied[0]]
                total = applied[1]
            else:
                solutions.append(steps + [ANSWER_STEP.format(answer=total)])
    return solutions


def _shared_group(story: Story) -> list[int]:
    """Indices of the grouped events when there are at least two and they share sign and size."""
    grouped = [i for i, e in enumerate(story.events) if e.grouped]
    if len(grouped) < 2 or len({(story.events[i].sign, story.events[i].size) for i in grouped}) != 1:
        return []
    return grouped


def containers_first_solutions(story: Story, max_result: int, template_only: bool = False) -> list[list[str]]:
    """Add the container counts of the grouped events (when they share sign and container size),
    multiply once, apply (``Ann gets 3 + 2 = 5 boxes.``, ``Ann gets 5 * 4 = 20 pens.``,
    ``Ann has 5 + 20 = 25 pens.``).

    Template: the counts in narrative order, the merged event applied where the first grouped
    event is told. Also valid: the counts in any order, the merged event and the other events
    applied in any valid order (the merged event's sum and product right before it is applied).
    """
    grouped = _shared_group(story)
    if not grouped:
        return []
    name, item = NAMES[story.name][0], ITEMS[story.item]
    first = story.events[grouped[0]]
    word = CONTAINERS[first.container]
    merged = -1  # stands for the merged event in an order
    units = [merged if i == grouped[0] else i for i in range(len(story.events)) if i not in grouped[1:]]
    chains = _orderings([story.events[i].count for i in grouped])
    orders = list(dict.fromkeys(itertools.permutations(units)))
    solutions = []
    for chain, order in (
        itertools.product(chains[:1], orders[:1]) if template_only else itertools.product(chains, orders)
    ):
        count_steps, count = _sum_steps(name, first.sign, chain, word)
        product = f"{name} {SUM_VERBS[first.sign]} {count} * {first.size} = {count * first.size} {item}."
        steps, total = [], story.start
        for unit in order:
            if unit == merged:
                sign, amount, before = first.sign, count * first.size, count_steps + [product]
            else:
                event = story.events[unit]
                sign, amount = event.sign, event.amount
                before = (
                    [f"{name} {_verb(event)[1]} {event.count} * {event.size} = {amount} {item}."]
                    if event.grouped
                    else []
                )
            applied = _apply(name, item, total, sign, amount, max_result)
            if applied is None:
                break
            steps += before + [applied[0]]
            total = applied[1]
        else:
            solutions.append(steps + [ANSWER_STEP.format(answer=total)])
    return solutions


STRATEGY_SOLUTIONS = {
    "running_total": running_total_solutions,
    "gains_losses": gains_losses_solutions,
    "containers_first": containers_first_solutions,
}
assert set(STRATEGY_SOLUTIONS) == set(STRATEGIES)


# ----------------------------------------------------------------------------- sampling

_MAX_TRIES = 10_000


def sample_story(rng: random.Random, num_ops: int, max_operand: int, max_result: int) -> Story:
    """Family ``mixed``: simple and grouped events of either sign, exactly ``num_ops``
    calculations, the narrative order valid.

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


def sample_gains_losses(rng: random.Random, num_ops: int, max_operand: int, max_result: int) -> Story:
    """Family ``gains_losses``: ``num_ops`` simple events (one calculation each in either
    strategy), at least two gains or two losses; drawn along the narrative (valid), and start +
    all gains within max_result (the template's order valid)."""
    for _ in range(_MAX_TRIES):
        start = rng.randint(1, min(max_operand, max_result))
        total, events = start, []
        for _ in range(num_ops):
            sign = 1 if rng.random() < 0.5 else -1
            room = max_result - total if sign > 0 else total
            if room < 1:
                break
            count = rng.randint(1, min(max_operand, room))
            events.append(Event(sign, count, 1, rng.randrange(len(GAIN_VERBS)), 0))
            total += sign * count
        gains = [e.count for e in events if e.sign > 0]
        if len(events) == num_ops and max(len(gains), num_ops - len(gains)) >= 2 and start + sum(gains) <= max_result:
            return Story(rng.randrange(len(NAMES)), rng.randrange(len(ITEMS)), start, tuple(events))
    raise ValueError(
        f"tinyworld: could not draw a gains_losses problem with {num_ops} events within "
        f"max_operand={max_operand}, max_result={max_result}"
    )


def sample_shared_containers(rng: random.Random, num_ops: int, max_operand: int, max_result: int) -> Story:
    """Family ``shared_containers``: two grouped events with the same sign, container and size
    (``She buys 3 boxes with 4 pens each. She finds 2 boxes with 4 pens each.``) and
    max(0, num_ops - 3) simple events told anywhere among them: the containers-first solution
    has max(num_ops, 3) calculations, the running total one more. Both templates valid, every
    product within max_result."""
    for _ in range(_MAX_TRIES):
        start = rng.randint(1, min(max_operand, max_result))
        sign = 1 if rng.random() < 0.5 else -1
        size = rng.randint(2, max(2, min(max_operand, max_result // 4)))
        container = rng.randrange(len(CONTAINERS))
        first = rng.randint(2, max(2, min(max_operand, max_result // size - 2)))
        second = rng.randint(2, max(2, min(max_operand, max_result // size - first)))
        events = [Event(sign, count, size, rng.randrange(len(GAIN_VERBS)), container) for count in (first, second)]
        for _ in range(max(0, num_ops - 3)):
            simple_sign = 1 if rng.random() < 0.5 else -1
            event = Event(simple_sign, rng.randint(1, max_operand), 1, rng.randrange(len(GAIN_VERBS)), 0)
            events.insert(rng.randint(0, len(events)), event)
        story = Story(rng.randrange(len(NAMES)), rng.randrange(len(ITEMS)), start, tuple(events))
        if (
            (first + second) * size <= max_result
            and order_is_valid(story, range(len(events)), max_result)
            and containers_first_solutions(story, max_result, template_only=True)
        ):
            return story
    raise ValueError(
        f"tinyworld: could not draw a shared_containers problem within max_operand={max_operand}, "
        f"max_result={max_result} (two grouped events of at least 2 containers of at least 2 items need max_result >= 8)"
    )


SAMPLERS = {"gains_losses": sample_gains_losses, "shared_containers": sample_shared_containers, "mixed": sample_story}
assert set(SAMPLERS) == set(FAMILIES)


def _calculation_key(equation: tuple[int, str, int, int]) -> tuple[int, str, int, int]:
    """A calculation up to the order of the operands of + and * (3 + 7 = 10 is 7 + 3 = 10)."""
    a, op, b, c = equation
    return (min(a, b), op, max(a, b), c) if op in "+*" else equation


def _calculations(steps: Sequence[str]) -> tuple:
    return tuple(_calculation_key(e) for e in step_equations(steps))


def make_problem(story: Story, problem_id: str, max_result: int, family: str, gold: str) -> Problem:
    """The Problem of a story of ``family`` whose gold solution is strategy ``gold``'s template.

    ``meta["solutions"]``: the gold template, then the family's other strategies' templates,
    then every other solution of each strategy; a solution whose calculations (up to operand
    order) repeat an earlier one is left out. ``meta["strategies"]`` names each one's strategy.
    """
    if gold not in FAMILIES[family]:
        raise ValueError(
            f"tinyworld: family {family!r} has no strategy {gold!r} (its strategies: {', '.join(FAMILIES[family])})"
        )
    template = STRATEGY_SOLUTIONS[gold](story, max_result, template_only=True)
    if not template:
        raise ValueError(f"tinyworld: strategy {gold!r} has no valid template for {question_text(story)!r}")
    others = [s for s in FAMILIES[family] if s != gold]
    every = {s: STRATEGY_SOLUTIONS[s](story, max_result) for s in FAMILIES[family]}
    candidates = [(gold, template[0])] + [(s, every[s][0]) for s in others if every[s]]
    candidates += [(s, steps) for s in [gold] + others for steps in every[s]]
    solutions, strategies, seen = [], [], set()
    for strategy, steps in candidates:
        key = _calculations(steps)
        if key not in seen:
            seen.add(key)
            solutions.append(steps)
            strategies.append(strategy)
    return Problem(
        problem_id=problem_id,
        question=question_text(story),
        answer=str(story.answer),
        source=SOURCE,
        meta={
            "solutions": solutions,
            "strategies": strategies,
            "family": family,
            "num_ops": len(step_equations(solutions[0])),
        },
    )


# The order the one seeded stream fills the splits in: the held-out ones first (evaluation's,
# then the reinforcement-learning problems), the bootstrap's training problems last.
SPLITS = ("test", "val", "rl", "train")


def drawn_strategies(cfg) -> dict[str, list[str]]:
    """family -> the strategies its gold solutions are drawn from (those of tinyworld.strategies
    that solve it); ValueError naming the key when a family gets none or no family is listed."""
    if not cfg.families:
        raise ValueError(f"tinyworld.families: empty; known: {', '.join(FAMILIES)}")
    drawn = {}
    for index, family in enumerate(cfg.families):
        if family not in FAMILIES:
            raise ValueError(f"tinyworld.families[{index}]: unknown family {family!r}; known: {', '.join(FAMILIES)}")
        drawn[family] = [s for s in FAMILIES[family] if s in cfg.strategies]
        if not drawn[family]:
            raise ValueError(
                f"tinyworld.strategies: family {family!r} has none of its strategies ({', '.join(FAMILIES[family])}) "
                f"listed, got {list(cfg.strategies)}"
            )
    for index, strategy in enumerate(cfg.strategies):
        if strategy not in STRATEGIES:
            raise ValueError(
                f"tinyworld.strategies[{index}]: unknown strategy {strategy!r}; known: {', '.join(STRATEGIES)}"
            )
    return drawn


def generate_splits(cfg) -> dict[str, list[Problem]]:
    """train / val / test / rl problems (a TinyWorldConfig), disjoint by question text: the
    bootstrap trains on train; rl is what the stages after it (mcts, gfn, ppo) draw from.

    One seeded stream fills test first, then val, then rl, then train, so a split does not change
    when the size of a split drawn after it does (test and val never with n_rl or n_train, rl
    never with n_train). Per problem it draws the family (uniformly from tinyworld.families), the
    number of calculations, the story, and the gold strategy (uniformly from the family's
    strategies in tinyworld.strategies). Ids are "tiny-<split>-<index:05d>".
    """
    if not 1 <= cfg.min_ops <= cfg.max_ops:
        raise ValueError(f"tinyworld: need 1 <= min_ops <= max_ops, got min_ops={cfg.min_ops} max_ops={cfg.max_ops}")
    if cfg.max_operand < 2 or cfg.max_result < 2 * cfg.max_operand:
        raise ValueError(
            f"tinyworld: need max_operand >= 2 and max_result >= 2 * max_operand, "
            f"got max_operand={cfg.max_operand} max_result={cfg.max_result}"
        )
    drawn = drawn_strategies(cfg)
    rng = random.Random(cfg.seed)
    sizes = {"test": cfg.n_test, "val": cfg.n_val, "rl": cfg.n_rl, "train": cfg.n_train}
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
            family = rng.choice(cfg.families)
            story = SAMPLERS[family](rng, rng.randint(cfg.min_ops, cfg.max_ops), cfg.max_operand, cfg.max_result)
            gold = rng.choice(drawn[family])
            problem = make_problem(story, f"tiny-{split}-{len(problems):05d}", cfg.max_result, family, gold)
            if problem.question in seen:
                continue
            seen.add(problem.question)
            problems.append(problem)
        splits[split] = problems
    return {split: splits[split] for split in ("train", "val", "test", "rl")}


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
    """Every valid solution's steps (the first is the gold solution)."""
    return [list(steps) for steps in problem.meta["solutions"]]


def num_strategies(problem: Problem) -> int:
    """How many distinct valid solutions (step orders of the problem's strategies) a problem has."""
    return len(problem.meta["solutions"])


def strategy_names(problem: Problem) -> list[str]:
    """The distinct strategy names of a problem's valid solutions, in order of first appearance
    (each solution index as its own name for a problem without ``meta["strategies"]``)."""
    names = problem.meta.get("strategies") or [str(i) for i in range(len(problem.meta["solutions"]))]
    return list(dict.fromkeys(map(str, names)))


def strategy_templates(problem: Problem) -> list[list[str]]:
    """The first listed solution of each strategy name: the gold, then the other strategies'
    templates (make_problem lists them right after the gold)."""
    names = problem.meta.get("strategies") or [str(i) for i in range(len(problem.meta["solutions"]))]
    first: dict[str, list[str]] = {}
    for name, steps in zip(map(str, names), problem.meta["solutions"]):
        first.setdefault(name, list(steps))
    return list(first.values())


def solution_strategy(problem: Problem, steps: Sequence[str]) -> int | None:
    """Index (into valid_step_orders) of the solution whose calculations ``steps`` carry out,
    wording and the order of the operands of + and * aside; None when they match none (a wrong
    or unfinished solution)."""
    calculations = _calculations(steps)
    for index, solution in enumerate(problem.meta["solutions"]):
        if _calculations(solution) == calculations:
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
      start of some valid solution's (a wrong result, a wrong operand or an order no strategy
      takes is wrong; wording and the operand order of + and * aside, as in solution_strategy);
    - a step without a calculation is right when it is ``The answer is <the answer>``.

        problem with valid solutions [(3*4=12, 5+12=17, 17-2=15), (5-2=3, 3*4=12, 3+12=15)], answer 15
        ["Ann has 5 - 2 = 3 apples.", "Ann buys 3 * 4 = 13 apples.", ...]  ->  1
        ["Ann buys 3 * 4 = 12 apples.", "Ann has 5 + 12 = 17 apples.", "The answer is 17"]  ->  2
    """
    strategies = [_calculations(solution) for solution in problem.meta["solutions"]]
    written: tuple = ()
    for index, step in enumerate(steps):
        equations = _calculations([step])
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

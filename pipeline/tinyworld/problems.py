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

The world is one module per idea: ``stories`` (events, stories, question text), ``solutions``
(each strategy's solutions), ``sampling`` (a family's stories from the seeded stream), ``checker``
(a solution against the problem's valid ones); this module makes problems and splits of them.
"""

from __future__ import annotations

import random
import typing

from pipeline.config.schema import TinyFamily, TinyStrategy
from pipeline.records import Problem
from pipeline.tinyworld.checker import calculations_up_to_order, step_equations
from pipeline.tinyworld.sampling import SAMPLERS
from pipeline.tinyworld.solutions import STRATEGY_SOLUTIONS
from pipeline.tinyworld.stories import Story, question_text

SOURCE = "tiny"

# family -> the strategies that solve its problems, running_total first (every family has it)
FAMILIES: dict[str, tuple[str, ...]] = {
    "gains_losses": ("running_total", "gains_losses"),
    "shared_containers": ("running_total", "containers_first"),
    "mixed": ("running_total",),
}
STRATEGIES = tuple(dict.fromkeys(s for strategies in FAMILIES.values() for s in strategies))
assert set(FAMILIES) == set(typing.get_args(TinyFamily)) and set(STRATEGIES) == set(typing.get_args(TinyStrategy))
assert set(STRATEGY_SOLUTIONS) == set(STRATEGIES)
assert set(SAMPLERS) == set(FAMILIES)


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
        key = calculations_up_to_order(steps)
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

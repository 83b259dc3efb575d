"""The solutions each strategy writes for a story (the strategies: pipeline.tinyworld.problems).

Every solution is a fixed step template, one calculation ``a op b = c`` per step, ending with
``The answer is N``; a solution is valid when every running total stays within [0, max_result].
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

from pipeline.tinyworld.stories import ANSWER_STEP, CONTAINERS, ITEMS, NAMES, SUM_VERBS, Story, event_verbs


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
            steps.append(f"{name} {event_verbs(event)[1]} {event.count} * {event.size} = {amount} {item}.")
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
                    [f"{name} {event_verbs(event)[1]} {event.count} * {event.size} = {amount} {item}."]
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

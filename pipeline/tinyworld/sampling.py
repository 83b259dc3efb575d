"""Drawing a family's stories from the seeded stream (the families: pipeline.tinyworld.problems).

Each sampler draws in a fixed order from the ``random.Random`` it is given, so a seed gives the
same stories.
"""

from __future__ import annotations

import random

from pipeline.tinyworld.solutions import containers_first_solutions, order_is_valid
from pipeline.tinyworld.stories import CONTAINERS, GAIN_VERBS, ITEMS, NAMES, Event, Story

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

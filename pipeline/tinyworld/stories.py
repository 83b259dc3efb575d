"""The tiny world's stories: the structured form of a problem and its question text.

A problem is a start amount and a list of events, each adding or removing items:

    Ann has 5 apples. She buys 3 apples. She finds 7 apples. She gives away 2 apples.
    How many apples does Ann have now?

An event is simple (``+n`` / ``-n``) or grouped (``+a*b`` / ``-a*b``: ``a`` containers with
``b`` items each). Names, items, containers and verbs are drawn by index from the lists below.
"""

from __future__ import annotations

from dataclasses import dataclass

ANSWER_STEP = "The answer is {answer}"

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


def event_verbs(event: Event) -> tuple[str, str]:
    """(question verb, step verb) of an event."""
    return (GAIN_VERBS if event.sign > 0 else LOSS_VERBS)[event.verb]


def question_text(story: Story) -> str:
    name, pronoun = NAMES[story.name]
    item = ITEMS[story.item]
    sentences = [f"{name} has {story.start} {item}."]
    for event in story.events:
        verb = event_verbs(event)[0]
        if event.grouped:
            sentences.append(
                f"{pronoun} {verb} {event.count} {CONTAINERS[event.container]} with {event.size} {item} each."
            )
        else:
            sentences.append(f"{pronoun} {verb} {event.count} {item}.")
    sentences.append(f"How many {item} does {name} have now?")
    return " ".join(sentences)

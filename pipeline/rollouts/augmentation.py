"""Similarity-grouped augmentation: PRM training data from MCTS records (paper 3.2, Figure 1).

Each MCTS record is one evaluated step s with its prefix P, its Monte Carlo value mc_value and
the k rollouts that estimated it, each a continuation r_1..r_n of P + [s]. Besides the record's
own example (P, s, mc_value), every rollout step is reused:

1. Candidates. Rollout i's step r_j becomes the candidate (P + [s] + r_1..r_{j-1}, r_j).
2. Groups. Within one record, the candidates at the same position j are clustered greedily
   with complete linkage: a step joins the first group in which it is consistent with EVERY
   member (equal calculation signatures and a Levenshtein ratio >= ``threshold``,
   ``pipeline.rollouts.similarity.steps_consistent``), else it founds a new group.
3. Labels. A group whose members all come from correct rollouts is labelled 1, all from
   incorrect rollouts 0, a mixture the record's mc_value. Once a rollout has a step labelled 0,
   its later steps are dropped before they are grouped: they build on an error.

A record with mc_value 0 is a first error (paper, Algorithm 1): it is one example labelled 0 and
its rollouts are not reused, since every step of them comes after the error.

Cost: a bucket of k candidates takes at most k(k-1)/2 consistency tests (a candidate is tested
against at most every candidate before it, each of which sits in one group); buckets never mix
records or positions, so the whole run is O(sum over records of k^2 * rollout length), never all
pairs of the data set. Every decision is in docs/augmentation.md.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections import Counter, defaultdict
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

from pipeline.records import ORIGIN_AUGMENTED, ORIGIN_MCTS, MCTSRecord, PRMExample
from pipeline.rollouts.similarity import CalculationSignature, StepSignature, step_signature, steps_consistent

DEFAULT_SIMILARITY_THRESHOLD = 0.85

# Paper 3.2: about 30% of the labels are 0, 20% are 1, 50% lie in between, and 100k MCTS
# records become 2.1M PRM examples. For comparison in reports, never asserted.
PAPER_REFERENCE = {"zero": 0.30, "between": 0.50, "one": 0.20, "expansion_factor": 21.0}


@dataclass(frozen=True)
class Candidate:
    """One rollout step offered as a PRM example.

    prefix_steps:    P + [s] + r_1..r_{j-1} (the record's prefix, its step, the rollout so far)
    step:            r_j
    position:        j, 1-based position of the step inside its rollout
    rollout_index:   i, 0-based index into the record's rollouts
    rollout_correct: whether rollout i reached the correct final answer
    """

    prefix_steps: tuple[str, ...]
    step: str
    position: int
    rollout_index: int
    rollout_correct: bool


def rollout_reuse_candidates(record: MCTSRecord) -> list[Candidate]:
    """Every step of every rollout of an MCTS record, in rollout order then position order."""
    state = (*record.prefix_steps, record.step)
    candidates = []
    for rollout_index, rollout in enumerate(record.rollouts):
        steps = rollout.steps
        for position, step in enumerate(steps, start=1):
            candidates.append(
                Candidate(
                    prefix_steps=state + tuple(steps[: position - 1]),
                    step=step,
                    position=position,
                    rollout_index=rollout_index,
                    rollout_correct=rollout.correct,
                )
            )
    return candidates


@dataclass
class StepGroup:
    """Consistent rollout steps at one position of one record, sharing one label.

    position:    j, the rollout position of every member
    index:       g, the group's rank among the groups of its (record, position), by creation
    members:     candidates in rollout order, every pair of them consistent (``steps_consistent``)
    label:       1.0, 0.0 or the record's mc_value (``group_label``)
    """

    position: int
    index: int
    members: list[Candidate]
    label: float


def greedy_similarity_groups(
    candidates: Sequence[Candidate], threshold: float = DEFAULT_SIMILARITY_THRESHOLD
) -> list[list[Candidate]]:
    """Greedy complete-linkage clustering of one bucket: each candidate, in order, joins the
    first group in which it is consistent with every member (``steps_consistent``: equal
    calculation signatures and Levenshtein ratio >= threshold), else founds a new group; so
    every pair inside a group is consistent.

    Cost for k candidates: k signatures, and at most k(k-1)/2 consistency tests -- a candidate
    is tested against at most every candidate before it, each a member of one group; only the
    groups of its own calculation signature are tried (a dict lookup), the others could not
    take it. Each test is one signature comparison and one Levenshtein ratio.
    """
    groups: list[list[Candidate]] = []
    member_signatures: list[list[StepSignature]] = []
    groups_by_calculation: dict[CalculationSignature, list[int]] = defaultdict(list)
    for candidate in candidates:
        signature = step_signature(candidate.step)
        same_calculation = groups_by_calculation[signature.calculation]
        for index in same_calculation:
            if all(steps_consistent(member, signature, threshold) for member in member_signatures[index]):
                groups[index].append(candidate)
                member_signatures[index].append(signature)
                break
        else:
            same_calculation.append(len(groups))
            groups.append([candidate])
            member_signatures.append([signature])
    return groups


def group_label(members: Sequence[Candidate], mc_value: float) -> float:
    """1.0 when every member's rollout is correct, 0.0 when none is, else mc_value."""
    n_correct = sum(member.rollout_correct for member in members)
    if n_correct == len(members):
        return 1.0
    if n_correct == 0:
        return 0.0
    return float(mc_value)


def label_rollout_steps(record: MCTSRecord, threshold: float = DEFAULT_SIMILARITY_THRESHOLD) -> list[StepGroup]:
    """The labelled groups of one MCTS record, position by position.

    A record with mc == 0 is a first error: its rollouts continue from an error, so none of
    their steps is labelled (no groups). Otherwise a rollout stops contributing after its first
    step labelled 0: its later steps are dropped before their position is grouped, so they
    neither become examples nor sway other labels.
    """
    if record.mc == 0.0:
        return []
    by_position: dict[int, list[Candidate]] = defaultdict(list)
    for candidate in rollout_reuse_candidates(record):
        by_position[candidate.position].append(candidate)
    failed_rollouts: set[int] = set()
    labelled: list[StepGroup] = []
    for position in sorted(by_position):
        alive = [c for c in by_position[position] if c.rollout_index not in failed_rollouts]
        for index, members in enumerate(greedy_similarity_groups(alive, threshold)):
            label = group_label(members, record.mc)
            labelled.append(StepGroup(position, index, members, label))
            if label == 0.0:
                failed_rollouts.update(member.rollout_index for member in members)
    return labelled


def record_key(record: MCTSRecord) -> str:
    """12 hex digits identifying an evaluated step within its problem: sha256 of its prefix and
    step. Unlike a running index it does not depend on input order, sharding or resumes."""
    payload = json.dumps([record.prefix_steps, record.step], ensure_ascii=False)
    return hashlib.sha256(payload.encode("utf-8")).hexdigest()[:12]


def augment_records(
    records: Iterable[MCTSRecord],
    threshold: float = DEFAULT_SIMILARITY_THRESHOLD,
    include_mcts: bool = True,
    dedupe: bool = True,
) -> Iterator[PRMExample]:
    """PRM examples from MCTS records, streamed one record at a time.

    Per record: its own step labelled with its mc_value (origin "mcts", when include_mcts), then
    its labelled rollout steps (origin "augmented") by position, group and rollout, each with
    group_id "<problem_id>:<record_key>:<position>:<group index>". With dedupe, an example whose
    (prefix_steps, step) already came from the same record is skipped: identical steps always
    fall into the same group, so the one kept carries the label every copy would have had.
    """
    seen_keys: Counter[tuple[str, str]] = Counter()
    for record in records:
        problem_id = record.problem_id
        key = record_key(record)
        seen_keys[(problem_id, key)] += 1
        occurrence = seen_keys[(problem_id, key)]
        if occurrence > 1:  # the same (prefix, step) evaluated twice: keep group ids unique
            key = f"{key}.{occurrence}"
        if include_mcts:
            yield PRMExample(
                problem_id=problem_id,
                question=record.question,
                prefix_steps=list(record.prefix_steps),
                step=record.step,
                label=record.mc,
                origin=ORIGIN_MCTS,
            )
        emitted: set[tuple[tuple[str, ...], str]] = set()
        for group in label_rollout_steps(record, threshold):
            group_id = f"{problem_id}:{key}:{group.position}:{group.index}"
            for member in group.members:
                if dedupe:
                    example_key = (member.prefix_steps, member.step)
                    if example_key in emitted:
                        continue
                    emitted.add(example_key)
                yield PRMExample(
                    problem_id=problem_id,
                    question=record.question,
                    prefix_steps=list(member.prefix_steps),
                    step=member.step,
                    label=group.label,
                    origin=ORIGIN_AUGMENTED,
                    group_id=group_id,
                )


def _label_bin(label: float) -> str:
    if label == 0.0:
        return "zero"
    if label == 1.0:
        return "one"
    return "between"


def augmentation_stats(examples: Iterable[PRMExample], n_mcts_records: int) -> dict:
    """Counts of a PRM data set (one pass, so a generator will do).

    n_examples, n_mcts_records, expansion_factor (n_examples / n_mcts_records, None when 0),
    by_origin {mcts, augmented}, label_bins {zero, between, one} (label == 0, 0 < label < 1,
    label == 1), label_fractions (the same over n_examples), label_bins_by_origin, and
    label_histogram {edges: 0.0..1.0 in 11 edges, counts: 10 bins [a, b), the last [0.9, 1]}.
    """
    by_origin: Counter[str] = Counter({ORIGIN_MCTS: 0, ORIGIN_AUGMENTED: 0})
    bins: Counter[str] = Counter({"zero": 0, "between": 0, "one": 0})
    bins_by_origin: dict[str, Counter[str]] = {}
    histogram = [0] * 10
    n_examples = 0
    for example in examples:
        label, origin = example.label, example.origin
        n_examples += 1
        by_origin[origin] += 1
        bins[_label_bin(label)] += 1
        bins_by_origin.setdefault(origin, Counter({"zero": 0, "between": 0, "one": 0}))[_label_bin(label)] += 1
        # The epsilon keeps labels such as 0.3 (= 3/10, stored as 0.29999...) in their bin.
        histogram[min(9, max(0, int(math.floor(label * 10 + 1e-9))))] += 1
    return {
        "n_examples": n_examples,
        "n_mcts_records": n_mcts_records,
        "expansion_factor": n_examples / n_mcts_records if n_mcts_records else None,
        "by_origin": dict(by_origin),
        "label_bins": dict(bins),
        "label_fractions": {name: (count / n_examples if n_examples else 0.0) for name, count in bins.items()},
        "label_bins_by_origin": {origin: dict(counts) for origin, counts in sorted(bins_by_origin.items())},
        "label_histogram": {"edges": [i / 10 for i in range(11)], "counts": histogram},
    }


def is_validation_problem(problem_id: str, val_fraction: float, seed: int) -> bool:
    """Whether a problem belongs to the validation split: the first 8 bytes of
    sha256(f"{seed}:{problem_id}") read as a number in [0, 1) fall below val_fraction.
    Depends on nothing but (seed, problem_id), so it is stable across runs, shards and data sets."""
    digest = hashlib.sha256(f"{seed}:{problem_id}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64 < val_fraction


def split_by_problem(
    examples: Iterable[PRMExample], val_fraction: float, seed: int
) -> tuple[list[PRMExample], list[PRMExample]]:
    """(train, val): every example of a problem lands in the same split, chosen by
    ``is_validation_problem``; input order is kept within each split. The validation share of
    problems is val_fraction in expectation, not exactly."""
    if not 0.0 <= val_fraction <= 1.0:
        raise ValueError(f"val_fraction must lie in [0, 1], got {val_fraction}")
    train: list[PRMExample] = []
    val: list[PRMExample] = []
    decided: dict[str, bool] = {}
    for example in examples:
        problem_id = example.problem_id
        if problem_id not in decided:
            decided[problem_id] = is_validation_problem(problem_id, val_fraction, seed)
        (val if decided[problem_id] else train).append(example)
    return train, val

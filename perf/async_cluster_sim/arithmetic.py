"""The arithmetic of a sweep point: the ideal rate with no overhead anywhere, and percentiles."""

from __future__ import annotations

import math


def ideal_rate(
    searchers: int, *, round_seconds: float, trajectories_per_round: int, update_seconds: float, rows_per_update: int
) -> float:
    """Trajectories trained per second with no overhead anywhere: the searchers' generation rate,
    capped by the trainer's.

        ideal(N) = min(N x trajectories_per_round / round_seconds, rows_per_update / update_seconds)
    """
    generation = searchers * trajectories_per_round / round_seconds
    training = rows_per_update / update_seconds
    return min(generation, training)


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (0-100), linear between the two nearest ranks (numpy's default)."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    position = (len(ordered) - 1) * q / 100
    low, high = math.floor(position), math.ceil(position)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)

"""A solution's strategy, counted: how many strategies a problem admits, which strategy each
right solution carries out, and the entropy of their distribution (eval's diversity and the
GFlowNet's reweighting ceiling share these; docs/metrics.md)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from pipeline.records import Problem
from pipeline.tinyworld import strategy_names, strategy_of


def strategy_entropy(strategies: Sequence[str], weights: Sequence[float] | None = None) -> float:
    """Entropy in bits of the distribution of strategy names (one problem's correct solutions):
    0 for one strategy or none, log2(m) for m strategies used equally often.

    weights: None (each name counts once: the empirical distribution) or one finite weight >= 0
             per name, their sum > 0: p_s = (sum of the weights of the names s) / (sum of all),
             names of weight 0 left out (0 log 0 = 0). Only their ratios matter.

        ["a", "a", "b", "b"] -> 1.0;  ["a", "a", "a", "b"] -> 0.811;  ["a"] -> 0.0
        ["a", "a", "b"] with weights [1, 1, 2] -> 1.0
    """
    names = list(strategies)
    if weights is not None:
        weights = np.asarray(weights, dtype=np.float64)
        if weights.shape != (len(names),):
            raise ValueError(f"strategy_entropy: {weights.shape} weights for {len(names)} strategy names")
        if not (np.all(np.isfinite(weights)) and np.all(weights >= 0)):
            raise ValueError("strategy_entropy: weights must be finite and >= 0")
        if names and weights.sum() <= 0:
            raise ValueError("strategy_entropy: the weights sum to 0")
    if not names:
        return 0.0
    _, index = np.unique(np.asarray(names, dtype=object).astype(str), return_inverse=True)
    mass = np.bincount(index.ravel(), weights=weights)
    p = mass[mass > 0] / mass.sum()
    return float(-(p * np.log2(p)).sum() + 0.0)


def admitted_strategies(problem: Problem) -> int | None:
    """How many distinct strategy names a problem's valid solutions carry
    (pipeline.tinyworld.checker.strategy_names; two solutions of one named strategy count once);
    None when its record lists no valid solutions, so its strategies are unknown."""
    return len(strategy_names(problem)) if problem.meta.get("solutions") else None


def correct_strategy_names(
    problem: Problem, solutions: Sequence[Sequence[str]], correct: Sequence[bool]
) -> list[str] | None:
    """The strategy name (pipeline.tinyworld.strategy_of) of each correct solution of one problem,
    in sample order; None when the problem's record lists no valid solutions (``meta["solutions"]``).
    A correct solution that carries out no valid strategy (the right answer reached by other
    calculations) has no name and is left out."""
    if len(solutions) != len(correct):
        raise ValueError(f"correct_strategy_names: {len(solutions)} solutions for {len(correct)} correctness flags")
    if not problem.meta.get("solutions"):
        return None
    names = (strategy_of(problem, steps) for steps, is_correct in zip(solutions, correct) if is_correct)
    return [name for name in names if name is not None]

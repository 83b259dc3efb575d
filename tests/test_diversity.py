"""eval.diversity: hand examples, the Vendi limits, and the real offline MiniLM embedder."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from eval.diversity import (
    distinct_correct_strategies,
    distinct_n,
    distinct_n_per_problem,
    load_embedder,
    mean_pairwise_cosine,
    normalize_step,
    semantic_similarity,
    solution_embeddings,
    vendi_score,
)


def test_mean_pairwise_cosine_matches_double_loop():
    rng = np.random.default_rng(0)
    embeddings = rng.normal(size=(6, 5))
    pairs = [
        embeddings[i] @ embeddings[j] / np.linalg.norm(embeddings[i]) / np.linalg.norm(embeddings[j])
        for i, j in itertools.combinations(range(6), 2)
    ]
    assert mean_pairwise_cosine(embeddings) == pytest.approx(np.mean(pairs), abs=1e-12)
    assert mean_pairwise_cosine(np.ones((3, 4))) == pytest.approx(1.0)
    assert mean_pairwise_cosine(np.eye(4)) == pytest.approx(0.0)
    with pytest.raises(ValueError, match="k >= 2"):
        mean_pairwise_cosine(np.ones((1, 4)))


def test_solution_embeddings_normalise_steps_before_averaging():
    # solution 0: a long step along x and a short one along y: equal weight after normalising
    solutions = solution_embeddings([np.array([[10.0, 0.0], [0.0, 0.1]]), np.array([[0.0, 3.0]])])
    np.testing.assert_allclose(solutions[0], [np.sqrt(0.5), np.sqrt(0.5)])
    np.testing.assert_allclose(solutions[1], [0.0, 1.0])
    with pytest.raises(ValueError, match="solution 1"):
        solution_embeddings([np.ones((1, 2)), np.zeros((0, 2))])


def test_vendi_limits_identical_orthogonal_and_mixed():
    for n in (1, 2, 5, 9):
        assert vendi_score(np.tile([[0.3, -1.2, 2.0]], (n, 1))) == pytest.approx(1.0, abs=1e-6)
        assert vendi_score(np.eye(n) * 4.0) == pytest.approx(float(n), abs=1e-6)
    mixed = np.array([[1.0, 0.0, 0.0], [1.0, 0.0, 0.0], [0.0, 1.0, 0.0], [0.0, 0.0, 1.0]])
    assert 1.0 < vendi_score(mixed) < 4.0
    # two orthogonal clusters of equal size count as two; more rows than dimensions (n > d path)
    clusters = np.repeat(np.eye(2), 10, axis=0)
    assert vendi_score(clusters) == pytest.approx(2.0, abs=1e-6)
    rng = np.random.default_rng(0)
    wide = rng.normal(size=(5, 40))
    tall = rng.normal(size=(40, 5))
    for x in (wide, tall):  # same value from X X^T and X^T X
        unit = x / np.linalg.norm(x, axis=1, keepdims=True)
        lam = np.clip(np.linalg.eigvalsh(unit @ unit.T / len(x)), 1e-300, None)
        assert vendi_score(x) == pytest.approx(np.exp(-np.sum(lam * np.log(lam))), rel=1e-8)


def test_semantic_similarity_makes_one_embed_call_and_skips_unscorable():
    calls = []
    table = {"a": [1.0, 0.0], "b": [0.0, 1.0], "c": [1.0, 1.0]}

    def embed(texts):
        calls.append(list(texts))
        return np.array([table[t] for t in texts])

    problems = [
        [["a"], ["a", "a"], ["b"]],  # cos: 1, 0, 0
        [["a", "b"], ["c"]],  # mean of a and b is parallel to c: cos 1
        [["a"], []],  # one non-empty solution: not scored
    ]
    result = semantic_similarity(problems, embed, n_resamples=100)
    assert len(calls) == 1 and calls[0] == ["a", "a", "a", "b", "a", "b", "c", "a"]
    assert result["per_problem"][0] == pytest.approx(1 / 3)
    assert result["per_problem"][1] == pytest.approx(1.0)
    assert result["per_problem"][2] is None
    assert result["n_scored"] == 2
    assert result["mean"] == pytest.approx(2 / 3)
    assert result["lo"] <= result["mean"] <= result["hi"]
    assert result["vendi_per_problem"][1] == pytest.approx(1.0)
    assert result["vendi_per_problem"][2] is None
    empty = semantic_similarity([[["a"]]], embed)
    assert empty["mean"] is None and empty["n_scored"] == 0


def test_distinct_n_hand_examples():
    assert distinct_n(["a b c", "a b d"], 1) == pytest.approx(4 / 6)
    assert distinct_n(["a b c", "a b d"], 2) == pytest.approx(3 / 4)  # ab, bc, ab, bd
    assert distinct_n(["a b", "c d"], 2) == 1.0  # "b c" spans two texts: not an n-gram
    assert distinct_n(["x  x\nx"], 1) == pytest.approx(1 / 3)
    assert np.isnan(distinct_n(["a"], 2))
    result = distinct_n_per_problem([["a a", "a a"], ["a b"], ["z"]], 1)
    assert result["per_problem"] == [pytest.approx(0.25), pytest.approx(1.0), pytest.approx(1.0)]
    assert distinct_n_per_problem([["a a"], ["z"]], 2)["per_problem"] == [1.0, None]
    assert distinct_n_per_problem([["a a"], ["z"]], 2)["mean"] == 1.0


def test_distinct_correct_strategies_counts_normalised_correct_sequences():
    solutions = [
        ["3 + 4 = 7.", "7 x 2 = 14"],
        ["3 + 4  =  7", "7 X 2 = 14!"],  # same strategy after normalising
        ["2 x 7 = 14", "14 - 0 = 14"],
        ["7 x 2 = 14", "3 + 4 = 7"],  # same steps, other order: another strategy
        ["wrong"],
    ]
    assert distinct_correct_strategies(solutions, [True, True, True, True, False]) == 3
    assert distinct_correct_strategies(solutions, [True, True, False, False, True]) == 2
    assert distinct_correct_strategies(solutions, [False] * 5) == 0
    assert distinct_correct_strategies(solutions, [True, True, False, False, False], normalize=str) == 2
    assert normalize_step("  The Sum IS 7 .  ") == "the sum is 7"
    with pytest.raises(ValueError, match="correctness"):
        distinct_correct_strategies(solutions, [True])


@pytest.mark.slow  # importing sentence-transformers alone takes 5-10 s on the 2-core machines
def test_real_minilm_ranks_paraphrases_above_unrelated_steps():
    embed = load_embedder(None)
    paraphrases = [
        "Add 12 and 30 to get 42.",
        "12 plus 30 equals 42.",
        "The sum of 12 and 30 is 42.",
        "Adding 30 to 12 gives 42.",
    ]
    unrelated = [
        "Divide both sides of the equation by 3.",
        "The area of a circle is pi times the radius squared.",
        "Factor the quadratic x^2 - 5x + 6.",
        "The probability of rolling a six is one sixth.",
    ]
    vectors = embed(paraphrases + unrelated)  # the one embed call
    assert vectors.shape == (8, 384) and vectors.dtype == np.float32
    np.testing.assert_allclose(np.linalg.norm(vectors, axis=1), 1.0, atol=1e-5)
    same = mean_pairwise_cosine(vectors[:4])
    different = mean_pairwise_cosine(vectors[4:])
    assert same > different + 0.3  # measured 0.85 vs 0.18
    assert vendi_score(vectors[:4]) < vendi_score(vectors[4:])
    assert embed([]).shape == (0, 384)


def test_strategy_entropy_matches_a_float64_brute_force():
    import math
    from collections import Counter

    from eval.diversity import strategy_entropy

    rng = np.random.default_rng(0)
    for _ in range(50):
        names = [str(x) for x in rng.integers(0, 4, size=int(rng.integers(1, 12)))]
        counts = Counter(names)
        expected = -sum(c / len(names) * math.log2(c / len(names)) for c in counts.values())
        assert strategy_entropy(names) == pytest.approx(expected, abs=1e-12)
    assert strategy_entropy([]) == 0.0
    assert strategy_entropy(["a", "a", "b", "b"]) == pytest.approx(1.0)

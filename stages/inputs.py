"""A stage's inputs, checked before it makes its run folder: files an earlier target makes
(``require``, ``require_records``, ``require_prm``: each error names that target) and the training
and validation problems (``training_problems``, ``validation_problems``), refused when they overlap
a file data.disjoint_from lists."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from pipeline.config.schema import Config
from pipeline.datasets.copies import HubUnreachable
from pipeline.datasets.loaders import load_benchmark
from pipeline.datasets.problems import question_places
from pipeline.generation import build_generator
from pipeline.records import RecordError
from pipeline.storage.files import InputNotFound
from prm.exact_check import FIRST_ERROR_LABELLERS, PolicySample, policy_solutions
from prm.formats import is_hub_id
from stages.cli import log


def require(path: Path, produced_by: str) -> Path:
    """A stage's input, with an error that says which target makes it."""
    if not Path(path).exists():
        raise SystemExit(f"missing input {path}: run `make {produced_by}` first (same CONFIG and RUN)")
    return Path(path)


def require_records(path: Path, read: Callable[[Path], list], produced_by: str) -> list:
    """A stage's input file of records, read by ``read``: it must exist and hold at least one
    record (an empty file is a damaged or failed earlier stage, never something to train or
    validate on)."""
    path = require(path, produced_by)
    records = read(path)
    if not records:
        raise SystemExit(
            f"{path}: no records (an empty file). Run `make {produced_by}` again (same CONFIG and RUN); "
            "if it writes an empty file again, its own log says why"
        )
    return records


def require_prm(path: str | Path) -> str:
    """The PRM a stage scores with: a hub id as it is (prm.formats.load_scorer fetches it), a
    local folder only when it exists (else: which target makes it)."""
    path = str(path)
    if not is_hub_id(path):
        require(Path(path), "prm")
    return path


def training_problems(config: Config):
    """The problems the training stages draw from (config.data.train*, filtered by
    data.problem_sources: the config refuses a filter data.train's loader cannot apply), refused
    when one shares its question with a file data.disjoint_from lists (``refuse_overlap``)."""
    filters = {"problem_sources": config.data.problem_sources} if config.data.problem_sources else {}
    data = config.data
    problems = _data_problems(config, "train", data.train, data.train_path, data.train_limit, **filters)
    refuse_overlap(config, problems)
    return problems


def _data_problems(config: Config, key: str, name: str, path: str | None, limit: int | None, **filters):
    """The problems of data.<key> (its loader ``name``, file ``path``, ``limit``); a hub dataset that
    cannot be fetched is one line naming data.<key> and data.<key>_path."""
    try:
        return load_benchmark(name, path=config.resolve(path), limit=limit, lenient=config.data.lenient, **filters)
    except HubUnreachable as error:
        raise error.named(f"data.{key}={name}", f"data.{key}_path") from None


def refuse_overlap(config: Config, problems) -> None:
    """A RecordError naming both files and the first of ``problems`` (data.train's, in order) whose
    question text a file of data.disjoint_from also holds, with its id and line in each; an
    InputNotFound naming the key for a listed file that is not there."""
    train_file = config.resolve(config.data.train_path) or f"data.train={config.data.train}"
    for raw in config.data.disjoint_from:
        other = config.resolve(raw)
        if not Path(other).is_file():
            raise InputNotFound(
                f"data.disjoint_from: {other} not found (a file the training problems may share no question "
                f"with; the tiny world's `make bootstrap` writes it; data.disjoint_from=[] checks nothing)"
            )
        places = question_places(other, lenient=config.data.lenient)
        shared = [problem for problem in problems if problem.question in places]
        if not shared:
            continue
        first = shared[0]
        local = Path(train_file).is_file()
        where = (question_places(train_file, validate=False).get(first.question) if local else None) or (
            train_file,
            first.problem_id,
        )
        other_where, other_id = places[first.question]
        raise RecordError(
            f"data.disjoint_from: {train_file} (data.train_path) and {other} share {len(shared)} of "
            f"{len(problems)} questions; first: {first.problem_id!r} at {where[0]} is {other_id!r} at {other_where}. "
            f"The problems the stages train on must be disjoint from the files data.disjoint_from lists"
        )


def validation_problems(config: Config):
    """Held-out problems of the training distribution (config.data.validation*)."""
    data = config.data
    return _data_problems(config, "validation", data.validation, data.validation_path, data.validation_limit)


def exact_check_samples(config, kind: str) -> list[PolicySample] | None:
    """The policy's samples of the held-out problems whose kind has an exact labeller, each beside
    its problem, for the exact check and the slip pairs; None when prm.exact_check_problems is 0,
    or the PRM's kind has no labeller (then no held-out problem is read), or no problem has one."""
    cfg = config.prm
    if cfg.exact_check_problems <= 0 or kind not in FIRST_ERROR_LABELLERS:
        return None
    problems = [p for p in validation_problems(config)[: cfg.exact_check_problems] if p.kind in FIRST_ERROR_LABELLERS]
    if not problems:
        log.info("prm: no held-out problem has an exact step labeller: the exact check and the slip pairs are skipped")
        return None
    generator = build_generator(config, progress=True)  # one generate call: its bar is the sampling's
    return policy_solutions(
        generator,
        problems,
        config.format,
        cfg.exact_check_samples,
        cfg.exact_check_temperature,
        config.generation.max_new_tokens,
        seed=cfg.seed,
    )

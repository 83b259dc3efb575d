"""Fault injection: SIGKILL mcts, augment, prm and gfn at random points, restart them, and check the
final outputs equal an uninterrupted run's (the figures in docs/results/reliability.md come
from this test, run with STEPFLOW_FAULT_REPORT=<file> and STEPFLOW_FAULT_SEED=<n>).

Two run folders share one tiny world (a random-init policy built from a config, its problems):
"straight" runs each stage once; "killed" runs each stage, SIGKILLs it at a random moment after it
has taken its run folder's lock, restarts it, and so on KILLS times, then lets it finish. A kill
delay is drawn uniformly from a shrinking share of the stage's uninterrupted duration, so the
delays add up to less than one uninterrupted run and the kills land before the stage is done (a
restart that finishes first anyway is counted, and the stage's kills start over). Every restart
must either be killed or finish with exit code 0 (no crash loop), and in the end:
the same MCTS records and summaries (0 lost, 0 duplicated), the same augmented files byte for
byte, the same PRM and GFlowNet weights bit for bit, and each metrics step logged exactly once.

Stages run in processes forked from a forkserver that imported them once (a fresh interpreter
per run would spend most of the time budget importing torch), with one torch thread, and every
wait is bounded in time.
"""

from __future__ import annotations

import importlib
import json
import multiprocessing
import os
import random
import shutil
import signal
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from pipeline.config.schema import BootstrapConfig, FormatConfig, TinyWorldConfig
from pipeline.datasets.problems import write_problems_jsonl
from pipeline.records import MCTSRecord, MCTSSummary
from pipeline.storage.shards import read_stream
from pipeline.tinyworld.model import build_model, save_policy
from pipeline.tinyworld.problems import generate_splits
from pipeline.tinyworld.tokenizer import tokenizer_corpus, train_tokenizer

REPO = Path(__file__).resolve().parents[1]
KILLS = 5  # per stage
PROBLEMS = 48
STAGE_TIMEOUT_S = 120
SEED = 25

STAGES = {  # stage -> (module, its lock file in its run folder)
    "mcts": ("stages.mcts", "mcts/.lock-shard-0of1"),
    "augment": ("stages.augment", "augment/.lock"),
    "prm": ("stages.train_prm", "prm/.lock"),
    "gfn": ("stages.train_gfn", "gfn/.lock"),
}

REDUCED = [
    "model.torch_threads=1",
    "generation.max_new_tokens=48",
    "generation.batch_size=64",
    "mcts.k=8",
    f"mcts.max_problems={PROBLEMS}",
    "mcts.max_iterations=4",
    "mcts.max_rollouts=64",
    "mcts.search_trivial=true",
    "mcts.problems_per_commit=2",
    "mcts.max_active=8",
    "prm.epochs=8",
    "prm.batch_size=8",
    "prm.micro_batch_size=8",
    "prm.save_every=2",
    "prm.log_every=1",
    "prm.corrupt_examples=8",
    "prm.exact_check_problems=0",
    "gfn.num_train_steps=40",
    "gfn.questions_per_step=2",
    "gfn.samples_per_question=2",
    "gfn.micro_batch_size=8",
    "gfn.save_every=1",
    "gfn.warmup_steps=0",
]


def run_stage(module: str, argv: list[str]) -> None:
    """The target of a forked stage process: the stage's main, as `python -m` runs it."""
    importlib.import_module(module).main(argv)


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("fault-world")
    splits = generate_splits(TinyWorldConfig(seed=7, n_train=PROBLEMS, n_val=4, n_test=4))
    write_problems_jsonl(splits["train"], root / "train.jsonl")
    write_problems_jsonl(splits["val"], root / "val.jsonl")
    tokenizer = train_tokenizer(tokenizer_corpus(splits["train"], FormatConfig(use_chat_template=False)), 512)
    torch.manual_seed(0)
    model = build_model(
        BootstrapConfig(hidden_size=32, intermediate_size=64, num_layers=1, num_heads=2, seed=3), tokenizer
    )
    save_policy(model, tokenizer, root / "policy")
    return root


def argv(world: Path, runs: Path, run: str) -> list[str]:
    return [
        "--config",
        str(REPO / "configs" / "tiny.yaml"),
        f"runs_root={runs}",
        f"run={run}",
        f"model.policy={world / 'policy'}",
        f"model.prm_backbone={world / 'policy'}",
        f"data.train_path={world / 'train.jsonl'}",
        "data.disjoint_from=[]",
        f"data.validation_path={world / 'val.jsonl'}",
        *REDUCED,
    ]


class Harness:
    def __init__(self, context):
        self.context = context

    def start(self, stage: str, args: list[str]):
        process = self.context.Process(target=run_stage, args=(STAGES[stage][0], args))
        process.start()
        return process

    @staticmethod
    def wait(process, timeout: float = STAGE_TIMEOUT_S) -> int:
        process.join(timeout)
        if process.is_alive():
            os.kill(process.pid, signal.SIGKILL)
            process.join(30)
            raise AssertionError(f"the stage did not finish within {timeout} s")
        return process.exitcode

    @staticmethod
    def wait_for_lock(process, lock: Path, timeout: float = STAGE_TIMEOUT_S) -> bool:
        """True once the stage process holds its lock (it has started its work), False if it ended first."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                if json.loads(lock.read_text() or "{}").get("pid") == process.pid:
                    return True
            except (OSError, ValueError):
                pass
            if not process.is_alive():
                return False
            time.sleep(0.005)
        os.kill(process.pid, signal.SIGKILL)
        raise AssertionError(f"the stage never took its lock {lock} within {timeout} s")


def left_behind(run_dir: Path, stage: str) -> list[str]:
    """Partial writes a kill left: staging folders and temporary files."""
    folder = run_dir / stage
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.name.startswith((".staging-", ".tmp-")))


def weights(path: Path) -> dict[str, torch.Tensor]:
    return {
        f"{file.relative_to(path)}:{name}": tensor
        for file in sorted(path.rglob("*.safetensors"))
        for name, tensor in load_file(str(file)).items()
    }


def metrics_without_timing(path: Path) -> list[dict]:
    timing = ("seconds", "_per_s", "wall_time")  # durations, rates and the clock time a record was written
    return [
        {k: v for k, v in json.loads(line).items() if not any(t in k for t in timing)}
        for line in path.read_text().splitlines()
        if line.strip()
    ]


@pytest.mark.slow
def test_sigkilled_stages_restart_to_the_outputs_of_an_uninterrupted_run(world, tmp_path, monkeypatch):
    for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        monkeypatch.setenv(name, "1")
    monkeypatch.setenv("TQDM_DISABLE", "1")
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "false")
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload([module for module, _ in STAGES.values()] + [__name__])
    harness = Harness(context)
    runs = tmp_path / "runs"
    rng = random.Random(int(os.environ.get("STEPFLOW_FAULT_SEED", SEED)))  # another seed: other kill points
    report: dict[str, dict] = {}
    started = time.monotonic()

    for stage in STAGES:
        lock = STAGES[stage][1]
        # the uninterrupted run: its duration from taking the lock to the end sets the kill delays
        process = harness.start(stage, argv(world, runs, "straight"))
        assert harness.wait_for_lock(process, runs / "straight" / lock), f"{stage}: ended before taking its lock"
        t0 = time.monotonic()
        assert harness.wait(process) == 0, f"{stage}: the uninterrupted run failed"
        duration = time.monotonic() - t0

        # A resuming stage keeps its progress: its delays come out of one budget smaller than an
        # uninterrupted run, so it should not finish before its last kill; on a busy machine one
        # may (a restart ran faster than the uninterrupted run did): then the stage's killed
        # folder is removed and its kills start over with half the budget. augment starts over
        # each time anyway: a restart that beat its kill is simply drawn again.
        delays, partial, finished_first, scale = [], [], 0, 0.8
        budget = scale * duration
        while len(delays) < KILLS:
            assert finished_first <= 2 * KILLS, f"{stage}: {finished_first} restarts finished before their kill"
            delay = rng.uniform(0.05, 0.7) * (duration if stage == "augment" else budget)
            before = left_behind(runs / "killed", stage)
            process = harness.start(stage, argv(world, runs, "killed"))
            assert harness.wait_for_lock(process, runs / "killed" / lock), (
                f"{stage}: a restart ended before taking its lock"
            )
            time.sleep(delay)
            try:
                os.kill(process.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            process.join(30)
            if process.exitcode == 0:  # finished before the kill came
                finished_first += 1
                if stage != "augment":
                    shutil.rmtree(runs / "killed" / stage)
                    delays, partial, scale = [], [], scale / 2
                    budget = scale * duration
                continue
            assert process.exitcode == -signal.SIGKILL, (
                f"{stage}: a restart crashed (exit code {process.exitcode}) before its kill"
            )
            budget -= delay
            delays.append(round(delay, 3))
            partial.append(sorted(set(left_behind(runs / "killed", stage)) - set(before)))  # what this kill cut short
        process = harness.start(stage, argv(world, runs, "killed"))
        assert harness.wait(process) == 0, f"{stage}: the run after {KILLS} kills did not finish cleanly"
        report[stage] = {
            "uninterrupted_s": round(duration, 2),
            "kill_delays_s": delays,
            "finished_before_kill": finished_first,
            "kills_leaving_partial_writes": sum(bool(p) for p in partial),
            "partial_writes": partial,
        }

    straight, killed = runs / "straight", runs / "killed"
    # mcts: every problem's records and summary, once each, identical
    for stream, record_type in (("records", MCTSRecord), ("summaries", MCTSSummary)):
        ours = [r.to_json() for r in read_stream(killed / "mcts" / "shards", stream, record_type)]
        theirs = [r.to_json() for r in read_stream(straight / "mcts" / "shards", stream, record_type)]
        key = lambda r: json.dumps(r, sort_keys=True)  # noqa: E731
        assert sorted(ours, key=key) == sorted(theirs, key=key), stream
        if stream == "summaries":
            assert len({r["problem_id"] for r in ours}) == len(ours) == PROBLEMS
            report["mcts"].update(problems=len(ours))
        else:
            report["mcts"].update(records=len(ours))
    # augment: the same files, byte for byte
    for name in ("prm_train.jsonl", "prm_val.jsonl"):
        assert (killed / "augment" / name).read_bytes() == (straight / "augment" / name).read_bytes(), name
    report["augment"].update(examples=sum(1 for _ in (killed / "augment" / "prm_train.jsonl").open()))
    # prm and gfn: the same weights bit for bit, each metrics step once, the same losses
    for stage in ("prm", "gfn"):
        ours, theirs = weights(killed / stage / "model"), weights(straight / stage / "model")
        assert ours.keys() == theirs.keys() and ours
        different = [name for name in ours if not torch.equal(ours[name], theirs[name])]
        assert different == [], f"{stage}: {len(different)} tensors differ, e.g. {different[:3]}"
        logged = metrics_without_timing(killed / stage / "metrics.jsonl")
        assert [m["step"] for m in logged] == sorted({m["step"] for m in logged})  # no step twice
        assert logged == metrics_without_timing(straight / stage / "metrics.jsonl")
        assert not (killed / stage / "checkpoints").exists()
        report[stage].update(tensors=len(ours), steps=logged[-1]["step"])
    # started again, each finished stage says so and changes nothing
    before = {stage: weights(killed / stage / "model") for stage in ("prm", "gfn")}
    for stage in ("prm", "gfn"):
        t0 = time.monotonic()
        assert harness.wait(harness.start(stage, argv(world, runs, "killed"))) == 0
        report[stage]["finished_restart_s"] = round(time.monotonic() - t0, 2)
        assert all(torch.equal(before[stage][k], v) for k, v in weights(killed / stage / "model").items())
    report["total_s"] = round(time.monotonic() - started, 1)
    if os.environ.get("STEPFLOW_FAULT_REPORT"):
        Path(os.environ["STEPFLOW_FAULT_REPORT"]).write_text(json.dumps(report, indent=1) + "\n")

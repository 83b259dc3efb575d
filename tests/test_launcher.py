"""One worker per device for mcts, eval and search: each on its own shard and GPU, merged as one process writes."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from pipeline.launcher import Worker, WorkerFailed, merge_worker, run_workers, shard_workers, visible_devices
from pipeline.records import MCTSRecord, MCTSSummary, SearchRecord
from pipeline.storage.files import read_records
from pipeline.storage.shards import read_stream
from stages import evaluate, launch, search

REPO = Path(__file__).resolve().parents[1]


def test_one_worker_per_visible_device_each_on_its_own_shard():
    devices = visible_devices({"CUDA_VISIBLE_DEVICES": "3,5"})
    workers = shard_workers("mcts", ["--config", "c.yaml", "run=r"], devices)
    assert [w.env for w in workers] == [{"CUDA_VISIBLE_DEVICES": "3"}, {"CUDA_VISIBLE_DEVICES": "5"}]
    assert [w.argv[2:] for w in workers] == [
        ["stages.mcts", "--config", "c.yaml", "run=r", "mcts.shard=0/2"],
        ["stages.mcts", "--config", "c.yaml", "run=r", "mcts.shard=1/2"],
    ]
    with pytest.raises(ValueError, match="mcts.shard is set by the launcher"):
        shard_workers("mcts", ["mcts.shard=0/4"], devices)
    with pytest.raises(ValueError, match="stage 'evaluate' has no shards"):
        shard_workers("evaluate", [], devices)
    with pytest.raises(ValueError, match="no devices to launch on"):
        shard_workers("mcts", [], visible_devices({"CUDA_VISIBLE_DEVICES": ""}))


@pytest.mark.parametrize(("stage", "module"), [("eval", "stages.evaluate"), ("search", "stages.search")])
def test_eval_and_search_workers_take_a_shard_each_then_one_run_merges_on_the_first_device(stage, module):
    devices = visible_devices({"CUDA_VISIBLE_DEVICES": "2,7"})
    workers = shard_workers(stage, ["run=r"], devices)
    assert [w.argv[2:] for w in workers] == [
        [module, "run=r", f"{stage}.shard=0/2"],
        [module, "run=r", f"{stage}.shard=1/2"],
    ]
    assert [w.env for w in workers] == [{"CUDA_VISIBLE_DEVICES": "2"}, {"CUDA_VISIBLE_DEVICES": "7"}]
    merge = merge_worker(stage, ["run=r"], devices)
    assert merge.argv[2:] == [module, "run=r"] and merge.env == {"CUDA_VISIBLE_DEVICES": "2"}
    assert merge_worker(stage, ["run=r"], None).env == {}  # CPU workers (--workers n)
    with pytest.raises(ValueError, match=f"{stage}.shard is set by the launcher"):
        shard_workers(stage, [f"{stage}.shard=1/2"], devices)
    with pytest.raises(ValueError, match="'mcts' has no merge run"):
        merge_worker("mcts", [], devices)


def _one_process_and_two_workers(stage: str, main, common: list[str], cwd: Path, monkeypatch) -> None:
    """The stage in one process (run=single), then the launcher with 2 CPU workers (run=sharded);
    both called in this process (the workers and the merge run are subprocesses, one torch thread each)."""
    monkeypatch.chdir(cwd)
    for name, value in {"PYTHONPATH": str(REPO), "TQDM_DISABLE": "1", "OMP_NUM_THREADS": "1"}.items():
        monkeypatch.setenv(name, value)
    main([*common, "run=single"])
    launch.main([stage, "--workers", "2", *common, "run=sharded"])


def _same_text(one: Path, two: Path) -> None:
    """Byte-equal files but for the run name."""
    assert one.read_text().replace("single", "RUN") == two.read_text().replace("sharded", "RUN"), (one, two)


@pytest.mark.slow
def test_two_cpu_workers_write_the_evaluation_one_process_writes(random_tiny_world, tmp_path, monkeypatch):
    """Per-problem random streams make each problem's samples independent of the worker and batch
    holding it, so the merged samples are byte-equal; accuracy intervals, similarity, Vendi, the
    PRM reward and the paired differences are computed once over all merged samples, so results.json
    is byte-equal too (one torch thread a process: the same arithmetic in every run)."""
    from transformers import AutoTokenizer

    from pipeline.config.schema import BootstrapConfig
    from pipeline.tinyworld.model import build_model, save_policy

    world = random_tiny_world
    tokenizer = AutoTokenizer.from_pretrained(world / "policy")
    other = build_model(
        BootstrapConfig(hidden_size=32, intermediate_size=64, num_layers=2, num_heads=2, seed=4), tokenizer
    )
    save_policy(other, tokenizer, tmp_path / "other")  # a second model: the comparisons are not all zero
    common = [
        "--config",
        str(REPO / "configs" / "tiny.yaml"),
        f"runs_root={tmp_path / 'runs'}",
        f"eval.models={{base: {world / 'policy'}, other: {tmp_path / 'other'}}}",
        "eval.pairs=[[other, base]]",
        "eval.benchmarks=[tiny_test]",
        f"eval.benchmark_paths={{tiny_test: {world / 'problems_train.jsonl'}}}",
        f"eval.prm={world / 'prm'}",
        "eval.max_problems=7",
        "eval.k=3",
        "eval.target_samples=0",
        "eval.problems_per_commit=2",
        "eval.bootstrap_resamples=200",
        "generation.max_new_tokens=24",
    ]
    _one_process_and_two_workers("eval", evaluate.main, common, tmp_path, monkeypatch)
    one, two = tmp_path / "reports" / "single", tmp_path / "reports" / "sharded"
    results = json.loads((one / "results.json").read_text())
    assert results["comparisons"]["pairs"]["other_vs_base"]["tiny_test"]["pass@1"] is not None
    assert (
        results["results"]["base"]["tiny_test"]["prm_reward"]["per_problem"]
        and results["benchmarks"]["tiny_test"]["n_problems"] == 7
    )
    for name in (
        "results.json",
        "report.md",
        "config.yaml",
        "samples/base__tiny_test.jsonl",
        "samples/other__tiny_test.jsonl",
        "samples/base__tiny_test.settings.json",
        "samples/other__tiny_test.settings.json",
    ):
        _same_text(one / name, two / name)
    assert sorted(p.name for p in (two / "samples").iterdir()) == sorted(
        p.name for p in (one / "samples").iterdir()
    )  # shards merged away


@pytest.mark.slow
def test_two_cpu_workers_write_the_search_results_one_process_writes(random_tiny_world, tmp_path, monkeypatch):
    """Every strategy's generate calls seed each prompt from (seed, problem id, ...), so a problem's
    solutions (steps, answers, tokens) do not depend on the worker or chunk holding it; the accuracy
    intervals come from one bootstrap over all merged problems, so results.json is byte-equal. The
    PRM scores the candidates of a whole chunk in one padded batch, and a batch of other problems
    rounds a float32 score differently in its last bits (6e-8 seen here): step scores agree to 1e-6."""
    world = random_tiny_world
    common = [
        "--config",
        str(REPO / "configs" / "tiny.yaml"),
        f"runs_root={tmp_path / 'runs'}",
        f"model.policy={world / 'policy'}",
        f"model.prm={world / 'prm'}",
        "search.benchmark=problems",
        f"search.benchmark_path={world / 'problems_train.jsonl'}",
        "search.max_problems=7",
        "search.ks=[1,2]",
        "search.strategies=[step_best_of_k,beam,best_of_n,weighted_vote]",
        "search.beam_width=2",
        "search.max_depth=3",
        "search.problems_per_commit=2",
        "generation.max_step_tokens=12",
        "generation.max_new_tokens=24",
    ]
    _one_process_and_two_workers("search", search.main, common, tmp_path, monkeypatch)
    one, two = tmp_path / "runs" / "single" / "search", tmp_path / "runs" / "sharded" / "search"
    rows = json.loads((one / "results.json").read_text())["rows"]
    assert len(rows) == 10 and all(r["n_problems"] == 7 for r in rows)
    assert len((one / "solutions.jsonl").read_text().splitlines()) == 7 * 10
    for name in ("results.json", "table.md"):
        _same_text(one / name, two / name)
    single, sharded = (list(read_records(path / "solutions.jsonl", SearchRecord)) for path in (one, two))
    assert [dataclasses.replace(r, step_scores=[]) for r in sharded] == [
        dataclasses.replace(r, step_scores=[]) for r in single
    ]
    assert [pytest.approx(r.step_scores, abs=1e-6) for r in sharded] == [r.step_scores for r in single]
    assert not (one / "shards").exists() and not (two / "shards").exists()  # merged away


@pytest.mark.slow
def test_two_cpu_workers_write_the_records_one_process_writes(random_tiny_world, tmp_path):
    world = random_tiny_world
    common = [
        "--config",
        str(REPO / "configs" / "tiny.yaml"),
        f"runs_root={tmp_path / 'runs'}",
        f"model.policy={world / 'policy'}",
        f"data.train_path={world / 'problems_train.jsonl'}",
        "data.disjoint_from=[]",
        "generation.max_new_tokens=32",
        "mcts.k=4",
        "mcts.max_problems=6",
        "mcts.max_iterations=1",
        "mcts.max_rollouts=8",
        "mcts.search_trivial=true",
    ]
    env = {**os.environ, "PYTHONPATH": str(REPO), "TQDM_DISABLE": "1"}
    quiet = {
        "env": env,
        "cwd": tmp_path,
        "check": True,
        "stdout": subprocess.DEVNULL,
        "stderr": subprocess.DEVNULL,
        "timeout": 240,
    }
    subprocess.run([sys.executable, "-m", "stages.mcts", *common, "run=one"], **quiet)
    subprocess.run([sys.executable, "-m", "stages.launch", "mcts", "--workers", "2", *common, "run=two"], **quiet)
    two = tmp_path / "runs" / "two" / "mcts"
    assert sorted(p.name for p in (two / "shards").glob("part-*")) and len(list((two / "shards").glob("part-*"))) >= 2

    def merged(run, stream, record_type):
        rows = [r.to_json() for r in read_stream(tmp_path / "runs" / run / "mcts" / "shards", stream, record_type)]
        return sorted(rows, key=lambda r: json.dumps(r, sort_keys=True))

    assert merged("two", "records", MCTSRecord) == merged("one", "records", MCTSRecord) != []
    assert merged("two", "summaries", MCTSSummary) == merged("one", "summaries", MCTSSummary)
    assert json.loads((two / "stats.json").read_text()) == json.loads(
        (tmp_path / "runs" / "one" / "mcts" / "stats.json").read_text()
    )


def test_a_failed_worker_stops_the_others_and_is_named(tmp_path):
    """One worker exits with status 3 while the other would sleep for a minute: the launch raises
    WorkerFailed naming the failed shard, and the sleeping worker is stopped (it never writes)."""
    marker = tmp_path / "slept"
    sleeper = f"import time, pathlib; time.sleep(60); pathlib.Path({str(marker)!r}).write_text('x')"
    workers = [
        Worker([sys.executable, "-c", "raise SystemExit(3)"], {}, "0of2"),
        Worker([sys.executable, "-c", sleeper], {}, "1of2"),
    ]
    with pytest.raises(WorkerFailed, match=r"shard 0of2 exited with status 3; the other workers were stopped"):
        run_workers(workers, timeout=120)
    assert not marker.exists()

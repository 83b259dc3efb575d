"""The asynchronous mode (TBA on Ray): searcher actors fill the store, the trainer draws from it.

A local Ray instance with two searcher actors, on the enumerable environment of
tests/test_gflownet.py (exact R/Z known) and through the stage CLI on a random tiny world; the
launch checks (cluster address, searchers against the cluster) without searchers. Every test
shuts Ray down, also on failure, and is bounded in time.
"""

from __future__ import annotations

import functools
import json
import math
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

ray = pytest.importorskip("ray")

from pipeline.config import GFNConfig, ModelConfig, TinyWorldConfig, load_config  # noqa: E402
from pipeline.finetune import ray_cluster  # noqa: E402
from pipeline.finetune.async_ray import AsyncFinetuneTrainer, searcher_config  # noqa: E402
from pipeline.finetune.objectives import build_objective  # noqa: E402
from pipeline.finetune.run import optimizer_settings  # noqa: E402
from pipeline.finetune.sampling import TrainProblem, TrajectorySampler  # noqa: E402
from pipeline.tinyworld.problems import generate_splits  # noqa: E402
from pipeline.training import TrainingBase, checkpoint, make_accelerator  # noqa: E402

TESTS = Path(__file__).resolve().parent
REPO = TESTS.parent
sys.path.insert(0, str(TESTS))
from test_gflownet import KnownScorer, TabularPolicy, jsd, target_distribution  # noqa: E402


@pytest.fixture
def local_ray():
    """A local Ray instance whose workers can import this test's modules; always shut down."""
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, namespace=f"test-{os.getpid()}-{time.monotonic_ns()}",
             runtime_env={"env_vars": {"PYTHONPATH": os.pathsep.join([str(TESTS), str(REPO)]), "OMP_NUM_THREADS": "1"}})
    try:
        yield
    finally:
        ray.shutdown()


def every_step_answers(step, kind):
    return step


def all_correct(texts, golds, kind):
    return [True] * len(texts)


ONE_PROBLEM = [{"problem_id": "p0", "question": "q", "answer": "1"}]


def tabular_sampler(cfg, index, problems):
    """A searcher's sampler (built inside its actor): its own tabular policy, the known scores, the
    problems it was given (their text does not change the tabular policy's samples)."""
    train = [TrainProblem(p["problem_id"], p["question"], p["question"], p["answer"]) for p in problems]
    return TrajectorySampler(TabularPolicy(), KnownScorer(), train, "tiny", searcher_config(cfg, index), extract=every_step_answers,
                             grade=all_correct)


@pytest.fixture(scope="module")
def tiny_world_problems() -> list[dict]:
    """The tiny world's default training set size (6,000 problems, about 4 MB as JSON): the size
    at which a searcher built from a large actor argument could not be restarted."""
    problems = [p.to_json() for p in generate_splits(TinyWorldConfig(n_train=6000, n_val=1, n_test=1))["train"]]
    assert len(json.dumps(problems)) >= 4_000_000
    return problems


def wait_for_rejoin(trainer, index: int, after: int, seconds: float = 120.0) -> None:
    """Until searcher ``index``, restarted by Ray (a new worker process: seconds), has sent
    trajectories sampled with weights published after step ``after``; the trainer publishes
    meanwhile, as it does every step."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            status = ray.get(trainer.searchers[index].status.remote(), timeout=10)
            if status["restarted"] and status["sampled_version"] > after:
                return
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
            pass  # still restarting
        trainer.publish()
        time.sleep(0.5)
    raise TimeoutError(f"searcher {index} did not rejoin within {seconds} s")


def tabular_trainer(cfg, out: Path, interrupt_at: int | None = None, kill_searcher_at: int | None = None,
                    problems: list[dict] = ONE_PROBLEM, rejoin: bool = True):
    torch.manual_seed(0)
    policy = TabularPolicy()
    objective = build_objective(cfg, policy, hidden_size=8)
    base = TrainingBase(make_accelerator(ModelConfig(device="cpu", dtype="float32")), policy, optimizer_settings(cfg, 1), out,
                        objective=objective, objective_lr=objective.lr, save_every=cfg.save_every, progress=False)
    sampler = TrajectorySampler(policy, None, [TrainProblem("p0", "q", "q", "1")], "tiny", cfg)

    class Trainer(AsyncFinetuneTrainer):
        def prepare(self):
            super().prepare()
            self.restored = self._resumed_store  # what the checkpoint gave back to the store

        def train_step(self):
            if self.step == interrupt_at:
                raise KeyboardInterrupt  # the trainer process dies here
            if self.step == kill_searcher_at:  # SIGKILL of its process: Ray restarts it; training goes on meanwhile
                self.killed_pid = ray.get(self.searchers[0].status.remote(), timeout=60)["pid"]
                os.kill(self.killed_pid, signal.SIGKILL)
            if rejoin and kill_searcher_at is not None and self.step == cfg.num_train_steps - 1:
                wait_for_rejoin(self, 0, after=kill_searcher_at)  # before the last step, it must be back
            return super().train_step()

        def stop(self):
            if self.searchers and rejoin:  # before the actors go (all alive: a searcher not left dead)
                self.last_status = ray.get([searcher.status.remote() for searcher in self.searchers], timeout=60)
            super().stop()

    export = lambda: {k: v.detach().clone() for k, v in policy.state_dict().items()}  # noqa: E731
    return Trainer(base, sampler, objective, cfg, functools.partial(tabular_sampler, cfg), export, problems=problems,
                   progress=False), policy


def tabular_config(**overrides) -> GFNConfig:
    settings = dict(loss="tb_vargrad", lr=0.1, scheduler="constant", warmup_steps=0, num_train_steps=250, questions_per_step=1,
                    samples_per_question=16, micro_batch_size=64, temperature=1.0, save_every=0, grad_clip=10.0, mode="async",
                    searchers=2, sync_every=1, max_staleness=4, buffer_size=200)
    return GFNConfig(**{**settings, **overrides})


@pytest.mark.slow
def test_async_searchers_learn_the_reward_proportional_distribution(local_ray, tmp_path):
    cfg = tabular_config()
    trainer, policy = tabular_trainer(cfg, tmp_path)
    before = jsd(policy.terminal_distribution(), target_distribution())
    history = trainer.train()
    after = jsd(policy.terminal_distribution(), target_distribution())
    assert len(history) == 250 and after <= 0.05 and after < before / 10, (before, after)
    # off-policy but bounded: nothing older than max_staleness trainer steps is trained on
    assert max(h["staleness_max"] for h in history) <= cfg.max_staleness
    assert all(h["searcher_trajectories_per_s"] >= 0 for h in history) and history[-1]["buffer_size"] > 0


@pytest.mark.slow
@pytest.mark.parametrize("transport", ["object_store", "collective"])
def test_a_killed_searcher_is_restarted_and_training_goes_on(local_ray, tmp_path, transport, tiny_world_problems):
    cfg = tabular_config(num_train_steps=30, weight_transport=transport)
    trainer, _ = tabular_trainer(cfg, tmp_path, kill_searcher_at=10, problems=tiny_world_problems)
    history = trainer.train()
    assert [h["step"] for h in history] == list(range(1, 31))
    assert history[-1]["searcher_restarts"] >= 1
    killed = trainer.last_status[0]
    # a new process, started from the 4 MB problem set, whose trajectories carry weights published after its death
    assert killed["restarted"] and killed["pid"] != trainer.killed_pid and killed["sampled_version"] > 10, killed
    # every searcher, the restarted one too, samples with weights published after the restart
    assert all(status["version"] > 10 for status in trainer.last_status), trainer.last_status
    expected = "gloo" if transport == "collective" else None  # collective on CPU: gloo
    assert all(status["channel"] == expected for status in trainer.last_status), trainer.last_status


@pytest.mark.slow
def test_a_searcher_that_keeps_dying_stops_the_run_naming_the_restart_bound(local_ray, tmp_path):
    cfg = tabular_config(num_train_steps=60, searcher_max_restarts=0)
    trainer, _ = tabular_trainer(cfg, tmp_path, kill_searcher_at=3, rejoin=False)
    with pytest.raises(RuntimeError, match=r"searcher 0 stopped and is not restarted again .*gfn\.searcher_max_restarts=0"):
        trainer.train()


@pytest.mark.slow
def test_a_restarted_trainer_resumes_with_its_buffer(local_ray, tmp_path):
    cfg = tabular_config(num_train_steps=12, save_every=4, max_staleness=None)
    first, _ = tabular_trainer(cfg, tmp_path, interrupt_at=6)
    with pytest.raises(KeyboardInterrupt):
        first.train()
    saved = checkpoint.read_state(tmp_path / "checkpoints" / "step-00000004", "trainer")["loop"]["store"]
    assert len(saved["buffer"]["items"]) > 0  # the buffer is persisted with the checkpoint (JSON)
    second, _ = tabular_trainer(cfg, tmp_path)
    history = second.train()
    assert second.restored == saved  # and given back to the store before the searchers start again
    assert [h["step"] for h in history] == list(range(5, 13))  # resumed after step 4
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, 13))


def test_ppo_is_refused_in_async_mode():
    from pipeline.finetune.run import preflight

    with pytest.raises(ValueError, match="PPO is on-policy"):
        preflight(load_config(REPO / "configs" / "tiny.yaml", ["ppo.mode=async"]), "ppo")
    with pytest.raises(ValueError, match="mode must be one of sync | async"):
        preflight(load_config(REPO / "configs" / "tiny.yaml", ["gfn.mode=later"]), "gfn")


@pytest.mark.slow
def test_the_stage_in_async_mode_writes_what_the_synchronous_one_writes(random_tiny_world, tmp_path):
    world = random_tiny_world
    args = ["--config", str(REPO / "configs" / "tiny.yaml"), f"runs_root={tmp_path}", "run=a", f"model.policy={world / 'policy'}",
            f"model.prm={world / 'prm'}", f"data.train_path={world / 'problems_train.jsonl'}", "generation.max_new_tokens=24",
            "gfn.mode=async", "gfn.loss=tb_vargrad", "gfn.num_train_steps=4", "gfn.questions_per_step=2", "gfn.samples_per_question=4",
            "gfn.searchers=2", "gfn.save_every=2", "gfn.max_staleness=3"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    process = subprocess.Popen([sys.executable, "-m", "stages.train_gfn", *args], cwd=REPO, env=env, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        out, _ = process.communicate(timeout=300)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait(timeout=30)
    assert process.returncode == 0, out[-4000:]
    gfn = tmp_path / "a" / "gfn"
    for name in ("model/config.json", "model/model.safetensors", "metrics.jsonl", "training_curves.png"):
        assert (gfn / name).exists(), name
    assert not (gfn / "checkpoints").exists()
    records = [json.loads(line) for line in (gfn / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    for record in records:
        assert {"loss", "avg_reward", "proportionality_gap", "staleness_mean", "staleness_max", "buffer_size"} <= set(record)
        assert 0 <= record["staleness_max"] <= 3 and math.isfinite(record["loss"])


# ----------------------------------------------------------------------------- launch checks


def unused_port() -> int:
    """A local TCP port nothing listens on (bound, then released)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.mark.slow
def test_an_unreachable_cluster_fails_within_the_connect_timeout_naming_the_key(random_tiny_world, tmp_path):
    world, port = random_tiny_world, unused_port()
    args = ["--config", str(REPO / "configs" / "tiny.yaml"), f"runs_root={tmp_path}", "run=a", f"model.policy={world / 'policy'}",
            f"model.prm={world / 'prm'}", f"data.train_path={world / 'problems_train.jsonl'}", "gfn.mode=async",
            "gfn.loss=tb_vargrad", f"gfn.ray_address=127.0.0.1:{port}", "gfn.ray_connect_timeout=3"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    process = subprocess.Popen([sys.executable, "-m", "stages.train_gfn", *args], cwd=REPO, env=env, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        out, _ = process.communicate(timeout=120)  # Ray's own retries went on for minutes
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait(timeout=30)
    assert process.returncode != 0
    line = f"gfn.ray_address=127.0.0.1:{port}: no Ray cluster answered at 127.0.0.1:{port} within 3 s (gfn.ray_connect_timeout"
    assert line in out, out[-4000:]
    assert "gfn: failed after" in out and "gfn: finished" not in out, out[-4000:]  # a crash is reported as one
    assert not (tmp_path / "a" / "gfn" / "model").exists()


def test_auto_without_a_cluster_says_how_to_start_one(tmp_path, monkeypatch):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setenv("RAY_TMPDIR", str(tmp_path))  # where `ray start` records its cluster: nothing there
    with pytest.raises(ray_cluster.ClusterError, match=r"gfn\.ray_address=auto: no running Ray cluster found .*`ray start --head`"):
        ray_cluster.resolve_address("auto")
    (tmp_path / "ray").mkdir()
    (tmp_path / "ray" / "ray_current_cluster").write_text("10.0.0.7:6379\n")
    assert ray_cluster.resolve_address("auto") == "10.0.0.7:6379"  # the cluster `ray start --head` recorded
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.8:6379")
    assert ray_cluster.resolve_address("auto") == "10.0.0.8:6379"
    assert ray_cluster.resolve_address(None) is None  # a local instance


def test_async_under_several_trainer_processes_needs_a_cluster_address(monkeypatch):
    from pipeline.finetune import run

    monkeypatch.setattr(run, "process_count", lambda model_config: 2)  # as under `accelerate launch --num_processes 2`
    with pytest.raises(ValueError, match=r"gfn.mode=async under 2 trainer processes needs gfn\.ray_address.*`ray start --head`"):
        run.preflight(load_config(REPO / "configs" / "tiny.yaml", ["gfn.mode=async", "gfn.questions_per_step=2"]), "gfn")
    run.preflight(load_config(REPO / "configs" / "tiny.yaml", ["gfn.mode=async", "gfn.questions_per_step=2",
                                                               "gfn.ray_address=auto"]), "gfn")
    with pytest.raises(ValueError, match=r"gfn\.questions_per_step=3 must be a positive multiple"):
        run.preflight(load_config(REPO / "configs" / "tiny.yaml", ["gfn.questions_per_step=3"]), "gfn")


def test_searchers_are_checked_against_what_the_cluster_offers(caplog):
    cfg = GFNConfig(mode="async", searchers=1000)
    with pytest.raises(ValueError, match=r"gfn\.searchers=1000 needs 1000 CPUs \(1 per searcher\) but the local Ray instance has 2"):
        ray_cluster.check_searchers_fit(cfg, {"CPU": 2.0, "memory": 8 * 2**30}, 2**20, "the local Ray instance")
    cfg = GFNConfig(mode="async", searchers=3, searcher_gpus=0.5)
    with pytest.raises(ValueError, match=r"gfn\.searchers=3 x gfn\.searcher_gpus=0.5 = 1.5 GPUs but .* has 1"):
        ray_cluster.check_searchers_fit(cfg, {"CPU": 8.0, "GPU": 1.0}, 2**20, "the cluster")
    cfg = GFNConfig(mode="async", searchers=2)
    warnings = ray_cluster.check_searchers_fit(cfg, {"CPU": 2.0, "memory": 2**30}, 2**30, "the local Ray instance")
    assert len(warnings) == 1 and "gfn.searchers=2 x about 1.00 GiB each" in warnings[0] and "2.0 GiB, more than the 1.0 GiB" in warnings[0]
    assert ray_cluster.check_searchers_fit(cfg, {"CPU": 2.0, "memory": 8 * 2**30}, 2**30, "the local Ray instance") == []


@pytest.mark.slow
def test_too_many_searchers_are_refused_before_any_model_loads_and_ray_is_shut_down(tmp_path):
    from pipeline.finetune.run import finetune_policy
    from pipeline.records import Problem

    assert not ray.is_initialized()
    searchers = (os.cpu_count() or 1) * 100  # more than a local instance (one CPU per core) can run
    config = load_config(REPO / "configs" / "tiny.yaml", [f"runs_root={tmp_path}", "gfn.mode=async", f"gfn.searchers={searchers}",
                                                          f"model.policy={tmp_path / 'no-such-policy'}"])
    problems = [Problem("p0", "1 + 1?", "2", "tiny")]
    try:
        with pytest.raises(ValueError, match=rf"gfn\.searchers={searchers} needs {searchers} CPUs"):
            finetune_policy(config, "gfn", problems, lambda: None, tmp_path / "gfn", progress=False)
        assert not ray.is_initialized()  # the local instance the stage started is shut down
    finally:
        ray.shutdown()

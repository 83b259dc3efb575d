"""The asynchronous mode (TBA on Ray): searcher actors fill the store, the trainer draws from it.

A local Ray instance with one or two searcher actors and many questions: on the enumerable
environment of tests/test_gflownet.py (exact R/Z known), on a wide one (20 letters x 3 steps: a
question's samples do not repeat, so lockstep async and sync train on the same rows), and through
the stage CLI on a random tiny world; a searcher killed while the problems it starts from are the
tiny world's 4 MB training set; the launch checks (cluster address, searchers against the
cluster) without searchers. Every test shuts Ray down, also on failure, and is bounded in time
(the trainer's wait for a batch has a deadline here).
"""

from __future__ import annotations

import functools
import json
import math
import os
import signal
import socket
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

ray = pytest.importorskip("ray")

from async_trainers import DeadlineTrainer  # noqa: E402
from processes import run_bounded  # noqa: E402

from pipeline.config.loader import load_config  # noqa: E402
from pipeline.config.schema import GFNConfig, ModelConfig, TinyWorldConfig  # noqa: E402
from pipeline.finetune.objectives import build_objective  # noqa: E402
from pipeline.finetune.policy import SampledSolution  # noqa: E402
from pipeline.finetune.run import optimizer_settings  # noqa: E402
from pipeline.finetune.sampling import TrainProblem, TrajectorySampler  # noqa: E402
from pipeline.finetune.tba import ray_cluster  # noqa: E402
from pipeline.finetune.tba.settings import searcher_config  # noqa: E402
from pipeline.finetune.trainer import FinetuneTrainer  # noqa: E402
from pipeline.tinyworld.problems import generate_splits  # noqa: E402
from pipeline.training import TrainingBase, checkpoint_io, make_accelerator  # noqa: E402

TESTS = Path(__file__).resolve().parent
REPO = TESTS.parent
sys.path.insert(0, str(TESTS))
from test_gflownet import KnownScorer, TabularPolicy, jsd, target_distribution  # noqa: E402


def start_local_ray(**resources) -> None:
    """A local Ray instance whose workers can import this test's modules (``resources``: num_cpus, num_gpus)."""
    ray.init(
        include_dashboard=False,
        log_to_driver=False,
        namespace=f"test-{os.getpid()}-{time.monotonic_ns()}",
        runtime_env={"env_vars": {"PYTHONPATH": os.pathsep.join([str(TESTS), str(REPO)]), "OMP_NUM_THREADS": "1"}},
        **resources,
    )


@pytest.fixture
def local_ray():
    """A local Ray instance of 2 CPUs; always shut down."""
    start_local_ray(num_cpus=2)
    try:
        yield
    finally:
        ray.shutdown()


@pytest.fixture
def ray_with_four_cpus():
    """A local Ray instance that advertises 4 CPUs (logical: three searchers and a trainer beside
    them on this 2-core machine); always shut down."""
    start_local_ray(num_cpus=4)
    try:
        yield
    finally:
        ray.shutdown()


def every_step_answers(step, kind):
    return step


def all_correct(texts, golds, kind):
    return [True] * len(texts)


def problems(n: int) -> list[TrainProblem]:
    """n questions (the policies here ignore the prompt: every question is the same environment)."""
    return [TrainProblem(f"p{i}", f"q{i}", f"q{i}", "1") for i in range(n)]


LETTERS = "abcdefghijklmnopqrst"
WIDE_DEPTH = 3


class WidePolicy(torch.nn.Module):
    """Per depth a softmax over 20 letters and stop (8420 terminal states; stopping at s_0 is
    practically ruled out by a fixed -30 on its logit): K samples of a question do not repeat."""

    def __init__(self):
        super().__init__()
        self.logits = torch.nn.Parameter(torch.zeros(WIDE_DEPTH, len(LETTERS) + 1))
        offset = torch.zeros(WIDE_DEPTH, len(LETTERS) + 1)
        offset[0, -1] = -30.0
        self.register_buffer("offset", offset)

    def dist(self, depth: int) -> torch.Tensor:
        if depth == WIDE_DEPTH:
            return torch.tensor([-math.inf] * len(LETTERS) + [0.0])
        return torch.log_softmax(self.logits[depth] + self.offset[depth], dim=-1)

    def sample(self, prompts, n, temperature, seed=None):
        out = []
        for prompt_seed in seed:
            generator = torch.Generator().manual_seed(prompt_seed)
            solutions = []
            for _ in range(n):
                steps = []
                while True:
                    probs = torch.softmax(self.dist(len(steps)).detach() / temperature, -1)
                    action = int(torch.multinomial(probs, 1, generator=generator))
                    if action == len(LETTERS):
                        break
                    steps.append(LETTERS[action])
                solutions.append(SampledSolution(steps, True, len(steps)))
            out.append(solutions)
        return out

    def logprobs(self, prompts, step_lists, with_grad, return_entropy=False, return_hidden=False):
        width = max(len(steps) for steps in step_lists)
        step_rows, stop_rows = [], []
        for steps in step_lists:
            dists = [self.dist(k) for k in range(len(steps) + 1)]
            pad = [torch.zeros(())] * (width - len(steps))
            step_rows.append(torch.stack([dists[k][LETTERS.index(a)] for k, a in enumerate(steps)] + pad))
            stop_rows.append(torch.stack([d[-1] for d in dists] + pad))
        return SimpleNamespace(step_logprobs=torch.stack(step_rows), termination_logprobs=torch.stack(stop_rows))

    def trajectory_logprob(self, steps) -> float:
        """log pi(tau), steps and stop, as the sampler records it for a reference (float)."""
        with torch.no_grad():
            lp = self.logprobs(None, [steps], with_grad=False)
        return float(lp.step_logprobs[0, : len(steps)].sum() + lp.termination_logprobs[0, len(steps)])

    def after_update(self, version, weights=None):
        pass  # it samples from its live parameters

    def plain_stream(self, weights):
        return weights  # no LoRA to merge

    def load_weights(self, state, version):  # an asynchronous searcher's copy
        self.load_state_dict(dict(state))  # a state dict or a stream of (name, tensor)


class LinearWidePolicy(WidePolicy):
    """WidePolicy whose logits are a Linear layer's weight (logits at depth d = table.weight[:, d]),
    so that peft can put a LoRA adapter on it, as on a language model's projections."""

    def __init__(self):
        torch.nn.Module.__init__(self)
        self.table = torch.nn.Linear(WIDE_DEPTH, len(LETTERS) + 1, bias=False)
        torch.nn.init.zeros_(self.table.weight)
        offset = torch.zeros(WIDE_DEPTH, len(LETTERS) + 1)
        offset[0, -1] = -30.0
        self.register_buffer("offset", offset)

    def dist(self, depth: int) -> torch.Tensor:
        if depth == WIDE_DEPTH:
            return torch.tensor([-math.inf] * len(LETTERS) + [0.0])
        onehot = torch.nn.functional.one_hot(torch.tensor(depth), WIDE_DEPTH).float()
        return torch.log_softmax(self.table(onehot) + self.offset[depth], dim=-1)


def lora_wide_policy():
    """A LinearWidePolicy with a LoRA adapter on its table (r = 2, alpha = 4), the same adapter
    initialisation every time; its B made non-zero, so a publication that forgot B A is seen."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(11)
    model = get_peft_model(LinearWidePolicy(), LoraConfig(r=2, lora_alpha=4, target_modules=["table"]))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(0.3 * torch.randn_like(p))
    return model


class WideScorer:
    """Later letters score higher: U(letter) in [0.3, 0.95]."""

    def log_scores_many(self, pairs):
        return [[math.log(0.3 + 0.65 * LETTERS.index(a) / (len(LETTERS) - 1)) for a in steps] for _, steps in pairs]


def searcher_problems(given: list[dict], questions: int) -> list[TrainProblem]:
    """The problems a searcher was started from (read from Ray's object store), or ``questions``
    made-up ones when the trainer was given none (the policies here ignore the prompt)."""
    if not given:
        return problems(questions)
    return [TrainProblem(p["problem_id"], p["question"], p["question"], p["answer"]) for p in given]


def tabular_sampler(cfg, index, given: list[dict] = (), questions: int = 12):
    """A searcher's sampler (built inside its actor): its own tabular policy, the known scores."""
    return TrajectorySampler(
        TabularPolicy(),
        KnownScorer(),
        searcher_problems(given, questions),
        "tiny",
        searcher_config(cfg, index),
        extract=every_step_answers,
        grade=all_correct,
    )


def wide_sampler(cfg, index, given: list[dict] = (), questions: int = 12, record_own_logprobs: bool = False):
    """A searcher's sampler on the wide environment. record_own_logprobs: the sampler's reference is
    its own policy, so each trajectory records log pi(tau) under the weights that sampled it."""
    policy = WidePolicy()
    return TrajectorySampler(
        policy,
        WideScorer(),
        searcher_problems(given, questions),
        "tiny",
        searcher_config(cfg, index),
        reference=policy if record_own_logprobs else None,
        extract=every_step_answers,
        grade=all_correct,
    )


def linear_wide_sampler(cfg, index, given: list[dict] = (), questions: int = 12):
    """A searcher's sampler holding a plain LinearWidePolicy: it loads the published weights (LoRA
    merged) by name, strictly."""
    return TrajectorySampler(
        LinearWidePolicy(),
        WideScorer(),
        searcher_problems(given, questions),
        "tiny",
        searcher_config(cfg, index),
        extract=every_step_answers,
        grade=all_correct,
    )


def pooled_wide_sampler(cfg, index, given: list[dict] = (), questions: int = 12):
    """A searcher's sampler on the wide environment with no scorer of its own: it scores through the
    scorer actors (PooledScorer), as pipeline.finetune.run.searcher_sampler builds it with gfn.scorer_actors > 0."""
    from pipeline.finetune.tba.scorers import PooledScorer

    return TrajectorySampler(
        WidePolicy(),
        PooledScorer(cfg.scorer_actors, index),
        searcher_problems(given, questions),
        "tiny",
        searcher_config(cfg, index),
        extract=every_step_answers,
        grade=all_correct,
    )


@pytest.fixture(scope="module")
def tiny_world_problems() -> list[dict]:
    """The tiny world's default training set size (6,000 problems, about 4 MB as JSON): the size
    at which a searcher built from a large actor argument could not be restarted."""
    problems = [p.to_json() for p in generate_splits(TinyWorldConfig(n_train=6000, n_val=1, n_test=1))["train"]]
    assert len(json.dumps(problems)) >= 4_000_000
    return problems


def rejoined(trainer, index: int, after: int) -> bool:
    """Whether searcher ``index``, restarted by Ray, has sent trajectories sampled with weights
    published after step ``after`` (a restarting searcher does not answer yet: False)."""
    try:
        status = ray.get(trainer.searchers[index].status.remote(), timeout=5)
    except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
        return False
    return status["restarted"] and status["sampled_version"] > after


def tabular_trainer(
    cfg,
    out: Path,
    interrupt_at: int | None = None,
    kill_searcher_at: int | None = None,
    policy=None,
    make_sampler=None,
    questions: int = 12,
    wait_seconds: float = 120.0,
    given: list[dict] = (),
    rejoin: bool = True,
    export=None,
    publish_dtype: torch.dtype | None = None,
    make_scorer=None,
    stage_export: bool = False,
):
    """The asynchronous trainer around a tabular policy (TabularPolicy unless ``policy``), keeping
    every published state (``published``: version -> weights) and the store's last contents.
    given: the problems the searchers start from (through Ray's object store); kill_searcher_at: the
    step at which searcher 0's process is SIGKILLed; rejoin: the test waits for it to come back;
    export: what is published (the policy's state dict unless given); stage_export: what the stage
    publishes instead (pipeline.finetune.tba.publication.published_weights: the training base's stream, LoRA
    merged by LMPolicy.plain_stream, in publish_dtype or float32); make_scorer: what each scorer
    actor (gfn.scorer_actors) builds its PRM with. Under torchrun, every process of the group is one
    of the trainer's."""
    from pipeline.training.distributed import Collective

    torch.manual_seed(0)
    policy = policy if policy is not None else TabularPolicy()
    objective = build_objective(cfg, policy, hidden_size=8)
    base = TrainingBase(
        make_accelerator(ModelConfig(device="cpu", dtype="float32")),
        policy,
        optimizer_settings(cfg, 1),
        out,
        objective=objective,
        objective_lr=objective.lr,
        save_every=cfg.save_every,
        progress=False,
    )
    sampler = TrajectorySampler(policy, None, problems(questions), "tiny", cfg, collective=Collective(base.accelerator))

    class Trainer(DeadlineTrainer):
        published_states: dict = {}
        rejoined = False
        deadline_seconds = wait_seconds

        def publish(self):
            self.published_states[self.step] = {k: v.detach().clone() for k, v in policy.state_dict().items()}
            super().publish()

        def prepare(self):
            super().prepare()
            self.restored = self._resumed_store  # what the checkpoint gave back to the store

        def train_step(self):
            if self.step == interrupt_at:
                raise KeyboardInterrupt  # the trainer process dies here
            if self.step == kill_searcher_at:  # SIGKILL of its process: Ray restarts it; training goes on meanwhile
                self.killed_pid = ray.get(self.searchers[0].status.remote(), timeout=60)["pid"]
                os.kill(self.killed_pid, signal.SIGKILL)
                if not rejoin:  # the next steps run only once Ray reports the loop's end (bounded): on busy
                    # cores Ray took longer to declare the actor dead than 57 tabular steps took to run
                    done, _ = ray.wait(self.runs[:1], timeout=60)
                    assert done, "Ray did not report searcher 0's loop ended within 60 s of its SIGKILL"
            if rejoin and kill_searcher_at is not None and self.step > kill_searcher_at and not self.rejoined:
                # until the restarted searcher has sampled with weights published after its death, each
                # step waits a second (Ray takes seconds to start a worker); the steps publish as always
                self.rejoined = rejoined(self, 0, after=kill_searcher_at)
                if not self.rejoined:
                    time.sleep(1.0)
            return super().train_step()

        def stop(self):
            if self.searchers and rejoin:  # before the actors go (all alive: a searcher not left dead)
                self.last_status = ray.get([searcher.status.remote() for searcher in self.searchers], timeout=60)
                self.scorer_status = ray.get([scorer.status.remote() for scorer in self.scorers], timeout=60)
                self.last_store = ray.get(self.store.state_dict.remote(), timeout=60)
            super().stop()

    if stage_export:
        from pipeline.finetune.policy import LMPolicy
        from pipeline.finetune.run import trained_lora_scaling
        from pipeline.finetune.tba.publication import published_weights
        from pipeline.modeling import lora_fan_in_fan_out

        stage_policy = LMPolicy(
            policy, None, lora_scaling=trained_lora_scaling(policy), lora_fan_in_fan_out=lora_fan_in_fan_out(policy)
        )
        export = functools.partial(published_weights, stage_policy, base, publish_dtype or torch.float32)
    export = export or (lambda: {k: v.detach().clone() for k, v in policy.state_dict().items()})
    make_sampler = make_sampler or functools.partial(tabular_sampler, cfg, questions=questions)
    return Trainer(
        base,
        sampler,
        objective,
        cfg,
        make_sampler,
        export,
        problems=list(given),
        progress=False,
        publish_dtype=publish_dtype,
        make_scorer=make_scorer,
    ), policy


def tabular_config(**overrides) -> GFNConfig:
    settings = dict(
        loss="tb_vargrad",
        lr=0.1,
        scheduler="constant",
        warmup_steps=0,
        num_train_steps=250,
        questions_per_step=4,
        samples_per_question=8,
        async_samples_used=4,
        micro_batch_size=64,
        temperature=1.0,
        save_every=0,
        grad_clip=10.0,
        mode="async",
        searchers=2,
        sync_every=1,
        max_staleness=4,
        buffer_size=200,
    )
    return GFNConfig(**{**settings, **overrides})


@pytest.mark.slow
def test_async_searchers_learn_the_reward_proportional_distribution(local_ray, tmp_path):
    cfg = tabular_config()  # 12 questions, 4 per step, K = 4 of S = 8
    trainer, policy = tabular_trainer(cfg, tmp_path)
    before = jsd(policy.terminal_distribution(), target_distribution())
    history = trainer.train()
    after = jsd(policy.terminal_distribution(), target_distribution())
    assert len(history) == 250 and after <= 0.05 and after < before / 10, (before, after)
    # off-policy but bounded: nothing older than max_staleness trainer steps is trained on
    assert max(h["staleness_max"] for h in history) <= cfg.max_staleness
    assert all(h["searcher_trajectories_per_s"] >= 0 for h in history) and history[-1]["buffer_size"] > 0


def assert_recorded_logprobs_are_the_published_weights(trainer, trajectories, before: int | None = None) -> int:
    """Each trajectory's recorded log pi(tau) (the searcher's own policy as its reference) equals the
    log-prob under the weights published at its version; and the check can tell versions apart: for
    most trajectories (at least half) the log-prob under the version before it (or, with ``before``,
    under the newest version published at or before that step) differs by more than 1e-4, which a
    searcher sampling with older weights than it reports would not match. A single trajectory's
    probability may move less than that in one update. Returns how many were checked."""
    checked, distinguishable = 0, 0
    for trajectory in trajectories:
        version = trajectory.policy_version
        older = [v for v in trainer.published_states if v < version and (before is None or v <= before)]
        if not older:
            continue
        recorded = sum(trajectory.reference_step_logprobs) + trajectory.reference_stop_logprob
        policy = WidePolicy()
        policy.load_state_dict(trainer.published_states[version])
        assert recorded == pytest.approx(policy.trajectory_logprob(trajectory.steps), abs=1e-5), (
            version,
            trajectory.steps,
        )
        policy.load_state_dict(trainer.published_states[max(older)])
        distinguishable += abs(recorded - policy.trajectory_logprob(trajectory.steps)) > 1e-4
        checked += 1
    assert 2 * distinguishable >= checked, (
        f"only {distinguishable} of {checked} trajectories tell their version from the one before"
    )
    return checked


def stored(trainer) -> list:
    from pipeline.records import Trajectory

    return [Trajectory.from_json(obj, "store") for obj in trainer.last_store["buffer"]["items"]]


@pytest.mark.slow
@pytest.mark.parametrize("transport", ["object_store", "collective"])
def test_a_killed_searcher_is_restarted_and_samples_with_the_newest_weights(
    local_ray, tmp_path, transport, tiny_world_problems
):
    cfg = tabular_config(num_train_steps=40, weight_transport=transport, lr=0.05)
    trainer, _ = tabular_trainer(
        cfg,
        tmp_path,
        kill_searcher_at=6,
        policy=WidePolicy(),
        given=tiny_world_problems,
        make_sampler=functools.partial(wide_sampler, cfg, record_own_logprobs=True),
    )
    history = trainer.train()
    assert [h["step"] for h in history] == list(range(1, 41))
    assert history[-1]["searcher_restarts"] >= 1 and trainer.rejoined
    killed = trainer.last_status[0]  # a new process, started again from the 4 MB problem set
    assert killed["restarted"] and killed["pid"] != trainer.killed_pid, killed
    # every searcher, the restarted one too, took weights published after the restart (the test publishes nothing)
    assert all(status["version"] > 6 for status in trainer.last_status), trainer.last_status
    expected = "gloo" if transport == "collective" else None  # collective on CPU: gloo
    assert all(status["channel"] == expected for status in trainer.last_status), trainer.last_status
    # and what the searchers recorded is what those weights give
    # and what the searchers recorded after the kill is what the newest weights give, not the weights before it
    later = [t for t in stored(trainer) if t.policy_version > 6]
    assert assert_recorded_logprobs_are_the_published_weights(trainer, later, before=6) > 0


class RecordingPolicy(TabularPolicy):
    """A searcher's tabular policy that writes every state it is given to
    ``folder/searcher<index>-v<version>-<process id>.safetensors`` (renamed into place whole)."""

    def __init__(self, folder: Path, index: int):
        super().__init__()
        self.folder, self.searcher = Path(folder), index

    def load_weights(self, state, version):
        from safetensors.torch import save_file

        path = self.folder / f"searcher{self.searcher}-v{version}-{os.getpid()}.safetensors"
        save_file({k: v.clone() for k, v in state.items()}, str(path.with_suffix(".partial")))
        os.replace(path.with_suffix(".partial"), path)


def recording_sampler(cfg, folder: Path, index, given: list[dict] = (), questions: int = 12):
    return TrajectorySampler(
        RecordingPolicy(folder, index),
        KnownScorer(),
        searcher_problems(given, questions),
        "tiny",
        searcher_config(cfg, index),
        extract=every_step_answers,
        grade=all_correct,
    )


def received(folder: Path, index: int, version: int) -> dict[int, dict]:
    """What searcher ``index`` loaded as ``version``: process id -> state."""
    from safetensors.torch import load_file

    return {
        int(path.stem.rsplit("-", 1)[1]): load_file(str(path))
        for path in folder.glob(f"searcher{index}-v{version}-*.safetensors")
    }


def wait_for(condition, what: str, seconds: float = 120.0):
    """``condition()``'s first truthy value, polled; a bounded wait."""
    deadline = time.monotonic() + seconds
    while not (value := condition()):
        assert time.monotonic() < deadline, f"timed out after {seconds:g} s waiting for {what}"
        time.sleep(0.1)
    return value


def answering(searcher) -> dict | None:
    """A searcher's status, or None while Ray restarts it."""
    try:
        return ray.get(searcher.status.remote(), timeout=5)
    except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
        return None


@pytest.mark.slow
@pytest.mark.parametrize("transport", ["object_store", "collective"])
def test_a_bucketed_publication_reaches_every_searcher_with_identical_weights(ray_with_four_cpus, tmp_path, transport):
    """Three searchers, weights cast to bfloat16 in buckets of 96 bytes (several), one publication
    for all; then searcher 0 is SIGKILLed: its new process takes the current weights (the object
    store's when it starts; the collective's at the next publication, in a new group of all three).
    Then what the stage publishes (pipeline.finetune.tba.publication.published_weights: a LoRA model's stream,
    the adapter merged, cast to bfloat16), another layout (the collective forms a new group for it):
    every searcher loads exactly the trainer's merged weights cast to bfloat16."""
    folder = tmp_path / "received"
    folder.mkdir()
    cfg = tabular_config(
        searchers=3, weight_transport=transport, publish_bucket_mb=96 / 2**20, searcher_rounds_per_version=1
    )
    generator = torch.Generator().manual_seed(1)
    state = {
        "embed.weight": torch.randn(8, 6, generator=generator),
        "bias": torch.randn(6, generator=generator, dtype=torch.float64),
        "norm.weight": torch.randn(5, generator=generator).to(torch.bfloat16),
        "position": torch.arange(9),
        "transposed": torch.randn(3, 7, generator=generator).t(),
    }
    trainer, _ = tabular_trainer(
        cfg,
        tmp_path / "trainer",
        export=lambda: state,
        publish_dtype=torch.bfloat16,
        make_sampler=functools.partial(recording_sampler, cfg, folder),
    )

    def published_as(version: int, pids_before: dict[int, int], searchers=range(3), source=None) -> dict[int, int]:
        """Each of ``searchers`` loaded ``source`` (default ``state``) in bfloat16, bit for bit, as
        ``version`` (from a new process where it had one before); returns searcher -> process id."""
        source = state if source is None else source
        expected = {k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in source.items()}
        pids = {}
        for index in searchers:
            copies = wait_for(
                lambda: {
                    pid: got for pid, got in received(folder, index, version).items() if pid != pids_before.get(index)
                },
                f"searcher {index} to load version {version}",
            )
            [(pids[index], got)] = copies.items()
            assert sorted(got) == sorted(expected), index  # (safetensors keeps names sorted)
            for name, value in expected.items():
                assert got[name].dtype == value.dtype and torch.equal(got[name], value), (index, name)
        return pids

    trainer.start()
    try:
        trainer.base.step = (
            1  # the version published: training step 1 (TB-VarGrad: one optimizer step per training step)
        )
        trainer.publish()
        trainer.keep_searching()
        trainer.publisher.wait()
        [publication] = trainer.publisher.take_finished()
        raw = 2 * (48 + 6 + 5 + 21) + 8 * 9  # bfloat16 floats, int64 positions
        assert (
            publication.version == 1 and publication.buckets >= 3 and raw <= publication.bytes < raw + 16 * len(state)
        )
        assert publication.searchers == (3 if transport == "collective" else None)
        pids = published_as(1, {})
        trainer.keep_searching()  # raises an error a searcher's loop ended with
        os.kill(pids[0], signal.SIGKILL)
        wait_for(
            lambda: (status := answering(trainer.searchers[0])) and status["restarted"], "searcher 0 to be restarted"
        )
        if transport == "object_store":  # the restarted searcher reads the newest references as it starts
            published_as(1, {0: pids[0]}, searchers=[0])
        state["embed.weight"].add_(1.0)
        state["position"].add_(1)
        trainer.base.step = 2
        trainer.publish()
        trainer.publisher.wait()
        [publication] = trainer.publisher.take_finished()
        assert publication.searchers == (3 if transport == "collective" else None)  # a new group with the restarted one
        published_as(2, {0: pids[0]})
        trainer.keep_searching()

        from pipeline.finetune.policy import LMPolicy
        from pipeline.finetune.run import trained_lora_scaling
        from pipeline.finetune.tba.publication import published_weights

        lora = lora_wide_policy()
        stage_base = TrainingBase(
            make_accelerator(ModelConfig(device="cpu", dtype="float32")),
            lora,
            optimizer_settings(cfg, 1),
            tmp_path / "stage",
            progress=False,
        )
        stage_policy = LMPolicy(lora, None, lora_scaling=trained_lora_scaling(lora))
        trainer.export = functools.partial(published_weights, stage_policy, stage_base, torch.bfloat16)
        params = {k.removeprefix("base_model.model.table."): v.detach() for k, v in lora.named_parameters()}
        merged = {  # W + alpha / r B A in float32 (the trainer's), cast by published_as to bfloat16
            "offset": lora.offset,
            "table.weight": params["base_layer.weight"]
            + (4 / 2) * (params["lora_B.default.weight"] @ params["lora_A.default.weight"]),
        }
        trainer.base.step = 3
        trainer.publish()
        trainer.publisher.wait()
        [publication] = trainer.publisher.take_finished()
        assert publication.searchers == (3 if transport == "collective" else None)
        published_as(3, {}, source=merged)
        trainer.keep_searching()
    finally:
        trainer.stop()


@pytest.mark.slow
def test_a_two_process_trainer_joins_one_ray_cluster_once_from_its_main_process(tmp_path, monkeypatch):
    """torchrun, 2 processes (gloo), gfn.ray_address = this test's Ray instance: the main process
    calls ray.init once (one driver, one job besides this test's), the other never; every step's
    batch is split between them (disjoint questions, B / 2 each) and weights go over the collective."""
    # the workers of every job on this instance import the tests' modules (the trainer's job sets only thread counts)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(TESTS), str(REPO), os.environ.get("PYTHONPATH", "")]))
    start_local_ray(num_cpus=4)
    try:
        address, own_job = ray.get_runtime_context().gcs_address, ray.get_runtime_context().get_job_id()
        command = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc_per_node",
            "2",
            "--master_port",
            str(unused_port()),
            str(TESTS / "async_two_ranks.py"),
            address,
            str(tmp_path),
        ]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
        returncode, out = run_bounded(command, env=env, timeout=240)
        assert returncode == 0, out[-4000:]
        jobs = [job for job in ray._private.state.jobs() if job["JobID"] != own_job]
    finally:
        ray.shutdown()
    ranks = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in (0, 1)]
    assert [r["world"] for r in ranks] == [2, 2]
    assert ranks[0]["ray_init_calls"] == [address] and ranks[1]["ray_init_calls"] == []  # once, the main process only
    assert len(jobs) == 1 and jobs[0]["DriverPid"] == ranks[0]["pid"], jobs
    assert not ranks[0]["connected_at_end"]  # it disconnected when the run ended
    assert len(ranks[0]["shares"]) == len(ranks[1]["shares"]) == 3
    for mine, theirs in zip(ranks[0]["shares"], ranks[1]["shares"]):
        assert len(mine) == len(theirs) == 2 and not set(mine) & set(theirs)
    for rank in ranks:
        assert [r["step"] for r in rank["records"]] == [1, 2, 3] and all(r["trained"] == 16 for r in rank["records"])
    assert (
        sum(r["publications"] for r in ranks[0]["records"]) >= 2
    )  # the main process published (the last may still run)


def wide_config(**overrides) -> GFNConfig:
    settings = dict(
        loss="tb_vargrad",
        lr=0.05,
        scheduler="constant",
        warmup_steps=0,
        num_train_steps=6,
        questions_per_step=4,
        samples_per_question=4,
        micro_batch_size=64,
        temperature=1.0,
        save_every=0,
        grad_clip=10.0,
        replay_fraction=0.0,
        buffer_size=400,
        seed=3,
    )
    return GFNConfig(**{**settings, **overrides})


@pytest.mark.slow
def test_async_lockstep_equals_sync(local_ray, tmp_path):
    """One searcher, one round per published version, sync period 1, staleness 0, recency 1: the
    trainer trains at step t on the round sampled with the weights of step t, the questions and
    seeds of the synchronous trainer's step t (docs/async.md, "Lockstep equals sync"). Both train a
    LoRA adapter; the asynchronous trainer publishes what the stage publishes
    (pipeline.finetune.tba.publication.published_weights: the training base's stream with the adapter merged,
    float32, over the object store) and the searcher loads it into a plain policy by name."""
    sync_cfg = wide_config()
    sync_policy = lora_wide_policy()
    objective = build_objective(sync_cfg, sync_policy, hidden_size=8)
    base = TrainingBase(
        make_accelerator(ModelConfig(device="cpu", dtype="float32")),
        sync_policy,
        optimizer_settings(sync_cfg, 1),
        tmp_path / "sync",
        objective=objective,
        objective_lr=objective.lr,
        progress=False,
    )
    sampler = TrajectorySampler(
        sync_policy, WideScorer(), problems(12), "tiny", sync_cfg, extract=every_step_answers, grade=all_correct
    )
    sync = FinetuneTrainer(base, sampler, objective, sync_cfg, progress=False).train()

    async_cfg = wide_config(
        mode="async", searchers=1, sync_every=1, max_staleness=0, recency_fraction=1.0, searcher_rounds_per_version=1
    )
    trainer, async_policy = tabular_trainer(
        async_cfg,
        tmp_path / "async",
        policy=lora_wide_policy(),
        make_sampler=functools.partial(linear_wide_sampler, async_cfg),
        stage_export=True,
    )
    lockstep = trainer.train()
    assert [h["questions"] for h in lockstep] == [4] * 6 and all(h["recent_questions"] == 4 for h in lockstep)
    assert all(h["trajectories_per_question_min"] == 4 for h in lockstep)  # the S = K samples did not repeat
    # the same rows in the same order (the objective sorts them) through the same float operations
    assert [h["avg_log_reward"] for h in lockstep] == pytest.approx([h["avg_log_reward"] for h in sync], rel=1e-12)
    assert [h["loss"] for h in lockstep] == pytest.approx([h["loss"] for h in sync], rel=1e-6)
    trained = {k: v for k, v in sync_policy.named_parameters() if v.requires_grad}
    assert sorted(trained) == sorted(k for k, v in async_policy.named_parameters() if v.requires_grad)
    lora = dict(async_policy.named_parameters())
    for name, value in trained.items():  # the adapters (the base weight is frozen)
        torch.testing.assert_close(lora[name].detach(), value.detach(), rtol=0, atol=1e-6)
    untrained = dict(lora_wide_policy().named_parameters())
    assert all(not torch.allclose(value, untrained[name], atol=1e-3) for name, value in trained.items())  # it trained


@pytest.mark.slow
def test_every_tb_vargrad_batch_has_k_distinct_completions_per_question(local_ray, tmp_path):
    cores = sorted(os.sched_getaffinity(0))[:2]  # searcher i pins itself to core_for(i, cores): cores[i % len]
    cfg = wide_config(
        mode="async",
        searchers=2,
        sync_every=2,
        max_staleness=3,
        recency_fraction=0.5,
        num_train_steps=8,
        questions_per_step=4,
        samples_per_question=4,
        async_samples_used=3,
        async_initial_completions=48,
        buffer_size=120,
        searcher_cores=cores,
    )
    trainer, _ = tabular_trainer(
        cfg,
        tmp_path,
        policy=WidePolicy(),
        questions=40,
        make_sampler=functools.partial(wide_sampler, cfg, questions=40, record_own_logprobs=True),
    )
    trainer.train()
    assert [status["cores"] for status in trainer.last_status] == [[cores[0]], [cores[1 % len(cores)]]]
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, 9))
    for record in records:
        assert (
            record["questions"] == 4
            and record["trajectories_per_question_min"] == record["trajectories_per_question_max"] == 3
        )
        assert record["trained"] == 12
        assert record["zero_gradient_fraction"] == 0.0
        assert sum(record["staleness_versions"].values()) == 12 and record["staleness_max"] <= 3
        assert record["generated_per_trained"] >= 0 and record["publish_seconds"] >= 0
        assert record["trainer_idle_seconds"] >= 0 and record["searcher_idle_seconds"] >= 0
        assert record["searcher_weight_load_seconds"] >= 0
        # the WidePolicy's logits and offsets (2 x 3 x 21 float32) in one bucket per finished publication
        assert (
            record["publication_buckets"] == record["publications"]
            and record["publication_bytes"] >= 504 * record["publications"]
        )
    assert (
        sum(r["publications"] for r in records) >= 3
    )  # 5 published (before step 1, after steps 2, 4, 6, 8), the last may still run
    # the searchers sampled with the weights they were published: recorded log-probs are those weights'
    assert assert_recorded_logprobs_are_the_published_weights(trainer, stored(trainer)) > 0


def boundary_run(cfg, out: Path, given: list[dict] = (), questions: int = 12) -> list[dict]:
    """Three steps of the wide environment (no repeats among a question's samples) under ``cfg``,
    two searchers; the metrics records."""
    trainer, _ = tabular_trainer(
        cfg,
        out,
        policy=WidePolicy(),
        questions=questions,
        given=given,
        wait_seconds=60.0,
        make_sampler=functools.partial(wide_sampler, cfg, questions=questions),
    )
    trainer.train()
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_the_smallest_legal_buffer_trains(local_ray, tmp_path):
    """B = 4, S = 4, K = 3: a buffer of (B - 1) x S + K = 15 completions (a round is 16) trains;
    one fewer is refused before Ray is asked for anything, naming the key and the arithmetic."""
    from pipeline.config.loader import ConfigError
    from pipeline.finetune.tba.settings import check_async_settings, smallest_buffer

    cfg = wide_config(mode="async", searchers=2, num_train_steps=3, async_samples_used=3, max_staleness=None)
    cfg.buffer_size = smallest_buffer(cfg)
    assert cfg.buffer_size == 15
    records = boundary_run(cfg, tmp_path)
    assert [r["questions"] for r in records] == [4, 4, 4] and all(r["trained"] == 12 for r in records)
    assert max(r["buffer_size"] for r in records) <= 15 and records[-1]["evicted"] > 0  # it ran full
    cfg.buffer_size = 14
    with pytest.raises(ConfigError, match=r"gfn\.buffer_size = 14 cannot hold .*\(4 - 1\) x 4 \+ 3 = 15"):
        check_async_settings(cfg)


def test_as_many_problems_as_a_batch_trains(local_ray, tmp_path):
    """4 training problems for B = 4 (two searchers, shares of 2, rounds of 4 questions that repeat
    them): every step trains all 4; 3 problems are refused before Ray starts, naming the key."""
    from pipeline.config.loader import ConfigError

    given = [{"problem_id": f"q{i}", "question": f"{i}", "answer": "1"} for i in range(4)]
    cfg = wide_config(mode="async", searchers=2, num_train_steps=3, async_samples_used=3, max_staleness=None)
    records = boundary_run(cfg, tmp_path, given=given, questions=4)
    assert [r["questions"] for r in records] == [4, 4, 4] and all(r["trained"] == 12 for r in records)
    with pytest.raises(ConfigError, match=r"gfn\.questions_per_step = 4 exceeds the 3 training problems"):
        tabular_trainer(cfg, tmp_path / "three", policy=WidePolicy(), given=given[:3])
    assert ray.is_initialized()  # the fixture's instance: refused in the trainer's constructor, nothing started


def test_a_wait_no_round_can_end_stops_the_run_naming_the_cause(local_ray, tmp_path):
    """One searcher, one round per weights version, K = S = 8 on the tabular environment, whose 8
    samples of a question repeat: the round leaves fewer than 4 questions with 8 distinct
    completions and the searcher then waits for weights the trainer publishes only after it trains.
    The trainer's wait ends with an error naming the key, not a warning every 60 s."""
    cfg = tabular_config(
        searchers=1, searcher_rounds_per_version=1, async_samples_used=8, num_train_steps=3, max_staleness=0
    )
    trainer, _ = tabular_trainer(cfg, tmp_path, wait_seconds=30.0, rejoin=False)
    with pytest.raises(RuntimeError, match=r"step 0 cannot get 4 questions x 8 .*searcher_rounds_per_version = 1"):
        trainer.train()


@pytest.mark.slow
def test_a_searcher_that_keeps_dying_stops_the_run_naming_the_restart_bound(local_ray, tmp_path):
    cfg = tabular_config(num_train_steps=60, searcher_max_restarts=0)
    trainer, _ = tabular_trainer(cfg, tmp_path, kill_searcher_at=3, rejoin=False)
    with pytest.raises(
        RuntimeError, match=r"searcher 0 stopped and is not restarted again .*gfn\.searcher_max_restarts=0"
    ):
        trainer.train()


@pytest.mark.slow
def test_a_restarted_trainer_resumes_with_its_buffer(local_ray, tmp_path):
    cfg = tabular_config(num_train_steps=12, save_every=4, max_staleness=None)
    first, _ = tabular_trainer(cfg, tmp_path, interrupt_at=6)
    with pytest.raises(KeyboardInterrupt):
        first.train()
    saved = checkpoint_io.read_state(tmp_path / "checkpoints" / "step-00000004", "trainer")["loop"]["store"]
    assert len(saved["buffer"]["items"]) > 0  # the buffer is persisted with the checkpoint (JSON)
    second, _ = tabular_trainer(cfg, tmp_path)
    history = second.train()
    assert second.restored == saved  # and given back to the store before the searchers start again
    assert [h["step"] for h in history] == list(range(5, 13))  # resumed after step 4
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, 13))


def test_searchers_walk_disjoint_shares_of_the_problems_and_one_searcher_walks_them_all(tmp_path):
    """Two searchers never sample a question at the same time, so the rounds of one weights version
    fill a batch of searchers x questions_per_step distinct questions (docs/async.md, "Who does what")."""
    from pipeline.config.loader import ConfigError
    from pipeline.finetune.tba.settings import searcher_share

    given = [{"problem_id": f"q{i}", "question": f"{i}", "answer": "1"} for i in range(10)]
    for searchers in (1, 3, 10):
        shares = [searcher_share(given, index, searchers) for index in range(searchers)]
        ids = [p["problem_id"] for share in shares for p in share]
        assert sorted(ids) == sorted(p["problem_id"] for p in given) and len(ids) == len(set(ids))
        assert max(map(len, shares)) - min(map(len, shares)) <= 1
    assert searcher_share(given, 0, 1) == given  # searcher 0 alone walks the synchronous trainer's cycle
    with pytest.raises(ValueError, match=r"gfn\.searchers = 11 exceeds the 10 training problems"):
        searcher_share(given, 0, 11)
    with pytest.raises(ConfigError, match=r"gfn\.searchers = 3 exceeds the 2 training problems"):  # before Ray starts
        tabular_trainer(tabular_config(searchers=3), tmp_path, given=given[:2])


def test_ppo_is_refused_in_async_mode():
    from pipeline.config.loader import load_config
    from pipeline.finetune.setup import preflight

    with pytest.raises(ValueError, match="PPO is on-policy"):
        preflight(load_config(REPO / "configs" / "tiny.yaml", ["ppo.mode=async"]), "ppo")
    with pytest.raises(ValueError, match="mode must be one of sync | async"):
        preflight(load_config(REPO / "configs" / "tiny.yaml", ["gfn.mode=later"]), "gfn")


@pytest.mark.slow
@pytest.mark.parametrize(
    "pool", [[], ["gfn.searchers=1", "gfn.scorer_actors=1"]], ids=["prm_in_searchers", "scorer_actor"]
)
def test_the_stage_in_async_mode_writes_what_the_synchronous_one_writes(random_tiny_world, tmp_path, pool):
    """Also with the world's PRM in a scorer actor (the stage's own loader pickled to it) and none in the searcher."""
    world = random_tiny_world
    # the tiny world's asynchronous config, at a smaller scale still
    args = [
        "--config",
        str(REPO / "configs" / "tiny-async.yaml"),
        f"runs_root={tmp_path}",
        "run=a",
        f"model.policy={world / 'policy'}",
        f"model.prm={world / 'prm'}",
        f"data.train_path={world / 'problems_train.jsonl'}",
        "data.disjoint_from=[]",
        "generation.max_new_tokens=24",
        "gfn.num_train_steps=4",
        "gfn.questions_per_step=2",
        "gfn.samples_per_question=4",
        "gfn.async_samples_used=3",
        "gfn.async_initial_completions=16",
        "gfn.save_every=2",
        "gfn.max_staleness=3",
        *pool,
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    returncode, out = run_bounded([sys.executable, "-m", "stages.train_gfn", *args], env=env, timeout=300)
    assert returncode == 0, out[-4000:]
    gfn = tmp_path / "a" / "gfn"
    for name in (
        "model/config.json",
        "model/model.safetensors",
        "metrics.jsonl",
        "training_curves.png",
        "ceiling.json",
    ):
        assert (gfn / name).exists(), name
    assert not (gfn / "checkpoints").exists()
    records = [json.loads(line) for line in (gfn / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    for record in records:
        assert {"loss", "avg_reward", "proportionality_gap", "staleness_mean", "staleness_max", "buffer_size"} <= set(
            record
        )
        assert 0 <= record["staleness_max"] <= 3 and math.isfinite(record["loss"])
        assert (
            record["questions"] == 2
            and record["trajectories_per_question_min"] == 3
            and record["zero_gradient_fraction"] == 0
        )


@pytest.mark.parametrize(
    "override,key",
    [
        ("gfn.async_samples_used=9", "gfn.async_samples_used"),  # K > S = 8
        ("gfn.async_samples_used=1", "gfn.async_samples_used"),  # K < 2 with TB-VarGrad
        ("gfn.async_initial_completions=2000", "gfn.async_initial_completions"),  # > buffer_size
        ("gfn.buffer_size=63", "gfn.buffer_size"),  # below (B - 1) x S + K = 7 x 8 + 8
        ("gfn.buffer_per_question=7", "gfn.buffer_per_question"),  # below K = 8
        ("gfn.max_staleness=1", "gfn.max_staleness"),  # below sync_every - 1 = 2
        ("gfn.searcher_cores=[4096]", "gfn.searcher_cores"),  # a core the machine lacks
        ("gfn.trainer_cores=[4096]", "gfn.trainer_cores"),
        ("gfn.scorer_gpus=1", "gfn.scorer_gpus"),  # GPUs for scorer actors, but gfn.scorer_actors = 0
    ],
)
def test_async_settings_that_cannot_work_are_refused_before_ray_starts(override, key):
    from pipeline.config.loader import ConfigError, load_config
    from pipeline.finetune.setup import preflight

    config = load_config(
        REPO / "configs" / "tiny.yaml", ["gfn.mode=async", "gfn.samples_per_question=8", "gfn.sync_every=3", override]
    )
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        preflight(config, "gfn")
    assert not ray.is_initialized()


def test_a_pinned_process_runs_every_thread_on_the_given_cores():
    """pin_process moves every thread of the process (a thread started before it too), not only
    the calling one; a core the machine lacks is an error naming the key."""
    from pipeline.finetune.tba.cores import pin_process

    before = os.sched_getaffinity(0)
    core = min(before)
    stop = threading.Event()
    worker = threading.Thread(target=stop.wait, daemon=True)
    worker.start()
    try:
        pin_process({core})
        for tid in os.listdir("/proc/self/task"):
            assert os.sched_getaffinity(int(tid)) == {core}, tid
        with pytest.raises(ValueError, match=r"gfn\.searcher_cores: cannot pin"):
            pin_process({4096})
    finally:
        stop.set()
        pin_process(before)
        worker.join(timeout=5)
    assert os.sched_getaffinity(0) == before


def test_recency_outside_zero_one_is_refused_naming_the_key():
    from pipeline.config.loader import ConfigError, load_config
    from pipeline.finetune.tba.settings import check_async_settings

    with pytest.raises(ConfigError, match=r"gfn\.recency_fraction"):
        load_config(REPO / "configs" / "tiny.yaml", ["gfn.mode=async", "gfn.recency_fraction=1.5"])
    with pytest.raises(ConfigError, match=r"gfn\.recency_fraction"):  # a section built in code, not loaded
        check_async_settings(tabular_config(recency_fraction=-0.1))


def test_the_store_waits_for_the_initial_completions_and_for_enough_eligible_questions():
    from pipeline.finetune.tba.stores import TrajectoryStore

    store = TrajectoryStore({"capacity": 100, "per_question": 2, "seed": 0})
    batch = tabular_sampler(tabular_config(), 0)
    trajectories, _ = batch.sample(0, version=0)  # 4 questions x 8 samples
    store.add(json.dumps([t.to_json() for t in trajectories]), searcher=0)
    size = store.stats()["size"]
    assert json.loads(store.sample(2, latest=0, now=0, max_staleness=None, minimum=size + 1))["groups"] == []
    assert len(json.loads(store.sample(2, latest=0, now=0, max_staleness=None, minimum=size))["groups"]) == 2
    assert (
        json.loads(store.sample(5, latest=0, now=0, max_staleness=None))["groups"] == []
    )  # 4 questions hold completions


def test_a_store_that_nothing_more_can_reach_says_why_and_one_still_filling_does_not():
    """Two searchers, one round per weights version (gfn.searcher_rounds_per_version = 1): once both
    have sent their round of the newest version and the buffer cannot give the batch, the store
    names the cause; while a searcher's round of that version is missing, or the batch can be
    given, it does not."""
    from pipeline.finetune.tba.stores import TrajectoryStore

    store = TrajectoryStore({"capacity": 100, "per_question": 2, "seed": 0})
    trajectories, _ = tabular_sampler(tabular_config(), 0).sample(0, version=3)  # 4 questions x 8 samples
    conditions = dict(questions=5, now=3, max_staleness=None, minimum=0, version=3, rounds=1, searchers=2)
    store.add(json.dumps([t.to_json() for t in trajectories]), searcher=0, version=3)
    assert store.stalled(**conditions) is None  # searcher 1's round of version 3 may still come
    store.add(json.dumps([]), searcher=1, version=2)  # an older version's round (all its samples dropped)
    assert store.stalled(**conditions) is None
    store.add(json.dumps([]), searcher=1, version=3)
    cause = store.stalled(**conditions)
    assert "gfn.searcher_rounds_per_version = 1 rounds of weights version 3" in cause
    assert f"holds {store.stats()['size']} completions" in cause and "5 needed" in cause
    assert store.stalled(**{**conditions, "questions": 2}) is None  # 4 eligible: the batch can be given
    assert store.stalled(**{**conditions, "rounds": 2}) is None  # a second round each may still come


@pytest.mark.slow
def test_waits_on_the_weights_and_the_store_return_what_arrives_while_waiting_and_nothing_after_their_bound(
    local_ray,
):
    """A searcher waiting for weights newer than its own gets the version published while it waits, a
    stop wakes it, and a wait with nothing new ends empty-handed after its bound; the trainer waiting
    for a batch gets it once a round fills the store, and no groups after its bound. The publish and
    the add reach the actors while a wait is in progress (async actors: a wait holds no call up)."""
    from pipeline.finetune.tba.stores import TrajectoryStore, WeightStore

    weights = ray.remote(num_cpus=0)(WeightStore).remote()
    waiting = weights.wait_newer.remote(-1, 60.0)
    assert ray.wait([waiting], timeout=1.0)[0] == []  # nothing published yet: still waiting
    bucket = ray.put(b"weights")
    ray.get(weights.publish.remote(0, [bucket], {"layout": 0}), timeout=30)
    version, refs, layout, stopped = ray.get(waiting, timeout=30)
    assert (version, layout, stopped) == (0, {"layout": 0}, False) and ray.get(refs[0]) == b"weights"
    # nothing newer than version 0 within the bound: the current version, no references
    assert ray.get(weights.wait_newer.remote(0, 0.2), timeout=30) == (0, None, None, False)
    waiting = weights.wait_newer.remote(0, 60.0)
    ray.get(weights.stop.remote(), timeout=30)
    assert ray.get(waiting, timeout=30)[3] is True

    store = ray.remote(num_cpus=0)(TrajectoryStore).remote({"capacity": 100, "per_question": 2, "seed": 0})
    waiting = store.wait_sample.remote(2, 0, 0, None, 0, 60.0)
    assert ray.wait([waiting], timeout=1.0)[0] == []  # the store is empty: still waiting
    trajectories, _ = tabular_sampler(tabular_config(), 0).sample(0, version=0)  # 4 questions x 8 samples
    ray.get(store.add.remote(json.dumps([t.to_json() for t in trajectories]), 0), timeout=30)
    assert len(json.loads(ray.get(waiting, timeout=30))["groups"]) == 2
    # 4 questions hold completions, never 5: no groups after the bound
    assert json.loads(ray.get(store.wait_sample.remote(5, 0, 0, None, 0, 0.2), timeout=30))["groups"] == []


def test_the_async_configs_carry_the_papers_settings_and_pass_the_checks():
    from pipeline.config.loader import load_config
    from pipeline.finetune.tba.settings import async_shape, check_async_settings

    paper = load_config(REPO / "configs" / "paper" / "llama3.2-3b-async.yaml").gfn
    assert (paper.mode, paper.loss, paper.recency_fraction, paper.sync_every) == ("async", "tb_vargrad", 0.95, 2)
    # TBA's MATH settings (Table 4): 32 prompts x 16 completions, beta 0.005, a reset every 50 steps, temperature 1,
    # the importance correction clipped to [0, 8]
    assert (paper.async_questions, paper.samples_per_question, paper.async_samples_used) == (32, 16, 16)
    assert (paper.kl_coef, paper.kl_coef_final, paper.reference_reset_every, paper.temperature) == (
        0.005,
        None,
        50,
        1.0,
    )
    assert (paper.importance_correction, paper.importance_clip_low, paper.importance_clip_high) == (True, 0.0, 8.0)
    assert paper.async_initial_completions == 500
    tiny = load_config(REPO / "configs" / "tiny-async.yaml").gfn
    assert (tiny.mode, tiny.loss, tiny.recency_fraction, tiny.sync_every) == ("async", "tb_vargrad", 0.95, 2)
    assert async_shape(tiny)[1] < tiny.samples_per_question
    for section in (paper, tiny):
        check_async_settings(section)


# ----------------------------------------------------------------------------- launch checks


def unused_port() -> int:
    """A local TCP port nothing listens on (bound, then released)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.mark.slow
def test_an_unreachable_cluster_fails_within_the_connect_timeout_naming_the_key(random_tiny_world, tmp_path):
    world, port = random_tiny_world, unused_port()
    args = [
        "--config",
        str(REPO / "configs" / "tiny.yaml"),
        f"runs_root={tmp_path}",
        "run=a",
        f"model.policy={world / 'policy'}",
        f"model.prm={world / 'prm'}",
        f"data.train_path={world / 'problems_train.jsonl'}",
        "data.disjoint_from=[]",
        "gfn.mode=async",
        "gfn.loss=tb_vargrad",
        f"gfn.ray_address=127.0.0.1:{port}",
        "gfn.ray_connect_timeout=3",
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    # bounded: Ray's own retries went on for minutes
    returncode, out = run_bounded([sys.executable, "-m", "stages.train_gfn", *args], env=env, timeout=120)
    assert returncode != 0
    line = f"gfn.ray_address=127.0.0.1:{port}: no Ray cluster answered at 127.0.0.1:{port} within 3 s (gfn.ray_connect_timeout"
    assert line in out, out[-4000:]
    assert "gfn: failed after" in out and "gfn: finished" not in out, out[-4000:]  # a crash is reported as one
    assert not (tmp_path / "a" / "gfn" / "model").exists()


def test_auto_without_a_cluster_says_how_to_start_one(tmp_path, monkeypatch):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setenv("RAY_TMPDIR", str(tmp_path))  # where `ray start` records its cluster: nothing there
    with pytest.raises(
        ray_cluster.ClusterError, match=r"gfn\.ray_address=auto: no running Ray cluster found .*`ray start --head`"
    ):
        ray_cluster.resolve_address("auto")
    (tmp_path / "ray").mkdir()
    (tmp_path / "ray" / "ray_current_cluster").write_text("10.0.0.7:6379\n")
    assert ray_cluster.resolve_address("auto") == "10.0.0.7:6379"  # the cluster `ray start --head` recorded
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.8:6379")
    assert ray_cluster.resolve_address("auto") == "10.0.0.8:6379"
    assert ray_cluster.resolve_address(None) is None  # a local instance


def test_async_under_several_trainer_processes_needs_a_cluster_address(monkeypatch):
    from pipeline.finetune import setup

    # as under `accelerate launch --num_processes 2`
    monkeypatch.setattr(setup, "process_count", lambda model_config: 2)
    with pytest.raises(
        ValueError, match=r"gfn.mode=async under 2 trainer processes needs gfn\.ray_address.*`ray start --head`"
    ):
        setup.preflight(
            load_config(REPO / "configs" / "tiny.yaml", ["gfn.mode=async", "gfn.questions_per_step=2"]), "gfn"
        )
    setup.preflight(
        load_config(
            REPO / "configs" / "tiny.yaml", ["gfn.mode=async", "gfn.questions_per_step=2", "gfn.ray_address=auto"]
        ),
        "gfn",
    )
    with pytest.raises(ValueError, match=r"gfn\.questions_per_step=3 must be a positive multiple"):
        setup.preflight(load_config(REPO / "configs" / "tiny.yaml", ["gfn.questions_per_step=3"]), "gfn")


def test_searchers_are_checked_against_what_the_cluster_offers(caplog):
    cfg = GFNConfig(mode="async", searchers=1000)
    with pytest.raises(
        ValueError, match=r"gfn\.searchers=1000 needs 1000 CPUs \(1 per searcher\) but the local Ray instance has 2"
    ):
        ray_cluster.check_searchers_fit(cfg, {"CPU": 2.0, "memory": 8 * 2**30}, 2**20, "the local Ray instance")
    cfg = GFNConfig(mode="async", searchers=3, searcher_gpus=0.5)
    with pytest.raises(ValueError, match=r"gfn\.searchers=3 x gfn\.searcher_gpus=0.5 = 1.5 GPUs but .* has 1"):
        ray_cluster.check_searchers_fit(cfg, {"CPU": 8.0, "GPU": 1.0}, 2**20, "the cluster")
    cfg = GFNConfig(mode="async", searchers=2)
    warnings = ray_cluster.check_searchers_fit(cfg, {"CPU": 2.0, "memory": 2**30}, 2**30, "the local Ray instance")
    assert (
        len(warnings) == 1
        and "gfn.searchers=2 x about 1.00 GiB each" in warnings[0]
        and "2.0 GiB, more than the 1.0 GiB" in warnings[0]
    )
    assert (
        ray_cluster.check_searchers_fit(cfg, {"CPU": 2.0, "memory": 8 * 2**30}, 2**30, "the local Ray instance") == []
    )
    cfg = GFNConfig(mode="async", searchers=2, scorer_actors=1)  # a scorer actor takes a CPU of its own
    with pytest.raises(
        ValueError, match=r"gfn\.searchers=2 \+ gfn\.scorer_actors=1 needs 3 CPUs \(1 per searcher and scorer actor\)"
    ):
        ray_cluster.check_searchers_fit(cfg, {"CPU": 2.0}, 2**20, "the local Ray instance")
    cfg = GFNConfig(mode="async", searchers=2, searcher_gpus=1.0, scorer_actors=2, scorer_gpus=0.5)
    with pytest.raises(
        ValueError,
        match=r"gfn\.searchers=2 x gfn\.searcher_gpus=1 \+ gfn\.scorer_actors=2 x gfn\.scorer_gpus=0\.5 "
        r"\+ 1 for the trainer's processes = 4 GPUs but the cluster has 3",
    ):
        ray_cluster.check_searchers_fit(cfg, {"CPU": 8.0, "GPU": 3.0}, 2**20, "the cluster", trainer_gpus=1)
    warnings = ray_cluster.check_searchers_fit(
        cfg, {"CPU": 8.0, "GPU": 4.0, "memory": 2**30}, 2**28, "the cluster", trainer_gpus=1, scorer_bytes=2**29
    )
    assert (
        len(warnings) == 1
        and "+ gfn.scorer_actors=2 x about 0.50 GiB each (a worker process and the PRM) = 1.5 GiB" in warnings[0]
    )


@pytest.mark.slow
def test_too_many_searchers_are_refused_before_any_model_loads_and_ray_is_shut_down(tmp_path):
    from pipeline.finetune.run import finetune_policy
    from pipeline.records import Problem

    assert not ray.is_initialized()
    searchers = (os.cpu_count() or 1) * 100  # more than a local instance (one CPU per core) can run
    config = load_config(
        REPO / "configs" / "tiny.yaml",
        [
            f"runs_root={tmp_path}",
            "gfn.mode=async",
            f"gfn.searchers={searchers}",
            f"model.policy={tmp_path / 'no-such-policy'}",
        ],
    )
    problems = [Problem(f"p{i}", "1 + 1?", "2", "tiny") for i in range(searchers)]  # a share for every searcher
    try:
        with pytest.raises(ValueError, match=rf"gfn\.searchers={searchers} needs {searchers} CPUs"):
            finetune_policy(config, "gfn", problems, lambda: None, tmp_path / "gfn", progress=False)
        assert not ray.is_initialized()  # the local instance the stage started is shut down
    finally:
        ray.shutdown()


@pytest.fixture
def ray_with_three_gpus():
    """A local Ray instance that advertises 3 GPUs (logical: Ray hands out their ids, nothing
    touches a device), so the placement of GPU searchers is tested on a CPU machine; always shut down."""
    ray.init(
        num_cpus=2,
        num_gpus=3,
        include_dashboard=False,
        log_to_driver=False,
        namespace=f"test-{os.getpid()}-{time.monotonic_ns()}",
        runtime_env={"env_vars": {"PYTHONPATH": os.pathsep.join([str(TESTS), str(REPO)]), "OMP_NUM_THREADS": "1"}},
    )
    try:
        yield
    finally:
        ray.shutdown()


def test_the_trainer_and_each_searcher_get_their_own_bundle_and_gpus(ray_with_three_gpus, tmp_path):
    cfg = tabular_config(searchers=2, searcher_gpus=1.0)
    trainer, _ = tabular_trainer(cfg, tmp_path)
    trainer.trainer_gpus = lambda: 1  # as a trainer on one GPU: its bundle reserves it
    trainer.start()
    try:
        trainer.keep_searching()
        placements = [
            status["placement"] for status in ray.get([s.status.remote() for s in trainer.searchers], timeout=30)
        ]
        assert [p["group"] for p in placements] == [trainer.placement_group.id.hex()] * 2
        assert [p["bundles"] for p in placements] == [[1], [2]]  # bundle 0 is the trainer's
        assert len(trainer.trainer_gpu_ids) == 1 and all(len(p["gpus"]) == 1 for p in placements)
        gpus = [trainer.trainer_gpu_ids[0]] + [p["gpus"][0] for p in placements]
        assert len(set(gpus)) == 3, gpus  # no searcher on the trainer's GPU, nor two on one
    finally:
        trainer.stop()
    assert all(row["state"] == "REMOVED" for row in ray.util.placement_group_table().values())


def test_asking_for_more_gpus_than_the_cluster_has_names_the_ask_and_what_ray_reports(ray_with_three_gpus, monkeypatch):
    cfg = GFNConfig(mode="async", searchers=2, searcher_gpus=1.0)
    resources = ray.cluster_resources()
    with pytest.raises(
        ValueError,
        match=r"gfn\.searchers=2 x gfn\.searcher_gpus=1 \+ 2 for the trainer's processes = 4 GPUs but "
        r"the local Ray instance has 3 \(Ray reports \{CPU: 2, GPU: 3\}\)",
    ):
        ray_cluster.check_searchers_fit(cfg, resources, 0, "the local Ray instance", trainer_gpus=2)
    assert ray_cluster.check_searchers_fit(cfg, resources, 0, "the local Ray instance", trainer_gpus=1) == []
    # a group Ray cannot place (here: 4 GPUs asked of 3) is refused within the bounded wait and removed
    with pytest.raises(
        ValueError,
        match=r"gfn\.searchers=2 searchers of \{'CPU': 1\.0, 'GPU': 1\.0\} each and a trainer bundle of "
        r"\{.*'GPU': 2\.0\} could not be placed within 2 s on the local Ray instance "
        r"\(Ray reports \{CPU: 2, GPU: 3\}",
    ):
        ray_cluster.reserve(cfg, 2, timeout=2.0, where="the local Ray instance")
    assert all(row["state"] == "REMOVED" for row in ray.util.placement_group_table().values())
    monkeypatch.setattr(
        ray.util, "get_node_ip_address", lambda: "192.0.2.1"
    )  # a trainer on a machine outside the cluster
    with pytest.raises(
        ValueError, match=r"the trainer's machine \(192\.0\.2\.1\) is not a node of the local Ray instance"
    ):
        ray_cluster.reserve(cfg, 0, timeout=2.0, where="the local Ray instance")


@pytest.fixture
def ray_with_room_for_scorers():
    """A local Ray instance with 3 logical CPUs and 4 logical GPUs (Ray hands out their ids; nothing
    touches a device): a GPU trainer, one searcher and two scorer actors; always shut down."""
    ray.init(
        num_cpus=3,
        num_gpus=4,
        include_dashboard=False,
        log_to_driver=False,
        namespace=f"test-{os.getpid()}-{time.monotonic_ns()}",
        runtime_env={"env_vars": {"PYTHONPATH": os.pathsep.join([str(TESTS), str(REPO)]), "OMP_NUM_THREADS": "1"}},
    )
    try:
        yield
    finally:
        ray.shutdown()


@pytest.mark.slow
def test_scorer_actors_in_their_own_bundles_give_the_searchers_the_prms_scores(ray_with_room_for_scorers, tmp_path):
    """gfn.scorer_actors=2: the searcher has no scorer of its own and sends each round to one actor,
    the two in turn; every stored trajectory carries exactly the scores the PRM (WideScorer) gives its
    steps, and the run trains. The trainer, the searcher and each scorer actor hold their own bundle and GPU."""
    from pipeline.finetune.tba.scorers import scorer_name

    cfg = wide_config(
        mode="async",
        searchers=1,
        searcher_gpus=1.0,
        scorer_actors=2,
        scorer_gpus=1.0,
        sync_every=1,
        max_staleness=3,
        num_train_steps=6,
        async_initial_completions=32,
    )
    trainer, policy = tabular_trainer(
        cfg,
        tmp_path,
        policy=WidePolicy(),
        make_sampler=functools.partial(pooled_wide_sampler, cfg),
        make_scorer=WideScorer,
    )
    trainer.trainer_gpus = lambda: 1  # as a trainer on one GPU: its bundle reserves it
    history = trainer.train()
    assert [h["step"] for h in history] == list(range(1, 7)) and all(math.isfinite(h["loss"]) for h in history)
    assert not torch.allclose(policy.logits.detach(), torch.zeros_like(policy.logits), atol=1e-3)  # it did train
    trajectories = stored(trainer)
    # the store received at least the initial completions; how many it still holds at the end depends on
    # how many rounds the searcher finished within the staleness bound, which is a matter of timing
    added = trainer.last_store["added"]
    assert added >= 32 and trajectories
    expected = WideScorer().log_scores_many([(t.question, t.steps) for t in trajectories])
    assert [
        t.step_log_scores for t in trajectories
    ] == expected  # exactly the PRM's scores of each trajectory's own steps
    assert [t.log_reward for t in trajectories] == [sum(scores) for scores in expected]
    scorers = trainer.scorer_status
    assert [s["index"] for s in scorers] == [0, 1] and all(s["calls"] >= 1 for s in scorers), (
        scorers
    )  # round robin: both used
    assert sum(s["solutions"] for s in scorers) >= added  # every completion the store received was scored
    searcher = trainer.last_status[0]["placement"]
    groups = {searcher["group"]} | {s["placement"]["group"] for s in scorers}
    assert groups == {trainer.placement_group.id.hex()}
    assert [searcher["bundles"]] + [s["placement"]["bundles"] for s in scorers] == [
        [1],
        [2],
        [3],
    ]  # bundle 0 is the trainer's
    gpus = trainer.trainer_gpu_ids + searcher["gpus"] + [g for s in scorers for g in s["placement"]["gpus"]]
    assert len(gpus) == 4 and len(set(gpus)) == 4, gpus
    assert scorer_name(1) == "scorer-1"


def test_a_searcher_with_scorer_actors_loads_no_prm_and_a_vllm_searcher_no_transformers_copy(monkeypatch, tmp_path):
    """pipeline.finetune.run.searcher_sampler (what an asynchronous searcher builds in its actor): with
    generation.backend=vllm it starts its own engine with gfn.searcher_vllm_memory_share and loads no
    transformers model; with gfn.scorer_actors > 0 it builds no PRM and scores through the actors, in
    turn from its own index; with none it builds the PRM once. (vLLM and the models are stand-ins here.)"""
    from pipeline import generation
    from pipeline.finetune import run
    from pipeline.finetune.tba.scorers import PooledScorer
    from pipeline.records import Problem

    engines = []

    class Engine:
        def __init__(self, path, config, weight_updates=False, **options):
            engines.append((path, config.generation.vllm_gpu_memory_utilization, weight_updates))

    def no_model(*args, **kwargs):
        raise AssertionError("a transformers copy of the policy was loaded")

    built = []

    def make_scorer():
        built.append(1)
        return WideScorer()

    monkeypatch.setattr(generation, "VLLMGenerator", Engine)
    monkeypatch.setattr(run, "load_causal_lm", no_model)
    monkeypatch.setattr(run, "load_tokenizer", lambda path, trust_remote_code: None)
    problems = [Problem(f"p{i}", f"{i} + 1?", str(i + 1), "tiny").to_json() for i in range(3)]
    config = load_config(
        REPO / "configs" / "tiny.yaml",
        [
            f"runs_root={tmp_path}",
            "generation.backend=vllm",
            "gfn.mode=async",
            "gfn.searchers=3",
            "gfn.scorer_actors=2",
            "gfn.searcher_vllm_memory_share=0.4",
        ],
    )
    sampler = run.searcher_sampler(config, "gfn", make_scorer, 1, problems)
    assert sampler.policy.model is None and engines == [(config.resolve(config.model.policy), 0.4, True)]
    assert config.generation.vllm_gpu_memory_utilization is None  # the other stages' key is left as it was
    assert (
        isinstance(sampler.scorer, PooledScorer)
        and (sampler.scorer.actors, sampler.scorer.next) == (2, 1)
        and built == []
    )
    config.gfn.scorer_actors = 0
    sampler = run.searcher_sampler(config, "gfn", make_scorer, 1, problems)
    assert isinstance(sampler.scorer, WideScorer) and built == [1]
    # the off-policy correction scores what the engine sampled teacher-forced, as the trainer does: a copy beside it
    config.gfn.importance_correction = True
    monkeypatch.setattr(run, "load_causal_lm", lambda path, model_config: torch.nn.Linear(1, 1))
    sampler = run.searcher_sampler(config, "gfn", make_scorer, 1, problems)
    assert isinstance(sampler.policy.model, torch.nn.Linear) and len(engines) == 3


def test_gpu_vllm_searchers_without_a_memory_share_outside_a_stage_are_refused():
    from pipeline.config.loader import ConfigError
    from pipeline.finetune.setup import preflight

    config = load_config(
        REPO / "configs" / "tiny.yaml", ["gfn.mode=async", "generation.backend=vllm", "gfn.searcher_gpus=1"]
    )
    with pytest.raises(
        ConfigError, match=r"gfn\.searcher_vllm_memory_share is unset with GPU searchers \(gfn\.searcher_gpus=1\)"
    ):
        preflight(config, "gfn")
    assert not ray.is_initialized()


class GatedStore:
    """The store's wait_sample as the trainer calls it, every call's conditions recorded in order:
    the answer for step s >= 1 (its batch, JSON; problem ids tagged with s) waits until the test
    opens step s's gate (at most a minute)."""

    def __init__(self, batches: dict[int, str]):
        self.batches, self.requests, self.gates = batches, [], {}

    def gate(self, step: int):
        import asyncio

        return self.gates.setdefault(step, asyncio.Event())

    async def wait_sample(self, questions, latest, now, max_staleness, minimum=0, timeout=1.0) -> str:
        import asyncio

        self.requests.append([questions, latest, now, max_staleness, minimum])
        if now > 0:
            await asyncio.wait_for(self.gate(now).wait(), 60)
        return self.batches[now]

    def open(self, step: int) -> None:
        self.gate(step).set()

    def seen(self) -> list:
        return self.requests

    def stats(self) -> dict:
        keys = ("added", "searcher_idle_seconds", "searcher_weight_load_seconds", "size", "dropped_stale", "evicted")
        return {**dict.fromkeys(keys, 0), "restarts": 0}


class NoPublisher:
    """Publications go nowhere (no searcher runs): the trainer's calls only."""

    def publish(self, state, version, searchers) -> None:
        pass

    def take_finished(self) -> list:
        return []

    def close(self) -> None:
        pass


@pytest.mark.slow
def test_the_next_batch_is_asked_for_while_the_update_runs_under_the_conditions_after_it(local_ray, tmp_path):
    """The trainer asks the store for step s + 1's batch while step s's update is still running
    (the update here waits until the store has the request), with the conditions a draw after the
    update carries (the version published at the end of step s, now = s + 1), trains step s + 1 on
    that answer, and at stop cancels the request whose answer never comes (no thread left)."""
    steps, max_staleness = 3, 2
    cfg = wide_config(mode="async", searchers=1, sync_every=1, max_staleness=max_staleness, num_train_steps=steps + 1)
    rounds = wide_sampler(cfg, 0)
    batches = {}
    for step in range(steps + 1):
        trajectories, _ = rounds.sample(step, version=step)
        groups: dict[str, list] = {}
        for t in trajectories:
            groups.setdefault(f"s{step}-{t.problem_id}", []).append(
                {**t.to_json(), "problem_id": f"s{step}-{t.problem_id}"}
            )
        batches[step] = json.dumps({"groups": list(groups.values()), "recent": 0})
    trainer, _ = tabular_trainer(cfg, tmp_path, policy=WidePolicy(), make_sampler=functools.partial(wide_sampler, cfg))
    trainer.store = ray.remote(num_cpus=0)(GatedStore).remote(batches)
    trainer.publisher, trainer.published = NoPublisher(), 0
    asked_during_update, trained = {}, {}
    update, record = trainer.update, trainer.record

    def gated_update(micro_batches):
        following = trainer.step + 1
        if following < cfg.num_train_steps:  # the store must hold the next step's request before the update ends
            deadline = time.monotonic() + 30
            while not (asked := any(r[2] == following for r in ray.get(trainer.store.seen.remote()))):
                if time.monotonic() > deadline:
                    break
                time.sleep(0.05)
            asked_during_update[following] = asked
            if following < steps:  # the last one is never answered: stop cancels it
                ray.get(trainer.store.open.remote(following))
        return update(micro_batches)

    def recording(step, lr, batch, *rest):
        trained[step - 1] = sorted({t.problem_id.split("-")[0] for t in batch})
        return record(step, lr, batch, *rest)

    trainer.update, trainer.record = gated_update, recording
    try:
        for _ in range(steps):
            trainer.train_step()
        pending = trainer._next_batch
        assert pending is not None and pending.thread.is_alive()  # step 3's batch: asked for, not answered
    finally:
        trainer.stop()
    assert asked_during_update == {1: True, 2: True, 3: True}
    questions, initial = cfg.questions_per_step, cfg.async_initial_completions
    # one request per step, each with the conditions of the draw after the previous update
    assert ray.get(trainer.store.seen.remote()) == [
        [questions, 0, 0, max_staleness, initial],
        *([questions, s, s, max_staleness, 0] for s in range(1, steps + 1)),
    ]
    assert trained == {s: [f"s{s}"] for s in range(steps)}  # each step trained the answer to its own request
    assert not pending.thread.is_alive() and trainer._next_batch is None
    assert not [t for t in threading.enumerate() if t.name == "stepflow-batch-request"]

"""Policy fine-tuning across processes (torchrun, gloo on CPU), through the stage CLI.

Two processes with questions_per_step 2B (B each) must reproduce one process with 2B on the same
seed: the same questions, the same sampled solutions (per-question seeds), the same gradient
(each process's loss is weighted world / global batch and DDP averages), so the same loss curve
and final weights up to float rounding. A two-process run killed after a checkpoint resumes,
with two processes or with one, to the weights of the uninterrupted run.

Each process runs one torch thread (2-core CI machines), and every launch has a time limit.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from processes import run_bounded
from safetensors.torch import load_file

REPO = Path(__file__).resolve().parents[1]
TIMEOUT_S = 240


@pytest.fixture(scope="module")
def world(random_tiny_world) -> Path:
    return random_tiny_world


def settings(world: Path, stage: str, out: Path, **extra) -> list[str]:
    args = {
        "runs_root": out.parent,
        "run": out.name,
        "model.policy": world / "policy",
        "model.prm": world / "prm",
        "model.prm_backbone": world / "policy",
        "data.train_path": world / "problems_train.jsonl",
        "data.disjoint_from": "[]",
        "generation.max_new_tokens": 24,
        "generation.batch_size": 8,
        f"{stage}.num_train_steps": 3,
        f"{stage}.questions_per_step": 4,
        f"{stage}.samples_per_question": 4,
        f"{stage}.micro_batch_size": 8,
        f"{stage}.temperature": 1.0,
        f"{stage}.save_every": 0,
        f"{stage}.warmup_steps": 0,
        f"{stage}.lr": 1e-3,
        **extra,
    }
    return ["--config", str(REPO / "configs" / "tiny.yaml"), *(f"{k}={v}" for k, v in args.items())]


# What `accelerate launch --config_file configs/accelerate/policy_fsdp.yaml` tells each process;
# torchrun passes it on, and the training base shards the policy with FSDP2 (gloo on CPU).
FSDP = {"ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "2"}


def launch(
    stage: str, args: list[str], processes: int, kill_when: Path | None = None, env: dict | None = None
) -> subprocess.CompletedProcess | None:
    """Run the stage in ``processes`` processes (accelerate launch, gloo); with ``kill_when``,
    SIGKILL the whole process group as soon as that path exists; ``env``: added to each
    process's environment (FSDP). Always bounded in time."""
    module = f"stages.train_{stage}"
    if processes == 1:
        command = [sys.executable, "-m", module, *args]
    else:
        # torchrun: what `accelerate launch --multi_gpu` runs under the hood; accelerate's own
        # multi-process CPU launch needs MPI. The stage's Accelerator picks up the process group (gloo).
        port = 29500 + os.getpid() % 1000
        command = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc_per_node",
            str(processes),
            "--master_port",
            str(port),
            "-m",
            module,
            *args,
        ]
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "MKL_NUM_THREADS": "1",
        "TOKENIZERS_PARALLELISM": "false",
        **(env or {}),
    }
    result = run_bounded(command, timeout=TIMEOUT_S, env=env, kill_when=kill_when)
    if result is None:
        return None
    returncode, out = result
    assert returncode == 0, out[-4000:]
    return subprocess.CompletedProcess(command, returncode, out)


def metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def assert_same_run(a: Path, b: Path, loss_tolerance: float, weight_tolerance: float, steps: int = 3) -> None:
    ma, mb = metrics(a), metrics(b)
    assert [m["step"] for m in ma] == [m["step"] for m in mb] == list(range(1, steps + 1))
    for x, y in zip(ma, mb):  # the same questions and solutions: identical sampling statistics
        assert (x["sampled"], x["empty_solutions"], x["solution_length"]) == (
            y["sampled"],
            y["empty_solutions"],
            y["solution_length"],
        )
        assert x["avg_log_reward"] == pytest.approx(y["avg_log_reward"], abs=1e-6)
        assert x["loss"] == pytest.approx(y["loss"], rel=loss_tolerance, abs=loss_tolerance)
    wa, wb = load_file(str(a / "model" / "model.safetensors")), load_file(str(b / "model" / "model.safetensors"))
    assert wa.keys() == wb.keys()
    for name in wa:
        assert torch.allclose(wa[name], wb[name], atol=weight_tolerance, rtol=0), name


@pytest.mark.slow
@pytest.mark.parametrize(
    "stage,extra",
    [
        ("gfn", {"gfn.loss": "subtb", "gfn.replay_fraction": 0.5}),
        ("gfn", {"gfn.loss": "tb_vargrad", "gfn.replay_fraction": 0.5}),
        ("ppo", {"ppo.ppo_epochs": 2}),
    ],
)
def test_two_processes_reproduce_one_process_with_the_same_questions(world, tmp_path, stage, extra):
    one, two = tmp_path / "one", tmp_path / "two"
    launch(stage, settings(world, stage, one, **extra), processes=1)
    launch(stage, settings(world, stage, two, **extra), processes=2)
    # Float rounding only: the processes' micro-batches hold other trajectories than one process's.
    assert_same_run(one / stage, two / stage, loss_tolerance=1e-4, weight_tolerance=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize(
    "stage,extra",
    [
        ("gfn", {"gfn.loss": "subtb", "gfn.replay_fraction": 0.5}),
        ("gfn", {"gfn.loss": "tb_vargrad"}),
        ("ppo", {"ppo.ppo_epochs": 2}),
    ],
    ids=["subtb", "tb_vargrad", "ppo"],
)
def test_two_fsdp2_processes_reproduce_one_process(world, tmp_path, stage, extra):
    """FSDP2 (the policy sharded over 2 processes, sampling from a gathered HF copy) against one
    unsharded process: the same sampled solutions, losses within 1e-4, weights within 1e-5.
    TB with a learned log Z is compared the same way by the resume test below."""
    one, two = tmp_path / "one", tmp_path / "two"
    extra = {f"{stage}.num_train_steps": 2, **extra}
    launch(stage, settings(world, stage, one, **extra), processes=1)
    result = launch(stage, settings(world, stage, two, **extra), processes=2, env=FSDP)
    assert_same_run(one / stage, two / stage, loss_tolerance=1e-4, weight_tolerance=1e-5, steps=2)
    assert "sharded with FSDP2" in result.stdout


@pytest.mark.slow
def test_a_killed_two_process_run_resumes_with_two_or_one_process(world, tmp_path):
    # six steps, killed once the step-2 checkpoint is committed: four steps of margin before the end
    extra = {"gfn.loss": "tb_vargrad", "gfn.replay_fraction": 0.5, "gfn.save_every": 1, "gfn.num_train_steps": 6}
    straight = tmp_path / "straight"
    launch("gfn", settings(world, "gfn", straight, **extra), processes=2)
    for name, processes in (("again_two", 2), ("again_one", 1)):
        out = tmp_path / name
        launch(
            "gfn",
            settings(world, "gfn", out, **extra),
            processes=2,
            kill_when=out / "gfn" / "checkpoints" / "step-00000002",
        )
        assert not (out / "gfn" / "model").exists()
        launch("gfn", settings(world, "gfn", out, **extra), processes=processes)
        assert_same_run(straight / "gfn", out / "gfn", loss_tolerance=1e-4, weight_tolerance=1e-5, steps=6)


@pytest.mark.slow
def test_a_killed_fsdp2_run_resumes_from_its_shards_with_two_or_one_process(world, tmp_path):
    """TB with a learned log Z (its own optimizer state in the checkpoint) under FSDP2: killed
    after the step-2 checkpoint (torch.distributed.checkpoint shards of 2 processes), resumed by
    2 FSDP2 processes and by 1 unsharded process, each ending where an uninterrupted one-process
    run ends."""
    extra = {"gfn.loss": "tb", "gfn.learn_log_z": "true", "gfn.save_every": 1, "gfn.num_train_steps": 4}
    straight, killed = tmp_path / "straight", tmp_path / "killed"
    launch("gfn", settings(world, "gfn", straight, **extra), processes=1)
    step_2 = killed / "gfn" / "checkpoints" / "step-00000002"
    launch("gfn", settings(world, "gfn", killed, **extra), processes=2, kill_when=step_2, env=FSDP)
    assert not (killed / "gfn" / "model").exists()
    assert sorted(p.name for p in (step_2 / "sharded").iterdir()) == [  # each process wrote its own shards
        "shard-00001-model-00001-of-00001.safetensors",
        "shard-00002-model-00001-of-00001.safetensors",
    ]
    for name, processes in (("again_two", 2), ("again_one", 1)):
        out = tmp_path / name
        shutil.copytree(killed, out)
        result = launch("gfn", settings(world, "gfn", out, **extra), processes=processes, env=FSDP)
        assert "resumed from" in result.stdout and "step 2 of 4" in result.stdout
        assert_same_run(straight / "gfn", out / "gfn", loss_tolerance=1e-4, weight_tolerance=1e-5, steps=4)
        log_z = [[r["log_z"] for r in metrics(run / "gfn")] for run in (straight, out)]  # trained in its own optimizer
        assert log_z[0] == pytest.approx(log_z[1], abs=1e-5) and log_z[0][-1] != 0.0


DEEPSPEED_MISSING = (
    "deepspeed is not installed (pip install -c constraints.txt -e '.[dev]'; docs/scale.md, 'DeepSpeed on CPU')"
)


def deepspeed_skip_reason() -> str | None:
    """Why the DeepSpeed runs cannot be tested here (None: they can): DeepSpeed needs its package
    and, through accelerate 1.15, an Accelerator that is not cpu=True, which the trainers build on
    every CPU-only machine."""
    if importlib.util.find_spec("deepspeed") is None:
        return DEEPSPEED_MISSING
    if torch.cuda.device_count() < 2:
        return (
            "accelerate 1.15 turns DeepSpeed on only for an Accelerator that is not cpu=True, and the trainers build a CPU "
            "one without GPUs: needs 2 GPUs (docs/scale.md, 'DeepSpeed on CPU')"
        )
    return None


@pytest.mark.slow
@pytest.mark.parametrize("zero_stage", ["2"])
def test_two_deepspeed_processes_reproduce_one_process(world, tmp_path, zero_stage):
    """ZeRO-2 (HF sampling, save_every=0) over 2 GPUs against one process on the same seed."""
    reason = deepspeed_skip_reason()
    if reason:
        pytest.skip(reason)
    one, two = tmp_path / "one", tmp_path / "two"
    extra = {
        "gfn.loss": "tb",
        "gfn.learn_log_z": "true",
        "gfn.num_train_steps": 2,
        "model.device": "cuda",
        "model.dtype": "float32",
    }
    launch("gfn", settings(world, "gfn", one, **extra), processes=1)
    launch(
        "gfn",
        settings(world, "gfn", two, **extra),
        processes=2,
        env={"ACCELERATE_USE_DEEPSPEED": "true", "ACCELERATE_DEEPSPEED_ZERO_STAGE": zero_stage},
    )
    assert_same_run(one / "gfn", two / "gfn", loss_tolerance=1e-4, weight_tolerance=1e-5, steps=2)


def test_bad_launches_fail_before_any_model_is_loaded(world, tmp_path):
    from pipeline.config.loader import load_config
    from pipeline.finetune.setup import preflight

    config = load_config(REPO / "configs" / "tiny.yaml", ["gfn.questions_per_step=3"])
    preflight(config, "gfn")  # one process: any count works
    if importlib.util.find_spec("vllm") is None:
        with pytest.raises(ValueError, match=r"generation.backend=vllm but vllm is not installed in this environment"):
            preflight(load_config(REPO / "configs" / "tiny.yaml", ["generation.backend=vllm"]), "ppo")
    from pipeline.batches import check_divisible

    with pytest.raises(
        ValueError, match=r"questions_per_step=3 must be a positive multiple of the number of processes \(2\)"
    ):
        check_divisible(3, 2)
    from stages import train_gfn

    with pytest.raises(SystemExit, match="run `make prm` first"):
        train_gfn.main(["--config", str(REPO / "configs" / "tiny.yaml"), f"runs_root={tmp_path}", "run=none"])


def test_accelerate_configs_that_cannot_work_are_refused_naming_the_one_that_does():
    from pipeline.config.loader import load_config
    from pipeline.finetune.setup import check_accelerate_launch

    gfn, saving = (load_config(REPO / "configs" / "tiny.yaml", [f"gfn.save_every={n}"]).gfn for n in (0, 5))
    fsdp2, deepspeed = {**FSDP}, {"ACCELERATE_USE_DEEPSPEED": "true", "ACCELERATE_DEEPSPEED_ZERO_STAGE": "2"}
    zero3 = {**deepspeed, "ACCELERATE_DEEPSPEED_ZERO_STAGE": "3"}
    for environ, backend in (
        (fsdp2, "hf"),
        (fsdp2, "vllm"),
        (deepspeed, "hf"),
        (deepspeed, "vllm"),
        (zero3, "vllm"),
        ({}, "hf"),
    ):
        check_accelerate_launch("gfn", gfn, backend, processes=1, environ=environ)
    check_accelerate_launch("gfn", saving, "hf", processes=2, environ=fsdp2)  # FSDP2 runs resume from their shards
    # ZeRO-3 gathers the weights on every process for a sampler holding its own (vLLM, asynchronous searchers)
    searching = load_config(REPO / "configs" / "tiny.yaml", ["gfn.save_every=0", "gfn.mode=async"]).gfn
    check_accelerate_launch("gfn", gfn, "vllm", processes=2, environ=zero3)
    check_accelerate_launch("gfn", searching, "hf", processes=2, environ=zero3)
    check_accelerate_launch("gfn", saving, "hf", processes=2, environ=deepspeed)  # ZeRO: whole tensors per parameter
    check_accelerate_launch("gfn", saving, "vllm", processes=2, environ=zero3)
    zero0 = {**deepspeed, "ACCELERATE_DEEPSPEED_ZERO_STAGE": "0"}
    cases = [
        ({"ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "1"}, gfn, "hf", 2, r"FSDP version 1.*policy_fsdp\.yaml"),
        (zero0, saving, "hf", 2, r"gfn\.save_every=5 under DeepSpeed ZeRO stage 0.*deepspeed_zero2\.yaml"),
        (zero3, gfn, "hf", 2, r"ZeRO-3 with generation\.backend=hf.*policy_fsdp\.yaml"),
    ]
    for environ, cfg, backend, processes, message in cases:
        with pytest.raises(ValueError, match=message):
            check_accelerate_launch("gfn", cfg, backend, processes, environ=environ)


@pytest.mark.slow
def test_a_deepspeed_engine_resumes_from_whole_tensors_under_another_number_of_processes(tmp_path):
    """DeepSpeed's own engine (deepspeed.initialize, not through accelerate, which turns DeepSpeed
    off on CPU) on CPU with gloo, ZeRO stages 1, 2 and 3 in turn (tests/zero_resume.py): a
    checkpoint written by 2 processes after 2 of 4 steps, loaded into another initialisation by 1
    process and by 2, ends at the weights of the uninterrupted 2-process run (the batches depend on
    the step only), with the AdamW step count 4; loading its weights without the moments ends more
    than 1e-3 away."""
    if importlib.util.find_spec("deepspeed") is None:
        pytest.skip(DEEPSPEED_MISSING)
    worker, stages = str(REPO / "tests" / "zero_resume.py"), ["1", "2", "3"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu"}

    def run(processes: int, mode: str) -> None:
        prefix = [sys.executable]
        if processes > 1:
            port = str(29500 + (os.getpid() + 7) % 1000)
            prefix += ["-m", "torch.distributed.run", "--nproc_per_node", str(processes), "--master_port", port]
        command = [*prefix, worker, ",".join(stages), mode, str(tmp_path)]
        returncode, out = run_bounded(command, timeout=TIMEOUT_S, env=env)
        assert returncode == 0, out[-4000:]

    run(2, "save")
    run(1, "load")
    run(2, "load")
    for stage in stages:
        for processes in (1, 2):
            found = json.loads((tmp_path / f"zero-{stage}" / f"load-{processes}.json").read_text())
            resumed, weights_only = found["load"], found["load_weights_only"]
            assert resumed["written_by"] == 2 and resumed["optimizer_step"] == 4, (stage, processes, found)
            assert resumed["max_difference"] <= 1e-6, (stage, processes, found)
            assert weights_only["max_difference"] > 1e-3, (stage, processes, found)

"""The stages that generate, run as README runs them (python -m stages.<name>) with
generation.backend=vllm on the real engine (marker vllm: `make test-vllm`), on a tiny world
with small counts: one process each, the fine-tuning sampler a colocated engine whose
external_launcher environment the stage sets itself.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[1]
TIMEOUT_S = 240


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> Path:
    """A random tiny-world policy of head_dim 32 (one of vLLM's CPU attention sizes), a PRM on
    its backbone, training and test problems."""
    from pipeline.config.schema import BootstrapConfig, FormatConfig, TinyWorldConfig
    from pipeline.datasets.problems import write_problems_jsonl
    from pipeline.tinyworld.model import build_model, save_policy
    from pipeline.tinyworld.problems import generate_splits
    from pipeline.tinyworld.tokenizer import tokenizer_corpus, train_tokenizer
    from prm.model import ProcessRewardModel

    root = tmp_path_factory.mktemp("vllm_world")
    splits = generate_splits(TinyWorldConfig(n_train=16, n_val=4, n_test=4))
    write_problems_jsonl(splits["train"], root / "train.jsonl")
    write_problems_jsonl(splits["test"], root / "test.jsonl")
    tokenizer = train_tokenizer(tokenizer_corpus(splits["train"], FormatConfig(use_chat_template=False)), 512)
    model = build_model(
        BootstrapConfig(
            hidden_size=64, intermediate_size=128, num_layers=2, num_heads=2, max_position_embeddings=512, seed=3
        ),
        tokenizer,
    )
    save_policy(model, tokenizer, root / "policy")
    ProcessRewardModel.from_backbone(model).save_pretrained(root / "prm", tokenizer=tokenizer)
    return root


def run_stage(module: str, world: Path, out: Path, *overrides: str, processes: int = 1) -> str:
    args = [
        "--config",
        str(REPO / "configs" / "tiny.yaml"),
        f"runs_root={out.parent}",
        f"run={out.name}",
        f"model.policy={world / 'policy'}",
        f"model.prm={world / 'prm'}",
        f"model.prm_backbone={world / 'policy'}",
        f"data.train_path={world / 'train.jsonl'}",
        "data.disjoint_from=[]",
        "generation.backend=vllm",
        "generation.vllm_enforce_eager=true",
        "generation.max_new_tokens=24",
        *overrides,
    ]
    env = {**os.environ, "PYTHONPATH": str(REPO), "TQDM_DISABLE": "1", "TOKENIZERS_PARALLELISM": "false"}
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)  # as `make gfn` runs it: no launcher
    launcher = (
        []
        if processes == 1
        else [
            "-m",
            "torch.distributed.run",
            "--nproc_per_node",
            str(processes),
            "--master_port",
            str(29700 + os.getpid() % 200),
        ]
    )
    if processes > 1:
        env.update(OMP_NUM_THREADS="1", VLLM_CPU_OMP_THREADS_BIND="nobind")  # one core each, as the gloo tests run
    process = subprocess.Popen(
        [sys.executable, *launcher, "-m", module, *args],
        cwd=out.parent,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        output, _ = process.communicate(timeout=TIMEOUT_S)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, 9)
            process.wait(timeout=30)
    assert process.returncode == 0, output[-4000:]
    return output


def test_mcts_labels_problems_with_the_vllm_backend(world, tmp_path):
    from pipeline.storage.shards import completed_problem_ids

    run_stage(
        "stages.mcts",
        world,
        tmp_path / "m",
        "mcts.k=4",
        "mcts.max_problems=4",
        "mcts.max_iterations=2",
        "mcts.max_rollouts=16",
        "mcts.search_trivial=true",
    )
    assert len(completed_problem_ids(tmp_path / "m" / "mcts" / "shards")) == 4


def test_gfn_fine_tunes_with_a_colocated_engine_and_no_launcher(world, tmp_path):
    run_stage(
        "stages.train_gfn",
        world,
        tmp_path / "g",
        "gfn.num_train_steps=2",
        "gfn.questions_per_step=2",
        "gfn.samples_per_question=2",
        "gfn.micro_batch_size=4",
        "gfn.save_every=0",
        "gfn.warmup_steps=0",
    )
    rows = [
        json.loads(line) for line in (tmp_path / "g" / "gfn" / "metrics.jsonl").read_text().splitlines() if line.strip()
    ]
    assert [r["step"] for r in rows if "loss" in r][-1] == 2
    assert (tmp_path / "g" / "gfn" / "model" / "config.json").is_file()


def test_gfn_with_two_processes_runs_two_colocated_engines(world, tmp_path):
    output = run_stage(
        "stages.train_gfn",
        world,
        tmp_path / "g2",
        "gfn.num_train_steps=2",
        "gfn.questions_per_step=2",
        "gfn.samples_per_question=2",
        "gfn.micro_batch_size=4",
        "gfn.save_every=0",
        "gfn.warmup_steps=0",
        processes=2,
    )
    # both ranks trained and finished with generation.backend=vllm; the engine arguments each rank builds
    # (external_launcher, data_parallel_size = the launch's processes) are checked by
    # tests/test_generation.py::test_vllm_engine_settings_on_cpu_colocated_and_by_default: vLLM's own log
    # lines, read from the launcher's merged output, were missing in one of three runs here
    assert output.count("gfn: finished") == 2, output[-4000:]
    rows = [
        json.loads(line)
        for line in (tmp_path / "g2" / "gfn" / "metrics.jsonl").read_text().splitlines()
        if line.strip()
    ]
    assert [r["step"] for r in rows if "loss" in r][-1] == 2


def test_search_runs_with_the_vllm_backend(world, tmp_path):
    run_stage(
        "stages.search",
        world,
        tmp_path / "s",
        "search.benchmark=problems",
        f"search.benchmark_path={world / 'test.jsonl'}",
        "search.ks=[1,2]",
        "search.strategies=[step_best_of_k,best_of_n]",
        "search.max_problems=4",
        "search.max_depth=4",
        "generation.max_step_tokens=16",
    )
    rows = json.loads((tmp_path / "s" / "search" / "results.json").read_text())["rows"]
    assert {(r["strategy"], r["k"]) for r in rows} >= {("step_best_of_k", 2), ("best_of_n", 2)}


def test_ppo_fine_tunes_with_a_colocated_engine_and_the_evaluation_serves_its_folder(world, tmp_path):
    run_stage(
        "stages.train_ppo",
        world,
        tmp_path / "p",
        "ppo.num_train_steps=2",
        "ppo.questions_per_step=2",
        "ppo.samples_per_question=2",
        "ppo.micro_batch_size=4",
        "ppo.save_every=0",
        "ppo.warmup_steps=0",
    )
    rows = [
        json.loads(line) for line in (tmp_path / "p" / "ppo" / "metrics.jsonl").read_text().splitlines() if line.strip()
    ]
    assert [r["step"] for r in rows if "loss" in r][-1] == 2
    assert (tmp_path / "p" / "ppo" / "model" / "config.json").is_file()
    assert (tmp_path / "p" / "ppo" / "value_head" / "value_head.safetensors").is_file()
    # the fine-tuned folder as vLLM reads it (every *.safetensors of a folder without an index), beside
    # the base model: two engines, the first shut down before the second starts
    run_stage(
        "stages.evaluate",
        world,
        tmp_path / "e",
        "eval.benchmarks=[tiny_test]",
        f"eval.benchmark_paths={{tiny_test: {world / 'test.jsonl'}}}",
        f"eval.models={{base: {world / 'policy'}, ppo: {tmp_path / 'p' / 'ppo' / 'model'}}}",
        "eval.pairs=[]",
        "eval.k=2",
        "eval.max_problems=4",
        "eval.bootstrap_resamples=10",
        "eval.target_samples=0",
    )
    results = json.loads(
        (tmp_path / "reports" / "e" / "results.json").read_text()
    )  # reports/<run>/ below the working folder
    assert list(results["results"]) == ["base", "ppo"] and results["skipped"] == []


GREEDY_PROMPTS = [
    "Question: Tom has 4 pens and buys 3 more. How many pens?\nAnswer:\n",
    "Question: 9 - 5 = ?\nAnswer:\n",
]
GREEDY_TOKENS = 12


class ConstantScorer:
    """A PRM stand-in that every searcher builds in its actor (the test checks sampling, not rewards)."""

    def log_scores_many(self, pairs):
        return [[-0.5] * len(steps) for _, steps in pairs]


def recording_searcher(config, record: str, index: int, problems: list):
    """The production searcher sampler (pipeline.finetune.run.searcher_sampler: its own vLLM
    engine, built in the Ray actor), which before each round appends to ``record`` the weights
    version it samples with and its engine's greedy tokens on GREEDY_PROMPTS."""
    from pipeline.finetune.run import searcher_sampler

    sampler = searcher_sampler(config, "gfn", ConstantScorer, index, problems)
    sample = sampler.sample

    def recorded(step, version=None):
        outputs = sampler.policy.sampler.generate(GREEDY_PROMPTS, n=1, temperature=0.0, max_new_tokens=GREEDY_TOKENS)
        with open(record, "a", encoding="utf-8") as file:
            file.write(
                json.dumps({"version": version, "greedy": [per_prompt[0].token_ids for per_prompt in outputs]}) + "\n"
            )
        return sample(step, version)

    sampler.sample = recorded
    return sampler


def test_an_async_searcher_samples_with_its_own_vllm_engine_on_the_published_weights(world, tmp_path):
    """gfn.mode=async with generation.backend=vllm: one searcher actor on a local Ray instance
    samples with its own engine while the trainer takes a few updates; before every round its
    engine's greedy tokens equal transformers' greedy tokens of the weights the trainer published
    as the version the round is tagged with."""
    import functools

    import ray
    import transformers
    from async_trainers import DeadlineTrainer

    from pipeline.config.loader import load_config
    from pipeline.datasets.loaders import load_benchmark
    from pipeline.finetune.objectives import build_objective
    from pipeline.finetune.policy import LMPolicy
    from pipeline.finetune.run import optimizer_settings, train_problems
    from pipeline.finetune.sampling import TrajectorySampler
    from pipeline.generation.hf import HFGenerator
    from pipeline.modeling import load_causal_lm, load_tokenizer
    from pipeline.training import TrainingBase, make_accelerator

    config = load_config(
        REPO / "configs" / "tiny.yaml",
        [
            f"runs_root={tmp_path}",
            f"model.policy={world / 'policy'}",
            "generation.backend=vllm",
            "generation.vllm_enforce_eager=true",
            "generation.max_new_tokens=24",
            "gfn.mode=async",
            "gfn.searchers=1",
            "gfn.num_train_steps=3",
            "gfn.questions_per_step=4",
            "gfn.async_questions=2",
            "gfn.samples_per_question=2",
            "gfn.temperature=1.0",
            "gfn.micro_batch_size=4",
            "gfn.save_every=0",
            "gfn.warmup_steps=0",
            "gfn.lr=3e-2",
            "gfn.buffer_size=64",
            "gfn.loss=tb_vargrad",
            "gfn.kl_coef=0",
            "gfn.reference_prior_coef=0",
            # one round per published version: the trainer's steps wait for rounds sampled with its newer weights
            "gfn.searcher_rounds_per_version=1",
        ],
    )
    cfg, policy_path = config.gfn, str(world / "policy")
    tokenizer = load_tokenizer(policy_path)
    model = load_causal_lm(policy_path, config.model, is_trainable=True)
    model.train()
    policy = LMPolicy(model, tokenizer, config.format.separator, config.generation.max_new_tokens)
    objective = build_objective(cfg, policy, hidden_size=model.config.hidden_size)
    base = TrainingBase(
        make_accelerator(config.model),
        model,
        optimizer_settings(cfg, 1),
        tmp_path / "gfn",
        objective=objective,
        objective_lr=objective.lr,
        progress=False,
    )
    policy.prepared(base.model, base.unwrapped)
    problems = load_benchmark("problems", path=world / "train.jsonl")
    prompts, kind = train_problems(config, problems, tokenizer)
    record = tmp_path / "searcher_greedy.jsonl"
    published: dict[int, dict] = {}

    def export():
        state = {name: value.detach().clone() for name, value in base.full_state_dict().items()}
        published[base.step] = state
        return state

    trainer = DeadlineTrainer(
        base,
        TrajectorySampler(policy, None, prompts, kind, cfg),
        objective,
        cfg,
        functools.partial(recording_searcher, config, str(record)),
        export=export,
        problems=[p.to_json() for p in problems],
        run_name="vllm-async",
        progress=False,
    )
    ray.init(
        num_cpus=2,
        include_dashboard=False,
        log_to_driver=False,
        namespace=f"vllm-async-{os.getpid()}",
        runtime_env={
            "env_vars": {
                "PYTHONPATH": os.pathsep.join([str(REPO / "tests"), str(REPO)]),
                "OMP_NUM_THREADS": "1",
                "TOKENIZERS_PARALLELISM": "false",
            }
        },
    )
    try:
        history = trainer.train()
    finally:
        ray.shutdown()
    assert [r["step"] for r in history] == [1, 2, 3]
    rounds = [json.loads(line) for line in record.read_text().splitlines()]
    assert rounds and {r["version"] for r in rounds} <= set(published)
    reference = transformers.AutoModelForCausalLM.from_pretrained(policy_path, torch_dtype="float32").eval()
    greedy = {}
    for version, state in published.items():
        reference.load_state_dict(state)
        outputs = HFGenerator(reference, tokenizer).generate(
            GREEDY_PROMPTS, n=1, temperature=0.0, max_new_tokens=GREEDY_TOKENS
        )
        greedy[version] = [per_prompt[0].token_ids for per_prompt in outputs]
    for r in rounds:
        assert r["greedy"] == greedy[r["version"]], r["version"]
    assert len({r["version"] for r in rounds}) >= 2  # the searcher took new weights while the trainer trained
    assert greedy[max(published)] != greedy[0]  # and training moved the greedy tokens

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
    from pipeline.config import BootstrapConfig, FormatConfig, TinyWorldConfig
    from pipeline.problems import write_problems_jsonl
    from pipeline.tinyworld.model import build_model, save_policy
    from pipeline.tinyworld.problems import generate_splits
    from pipeline.tinyworld.tokenizer import tokenizer_corpus, train_tokenizer
    from prm.model import ProcessRewardModel

    root = tmp_path_factory.mktemp("vllm_world")
    splits = generate_splits(TinyWorldConfig(n_train=16, n_val=4, n_test=4))
    write_problems_jsonl(splits["train"], root / "train.jsonl")
    write_problems_jsonl(splits["test"], root / "test.jsonl")
    tokenizer = train_tokenizer(tokenizer_corpus(splits["train"], FormatConfig(use_chat_template=False)), 512)
    model = build_model(BootstrapConfig(hidden_size=64, intermediate_size=128, num_layers=2, num_heads=2,
                                         max_position_embeddings=512, seed=3), tokenizer)
    save_policy(model, tokenizer, root / "policy")
    ProcessRewardModel.from_backbone(model).save_pretrained(root / "prm", tokenizer=tokenizer)
    return root


def run_stage(module: str, world: Path, out: Path, *overrides: str, processes: int = 1) -> str:
    args = ["--config", str(REPO / "configs" / "tiny.yaml"), f"runs_root={out.parent}", f"run={out.name}",
            f"model.policy={world / 'policy'}", f"model.prm={world / 'prm'}", f"model.prm_backbone={world / 'policy'}",
            f"data.train_path={world / 'train.jsonl'}", "generation.backend=vllm", "generation.vllm_enforce_eager=true",
            "generation.max_new_tokens=24", *overrides]
    env = {**os.environ, "PYTHONPATH": str(REPO), "TQDM_DISABLE": "1", "TOKENIZERS_PARALLELISM": "false"}
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)  # as `make gfn` runs it: no launcher
    launcher = [] if processes == 1 else ["-m", "torch.distributed.run", "--nproc_per_node", str(processes),
                                          "--master_port", str(29700 + os.getpid() % 200)]
    if processes > 1:
        env.update(OMP_NUM_THREADS="1", VLLM_CPU_OMP_THREADS_BIND="nobind")  # one core each, as the gloo tests run
    process = subprocess.Popen([sys.executable, *launcher, "-m", module, *args], cwd=out.parent, env=env, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        output, _ = process.communicate(timeout=TIMEOUT_S)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, 9)
            process.wait(timeout=30)
    assert process.returncode == 0, output[-4000:]
    return output


def test_mcts_labels_problems_with_the_vllm_backend(world, tmp_path):
    from pipeline.io import completed_problem_ids

    run_stage("stages.mcts", world, tmp_path / "m", "mcts.k=4", "mcts.max_problems=4", "mcts.max_iterations=2",
              "mcts.max_rollouts=16", "mcts.search_trivial=true")
    assert len(completed_problem_ids(tmp_path / "m" / "mcts" / "shards")) == 4


def test_gfn_fine_tunes_with_a_colocated_engine_and_no_launcher(world, tmp_path):
    run_stage("stages.train_gfn", world, tmp_path / "g", "gfn.num_train_steps=2", "gfn.questions_per_step=2",
              "gfn.samples_per_question=2", "gfn.micro_batch_size=4", "gfn.save_every=0", "gfn.warmup_steps=0")
    rows = [json.loads(line) for line in (tmp_path / "g" / "gfn" / "metrics.jsonl").read_text().splitlines() if line.strip()]
    assert [r["step"] for r in rows if "loss" in r][-1] == 2
    assert (tmp_path / "g" / "gfn" / "model" / "config.json").is_file()


def test_gfn_with_two_processes_runs_two_colocated_engines(world, tmp_path):
    output = run_stage("stages.train_gfn", world, tmp_path / "g2", "gfn.num_train_steps=2", "gfn.questions_per_step=2",
                       "gfn.samples_per_question=2", "gfn.micro_batch_size=4", "gfn.save_every=0", "gfn.warmup_steps=0", processes=2)
    # both ranks trained and finished with generation.backend=vllm; the engine arguments each rank builds
    # (external_launcher, data_parallel_size = the launch's processes) are checked by
    # tests/test_generation.py::test_vllm_engine_settings_on_cpu_colocated_and_by_default: vLLM's own log
    # lines, read from the launcher's merged output, were missing in one of three runs here
    assert output.count("gfn: finished") == 2, output[-4000:]
    rows = [json.loads(line) for line in (tmp_path / "g2" / "gfn" / "metrics.jsonl").read_text().splitlines() if line.strip()]
    assert [r["step"] for r in rows if "loss" in r][-1] == 2


def test_search_runs_with_the_vllm_backend(world, tmp_path):
    run_stage("stages.search", world, tmp_path / "s", "search.benchmark=problems", f"search.benchmark_path={world / 'test.jsonl'}",
              "search.ks=[1,2]", "search.strategies=[step_best_of_k,best_of_n]", "search.max_problems=4",
              "search.max_depth=4", "generation.max_step_tokens=16")
    rows = json.loads((tmp_path / "s" / "search" / "results.json").read_text())["rows"]
    assert {(r["strategy"], r["k"]) for r in rows} >= {("step_best_of_k", 2), ("best_of_n", 2)}


def test_eval_samples_every_model_with_the_vllm_backend(world, tmp_path):
    run_stage("stages.evaluate", world, tmp_path / "e", "eval.benchmarks=[tiny_test]", f"eval.benchmark_paths={{tiny_test: {world / 'test.jsonl'}}}",
              f"eval.models={{base: {world / 'policy'}}}", "eval.pairs=[]", "eval.k=2", "eval.max_problems=4",
              "eval.bootstrap_resamples=10")
    results = json.loads((tmp_path / "reports" / "e" / "results.json").read_text())  # reports/<run>/ below the working folder
    assert "base" in json.dumps(results)

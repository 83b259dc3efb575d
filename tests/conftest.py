"""Shared fixtures: the real benchmark files and the offline environment."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest
import torch

from pipeline.storage.locks import release_stage_locks as release_held_locks

REPO = Path(__file__).resolve().parents[1]

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def benchmarks_dir() -> Path:
    """The benchmark files the repository carries (data/benchmarks/, or $STEPFLOW_BENCHMARKS), each
    checked against data/benchmarks/SOURCES.md first."""
    from pipeline.datasets.copies import benchmarks_dir as folder
    from pipeline.datasets.copies import recorded_files, shipped_file

    for name in recorded_files():
        shipped_file(name)
    return folder()


@pytest.fixture(scope="session")
def random_tiny_world(tmp_path_factory) -> Path:
    """A random-init tiny-world policy (policy/), PRM on its backbone (prm/) and 40 training
    problems (problems_train.jsonl): what the fine-tuning stages read, in seconds, when a test
    compares runs with each other rather than against a target."""
    # imported here, not at the top: the offline settings above must come before transformers loads
    from pipeline.config.schema import BootstrapConfig, FormatConfig, TinyWorldConfig
    from pipeline.datasets.problems import write_problems_jsonl
    from pipeline.tinyworld.model import build_model, save_policy
    from pipeline.tinyworld.problems import generate_splits
    from pipeline.tinyworld.tokenizer import tokenizer_corpus, train_tokenizer
    from prm.model import ProcessRewardModel

    root = tmp_path_factory.mktemp("random_tiny_world")
    splits = generate_splits(TinyWorldConfig(n_train=40, n_val=4, n_test=4))
    write_problems_jsonl(splits["train"], root / "problems_train.jsonl")
    tokenizer = train_tokenizer(tokenizer_corpus(splits["train"], FormatConfig(use_chat_template=False)), 512)
    model = build_model(
        BootstrapConfig(hidden_size=32, intermediate_size=64, num_layers=2, num_heads=2, seed=3), tokenizer
    )
    save_policy(model, tokenizer, root / "policy")
    ProcessRewardModel.from_backbone(model).save_pretrained(root / "prm", tokenizer=tokenizer)
    return root


@pytest.fixture(scope="module")
def one_torch_thread():
    """Tiny models on 2 busy cores run many times faster on one thread (DESIGN.md); a module that
    trains them says `pytestmark = pytest.mark.usefixtures("one_torch_thread")`."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(autouse=True)
def restore_torch_threads():
    """A stage main called in-process sets torch's thread count from model.torch_threads for the
    whole process (stages.cli.set_threads); give the next test the count it had."""
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


@pytest.fixture(autouse=True)
def release_stage_locks():
    """A stage main called in-process keeps its run folder's lock until the process ends (the demo
    runs every stage in one process); between tests, let them go."""
    yield
    release_held_locks()


def pytest_runtest_setup(item):
    """Tests marked vllm run the real engine: skipped where vllm is not installed (the shared
    .venv), an error under STEPFLOW_REQUIRE_VLLM=1 (make test-vllm), where skipping would pass a
    CI run that tested nothing."""
    if item.get_closest_marker("vllm") is None or importlib.util.find_spec("vllm") is not None:
        return
    if os.environ.get("STEPFLOW_REQUIRE_VLLM") == "1":
        pytest.fail(
            "vllm is not installed but STEPFLOW_REQUIRE_VLLM=1: run the vLLM tests with `make test-vllm` (.venv-vllm)",
            pytrace=False,
        )
    pytest.skip("vllm is not installed (make test-vllm runs these tests in .venv-vllm)")

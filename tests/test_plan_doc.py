"""The make plan outputs docs/real-model.md quotes are the planner's own (planner/doc.py, make
plan-doc): a committed block that differs from what the planner prints now fails here."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from planner.doc import PLAN_BLOCK, plan_output, refresh
from stages import plan_doc

REPO = Path(__file__).resolve().parents[1]
DOC = REPO / "docs" / "real-model.md"


@pytest.mark.skipif(
    importlib.util.find_spec("vllm") is not None, reason="the docs quote the planner in .venv, without vLLM"
)
def test_the_make_plan_outputs_docs_real_model_quotes_are_the_planners(monkeypatch):
    monkeypatch.chdir(REPO)  # the blocks name configs relative to the repository, as make plan-doc runs them
    text = DOC.read_text()
    blocks = [m["args"] for m in PLAN_BLOCK.finditer(text)]
    assert blocks == [
        "--config configs/paper/qwen2.5-math-1.5b.yaml",
        "--config configs/paper/llama3.2-3b.yaml",
    ]
    assert refresh(text) == text, "docs/real-model.md's make plan blocks are stale: run make plan-doc"


def _hub_cache_with(root: Path, hub_id: str, config: str) -> Path:
    """A hub cache (huggingface_hub's layout) holding one model's config.json."""
    repo = root / f"models--{hub_id.replace('/', '--')}"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text("0" * 40)
    snapshot = repo / "snapshots" / ("0" * 40)
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text(config)
    return root


def test_a_stale_block_is_rewritten_refused_by_check_and_the_hub_cache_is_not_read(monkeypatch, tmp_path, capsys):
    import huggingface_hub.constants

    monkeypatch.chdir(REPO)
    # a hub cache claiming the 1.5B policy is a two-layer model: the doc's output must not depend on it
    cache = _hub_cache_with(
        tmp_path / "hub",
        "Qwen/Qwen2.5-Math-1.5B-Instruct",
        '{"model_type": "qwen2", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2, '
        '"num_key_value_heads": 1, "intermediate_size": 128, "vocab_size": 1000, "tie_word_embeddings": true}',
    )
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
    output = plan_output("--config configs/paper/qwen2.5-math-1.5b.yaml")
    assert "model.policy           Qwen/Qwen2.5-Math-1.5B-Instruct  [needs the hub; qwen2, 1.54e9 parameters" in output
    doc = tmp_path / "doc.md"
    stale = "# a recipe\n\n<!-- make plan --config configs/paper/qwen2.5-math-1.5b.yaml -->\n```\nold output\n```\n\nafter\n"
    doc.write_text(stale)
    with pytest.raises(
        SystemExit, match=r"doc.md: a make plan block differs from the planner's output: run make plan-doc"
    ):
        plan_doc.main([str(doc), "--check"])
    assert doc.read_text() == stale  # --check writes nothing
    plan_doc.main([str(doc)])
    assert doc.read_text() == stale.replace("old output", output)
    plan_doc.main([str(doc), "--check"])  # fresh now
    assert "every make plan block is the planner's output" in capsys.readouterr().out

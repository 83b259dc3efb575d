"""make bench's bookkeeping (perf/): one module per row of docs/perf.md, the row schema
(ratio = reference_s / ours_s, rates stated as seconds per unit of work), `python -m perf`'s
row choice and what it writes, the pinned processes' core choice, the MFU formula against a real
model's parameter count, docs/perf.md keeping other machines' rows, the thread probes'
protocol, the equal-work comparison of the synchronous and asynchronous modes (its settings, its
work check, the ceiling arithmetic) (the benchmarks themselves measure, never tested for time)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def test_every_row_of_the_perf_doc_has_its_module_and_make_bench_runs_it():
    """One module per row name of docs/perf.md's ratio table, named after it, with run(cfg,
    out_dir); `python -m perf` runs every module of perf.ROWS, each exactly once."""
    import importlib
    import inspect

    from perf import ROWS

    text = (REPO / "docs" / "perf.md").read_text()
    table = text[text.index("## Batched vs one at a time") : text.index("## PRM training throughput")]
    documented = {
        line.split("|")[1].strip()
        for line in table.splitlines()
        if line.startswith("| ") and not line.startswith("| name")
    }
    assert documented and documented <= set(ROWS) and len(ROWS) == len(set(ROWS))
    for name in ROWS:
        module = importlib.import_module(f"perf.{name}")
        assert module.NAME == name and list(inspect.signature(module.run).parameters) == ["cfg", "out_dir"]


def test_a_ratio_row_is_reference_time_over_ours_and_rates_become_seconds_per_unit():
    from perf.rows import per_unit, ratio_row

    row = ratio_row("x", ours_s=2.0, reference_s=6.0, goal=4.0, reference="one at a time", problems=3)
    assert (row["ratio"], row["goal"], row["reference"], row["problems"]) == (3.0, 4.0, "one at a time", 3)
    assert ratio_row("x", ours_s=0.0, reference_s=1.0, goal=None, reference="-")["ratio"] == float("inf")
    # 300 completions in 10 s against 50 in 5 s: 30/s over 10/s, the same 3.0 as a ratio of seconds per completion
    rate_row = ratio_row("x", ours_s=per_unit(10.0, 300), reference_s=per_unit(5.0, 50), goal=None, reference="-")
    assert rate_row["ratio"] == pytest.approx((300 / 10.0) / (50 / 5.0))
    with pytest.raises(ValueError, match="0 units of work"):
        per_unit(1.0, 0)


def test_the_mcts_row_compares_completions_per_second_as_a_time_ratio():
    from test_mcts import FakeWorld

    from perf.mcts_batched import bench_mcts_batched
    from pipeline.config.schema import MCTSConfig

    row = bench_mcts_batched(
        [("p0", "q"), ("p1", "q")], MCTSConfig(k=8, max_iterations=1, max_rollouts=64), FakeWorld(p_good=0.5)
    )
    assert row["ours_completions"] > 0 and row["reference_completions"] > 0
    assert row["ours_s"] == pytest.approx(row["ours_total_s"] / row["ours_completions"])
    assert row["reference_s"] == pytest.approx(row["reference_total_s"] / row["reference_completions"])
    assert row["ratio"] == pytest.approx(row["ours_completions_per_s"] / row["reference_completions_per_s"])
    assert row["ratio"] == pytest.approx(row["reference_s"] / row["ours_s"])


def test_only_names_one_known_row():
    from perf.__main__ import split_only

    assert split_only(["--config", "c.yaml", "run=bench"]) == (["--config", "c.yaml", "run=bench"], None)
    assert split_only(["run=bench", "only=mcts_batched", "mcts.k=2"]) == (["run=bench", "mcts.k=2"], "mcts_batched")
    with pytest.raises(SystemExit, match="only=mcts: name one row of generation_shared_prompt, "):
        split_only(["only=mcts"])
    with pytest.raises(SystemExit, match="name one row"):
        split_only(["only=mcts_batched", "only=prm_one_pass"])


def test_a_row_run_alone_writes_its_file_and_its_line_and_a_full_run_writes_every_table(tmp_path):
    from perf.__main__ import write_results

    docs = tmp_path / "perf.md"
    row = lambda ratio: {
        "name": "prm_one_pass",
        "ours_s": 1.0,
        "reference_s": ratio,
        "ratio": ratio,
        "goal": 3.0,
        "reference": "per prefix",
        "model": "random init",
        "machine": "CPU-B",
    }
    threads = {
        "name": "threads_under_contention",
        "machine": "CPU-B",
        "settings": {
            "1 thread": {
                "alone_steps_per_s": 20.0,
                "shared_steps_per_s": 10.0,
                "slowdown": 2.0,
                "competitor_steps_per_s": 8.0,
            }
        },
    }
    write_results(
        {"prm_one_pass": row(2.0), "threads_under_contention": threads}, tmp_path, "CPU-B", alone=False, docs=docs
    )
    assert set(json.loads((tmp_path / "results.json").read_text())) == {"prm_one_pass", "threads_under_contention"}
    assert "| 1 thread | 20.0 | 10.0 | 2.00x | 8.0 | CPU-B |" in docs.read_text()
    write_results({"prm_one_pass": row(5.0)}, tmp_path, "CPU-B", alone=True, docs=docs)
    assert json.loads((tmp_path / "prm_one_pass.json").read_text())["ratio"] == 5.0
    text = docs.read_text()
    assert [line for line in text.splitlines() if line.startswith("| prm_one_pass")] == [
        "| prm_one_pass | 1.000 | 5.000 | 5.00x | >= 3x | per prefix | CPU-B |"
    ]
    assert "| 1 thread | 20.0 |" in text  # the other tables kept


def test_pinned_processes_take_the_core_of_their_rank(tmp_path):
    """core_for (pipeline.finetune.tba.cores) picks the rank-th core (wrapping around); pinned_to pins a child
    before it starts; `python -m perf.pinned` pins a torchrun worker by its LOCAL_RANK."""
    from perf.rows import pinned_to
    from pipeline.finetune.tba.cores import core_for

    assert [core_for(rank, {5, 2, 9}) for rank in range(4)] == [2, 5, 9, 2]
    cores = sorted(os.sched_getaffinity(0))
    show = "import os; print(sorted(os.sched_getaffinity(0)))"
    child = subprocess.run(
        [sys.executable, "-c", show],
        preexec_fn=pinned_to(cores[-1]),
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    )
    assert child.stdout.strip() == str([cores[-1]])
    (tmp_path / "show_affinity.py").write_text(show + "\n")
    env = {
        **os.environ,
        "LOCAL_RANK": "1",
        "PYTHONPATH": os.pathsep.join([str(REPO), str(tmp_path), os.environ.get("PYTHONPATH", "")]),
    }
    worker = subprocess.run(
        [sys.executable, "-m", "perf.pinned", "show_affinity"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    )
    assert worker.stdout.strip().splitlines()[-1] == str([cores[1 % len(cores)]])


def test_training_flops_count_the_decoder_block_matrices():
    from transformers import Qwen2Config, Qwen2Model

    from perf.prm_training import peak_bf16_flops, training_flops_per_token

    config = Qwen2Config(
        vocab_size=50,
        hidden_size=48,
        intermediate_size=80,
        num_hidden_layers=3,
        num_attention_heads=6,
        num_key_value_heads=2,
    )
    model = Qwen2Model(config)
    matrices = sum(
        p.numel() for n, p in model.named_parameters() if n.startswith("layers.") and n.endswith("proj.weight")
    )
    assert training_flops_per_token(config, 0.0) == 6 * matrices
    assert training_flops_per_token(config, 100.0) == 6 * matrices + 12 * 3 * 48 * 100
    assert peak_bf16_flops("NVIDIA H100 80GB HBM3") == 989.4e12 and peak_bf16_flops("Some CPU") is None


def test_benchmarks_markdown_replaces_this_machines_rows_and_keeps_the_rest(tmp_path):
    from perf.rows import write_markdown

    path = tmp_path / "perf.md"
    result = lambda s: {"ours_s": s, "reference_s": 2 * s, "ratio": 2.0, "goal": 3.0, "reference": "prefix by prefix"}
    training = {
        "tokens_per_s": 1000.0,
        "achieved_tflops": 1.0,
        "mfu": 0.5,
        "seq_len": 10.0,
        "micro_batch_size": 4,
        "batch_size": 8,
        "compile": True,
    }
    threads = lambda rate: {
        "1 thread": {
            "alone_steps_per_s": rate,
            "shared_steps_per_s": rate / 2,
            "slowdown": 2.0,
            "competitor_steps_per_s": 7.0,
        }
    }
    write_markdown({"prm_one_pass": result(1.0)}, path, "random init", "GPU-A", [training], threads(30.0))
    path.write_text(path.read_text() + "\n## Notes\n\nhand-written note\n")
    write_markdown({"prm_one_pass": result(3.0)}, path, "random init", "CPU-B", contention=threads(10.0))
    write_markdown({"prm_one_pass": result(5.0)}, path, "random init", "CPU-B", contention=threads(12.0))
    text = path.read_text()
    rows = [line for line in text.splitlines() if line.startswith("| prm_one_pass")]
    assert len(rows) == 2 and rows[0].endswith("| GPU-A |") and "| 5.000 |" in rows[1] and rows[1].endswith("| CPU-B |")
    assert "| 2.00x | >= 3x | prefix by prefix | CPU-B |" in rows[1]  # the goal and reference text the row carries
    assert "| 1000 | 1.0 | 50.0% | 10 | 4 x 2 | True | GPU-A |" in text
    assert text.count("hand-written note") == 1
    thread_rows = [line for line in text.splitlines() if line.startswith("| 1 thread")]
    assert thread_rows == [
        "| 1 thread | 30.0 | 15.0 | 2.00x | 7.0 | GPU-A |",
        "| 1 thread | 12.0 | 6.0 | 2.00x | 7.0 | CPU-B |",
    ]


def test_the_vllm_row_is_written_alone_and_kept_by_a_bench_run_without_it(tmp_path):
    from perf.rows import write_markdown, write_ratio_row

    path = tmp_path / "perf.md"
    result = lambda s: {"ours_s": s, "reference_s": 2 * s, "ratio": 2.0, "goal": 3.0, "reference": "prefix by prefix"}
    vllm = {
        "ours_s": 1.0,
        "reference_s": 3.0,
        "ratio": 3.0,
        "goal": None,
        "reference": "the HF backend",
        "ours_tokens": 700,
        "reference_tokens": 690,
    }
    write_markdown({"prm_one_pass": result(1.0)}, path, "random init", "CPU-B", contention={})
    write_ratio_row(path, "generation_vllm_vs_hf", vllm, "random init", "CPU-B")
    write_ratio_row(
        path, "generation_vllm_vs_hf", {**vllm, "ratio": 4.0}, "random init", "CPU-B"
    )  # replaces its own row
    write_markdown(
        {"prm_one_pass": result(5.0)}, path, "random init", "CPU-B", contention={}
    )  # make bench where vllm is absent
    rows = [line for line in path.read_text().splitlines() if line.startswith("| ")]
    assert [row.split("|")[1].strip() for row in rows if "CPU-B" in row] == ["generation_vllm_vs_hf", "prm_one_pass"]
    vllm_row = next(row for row in rows if row.startswith("| generation_vllm_vs_hf"))
    assert "| 4.00x |" in vllm_row and "generated tokens: ours 700, reference 690" in vllm_row
    assert "| 5.000 |" in next(row for row in rows if row.startswith("| prm_one_pass"))


def test_two_backends_are_timed_on_the_same_prompts_and_budget():
    from test_generation import PROMPTS, make_model, make_tokenizer

    from perf.generation_vllm_vs_hf import bench_backends
    from pipeline.generation.hf import HFGenerator

    tokenizer = make_tokenizer()
    result = bench_backends(
        HFGenerator(make_model(), tokenizer),
        HFGenerator(make_model(), tokenizer),
        PROMPTS,
        n_prompts=3,
        n=2,
        max_new_tokens=3,
    )
    assert result["sequences"] == 6 and result["ours_tokens"] == result["reference_tokens"] <= 18
    assert result["ratio"] == result["reference_s"] / result["ours_s"]


@pytest.mark.slow
def test_thread_probes_are_timed_over_one_shared_window(tmp_path):
    """The contention benchmark's probes run in their own processes, wait for each other after
    warming up, and each report a rate; a probe that dies before its window is an error, not a hang."""
    from perf.threads_under_contention import measure_together
    from pipeline.config.loader import load_config, save_config

    config = load_config(
        "configs/tiny.yaml",
        [
            "tinyworld.n_train=200",
            "tinyworld.n_val=4",
            "tinyworld.n_test=4",
            "bootstrap.hidden_size=32",
            "bootstrap.intermediate_size=64",
            "bootstrap.num_layers=1",
        ],
    )
    save_config(config, tmp_path / "probe.yaml")
    rates = measure_together(
        [(1, {}), (1, {"OMP_WAIT_POLICY": "PASSIVE"})], str(tmp_path / "probe.yaml"), seconds=0.5, timeout=240
    )
    assert len(rates) == 2 and all(rate > 0 for rate in rates)
    with pytest.raises(RuntimeError, match="before its timed window"):
        measure_together([(1, {})], str(tmp_path / "missing.yaml"), seconds=0.5, timeout=240)


def test_the_speedup_ceiling_is_the_sum_over_the_longer_part():
    from perf.gfn_async_speedup import speedup_ceiling

    assert speedup_ceiling(1.0, 1.0) == 2.0
    assert speedup_ceiling(3.0, 1.0) == pytest.approx(4 / 3) and speedup_ceiling(1.0, 3.0) == pytest.approx(4 / 3)
    assert speedup_ceiling(0.0, 2.0) == 1.0
    with pytest.raises(ValueError, match="G, T >= 0"):
        speedup_ceiling(-1.0, 2.0)


def equal_work_rows(updates: int, generate: float, train: float, overlapped: float, batch: int = 16, replayed: int = 0):
    """Metrics records of a synchronous run (an update every generate + train seconds, ``generate``
    of them sampling) and of an asynchronous one (an update every ``overlapped`` seconds)."""
    sync = [
        {
            "step": i + 1,
            "sampled": batch,
            "empty_solutions": 0,
            "replayed": replayed,
            "trained": batch + replayed,
            "sample_seconds": generate,
            "seconds": generate + train,
            "wall_time": 100.0 + (i + 1) * (generate + train),
        }
        for i in range(updates)
    ]
    asynchronous = [
        {
            "step": i + 1,
            "trained": batch,
            "trajectories_per_question_min": 4,
            "generated_per_trained": 1.0,
            "staleness_mean": 1.0,
            "seconds": overlapped,
            "trainer_idle_seconds": 0.25,
            "publish_seconds": 0.01,
            "wall_time": 500.0 + (i + 1) * overlapped,
        }
        for i in range(updates)
    ]
    return sync, asynchronous


def test_equal_work_speedup_times_the_same_updates_and_reports_the_fraction_of_the_ceiling():
    from perf.gfn_async_speedup import equal_work_speedup

    sync, asynchronous = equal_work_rows(10, generate=1.0, train=3.0, overlapped=3.75)
    result = equal_work_speedup(sync, asynchronous, questions=4, samples=4, timed_from=2)
    assert result["timed_updates"] == 8 and result["updates"] == 10
    assert result["generate_s"] == pytest.approx(1.0) and result["train_s"] == pytest.approx(3.0)
    assert result["sync_s"] == pytest.approx(8 * 4.0) and result["async_s"] == pytest.approx(8 * 3.75)
    assert result["ceiling"] == pytest.approx(4 / 3)  # (G + T) / max(G, T)
    assert result["speedup"] == pytest.approx(4.0 / 3.75) and result["fraction"] == pytest.approx(
        (4.0 / 3.75) / (4 / 3)
    )
    assert result["sync_trained"] == result["async_trained"] == 16
    assert result["async_busy_s"] == pytest.approx(3.5) and result["async_trainer_idle_s"] == pytest.approx(0.25)


def test_equal_work_speedup_refuses_runs_that_did_different_work():
    from perf.gfn_async_speedup import equal_work_speedup

    sync, asynchronous = equal_work_rows(10, 1.0, 1.0, 1.2, replayed=8)  # 16 fresh + 8 replayed against 16
    with pytest.raises(ValueError, match="synchronous update 1 trained 24 rows"):
        equal_work_speedup(sync, asynchronous, questions=4, samples=4)
    sync, asynchronous = equal_work_rows(10, 1.0, 1.0, 1.2)
    with pytest.raises(ValueError, match="10 synchronous updates vs 9 asynchronous"):
        equal_work_speedup(sync, asynchronous[:9], questions=4, samples=4)
    asynchronous[3] = {**asynchronous[3], "trained": 12, "trajectories_per_question_min": 3}
    with pytest.raises(ValueError, match="asynchronous update 4 trained 12 rows"):
        equal_work_speedup(sync, asynchronous, questions=4, samples=4)


def test_the_equal_work_settings_train_the_same_rows_in_both_modes():
    """Both modes' `make gfn` settings: the synchronous run replays nothing, the asynchronous trainer
    draws the same questions x samples a searcher sampled once per published version; the
    asynchronous settings pass the checks the stage runs before Ray starts."""
    from perf.gfn_async_speedup import equal_work_overrides
    from pipeline.config.loader import load_config
    from pipeline.finetune.tba.settings import async_shape, check_async_settings

    sync = load_config("configs/tiny.yaml", equal_work_overrides("sync", 4, 4, (0, 1))).gfn
    asynchronous = load_config("configs/tiny.yaml", equal_work_overrides("async", 4, 4, (0, 1))).gfn
    assert (sync.mode, sync.loss, sync.replay_fraction, sync.trainer_cores) == ("sync", "tb_vargrad", 0.0, [0])
    assert sync.questions_per_step * sync.samples_per_question == 16
    assert async_shape(asynchronous) == (4, 4) and asynchronous.samples_per_question == 4  # K = S: every sample trained
    assert (asynchronous.searchers, asynchronous.searcher_rounds_per_version, asynchronous.sync_every) == (1, 1, 1)
    assert (asynchronous.trainer_cores, asynchronous.searcher_cores) == ([0], [1])
    check_async_settings(asynchronous)
    with pytest.raises(ValueError, match="sync or async"):
        equal_work_overrides("lockstep", 4, 4, (0, 1))

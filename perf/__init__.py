"""make bench: each batched design of the library against its one-at-a-time reference, and the
measurements docs/perf.md records. Not part of the installed library (nothing in pipeline/,
prm/, eval/ or stages/ imports it); run from the repository root:

    python -m perf --config configs/tiny.yaml run=bench [only=<row>]

One module per row of docs/perf.md (ROWS, in the order make bench runs them), each with
``run(cfg, out_dir) -> dict``; perf.rows holds the timer, the row schema (ratio =
reference_s / ours_s always) and the table writer; perf.world the model the rows share.
"""

ROWS = (
    "generation_shared_prompt",
    "generation_vllm_vs_hf",
    "mcts_batched",
    "prm_one_pass",
    "gfn_batched_step",
    "search_batched",
    "gfn_step_scaling",
    "gfn_step_scaling_fsdp2",
    "gfn_async_speedup",
    "async_cluster_sim",
    "threads_under_contention",
    "prm_training",
)

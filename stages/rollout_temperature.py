"""make rollout-temperature: how the policy's rollouts err at each sampling temperature.

Reads:  the policy (model.policy), held-out problems (data.validation*, the first
        rollout_temperature.problems), of a kind with an exact first-wrong-step labeller
        (prm.exact_check.FIRST_ERROR_LABELLERS: the tiny world)
Writes: runs/<run>/rollout_temperature/results.json ({"rows": one per temperature, "settings"}),
        config.yaml; prints the table
Library: pipeline.rollouts.temperature.temperature_sweep (its docstring defines every column).

For each of rollout_temperature.temperatures: rollout_temperature.k (default mcts.k) samples of
each problem from its root, drawn as MCTS draws its rollouts; the per-step slip rate (first wrong
steps over the steps reached with a correct prefix), the arithmetic slips, the sampled accuracy
and the share of problems whose root MC is strictly between 0 and 1 (those MCTS searches).
docs/mcts.md, "Rollout temperature", reads mcts.temperature off this table.
"""

from __future__ import annotations

from pipeline.generation import build_generator
from pipeline.rollouts.temperature import sweep_table, temperature_sweep
from pipeline.storage.files import write_json_atomic
from prm.exact_check import FIRST_ERROR_LABELLERS
from stages.cli import cli, log, parse_args, set_threads, timed
from stages.inputs import validation_problems
from stages.run_folders import stage_dir


def main(argv: list[str] | None = None) -> dict:
    config = parse_args("rollout_temperature", argv)
    set_threads(config, "rollout_temperature")
    cfg = config.rollout_temperature
    problems = validation_problems(config)[: cfg.problems]
    kinds = sorted({p.kind for p in problems})
    if len(kinds) != 1 or kinds[0] not in FIRST_ERROR_LABELLERS:
        raise SystemExit(
            "rollout_temperature: the problems of data.validation "
            f"({config.resolve(config.data.validation_path) or config.data.validation}) "
            f"are of kind(s) {kinds}; the slip rate needs one kind with an exact first-wrong-step labeller "
            f"({sorted(FIRST_ERROR_LABELLERS)})"
        )
    out = stage_dir(config, "rollout_temperature")
    k = cfg.k or config.mcts.k
    with timed("rollout_temperature"):
        rows = temperature_sweep(
            build_generator(config), problems, config, cfg.temperatures, k, cfg.seed, FIRST_ERROR_LABELLERS[kinds[0]]
        )
    result = {
        "rows": rows,
        "settings": {
            "policy": config.resolve(config.model.policy),
            "problems": len(problems),
            "k": k,
            "validation": config.resolve(config.data.validation_path) or config.data.validation,
            "mcts.temperature": config.mcts.temperature,
            "seed": cfg.seed,
        },
    }
    write_json_atomic(out / "results.json", result)
    log.info("rollout_temperature: wrote %s", out / "results.json")
    print(
        f"rollout temperature sweep: {len(problems)} held-out problems x {k} samples, policy {config.resolve(config.model.policy)}"
    )
    print(sweep_table(rows))
    return result


if __name__ == "__main__":
    cli(main)

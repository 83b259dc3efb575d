"""make gfn: step-level GFlowNet fine-tuning of the policy (paper 4; SubTB(lambda), TB, TB-VarGrad).

Runs in one process, or across N with ``accelerate launch --num_processes N -m stages.train_gfn``
(configs/accelerate/: DDP, FSDP, DeepSpeed; docs/scale.md); with gfn.mode=async, searcher actors
on Ray sample and score while this process trains (docs/async.md).

Reads:  the policy (config.model.policy), the PRM (config.model.prm: runs/<run>/prm/model, or another PRM), the training problems
Writes: runs/<run>/gfn/model/ (save_pretrained), metrics.jsonl, training_curves.png,
        ceiling.json (before training: the reweighting ceiling of the base policy's samples,
        also logged in one line; pipeline.finetune.ceiling),
        checkpoints/step-<n>/ (every gfn.save_every steps; a rerun resumes from the newest good one)
Started again once finished (model/ committed whole), it says so and returns the logged metrics;
gfn.retrain=true (ppo.retrain for make ppo) trains afresh.
"""

from __future__ import annotations

import dataclasses
import functools

from pipeline.finetune.run import finetune_policy
from pipeline.finetune.setup import preflight
from pipeline.training.metrics import MetricsLog
from prm.formats import load_scorer
from stages.cli import cli, parse_args, set_threads, timed
from stages.inputs import require_prm, training_problems
from stages.run_folders import finished_model, require_finished, stage_dir


def main(argv: list[str] | None = None, stage: str = "gfn") -> list[dict]:
    config = parse_args(f"train_{stage}", argv)
    set_threads(config, stage)
    prm_path = require_prm(config.resolve(config.model.prm))
    preflight(config, stage)  # before any model is loaded
    require_finished(config, "prm")
    problems = training_problems(config)  # before the run folder is made: a stage that cannot start writes nothing
    out = stage_dir(config, stage)
    cfg = config.finetune_section(stage)
    if finished_model(out, stage, cfg.retrain, dataclasses.asdict(cfg)) is not None:
        return MetricsLog(out / "metrics.jsonl").read()
    # each process (or asynchronous searcher) builds its own frozen PRM, on its own device: ours or
    # another format (model.prm_format)
    make_scorer = functools.partial(load_scorer, prm_path, config)
    with timed(stage):
        return finetune_policy(config, stage, problems, make_scorer, out)


if __name__ == "__main__":
    cli(main)

"""make gfn: step-level GFlowNet fine-tuning of the policy (paper 4; SubTB(lambda), TB, TB-VarGrad).

Reads:  the policy (config.model.policy), the PRM (runs/<run>/prm/model), the training problems
Writes: runs/<run>/gfn/model/ (save_pretrained), metrics.jsonl, training_curves.png,
        checkpoint/ (every gfn.save_every steps; a rerun resumes from it)
"""

from __future__ import annotations

import sys

from pipeline.finetune.run import train_policy
from stages.common import parse_args, require, set_threads, stage_dir, timed, training_problems


def main(argv: list[str] | None = None, stage: str = "gfn") -> list[dict]:
    config = parse_args(f"train_{stage}", argv)
    set_threads(config)
    out = stage_dir(config, stage)
    require(config.resolve(config.model.prm), "prm")
    with timed(stage):
        return train_policy(config, stage, training_problems(config), out)


if __name__ == "__main__":
    main(sys.argv[1:])

"""make ppo: the PPO baseline with step-level PRM rewards (paper 5, appendix D).

Reads:  the policy (config.model.policy), the PRM (runs/<run>/prm/model), the training problems
Writes: runs/<run>/ppo/model/ (save_pretrained), value_head/value_head.safetensors (beside the model:
        vLLM would load a stray weight file inside it), metrics.jsonl,
        training_curves.png, checkpoints/ (while training)
"""

from __future__ import annotations

from stages.cli import cli
from stages.train_gfn import main as train_main


def main(argv: list[str] | None = None) -> list[dict]:
    return train_main(argv, stage="ppo")


if __name__ == "__main__":
    cli(main)

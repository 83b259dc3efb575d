"""The batch arithmetic every trainer checks before it loads a model, and `make plan` checks
before anything runs: the same functions, so a plan that passes never meets a launch that fails."""

from __future__ import annotations


def check_divisible(questions_per_step: int, processes: int, key: str = "questions_per_step") -> None:
    """Every process samples the same number of whole questions (a question's samples stay on one
    process): ``questions_per_step`` must be a multiple of ``processes``."""
    if questions_per_step < 1 or questions_per_step % processes:
        raise ValueError(
            f"{key}={questions_per_step} must be a positive multiple of the number of processes ({processes}): "
            f"each process samples questions_per_step / {processes} whole questions "
            f"({questions_per_step} / {processes} = {questions_per_step / processes:.4g})"
        )


def gradient_accumulation(batch_size: int, micro_batch_size: int, processes: int, key: str = "prm.batch_size") -> int:
    """The accumulation steps that make ``batch_size`` sequences per optimizer step out of
    ``micro_batch_size`` per forward on each of ``processes``: batch / (micro x processes), which
    must be a whole number (a rounded one would train with another batch than the config says).

    >>> gradient_accumulation(144, 6, 8)
    3
    """
    per_round = micro_batch_size * processes
    if batch_size < per_round or batch_size % per_round:
        raise ValueError(
            f"{key}={batch_size} is not a multiple of micro_batch_size x processes = {micro_batch_size} x {processes} "
            f"= {per_round} ({batch_size} / {per_round} = {batch_size / per_round:.4g}): the effective batch would be "
            f"{max(1, round(batch_size / per_round)) * per_round}. Choose a micro-batch size that divides "
            f"{batch_size} / {processes}"
            + (
                f" = {batch_size / processes:.4g}"
                if batch_size % processes == 0
                else f" (or a batch size that is a multiple of {processes})"
            )
        )
    return batch_size // per_round

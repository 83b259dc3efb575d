"""The simulation's settings: the calibration (measured seconds it sleeps), the store policies it
runs under and the sweep's shape."""

from __future__ import annotations

import dataclasses
from pathlib import Path

NAME = "async_cluster_sim"
REPO = Path(__file__).resolve().parents[2]


@dataclasses.dataclass(frozen=True)
class Calibration:
    """Measured seconds the simulation sleeps (sources in ``source``).

    round_seconds:          G, one searcher round (generation + scoring) of trajectories_per_round
    trajectories_per_round: questions_per_round x samples_per_question of that measurement
    update_seconds:         T, one trainer update (of rows_measured rows on that machine)
    token_seconds:          per generated token, batched generation
    tokens_per_trajectory:  mean tokens of a simulated trajectory (uniform in [tokens/2, 3 tokens/2])
    """

    round_seconds: float = 0.911
    trajectories_per_round: int = 16
    update_seconds: float = 1.024
    token_seconds: float = 2.282 / (64 * 16 * 48)
    tokens_per_trajectory: int = 48
    source: str = (
        "2-core CPU, 2026-11-26: G and T from docs/async.md 'Measured' (make gfn, 4 questions x 4 "
        "trajectories, sync run, updates 3-20, 3 seeds); per token from docs/perf.md "
        "generation_shared_prompt (CPU, 64 prompts x 16 x 48 tokens in 2.282 s)"
    )

    @property
    def trajectory_seconds(self) -> float:
        """Per trajectory besides its tokens, so that a round of mean length costs G."""
        return self.round_seconds / self.trajectories_per_round - self.tokens_per_trajectory * self.token_seconds


CALIBRATION = Calibration()


@dataclasses.dataclass(frozen=True)
class StorePolicy:
    """How the trainer publishes, what the store keeps and draws, and how many rounds a searcher
    samples per published version (the gfn keys of the same names).

    buffer_size: completions kept; None: buffer_batches trainer batches
    """

    name: str
    sync_every: int
    max_staleness: int | None
    recency_fraction: float
    async_priority: str
    buffer_size: int | None = None
    buffer_batches: int = 4
    searcher_rounds_per_version: int | None = None


def config_policy(gfn) -> StorePolicy:
    """The config's own asynchronous settings (what `make gfn gfn.mode=async` would run): replay allowed."""
    return StorePolicy(
        "config",
        gfn.sync_every,
        gfn.max_staleness,
        gfn.recency_fraction,
        gfn.async_priority,
        gfn.buffer_size,
        searcher_rounds_per_version=gfn.searcher_rounds_per_version,
    )


# No replay, as in the project's equal-work measurement (docs/async.md, "Measured"): a publication
# after every update, completions of weights more than one update old dropped, one round per
# searcher per published version, so update t trains the rounds sampled with the weights of update
# t - 1 while the searchers sample the next ones. Without the one-round limit a searcher that ends a
# round before the next publication starts another with the same weights; that round ends after the
# trainer has drawn its batch and is too stale for the next one (docs/perf.md, "Simulated cluster").
NO_REPLAY = StorePolicy(
    "no_replay",
    sync_every=1,
    max_staleness=1,
    recency_fraction=1.0,
    async_priority="uniform",
    searcher_rounds_per_version=1,
)


@dataclasses.dataclass(frozen=True)
class SimSettings:
    """The sweep's shape. questions_per_round x samples_per_question trajectories per searcher round;
    the trainer draws searchers x questions_per_round questions x samples_per_question per update.
    policies: None = the config's asynchronous settings, then NO_REPLAY."""

    searcher_counts: tuple[int, ...] = (1, 2, 4, 8, 16, 32)
    policies: tuple[StorePolicy, ...] | None = None
    questions_per_round: int = 4
    samples_per_question: int = 4
    warmup_updates: int = 2  # not measured: the first rounds of every searcher
    measured_updates: int = 8
    problems: int = 4096
    sweep_payload_parameters: int = 1_000_000  # bf16 weights published every sync_every updates in the sweep
    full_payload_parameters: int = 1_000_000_000  # the 1B-parameter bf16 publication, measured once after the sweep
    placement_timeout: float = 120.0
    draw_timeout: float = 120.0  # a trainer step that cannot get its batch this long fails the run


DEFAULT_SETTINGS = SimSettings()

"""The asynchronous mode's settings: B and K of a draw, each searcher's share of the problems and
seed, and the checks of the gfn keys that only make sense together (against each other and against
the number of training problems), run before Ray starts (docs/async.md, "The buffer")."""

from __future__ import annotations

import dataclasses
import os

from pipeline.config.loader import ConfigError
from pipeline.finetune.rewards import StateLogRewards


def searcher_config(cfg, index: int):
    """A searcher's copy of the section: its own seed, with which it shuffles its share of the problems
    (searcher_share) and samples (searcher 0 of one walks the synchronous trainer's cycle: lockstep
    equals sync, docs/async.md)."""
    return dataclasses.replace(cfg, seed=cfg.seed + 7919 * index)


def searcher_share(problems: list, index: int, searchers: int) -> list:
    """Searcher ``index``'s share of the training problems: those at positions index, index +
    searchers, ... (each problem in exactly one share; one searcher: all of them, so searcher 0 walks
    the synchronous trainer's cycle). Disjoint shares mean two searchers never sample a question at
    the same time: the rounds of one weights version hold searchers x questions_per_step distinct
    questions. With shared cycles two searchers meet on a question with probability about
    1 - exp(-(N q)^2 / 2P) per version (N searchers of q questions each, P problems), and then a
    version's rounds hold fewer questions than a batch of B = N q needs: under a staleness bound of
    one version the trainer waits for the next version's rounds and trains them twice."""
    if not 0 <= index < searchers:
        raise ValueError(f"searcher index {index}: expected 0 <= index < gfn.searchers = {searchers}")
    if 0 < len(problems) < searchers:
        raise ValueError(
            f"gfn.searchers = {searchers} exceeds the {len(problems)} training problems: each searcher walks its own "
            "share of them"
        )
    return problems[index::searchers]


def async_shape(cfg) -> tuple[int, int]:
    """(B questions per trainer step, K distinct completions per question) of the gfn section."""
    return cfg.async_questions or cfg.questions_per_step, cfg.async_samples_used or cfg.samples_per_question


def question_capacity(cfg) -> int:
    """The most completions the buffer keeps per question: gfn.buffer_per_question, default S."""
    return cfg.buffer_per_question or cfg.samples_per_question


def store_buffer_settings(cfg) -> dict:
    """The store's GroupedReplay arguments of the gfn section: buffer_size, K, async_priority,
    buffer_temperature, recency_fraction, seed, the per-question capacity and the priority
    (gfn.buffer_key under the section's reward shaping)."""
    return {
        "capacity": cfg.buffer_size,
        "per_question": async_shape(cfg)[1],
        "priority": cfg.async_priority,
        "temperature": cfg.buffer_temperature,
        "recency": cfg.recency_fraction,
        "seed": cfg.seed,
        "question_capacity": question_capacity(cfg),
        "reward": StateLogRewards.of(cfg),
        "key": cfg.buffer_key,
    }


def batch_key(cfg, section: str = "gfn") -> str:
    """The key B is read from: async_questions when set, else questions_per_step."""
    return f"{section}.async_questions" if cfg.async_questions else f"{section}.questions_per_step"


def smallest_buffer(cfg) -> int:
    """The smallest buffer_size that holds a batch whatever the order of the searchers' rounds:
    (B - 1) x c + K, c = question_capacity. A searcher adds a round question by question, S
    completions each, and the buffer keeps the newest; a question holds at most c of them, and
    only the oldest question in the buffer can hold fewer than its newest visit gave (>= K with
    S >= K and c >= K). So B questions with K completions each fit exactly when the B - 1 newest
    hold c each and the oldest K (docs/async.md, "The buffer")."""
    questions, used = async_shape(cfg)
    return (questions - 1) * question_capacity(cfg) + used


def check_async_settings(cfg, section: str = "gfn") -> None:
    """The asynchronous settings that only make sense together, checked before Ray starts;
    raises ConfigError naming the key."""
    questions, used = async_shape(cfg)
    capacity = question_capacity(cfg)
    if not 0.0 <= cfg.recency_fraction <= 1.0:
        raise ConfigError(f"{section}.recency_fraction = {cfg.recency_fraction}: expected m in [0, 1]")
    if used > cfg.samples_per_question:
        raise ConfigError(
            f"{section}.async_samples_used = {used} exceeds {section}.samples_per_question = {cfg.samples_per_question}: "
            "a question's K distinct completions come from the S >= K a searcher generates"
        )
    if cfg.loss == "tb_vargrad" and used < 2:
        raise ConfigError(
            f"{section}.async_samples_used = {used}: TB-VarGrad needs K >= 2 completions per question "
            "(a question with one row has zero loss)"
        )
    if cfg.async_initial_completions > cfg.buffer_size:
        raise ConfigError(
            f"{section}.async_initial_completions = {cfg.async_initial_completions} exceeds {section}.buffer_size = "
            f"{cfg.buffer_size}: training would never start"
        )
    if capacity < used:
        raise ConfigError(
            f"{section}.buffer_per_question = {capacity} is below {section}.async_samples_used = {used}: no question "
            "could hold a group of K distinct completions"
        )
    if cfg.buffer_size < smallest_buffer(cfg):
        raise ConfigError(
            f"{section}.buffer_size = {cfg.buffer_size} cannot hold a batch of {questions} questions "
            f"({batch_key(cfg, section)}) x {used} distinct completions: a searcher adds its round question by question, "
            f"{cfg.samples_per_question} completions each ({cfg.questions_per_step} x {cfg.samples_per_question} = "
            f"{cfg.questions_per_step * cfg.samples_per_question} at once), a question keeps up to {capacity} "
            f"({section}.buffer_per_question, default S) and the buffer the newest, so it needs "
            f"({questions} - 1) x {capacity} + {used} = {smallest_buffer(cfg)}"
        )
    if cfg.max_staleness is not None and cfg.max_staleness < cfg.sync_every - 1:
        raise ConfigError(
            f"{section}.max_staleness = {cfg.max_staleness} is below {section}.sync_every - 1 = {cfg.sync_every - 1}: "
            "the newest weights a searcher has are up to sync_every - 1 trainer steps old, so nothing could be trained on"
        )
    cores = os.cpu_count() or 1
    if cfg.searcher_cores is not None and cfg.ray_address is None and any(core >= cores for core in cfg.searcher_cores):
        raise ConfigError(f"{section}.searcher_cores = {cfg.searcher_cores}: this machine has cores 0 to {cores - 1}")
    if cfg.scorer_gpus and not cfg.scorer_actors:
        raise ConfigError(
            f"{section}.scorer_gpus = {cfg.scorer_gpus:g} with {section}.scorer_actors = 0: the searchers hold the PRM "
            f"(on their own GPUs); set {section}.scorer_actors to run the PRM in actors of its own"
        )
    if cfg.kl_coef_final is not None and not (cfg.kl_coef > 0 and cfg.kl_coef_final > 0):
        raise ConfigError(
            f"{section}.kl_coef_final = {cfg.kl_coef_final}: an annealed beta runs from {section}.kl_coef > 0 to a "
            f"value > 0 (got kl_coef = {cfg.kl_coef})"
        )


def share_sizes(problems: int, searchers: int) -> list[int]:
    """How many problems each searcher's share holds (searcher_share: positions i, i + N, ...)."""
    return [len(range(index, problems, searchers)) for index in range(searchers)]


def check_async_problems(cfg, problems: int, section: str = "gfn") -> None:
    """The asynchronous settings against the number of training problems, checked before Ray
    starts; raises ConfigError naming the key. A batch holds B distinct questions (the synchronous
    mode's cycle repeats questions within a step; a draw cannot), each searcher walks its own share,
    and with gfn.searcher_rounds_per_version = r the searchers sample r rounds of the first weights
    and then wait for the trainer's next ones: those rounds must hold a batch and the initial
    completions (every completion assumed distinct; repeats are found at run time)."""
    questions, used = async_shape(cfg)
    samples, per_round, capacity = cfg.samples_per_question, cfg.questions_per_step, question_capacity(cfg)
    if problems < cfg.searchers:
        raise ConfigError(
            f"{section}.searchers = {cfg.searchers} exceeds the {problems} training problems: each searcher walks its own "
            "share of them"
        )
    if problems < questions:
        raise ConfigError(
            f"{batch_key(cfg, section)} = {questions} exceeds the {problems} training problems: an asynchronous batch "
            f"holds {questions} distinct questions (the synchronous mode's cycle repeats questions within a step, a draw "
            "from the buffer cannot), so the trainer would wait for ever"
        )
    if cfg.async_initial_completions > problems * capacity:
        raise ConfigError(
            f"{section}.async_initial_completions = {cfg.async_initial_completions} exceeds what the buffer can hold of "
            f"{problems} problems: {problems} x {capacity} ({section}.buffer_per_question, default S) = "
            f"{problems * capacity}; training would never start"
        )
    rounds = cfg.searcher_rounds_per_version
    if rounds is None:
        return
    picks = rounds * per_round  # questions a searcher samples with one weights version
    shares = share_sizes(problems, cfg.searchers)
    distinct = sum(min(share, picks) for share in shares)
    if distinct < questions:
        raise ConfigError(
            f"{section}.searcher_rounds_per_version = {rounds}: with the first weights the searchers sample "
            f"{rounds} x {per_round} questions each of their shares of {shares} problems, {distinct} distinct in all, "
            f"and then wait for weights the trainer publishes only after training on a batch of {questions} "
            f"({batch_key(cfg, section)})"
        )
    held = 0
    for share in shares:  # a question sampled v times holds min(c, v x S)
        cycles, rest = divmod(picks, share)
        held += rest * min(capacity, (cycles + 1) * samples) + (share - rest) * min(capacity, cycles * samples)
    if min(held, cfg.buffer_size) < cfg.async_initial_completions:
        raise ConfigError(
            f"{section}.async_initial_completions = {cfg.async_initial_completions} exceeds the {min(held, cfg.buffer_size)} "
            f"completions the buffer holds after the first weights' {section}.searcher_rounds_per_version = {rounds} "
            "rounds of every searcher, after which they wait for weights the trainer publishes only once it has trained"
        )

"""The asynchronous mode's settings check against a simulation of what it guards: searchers' rounds
(their own shares, their own question cycles), the store's buffer (per-question and overall
capacity, eviction) and the trainer's first draw, without Ray (seconds).

Every setting the check accepts serves the first batch, whatever order the searchers' rounds come
in (hypothesis picks the first rounds' order, then every searcher keeps sampling); where a question
keeps at most S completions (gfn.buffer_per_question <= S, the default S) every setting it refuses
never does: the check is exact there. Completions are all distinct here: repeats among a round's
samples are the run-time case (docs/async.md, "The buffer").
"""

from __future__ import annotations

import json
import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pipeline.config.loader import ConfigError
from pipeline.config.schema import GFNConfig
from pipeline.finetune.policy import SampledSolution
from pipeline.finetune.sampling import TrainProblem, TrajectorySampler
from pipeline.finetune.tba.settings import (
    async_shape,
    check_async_problems,
    check_async_settings,
    question_capacity,
    searcher_config,
    searcher_share,
    share_sizes,
    smallest_buffer,
)
from pipeline.finetune.tba.stores import TrajectoryStore


class DistinctPolicy:
    """Every solution it samples is one step never sampled before."""

    def __init__(self):
        self.sampled = 0

    def sample(self, prompts, n, temperature, seed=None):
        out = []
        for _ in prompts:
            out.append([SampledSolution([f"step {self.sampled + j}"], True, 1) for j in range(n)])
            self.sampled += n
        return out


class FlatScorer:
    def log_scores_many(self, pairs):
        return [[-0.1] * len(steps) for _, steps in pairs]


def no_answer(step, kind):
    return None


def simulate(cfg: GFNConfig, problems: int, first_rounds: list[int]) -> tuple[bool, TrajectoryStore]:
    """Whether the store can give the trainer's first batch (B questions x K distinct completions,
    the initial completions in) after some round. Searchers send rounds in the order
    ``first_rounds`` gives (indices modulo the searchers; any order, a searcher may be starved),
    then in turns of every searcher once; each stops after gfn.searcher_rounds_per_version rounds.
    The turns go on until every question could hold its full capacity (enough to serve if anything
    can)."""
    questions, used = async_shape(cfg)
    store = TrajectoryStore(
        {
            "capacity": cfg.buffer_size,
            "per_question": used,
            "question_capacity": question_capacity(cfg),
            "seed": 0,
        }
    )
    everything = [TrainProblem(f"p{i}", f"q{i}", f"q{i}", "1") for i in range(problems)]
    searchers = [
        TrajectorySampler(
            DistinctPolicy(),
            FlatScorer(),
            searcher_share(everything, index, cfg.searchers),
            "tiny",
            searcher_config(cfg, index),
            extract=no_answer,
        )
        for index in range(cfg.searchers)
    ]
    sent = [0] * cfg.searchers
    visits = math.ceil(question_capacity(cfg) / cfg.samples_per_question) + 1
    turns = math.ceil(max(share_sizes(problems, cfg.searchers)) * visits / cfg.questions_per_step) + 1
    order = [index % cfg.searchers for index in first_rounds] + list(range(cfg.searchers)) * turns
    for index in order:
        if cfg.searcher_rounds_per_version is not None and sent[index] >= cfg.searcher_rounds_per_version:
            continue
        trajectories, _ = searchers[index].sample(sent[index], version=0)
        store.add(json.dumps([t.to_json() for t in trajectories]), index, version=0)
        sent[index] += 1
        if store.can_draw(questions, now=0, max_staleness=None, minimum=cfg.async_initial_completions):
            return True, store
    return False, store


def accepted(cfg: GFNConfig, problems: int) -> bool:
    try:
        check_async_settings(cfg)
        check_async_problems(cfg, problems)
    except ConfigError:
        return False
    return True


@st.composite
def async_settings(draw) -> tuple[GFNConfig, int]:
    searchers = draw(st.integers(1, 3))
    used = draw(st.integers(1, 3))
    samples = draw(st.integers(used, 4))
    cap = draw(st.none() | st.integers(used, 2 * samples))
    batch = draw(st.integers(1, 5))
    per_round = draw(st.integers(1, 4))
    problems = draw(st.integers(searchers, 10))
    cfg = GFNConfig(
        loss="tb",
        mode="async",
        searchers=searchers,
        questions_per_step=per_round,
        samples_per_question=samples,
        async_samples_used=used,
        async_questions=batch,
        buffer_per_question=cap,
        max_staleness=None,
        searcher_rounds_per_version=draw(st.none() | st.integers(1, 3)),
    )
    cfg.buffer_size = max(1, smallest_buffer(cfg) + draw(st.integers(-4, 4)))
    cfg.async_initial_completions = draw(st.integers(0, cfg.buffer_size + 2))
    return cfg, problems


@settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(async_settings(), st.lists(st.integers(0, 2), max_size=12))
def test_every_accepted_setting_serves_the_first_batch_and_with_s_per_question_no_refused_one_does(setup, first):
    cfg, problems = setup
    served, store = simulate(cfg, problems, first)
    if accepted(cfg, problems):
        assert served, (cfg, problems, store.stats(), store.buffer.eligible())
        questions, used = async_shape(cfg)
        groups = json.loads(store.draw(questions, latest=0))["groups"]
        assert len(groups) == questions and len({group[0]["problem_id"] for group in groups}) == questions
        assert all(len({tuple(t["steps"]) for t in group}) == used for group in groups)
    elif question_capacity(cfg) <= cfg.samples_per_question:
        assert not served, (cfg, problems, store.stats())


def test_the_issues_hang_is_refused_with_the_arithmetic_and_its_smallest_buffer_serves():
    """B = 4, S = 4, K = 3, buffer 12: a round of 4 questions x 4 leaves 3 questions in the buffer;
    refused naming the key and (B - 1) x S + K = 15; at 15 the first round serves."""
    cfg = GFNConfig(
        loss="tb", mode="async", searchers=1, questions_per_step=4, samples_per_question=4, async_samples_used=3
    )
    cfg.buffer_size = 12
    with pytest.raises(ConfigError, match=r"gfn\.buffer_size = 12 cannot hold .* \(4 - 1\) x 4 \+ 3 = 15"):
        check_async_settings(cfg)
    assert not simulate(cfg, 40, [])[0]
    cfg.buffer_size = 15
    check_async_settings(cfg)
    assert simulate(cfg, 40, [])[0]


def test_fewer_problems_than_a_batch_are_refused_naming_the_key():
    cfg = GFNConfig(loss="tb", mode="async", searchers=1, questions_per_step=4, samples_per_question=4)
    with pytest.raises(ConfigError, match=r"gfn\.questions_per_step = 4 exceeds the 3 training problems"):
        check_async_problems(cfg, 3)
    check_async_problems(cfg, 4)
    cfg.async_questions = 5
    with pytest.raises(ConfigError, match=r"gfn\.async_questions = 5 exceeds the 4 training problems"):
        check_async_problems(cfg, 4)

"""MCTS against a deterministic fake world whose per-prefix success probabilities are known."""

import math

import pytest

from pipeline.config.schema import MCTSConfig
from pipeline.rollouts.mcts import (
    Rollout,
    TreeState,
    make_rollout_fn,
    mc_value,
    probe_seed,
    run_mcts,
    select_from_pool,
    selection_score,
)

GOLD = [f"g{i}" for i in range(1, 17)]  # the correct 16-step path


class FakeWorld:
    """Rollouts from a prefix succeed with a known probability, realised exactly (round(p k)).

    A prefix on the gold path succeeds with probability `p_good`; a prefix holding a wrong step
    never does. Incorrect rollouts follow the gold path up to the planted error position
    `error_at` (1-based step index), write "bad" there, then filler until 16 steps. With a
    tuple of positions, the i-th incorrect rollout of a prefix errs at error_at[i % len].
    """

    def __init__(self, p_good=0.5, error_at=11, k=8):
        self.p_good, self.k = p_good, k
        self.errors = error_at if isinstance(error_at, tuple) else (error_at,)
        self.calls = []

    def success_probability(self, prefix):
        return self.p_good if list(prefix) == GOLD[: len(prefix)] else 0.0

    def rollouts(self, prefix):
        n_correct = round(self.success_probability(prefix) * self.k)
        out = []
        for j in range(self.k):
            if j < n_correct:
                steps = GOLD[len(prefix) :]
                out.append(Rollout(steps, "42", True, num_tokens=10 * len(steps)))
            else:
                error_at = self.errors[(j - n_correct) % len(self.errors)]
                steps = []
                for pos in range(len(prefix) + 1, 17):
                    on_gold = list(prefix) == GOLD[: len(prefix)] and pos < error_at
                    steps.append(GOLD[pos - 1] if on_gold else ("bad" if pos == error_at else f"x{pos}"))
                out.append(Rollout(steps, "0", False, num_tokens=10 * len(steps) + j))
        return out

    def __call__(self, requests):
        self.calls.append(requests)
        return [self.rollouts(prefix) for _, prefix in requests]


def run_one(world, params):
    results = []
    run_mcts([("p0", "q")], params, world, results.append)
    return results[0]


def test_mc_estimates_are_fractions_of_correct_rollouts():
    world = FakeWorld(p_good=0.25, k=8)
    result = run_one(world, MCTSConfig(k=8, max_iterations=1, max_rollouts=10_000))
    assert result.summary.root_mc == 0.25
    for record in result.records:
        prefix = record.prefix_steps + [record.step]
        if record.n_rollouts:
            assert record.mc == world.success_probability(prefix)
            assert record.n_correct == sum(r.correct for r in record.rollouts)
            assert len(record.rollouts) == record.n_rollouts == 8
        assert record.depth == len(prefix)


@pytest.mark.parametrize("error_at", [1, 2, 7, 11, 15, 16])
def test_binary_search_finds_planted_first_error_in_log_probes(error_at):
    world = FakeWorld(p_good=0.5, error_at=error_at)
    result = run_one(world, MCTSConfig(k=8, max_iterations=1, max_rollouts=10_000))
    probes = len(world.calls) - 1  # minus the root estimate
    assert probes <= math.ceil(math.log2(16))
    zeros = [r for r in result.records if r.mc == 0.0]
    assert [(r.step, r.depth) for r in zeros] == [("bad", error_at)], "the first error, nothing after it"
    assert all(r.mc > 0 for r in result.records if r.depth < error_at)
    if error_at == 16:  # the rollout's last step: never probed, recorded with its own outcome
        assert zeros[0].n_rollouts == 0 and zeros[0].rollouts == []


def test_probes_with_mc_between_become_tree_states_and_join_the_pool():
    world = FakeWorld(p_good=0.5, error_at=11)
    result = run_one(world, MCTSConfig(k=8, max_iterations=3, max_rollouts=10_000))
    assert result.summary.iterations == 3
    assert result.summary.tree_states > 1
    depths = [r.depth for r in result.records]
    assert len(depths) == len(set(zip(depths, [r.step for r in result.records]))), "no step recorded twice"


def path_of(record):
    return " ".join([*record.prefix_steps, record.step])


# The prefixes the search requested from the generator, root first, on a world whose incorrect
# rollouts err at steps 3, 7, 11 and 14, before the records followed Algorithm 1 (commit
# 2d298cf): which records are emitted must not change what is probed.
REQUESTED_BEFORE = [
    "",
    "g1 g2 bad x4 x5 x6 x7 x8",
    "g1 g2 bad x4",
    "g1 g2",
    "g1 g2 bad",
    "g1 g2 bad x4 x5 x6 x7 x8 x9",
    "g1 g2 bad x4 x5 x6",
    "g1 g2 g3 g4 g5 g6 bad x8 x9",
    "g1 g2 g3 g4 g5 g6",
    "g1 g2 g3 g4 g5 g6 bad x8",
    "g1 g2 g3 g4 g5 g6 bad",
    "g1 g2 g3 g4 g5 g6 x7 x8 x9 x10 x11",
    "g1 g2 g3 g4 g5 g6 x7 x8 x9",
    "g1 g2 g3 g4 g5 g6 x7 x8",
    "g1 g2 g3 g4 g5 g6 x7",
    "g1 g2 g3 g4 g5 g6 bad x8 x9 x10 x11",
    "g1 g2 g3 g4",
    "g1 g2 g3 g4 x5 x6 x7 x8 x9 x10",
    "g1 g2 g3 g4 x5 x6 x7",
    "g1 g2 g3 g4 x5 x6",
    "g1 g2 g3 g4 x5",
    "g1 g2 g3 g4 g5 g6 bad x8 x9 x10",
]


@pytest.mark.parametrize("max_rollouts, n_requests", [(10_000, 22), (64, 8)])
def test_the_record_rules_do_not_change_which_prefixes_are_probed(max_rollouts, n_requests):
    world = FakeWorld(p_good=0.5, error_at=(3, 7, 11, 14))
    run_one(world, MCTSConfig(k=8, max_iterations=8, max_rollouts=max_rollouts))
    assert [" ".join(call[0][1]) for call in world.calls] == REQUESTED_BEFORE[:n_requests]


def test_no_record_after_the_first_error_on_a_path():
    world = FakeWorld(p_good=0.5, error_at=(3, 7, 11, 14))
    result = run_one(world, MCTSConfig(k=8, max_iterations=8, max_rollouts=10_000))
    # 21 prefixes probed; kept: the probes with MC > 0 and each search's first error. The
    # searches that end on a first error recorded before (through the cache) add nothing.
    assert [(path_of(r), r.mc) for r in result.records] == [
        ("g1 g2", 0.5),
        ("g1 g2 bad", 0.0),
        ("g1 g2 g3 g4 g5 g6", 0.5),
        ("g1 g2 g3 g4 g5 g6 bad", 0.0),
        ("g1 g2 g3 g4 g5 g6 x7", 0.0),
        ("g1 g2 g3 g4", 0.5),
        ("g1 g2 g3 g4 x5", 0.0),
    ]
    zeros = [path_of(r) + " " for r in result.records if r.mc == 0.0]
    assert not any(path_of(r).startswith(zero) for zero in zeros for r in result.records)
    assert result.summary.steps_evaluated == len(result.records)
    assert result.summary.rollouts_spent == 8 * len(world.calls)  # the dropped probes were paid for


def test_the_first_error_is_kept_and_the_mc_zero_probes_after_it_are_not():
    world = FakeWorld(p_good=0.5, error_at=2)
    result = run_one(world, MCTSConfig(k=8, max_iterations=1, max_rollouts=10_000))
    probed = [len(call[0][1]) for call in world.calls[1:]]
    assert probed == [8, 4, 2, 1]  # MC 0, 0, 0 (the first error), 0.5
    assert [(r.depth, r.step, r.mc, r.n_rollouts) for r in result.records] == [(2, "bad", 0.0, 8), (1, "g1", 0.5, 8)]


class RecoveringWorld(FakeWorld):
    """FakeWorld in which the policy recovers from the error in the given prefixes: they succeed
    with probability p_good although they hold a wrong step (non-monotone MC values)."""

    def __init__(self, recovered, **kwargs):
        super().__init__(**kwargs)
        self.recovered = recovered

    def success_probability(self, prefix):
        return self.p_good if " ".join(prefix) in self.recovered else super().success_probability(prefix)


def test_a_dropped_prefix_reached_again_through_the_cache_stays_unrecorded():
    world = RecoveringWorld({"g1 bad x3"}, p_good=0.5, error_at=2)
    result = run_one(world, MCTSConfig(k=8, max_iterations=2, max_rollouts=10_000))
    # Search 1 (from the root): 8, 4, 2 have MC 0, 1 has 0.5 -> first error "g1 bad"; 8 and 4
    # are dropped. Search 2 (from the state "g1", same path): 9 and 5 MC 0, 3 MC 0.5 (the
    # recovery), 4 from the cache (MC 0) -> it resolves at 4, a prefix dropped in search 1, which
    # stays unrecorded: it lies after "g1 bad".
    assert [" ".join(call[0][1]) for call in world.calls] == [
        "",
        "g1 bad x3 x4 x5 x6 x7 x8",
        "g1 bad x3 x4",
        "g1 bad",
        "g1",
        "g1 bad x3 x4 x5 x6 x7 x8 x9",
        "g1 bad x3 x4 x5",
        "g1 bad x3",
    ]
    # The MC > 0 probe after the first error is recorded like any other (docs/mcts.md,
    # "Non-monotone estimates").
    assert [(path_of(r), r.mc) for r in result.records] == [("g1 bad", 0.0), ("g1", 0.5), ("g1 bad x3", 0.5)]


@pytest.mark.parametrize(
    "error_at, max_rollouts, kept",
    [
        (2, 24, []),  # probes at 8 and 4 (MC 0), then out of budget: the first error is unknown
        (2, 32, []),  # ... 2 as well: MC 0 but not yet known to be the first error
        (2, 40, [(2, 0.0), (1, 0.5)]),  # ... and 1 (MC > 0): resolved at 2
        (11, 24, [(8, 0.5)]),  # 8 (MC > 0, kept), 12 (MC 0, dropped), out of budget
    ],
)
def test_a_search_stopped_by_the_budget_records_no_mc_zero_probe(error_at, max_rollouts, kept):
    world = FakeWorld(p_good=0.5, error_at=error_at)
    result = run_one(world, MCTSConfig(k=8, max_iterations=1, max_rollouts=max_rollouts))
    assert result.summary.rollouts_spent == max_rollouts
    assert [(r.depth, r.mc) for r in result.records] == kept


def test_trivial_problems_are_recorded_but_not_searched():
    for p in (0.0, 1.0):
        world = FakeWorld(p_good=p)
        result = run_one(world, MCTSConfig(k=8, max_iterations=5))
        assert result.records == [] and result.summary.searched is False
        assert result.summary.root_mc == p and len(world.calls) == 1
    world = FakeWorld(p_good=0.0)
    result = run_one(world, MCTSConfig(k=8, max_iterations=1, search_trivial=True, max_rollouts=10_000))
    assert result.summary.searched and result.records


def test_rollout_budget_is_respected():
    world = FakeWorld(p_good=0.5)
    result = run_one(world, MCTSConfig(k=8, max_iterations=100, max_rollouts=40))
    assert result.summary.rollouts_spent <= 40


def test_selection_follows_the_formula():
    params = MCTSConfig(alpha=0.5, beta=0.9, length_scale=100, c_puct=0.5)
    a, b = TreeState(("s",), mc=0.9, visits=3), TreeState(("t",), mc=0.3, visits=0)
    pool = [
        (a, Rollout(["x"], None, False, 50)),
        (b, Rollout(["y"], None, False, 50)),
        (a, Rollout(["z"], None, False, 10)),
    ]
    total = 3
    expected = [
        0.5 ** (1 - 0.9) * 0.9**0.5 + 0.5 * math.sqrt(total) / 4,
        0.5 ** (1 - 0.3) * 0.9**0.5 + 0.5 * math.sqrt(total) / 1,
        0.5 ** (1 - 0.9) * 0.9**0.1 + 0.5 * math.sqrt(total) / 4,
    ]
    got = [selection_score(s.mc, r.num_tokens, s.visits, total, params) for s, r in pool]
    assert got == pytest.approx(expected)
    assert select_from_pool(pool, [a, b], params) == max(range(3), key=expected.__getitem__)
    params.c_puct = 0.0  # exploitation only: high MC and short rollout win
    assert select_from_pool(pool, [a, b], params) == 2


def test_problems_advance_together_in_one_call_per_round():
    world = FakeWorld(p_good=0.5)
    results = []
    params = MCTSConfig(k=8, max_iterations=2, max_rollouts=10_000)
    run_mcts([(f"p{i}", "q") for i in range(5)], params, world, results.append)
    single = FakeWorld(p_good=0.5)
    run_one(single, params)
    assert len(results) == 5
    assert len(world.calls) == len(single.calls), "five problems take as many calls as one"
    assert len(world.calls[0]) == 5


def test_max_active_bounds_problems_in_flight():
    world = FakeWorld(p_good=0.5)
    results = []
    run_mcts(
        [(f"p{i}", "q") for i in range(5)],
        MCTSConfig(k=8, max_iterations=1, max_rollouts=10_000),
        world,
        results.append,
        max_active=2,
    )
    assert len(results) == 5 and max(len(c) for c in world.calls) <= 2


class FakeCompletion:
    def __init__(self, text):
        self.text, self.token_ids, self.finish_reason = text, [1] * len(text), "eos"


class FakeGenerator:
    def __init__(self):
        self.calls = []

    def generate(self, prompts, n=1, temperature=1.0, top_p=1.0, max_new_tokens=16, stop=None, seed=None):
        self.calls.append((list(prompts), n))
        return [
            [
                FakeCompletion("1 + 1 = 2\nThe answer is 2\n" if j % 2 == 0 else "1 + 1 = 3\nThe answer is 3\n")
                for j in range(n)
            ]
            for _ in prompts
        ]


def test_make_rollout_fn_grades_and_splits_in_one_generator_call():
    gen = FakeGenerator()
    grade_many = lambda texts, golds, kind: [t.strip().endswith(f"is {g}") for t, g in zip(texts, golds)]
    extract = lambda text, kind: text.strip().rsplit(" ", 1)[-1]
    fn = make_rollout_fn(
        gen,
        ["Q1\n", "Q2\n"],
        ["2", "3"],
        "tiny",
        k=4,
        temperature=0.6,
        top_p=1.0,
        max_new_tokens=16,
        separator="\n",
        grade_many=grade_many,
        extract_answer=extract,
    )
    out = fn([(0, ()), (1, ("a step",))])
    assert len(gen.calls) == 1 and gen.calls[0] == (["Q1\n", "Q2\na step\n"], 4)
    assert [r.correct for r in out[0]] == [True, False, True, False]
    assert [r.correct for r in out[1]] == [False, True, False, True]
    assert out[0][0].steps == ["1 + 1 = 2", "The answer is 2"] and out[0][0].answer == "2"
    assert mc_value(out[0]) == 0.5


class TemperatureRecorder:
    """Records each call's prompts and temperature; a completion names its prompt and temperature."""

    def __init__(self):
        self.calls = []

    def generate(self, prompts, n=1, temperature=1.0, top_p=1.0, max_new_tokens=16, stop=None, seed=None):
        self.calls.append((list(prompts), temperature))
        tag = lambda prompt: prompt.strip().replace("\n", "|")  # noqa: E731
        return [[FakeCompletion(f"{tag(p)} at {temperature}\nThe answer is 2\n")] * n for p in prompts]


def test_the_root_rollouts_are_drawn_at_the_root_temperature_and_every_probe_at_the_value_temperature():
    grade_many = lambda texts, golds, kind: [t.strip().endswith(f"is {g}") for t, g in zip(texts, golds)]
    extract = lambda text, kind: text.strip().rsplit(" ", 1)[-1]
    settings = dict(
        prompts=["Q1\n", "Q2\n", "Q3\n"],
        golds=["2", "2", "2"],
        kind="tiny",
        k=2,
        temperature=0.6,
        top_p=1.0,
        max_new_tokens=16,
        separator="\n",
        grade_many=grade_many,
        extract_answer=extract,
    )
    requests = [(0, ("a",)), (1, ()), (2, ("b", "c")), (0, ())]
    gen = TemperatureRecorder()
    out = make_rollout_fn(gen, **settings, root_temperature=1.2)(requests)
    # two calls: the roots at 1.2, the probes at 0.6; each request's rollouts in its own place
    assert gen.calls == [(["Q2\n", "Q1\n"], 1.2), (["Q1\na\n", "Q3\nb\nc\n"], 0.6)]
    assert [rollouts[0].steps[0] for rollouts in out] == ["Q1|a at 0.6", "Q2 at 1.2", "Q3|b|c at 0.6", "Q1 at 1.2"]
    assert all(len(rollouts) == 2 and rollouts[0].correct for rollouts in out)
    # unset, or equal to the value temperature: one call at that temperature, as before
    for root in (None, 0.6):
        gen = TemperatureRecorder()
        make_rollout_fn(gen, **settings, root_temperature=root)(requests)
        assert [t for _, t in gen.calls] == [0.6]


class SeededGenerator:
    """Completions drawn from the per-prompt seed only (prompt i's sample j from seed[i] + j), as
    the real backends do: 1-4 steps, then an answer that is right one time in two."""

    def __init__(self):
        self.calls = 0

    def generate(self, prompts, n=1, temperature=1.0, top_p=1.0, max_new_tokens=16, stop=None, seed=None):
        import random

        assert isinstance(seed, list) and len(seed) == len(prompts)
        self.calls += 1
        out = []
        for s in seed:
            completions = []
            for j in range(n):
                rng = random.Random(s + j)
                steps = [f"s{rng.randint(0, 2)} = {rng.randint(0, 2)}" for _ in range(rng.randint(1, 4))]
                text = "\n".join(steps + [f"The answer is {2 if rng.random() < 0.5 else 3}"]) + "\n"
                completions.append(FakeCompletion(text))
            out.append(completions)
        return out


def seeded_mcts(problem_ids, max_active, seed=0):
    """Every record (as JSON) of run_mcts over ``problem_ids`` with the seeded generator, by problem."""
    grade_many = lambda texts, golds, kind: [t.strip().endswith(f"is {g}") for t, g in zip(texts, golds)]
    extract = lambda text, kind: text.strip().rsplit(" ", 1)[-1]
    fn = make_rollout_fn(
        SeededGenerator(),
        [f"Q {pid}\n" for pid in problem_ids],
        ["2"] * len(problem_ids),
        "tiny",
        k=4,
        temperature=0.6,
        top_p=1.0,
        max_new_tokens=16,
        separator="\n",
        grade_many=grade_many,
        extract_answer=extract,
        seed=seed,
        problem_ids=problem_ids,
    )
    results = []
    params = MCTSConfig(k=4, max_iterations=3, max_rollouts=40, search_trivial=True)
    run_mcts([(pid, "q") for pid in problem_ids], params, fn, results.append, max_active=max_active)
    return {r.summary.problem_id: ([x.to_json() for x in r.records], r.summary.to_json()) for r in results}


def test_a_problems_rollouts_depend_only_on_the_problem_not_on_what_ran_before_or_beside_it():
    ids = [f"p{i}" for i in range(6)]
    whole = seeded_mcts(ids, max_active=3)
    assert sum(len(records) for records, _ in whole.values()) > 6  # the searches did run
    # resumed after the first two problems were committed: the rest start at other positions,
    # in other rounds, next to other problems
    resumed = {**seeded_mcts(ids[:2], max_active=3), **seeded_mcts(ids[2:], max_active=3)}
    assert resumed == whole
    assert seeded_mcts(ids[::-1], max_active=1) == whole  # order and batching do not matter either
    assert seeded_mcts(ids, max_active=3, seed=1) != whole  # the config seed does


def test_probe_seeds_differ_per_probe_and_leave_room_for_k_samples():
    seeds = {probe_seed(0, pid, prefix) for pid in ("a", "b") for prefix in [(), ("x",), ("x", "y"), ("y",)]}
    assert len(seeds) == 8 and all(0 <= s < 2**62 for s in seeds)
    assert probe_seed(0, "a", ("x",)) == probe_seed(0, "a", ["x"]) != probe_seed(1, "a", ("x",))


# ----------------------------------------------------------------------------- the stage


@pytest.mark.slow
def test_stage_on_a_tiny_model_killed_mid_run_resumes_with_every_record_once(tmp_path):
    """make mcts on a tiny-world model: SIGKILL after the first commits, restart, and every
    problem's records are there exactly once, satisfy the mcts contract, and are the records an
    uninterrupted run writes (per-probe random streams: a problem's search does not depend on what
    ran before it)."""
    import json
    import os
    import signal
    import subprocess
    import sys
    import time
    from pathlib import Path

    from pipeline.config.schema import BootstrapConfig, FormatConfig, TinyWorldConfig
    from pipeline.contracts import check_files
    from pipeline.datasets.problems import write_problems_jsonl
    from pipeline.records import MCTSRecord, MCTSSummary
    from pipeline.storage.shards import completed_problem_ids, read_stream
    from pipeline.tinyworld.model import build_model, save_policy
    from pipeline.tinyworld.problems import generate_splits
    from pipeline.tinyworld.tokenizer import tokenizer_corpus, train_tokenizer

    repo = Path(__file__).resolve().parents[1]
    splits = generate_splits(TinyWorldConfig(seed=5, n_train=24, n_val=2, n_test=2))
    tokenizer = train_tokenizer(tokenizer_corpus(splits["train"], FormatConfig()), vocab_size=512)
    model = build_model(BootstrapConfig(hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64), tokenizer)
    save_policy(model, tokenizer, tmp_path / "policy")
    write_problems_jsonl(splits["train"], tmp_path / "train.jsonl")
    argv = [
        sys.executable,
        "-m",
        "stages.mcts",
        "--config",
        str(repo / "configs" / "tiny.yaml"),
        f"runs_root={tmp_path / 'runs'}",
        f"model.policy={tmp_path / 'policy'}",
        f"data.train_path={tmp_path / 'train.jsonl'}",
        "data.disjoint_from=[]",
        "generation.max_new_tokens=40",
        "mcts.k=4",
        "mcts.max_problems=24",
        "mcts.max_iterations=2",
        "mcts.max_rollouts=24",
        "mcts.search_trivial=true",
        "mcts.problems_per_commit=1",
        "mcts.max_active=2",
    ]
    env = {**os.environ, "PYTHONPATH": str(repo), "TQDM_DISABLE": "1"}
    shards = tmp_path / "runs" / "k" / "mcts" / "shards"
    subprocess.run(
        argv + ["run=u"],
        env=env,
        cwd=tmp_path,
        check=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        timeout=300,
    )
    argv.append("run=k")
    proc = subprocess.Popen(argv, env=env, cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None and len(completed_problem_ids(shards)) < 3:
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    first = completed_problem_ids(shards)
    assert 0 < len(first) < 24, f"the stage must be killed mid-run; stderr: {proc.stderr.read().decode()[-2000:]}"
    proc.stderr.close()

    subprocess.run(
        argv, env=env, cwd=tmp_path, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=300
    )
    summaries = list(read_stream(shards, "summaries", MCTSSummary))
    assert sorted(s.problem_id for s in summaries) == sorted(p.problem_id for p in splits["train"])
    records = list(read_stream(shards, "records", MCTSRecord))
    keys = [(r.problem_id, tuple(r.prefix_steps), r.step, r.depth) for r in records]
    assert records and len(keys) == len(set(keys))
    per_problem = {s.problem_id: s.steps_evaluated for s in summaries}
    assert all(sum(r.problem_id == pid for r in records) == n for pid, n in per_problem.items())
    assert check_files(sorted(shards.glob("part-*/records.jsonl")), MCTSRecord) == []
    stats = json.loads((shards.parent / "stats.json").read_text())
    assert stats["problems"] == 24 and stats["steps_evaluated"] == len(records)

    def by_problem(stream, record_type, run):
        records = [r.to_json() for r in read_stream(tmp_path / "runs" / run / "mcts" / "shards", stream, record_type)]
        return sorted(records, key=lambda r: json.dumps(r, sort_keys=True))

    assert by_problem("records", MCTSRecord, "k") == by_problem("records", MCTSRecord, "u")
    uninterrupted = by_problem("summaries", MCTSSummary, "u")
    assert by_problem("summaries", MCTSSummary, "k") == uninterrupted
    assert len({json.dumps(s["root_rollouts"]) for s in uninterrupted}) == 24  # sampled text: the streams matter

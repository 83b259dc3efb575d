"""Every registered objective satisfies the objective contract (pipeline.finetune.objectives.Objective)."""

import inspect
from types import SimpleNamespace

import pytest
import torch

from pipeline.config.schema import GFNConfig, PPOConfig
from pipeline.finetune.gflownet import LOSSES
from pipeline.finetune.objectives import OBJECTIVES, Objective, build_objective

METHODS = [name for name, member in vars(Objective).items() if inspect.isfunction(member) and not name.startswith("_")]
ATTRIBUTES = {"name": str, "off_policy": bool, "updates_per_rollout": int, "lr": float}


def built(name: str):
    cfg = PPOConfig() if name == "ppo" else GFNConfig(loss=name)
    return build_objective(cfg, policy=object(), hidden_size=4)


def test_the_contract_lists_what_the_loop_calls():
    assert set(METHODS) == {"rollout", "loss", "filler", "summary", "begin_update", "reset_reference"}
    assert set(Objective.__annotations__) == set(ATTRIBUTES)


@pytest.mark.parametrize("name", sorted(OBJECTIVES))
def test_every_registered_objective_satisfies_the_contract(name):
    objective = built(name)
    assert isinstance(objective, OBJECTIVES[name]) and isinstance(objective, torch.nn.Module)
    assert isinstance(objective, Objective)
    for attribute, kind in ATTRIBUTES.items():
        assert type(getattr(objective, attribute)) is kind, attribute
    assert objective.name == name and objective.updates_per_rollout >= 1
    for method in METHODS:
        wanted = [p for p in inspect.signature(getattr(Objective, method)).parameters if p != "self"]
        assert list(inspect.signature(getattr(objective, method)).parameters) == wanted, method


def test_an_object_lacking_a_member_of_the_contract_does_not_satisfy_it():
    class Partial:
        name, off_policy, updates_per_rollout, lr = "partial", True, 1, 1e-3

        def rollout(self, fresh, everyone): ...

        def loss(self, micro): ...

        def summary(self): ...

        def begin_update(self, step): ...

        def reset_reference(self, weights, step): ...

    assert not isinstance(Partial(), Objective)  # no filler
    Partial.filler = lambda self, micro_batches: None
    assert isinstance(Partial(), Objective)


def test_each_config_name_builds_its_own_class():
    assert set(OBJECTIVES) == set(LOSSES) | {"ppo"}
    assert len(set(OBJECTIVES.values())) == len(OBJECTIVES)
    for name, cls in OBJECTIVES.items():
        assert type(built(name)) is cls and cls.name == name


@pytest.mark.parametrize("name", sorted(OBJECTIVES))
def test_only_trajectory_balance_owns_a_log_z(name):
    parameters = dict(built(name).named_parameters())
    assert ("log_z" in parameters) == (name == "tb"), sorted(parameters)
    if name == "tb":
        unlearned = build_objective(GFNConfig(loss="tb", learn_log_z=False), policy=object(), hidden_size=4)
        assert dict(unlearned.named_parameters()) == {}


@pytest.mark.parametrize("name", sorted(LOSSES))
def test_only_tb_vargrad_keeps_a_questions_trajectories_in_one_micro_batch(name):
    """TB-VarGrad's log Z estimate is the mean over one question's trajectories, so they must share
    a micro-batch; SubTB and TB split at micro_batch_size whatever the question."""
    objective = build_objective(GFNConfig(loss=name, micro_batch_size=4), policy=object(), hidden_size=4)
    batch = [SimpleNamespace(problem_id=f"q{q}", steps=[f"s{i}"]) for q in range(3) for i in range(3)]
    chunks = [chunk for chunk, _ in objective.plan(batch, 1.0)]
    questions_split = {q for q in "q0 q1 q2".split() if sum(any(t.problem_id == q for t in c) for c in chunks) > 1}
    assert sorted(t.problem_id for c in chunks for t in c) == sorted(t.problem_id for t in batch)
    assert (questions_split == set()) == (name == "tb_vargrad"), (name, [[t.problem_id for t in c] for c in chunks])

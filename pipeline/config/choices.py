"""The config's closed choices: every field that takes one of a few names is typed with one of
these ``Literal`` aliases, the one list of those names (pipeline.config.schema uses them and
re-exports them; the asynchronous mode's are in pipeline.config.asynchronous).
"""

from __future__ import annotations

import typing
from typing import Literal

# Fields that take one of a few names are typed Literal[...], the one list of those names: the loader
# checks any such field (or list of them) where it is set, naming the file or the command line, with
# ``check_choice`` (pipeline.config.loader), which library calls taking such a name use too;
# typing.get_args lists them (PRM_FORMATS, gflownet.LOSSES, prm.search.STRATEGIES). The asynchronous mode's
# (WeightTransport, AsyncPriority) are beside its fields, in pipeline.config.asynchronous.
ReportTo = Literal["none", "tensorboard", "wandb", "all"]  # experiment trackers (pipeline/training/tracking.py)
PRMFormat = Literal[
    "auto", "stepflow", "token_classification", "math_shepherd", "qwen_prm", "result_likelihood"
]  # docs/prm.md, "Other PRMs"
TrainingMode = Literal["sync", "async"]  # gfn.mode / ppo.mode (async: docs/async.md; PPO refuses it)
GFlowNetLoss = Literal["subtb", "tb", "tb_vargrad"]  # gfn.loss (pipeline/finetune/gflownet.py)
# gfn.log_flow, SubTB's log F(s) at the states that state no answer: stop (the paper's eq. 1: log R(s) - log pi(s_f|s)
# at every state) | learned (a linear head on the policy's state; pipeline/finetune/losses.py learned_flow_states)
LogFlow = Literal["stop", "learned"]
SearchStrategy = Literal["step_best_of_k", "beam", "best_of_n", "weighted_vote", "majority"]  # prm/search.py
Aggregation = Literal["last", "mean", "min", "prod"]  # search.aggregation (prm/search.py, docs/search.md)
TinyFamily = Literal[
    "gains_losses", "shared_containers", "mixed"
]  # tinyworld.families (pipeline/tinyworld/problems.py FAMILIES)
TinyStrategy = Literal["running_total", "gains_losses", "containers_first"]  # tinyworld.strategies (docs/tinyworld.md)
PRMLabels = Literal[
    "soft", "hard"
]  # prm.labels: the BCE targets, the MC value or MC > prm.hard_label_threshold (prm/train.py)
ModelDtype = Literal["auto", "float32", "bfloat16", "float16"]  # model.dtype (pipeline/modeling.py DTYPES)
GenerationBackend = Literal["hf", "vllm"]  # generation.backend (pipeline/generation)
Schedule = Literal["cosine", "linear", "constant"]  # prm.scheduler, gfn.scheduler, ppo.scheduler (training/schedule.py)
BufferPriority = Literal["softmax", "proportional"]  # gfn.buffer_priority (pipeline/finetune/replay_buffer.py)
BufferScope = Literal["global", "per_question"]  # gfn.buffer_scope (pipeline/finetune/replay_buffer.py)
BufferKey = Literal["log_reward", "log_u"]  # gfn.buffer_key (pipeline/finetune/rewards.py StateLogRewards.priorities)
GPUType = Literal["A100-40GB", "A100-80GB", "H100-80GB", "H200", "L40S"]  # plan.gpu (planner/plan.py GPUS)
# model.device: auto | cpu | cuda | cuda:<N> (an index is no closed list: check_ranges matches this pattern)
DEVICE_PATTERN = r"auto|cpu|cuda(:[0-9]+)?"
DEVICE_CHOICES = "auto, cpu, cuda, cuda:<N>"
PRM_FORMATS = typing.get_args(PRMFormat)

"""Typed records: the JSONL data contracts of DESIGN.md as dataclasses (docs/data.md, "Records").

    Problem       problems           one problem: question, reference answer, source, meta
    MCTSRollout   (inside the two below)  one rollout: its steps, answer and correctness
    MCTSRecord    mcts records       one evaluated step with its Monte Carlo value and rollouts
    MCTSSummary   mcts summaries     one searched problem: root value, budget spent, tree size
    PRMExample    PRM data           one labelled step, from MCTS or from augmentation
    Sample        eval samples       one sampled (or greedy) solution of an evaluated model
    Trajectory    policy training    one complete solution with its step scores and log-probs

Each is a frozen dataclass deriving from ``Record``. ``RecordType.from_json(obj, where)`` is its
one validator, derived by the annotation codec (pipeline.config.codec, shared with the config loader)
from the field annotations -- str, int (a bool is not an int), float (ints are accepted and
widened), bool, dict, list[X], X | None and nested records -- and from the rules each field
declares with ``field(metadata=rules(...))``; it raises ``RecordError`` naming
``where`` (file:line), the field (``rollouts[3].correct``) and what was expected. Keys the class
does not know are ignored, so a file written by a later version that added a key still reads.
``to_json()`` is the plain dict written to disk: the fields in declaration order, nested
records as dicts, and None written as null unless the field is declared ``omit_if_none``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Self

from pipeline.config.codec import FieldError, describe_value, read_fields, rules, write_fields


class RecordError(ValueError):
    """A malformed input record; the message names the file, the line and the field."""


class Record:
    """Base of the typed records: a frozen dataclass whose fields are its JSON keys.

    A subclass declares its fields with types and ``rules``; from_json and to_json follow
    from them (pipeline.config.codec). A rule that spans several fields goes in ``check``.
    """

    @classmethod
    def from_json(cls, obj: Any, where: str = "record") -> Self:
        """The record held by a parsed JSON object; raises RecordError "<where>: field ..."
        for a missing or ill-typed field or a broken rule. Unknown keys are ignored."""
        if not isinstance(obj, dict):
            raise RecordError(f"{where}: expected a JSON object ({cls.__name__}), got {describe_value(obj)}")
        try:
            return read_fields(cls, obj)
        except FieldError as error:
            raise RecordError(f"{where}: {error}") from None

    def to_json(self) -> dict[str, Any]:
        """The plain dict written to disk (fields in declaration order)."""
        return write_fields(self)

    def check(self) -> None:
        """Rules that span several fields, run by from_json once every field is valid; a
        broken one raises FieldError(field, what was expected, value). The base has none."""


# ----------------------------------------------------------------------------- problems

# source -> grading kind (the grader and the prompt builder switch on the kind).
ANSWER_KINDS = {
    "gsm8k": "gsm8k",
    "math": "math",
    "math500": "math",
    "openmathinstruct2": "math",
    "sat_math": "sat",
    "agieval_sat_math": "sat",
    "tiny": "tiny",
}


def answer_kind(source: str) -> str:
    """The grading kind ("math", "gsm8k", "sat" or "tiny") of a problem source."""
    try:
        return ANSWER_KINDS[source]
    except KeyError:
        raise ValueError(f"unknown problem source {source!r}; expected one of {sorted(ANSWER_KINDS)}") from None


@dataclass(frozen=True)
class Problem(Record):
    """One problem: the question shown to the model, the reference answer the grader compares
    with (may be empty), the source benchmark (which fixes the grading kind) and
    source-specific extras (``meta``: level, subject, multiple-choice options, the reference
    solution, ...; absent in a file = {})."""

    problem_id: str = field(metadata=rules(non_empty=True))
    question: str = field(metadata=rules(non_empty=True))
    answer: str
    source: str = field(metadata=rules(one_of=tuple(sorted(ANSWER_KINDS))))
    meta: dict = field(default_factory=dict, hash=False)

    @property
    def kind(self) -> str:
        """The grading kind of the problem's source."""
        return answer_kind(self.source)


# ----------------------------------------------------------------------------- MCTS


@dataclass(frozen=True)
class MCTSRollout(Record):
    """One rollout from an evaluated prefix: its steps after the prefix, the final answer the
    grader extracted (None: none found; a number in a hand-written file is read as its text)
    and whether it matches the reference answer."""

    steps: list[str]
    answer: str | None = field(metadata=rules(numbers_as_text=True))
    correct: bool


@dataclass(frozen=True)
class MCTSRecord(Record):
    """One evaluated step (paper 3.1): ``step`` after ``prefix_steps`` has the Monte Carlo value
    ``mc`` = n_correct / n_rollouts of the ``rollouts`` continuing it; depth = its 1-based
    position in the solution. A first error found at a rollout's last step has no rollouts of
    its own (mc 0, n_rollouts 0)."""

    problem_id: str = field(metadata=rules(non_empty=True))
    question: str
    prefix_steps: list[str]
    step: str
    mc: float = field(metadata=rules(within=(0, 1)))
    n_correct: int = field(metadata=rules(minimum=0))
    n_rollouts: int = field(metadata=rules(minimum=0))
    rollouts: list[MCTSRollout]
    depth: int = field(metadata=rules(minimum=0))

    def check(self) -> None:
        if self.n_correct > self.n_rollouts:
            raise FieldError("n_correct", f"at most n_rollouts ({self.n_rollouts})", self.n_correct)


@dataclass(frozen=True)
class MCTSSummary(Record):
    """One searched problem: the root's Monte Carlo value and rollouts, whether it was searched
    (0 < root_mc < 1, or mcts.search_trivial), the iterations run, steps recorded, rollouts
    generated and tree states (root included)."""

    problem_id: str = field(metadata=rules(non_empty=True))
    root_mc: float = field(metadata=rules(within=(0, 1)))
    root_n_correct: int = field(metadata=rules(minimum=0))
    root_rollouts: list[MCTSRollout]
    searched: bool
    iterations: int = field(metadata=rules(minimum=0))
    steps_evaluated: int = field(metadata=rules(minimum=0))
    rollouts_spent: int = field(metadata=rules(minimum=0))
    tree_states: int = field(metadata=rules(minimum=0))

    def check(self) -> None:
        if self.root_n_correct > len(self.root_rollouts):
            raise FieldError(
                "root_n_correct",
                f"at most the number of root_rollouts ({len(self.root_rollouts)})",
                self.root_n_correct,
            )


# ----------------------------------------------------------------------------- PRM data

ORIGIN_MCTS = "mcts"
ORIGIN_AUGMENTED = "augmented"
ORIGIN_HUMAN = "human"  # a human step rating (PRM800K, prm/prm800k.py)


@dataclass(frozen=True)
class PRMExample(Record):
    """One PRM training label: ``step`` after ``prefix_steps`` leads to a correct answer with
    probability ``label``. origin "mcts": an MCTS record's own step, labelled with its mc (no
    group_id); "augmented": a rollout step labelled by its similarity group, whose id
    "<problem_id>:<record key>:<position>:<group index>" it carries (docs/augmentation.md); "human":
    a human step rating mapped to a label (PRM800K, docs/prm.md)."""

    problem_id: str = field(metadata=rules(non_empty=True))
    question: str
    prefix_steps: list[str]
    step: str = field(metadata=rules(non_empty=True))
    label: float = field(metadata=rules(within=(0, 1)))
    origin: str = field(metadata=rules(one_of=(ORIGIN_MCTS, ORIGIN_AUGMENTED, ORIGIN_HUMAN)))
    group_id: str | None = field(default=None, metadata=rules(omit_if_none=True))

    @property
    def path(self) -> tuple[str, ...]:
        """The labelled solution path: prefix_steps then step."""
        return (*self.prefix_steps, self.step)


# ----------------------------------------------------------------------------- evaluation samples


@dataclass(frozen=True)
class Sample(Record):
    """One solution of an evaluated model: sample_idx -1 is the greedy one, 0..k-1 the sampled
    ones; final_answer is what the grader extracted (None: none found) and correct its
    verdict. finished: False when generation was cut off at max_new_tokens (absent in files
    written before it was recorded). step_scores: one PRM score per step, when scored."""

    problem_id: str = field(metadata=rules(non_empty=True))
    model: str
    sample_idx: int = field(metadata=rules(minimum=-1))
    steps: list[str]
    final_answer: str | None
    correct: bool
    finished: bool | None = field(default=None, metadata=rules(omit_if_none=True))
    step_scores: list[float] | None = field(default=None, metadata=rules(within=(0, 1), omit_if_none=True))

    def check(self) -> None:
        if self.step_scores is not None and len(self.step_scores) != len(self.steps):
            raise FieldError("step_scores", f"one score per step ({len(self.steps)})", self.step_scores)


@dataclass(frozen=True)
class SiblingCandidates(Record):
    """The candidates of one expansion of a correct prefix by a step-level search, labelled
    exactly (prm.search.siblings): per candidate the score the search ranked it by, whether its
    step is right, and which candidate of the expansion first had its step text (``texts[i] ==
    j``: candidate i's steps equal candidate j's, j <= i; equal texts, equal indices)."""

    scores: list[float]
    correct: list[bool]
    texts: list[int] = field(metadata=rules(minimum=0))

    def check(self) -> None:
        n = len(self.scores)
        for name in ("correct", "texts"):
            if len(getattr(self, name)) != n:
                raise FieldError(name, f"one value per candidate ({n})", getattr(self, name))
        if any(j > i or self.texts[j] != j for i, j in enumerate(self.texts)):
            raise FieldError("texts", "per candidate the index of the first candidate with its text", self.texts)


@dataclass(frozen=True)
class SearchRecord(Record):
    """The solution one search strategy returned for one problem at one k (make search): its
    steps, their PRM scores ([] for the unguided majority and for a solution without steps),
    whether it finished, the answer read from it (None: none stated) and the policy tokens
    generated for the problem, discarded candidates included (prm.search.SearchResult).
    siblings: the labelled candidates of every expansion of a correct prefix (step-level
    strategies on a kind with an exact first-error labeller; absent otherwise)."""

    problem_id: str = field(metadata=rules(non_empty=True))
    strategy: str = field(metadata=rules(non_empty=True))
    k: int = field(metadata=rules(minimum=1))
    steps: list[str]
    step_scores: list[float]
    finished: bool
    answer: str | None
    tokens_generated: int = field(metadata=rules(minimum=0))
    siblings: list[SiblingCandidates] | None = field(default=None, metadata=rules(omit_if_none=True))

    def check(self) -> None:
        if self.step_scores and len(self.step_scores) != len(self.steps):
            raise FieldError("step_scores", f"none, or one score per step ({len(self.steps)})", self.step_scores)


# ----------------------------------------------------------------------------- policy training


@dataclass(frozen=True)
class Trajectory(Record):
    """One complete solution sampled by the policy being fine-tuned (s_0 = prompt, one action
    per step, then stop), as the replay buffer and the trainers exchange it.

    step_log_scores:          log U(s_k | s_{k-1}) per step, the PRM's log step scores
    answer_flags:             per step: -1 the step states no final answer, 0 a wrong one, 1 the
                              correct one (pipeline.finetune.rewards: NO_ANSWER, WRONG_ANSWER,
                              CORRECT_ANSWER)
    finished:                 the solution ended with the end-of-solution token (not cut off)
    log_reward:               sum of step_log_scores, the replay priority (finite)
    reference_step_logprobs:  log pi_ref(s_k | s_{k-1}) per step, when a reference policy is used
    reference_stop_logprob:   log pi_ref(s_f | s_n), when a reference policy is used
    policy_version:           the number of policy updates before it was sampled
    sampling_logprob:         log pi(tau) (steps and stop, teacher-forced) under the weights that sampled
                              it, for the off-policy correction (gfn.importance_correction); None: not recorded
    """

    problem_id: str = field(metadata=rules(non_empty=True))
    question: str
    prompt: str
    steps: list[str] = field(metadata=rules(min_items=1))
    step_log_scores: list[float]
    answer_flags: list[int] = field(metadata=rules(one_of=(-1, 0, 1)))
    finished: bool
    log_reward: float = field(metadata=rules(finite=True))
    reference_step_logprobs: list[float] | None = None
    reference_stop_logprob: float | None = None
    policy_version: int = field(default=0, metadata=rules(minimum=0))
    sampling_logprob: float | None = field(default=None, metadata=rules(finite=True))

    def check(self) -> None:
        n = len(self.steps)
        for name in ("step_log_scores", "answer_flags", "reference_step_logprobs"):
            values = getattr(self, name)
            if values is not None and len(values) != n:
                raise FieldError(name, f"one value per step ({n})", values)

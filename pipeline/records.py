"""Typed records: the JSONL data contracts of DESIGN.md as dataclasses (docs/data.md, "Records").

    Problem       problems           one problem: question, reference answer, source, meta
    MCTSRollout   (inside the two below)  one rollout: its steps, answer and correctness
    MCTSRecord    mcts records       one evaluated step with its Monte Carlo value and rollouts
    MCTSSummary   mcts summaries     one searched problem: root value, budget spent, tree size
    PRMExample    PRM data           one labelled step, from MCTS or from augmentation
    Sample        eval samples       one sampled (or greedy) solution of an evaluated model
    Trajectory    policy training    one complete solution with its step scores and log-probs

Each is a frozen dataclass deriving from ``Record``. ``RecordType.from_json(obj, where)`` is its
one validator, derived from the field annotations -- str, int (a bool is not an int), float
(ints are accepted and widened), bool, dict, list[X], X | None and nested records -- and from the
rules each field declares with ``field(metadata=rules(...))``; it raises ``RecordError`` naming
``where`` (file:line), the field (``rollouts[3].correct``) and what was expected. Keys the class
does not know are ignored, so a file written by a later version that added a key still reads.
``to_json()`` is the plain dict written to disk: the fields in declaration order, nested
records as dicts, and None written as null unless the field is declared ``omit_if_none``.
"""

from __future__ import annotations

import dataclasses
import json
import math
import types
import typing
from dataclasses import dataclass, field
from functools import cache
from typing import Any, Callable, Self


class RecordError(ValueError):
    """A malformed input record; the message names the file, the line and the field."""


_ABSENT = object()  # stands for a key missing from the JSON object
_RULES_KEY = "record_rules"
_MAX_SHOWN_CHARS = 40  # an offending value is quoted in an error message up to this length


# ----------------------------------------------------------------------------- field rules


@dataclass(frozen=True)
class FieldRules:
    """What a field's value must satisfy beyond its type.

    On a list field the value rules (non_empty, within, minimum, one_of, finite,
    numbers_as_text) apply to each item, and min_items to the list.

    non_empty:       a string holding more than whitespace
    within:          (lo, hi): a number in [lo, hi]
    minimum:         a number >= minimum
    one_of:          one of these values
    finite:          a number that is neither infinite nor NaN
    numbers_as_text: a str field also accepts a JSON number and keeps its text (7 -> "7")
    min_items:       a list of at least this many items
    omit_if_none:    to_json leaves the key out when the value is None (else it writes null)
    """

    non_empty: bool = False
    within: tuple[float, float] | None = None
    minimum: float | None = None
    one_of: tuple[Any, ...] | None = None
    finite: bool = False
    numbers_as_text: bool = False
    min_items: int = 0
    omit_if_none: bool = False


def rules(**kwargs: Any) -> dict[str, FieldRules]:
    """The ``metadata`` of a record field, e.g. ``field(metadata=rules(within=(0, 1)))``;
    the keywords are FieldRules' fields."""
    return {_RULES_KEY: FieldRules(**kwargs)}


class FieldError(ValueError):
    """A field that breaks its record's contract. ``field`` is the field's path inside the
    record (``rollouts[3].correct``); ``Record.from_json`` prefixes the file and line."""

    def __init__(self, field: str, expected: str, value: Any = _ABSENT):
        self.field, self.expected, self.value = field, expected, value
        if value is _ABSENT:
            message = f"missing field '{field}' (expected {expected})"
        else:
            message = f"field '{field}': expected {expected}, got {_describe_value(value)}"
        super().__init__(message)

    def inside(self, prefix: str) -> FieldError:
        """The same error for a record nested at ``prefix``."""
        return FieldError(f"{prefix}.{self.field}", self.expected, self.value)


def _describe_value(value: Any) -> str:
    """A value's type and JSON text for an error message, cut to a few dozen characters."""
    if value is None:
        return "null"
    text = json.dumps(value, ensure_ascii=False, default=repr)
    if len(text) > _MAX_SHOWN_CHARS:
        text = text[: _MAX_SHOWN_CHARS - 3] + "..."
    return f"{type(value).__name__} {text}"


# ----------------------------------------------------------------------------- the record base


class Record:
    """Base of the typed records: a frozen dataclass whose fields are its JSON keys.

    A subclass declares its fields with types and ``rules``; from_json and to_json follow
    from them. A rule that spans several fields goes in ``check``.
    """

    @classmethod
    def from_json(cls, obj: Any, where: str = "record") -> Self:
        """The record held by a parsed JSON object; raises RecordError "<where>: field ..."
        for a missing or ill-typed field or a broken rule. Unknown keys are ignored."""
        if not isinstance(obj, dict):
            raise RecordError(f"{where}: expected a JSON object ({cls.__name__}), got {_describe_value(obj)}")
        try:
            return cls._from_fields(obj, prefix="")
        except FieldError as error:
            raise RecordError(f"{where}: {error}") from None

    def to_json(self) -> dict[str, Any]:
        """The plain dict written to disk (fields in declaration order)."""
        out: dict[str, Any] = {}
        for spec in _field_specs(type(self)):
            value = getattr(self, spec.name)
            if value is None:
                if not spec.rules.omit_if_none:
                    out[spec.name] = None
            else:
                out[spec.name] = spec.dump(value)
        return out

    def check(self) -> None:
        """Rules that span several fields, run by from_json once every field is valid; a
        broken one raises FieldError(field, what was expected, value). The base has none."""

    @classmethod
    def _from_fields(cls, obj: dict, prefix: str) -> Self:
        values = {}
        for spec in _field_specs(cls):
            path = f"{prefix}.{spec.name}" if prefix else spec.name
            value = obj.get(spec.name, _ABSENT)
            if value is _ABSENT:
                if spec.required:
                    raise FieldError(path, spec.expected)
                continue  # the dataclass default
            values[spec.name] = spec.convert(value, path)
        record = cls(**values)
        try:
            record.check()
        except FieldError as error:
            raise (error.inside(prefix) if prefix else error) from None
        return record


# ----------------------------------------------------------------------------- the derived validator

Convert = Callable[[Any, str], Any]  # (JSON value, field path) -> field value, or FieldError
Dump = Callable[[Any], Any]  # field value -> JSON value


@dataclass(frozen=True)
class _FieldSpec:
    name: str
    required: bool
    rules: FieldRules
    expected: str
    convert: Convert
    dump: Dump


@cache
def _field_specs(cls: type) -> tuple[_FieldSpec, ...]:
    """How to read and write each field of a record class, built once per class."""
    if not dataclasses.is_dataclass(cls):
        raise TypeError(f"{cls.__name__}: a Record must be a dataclass")
    hints = typing.get_type_hints(cls)
    specs = []
    for f in dataclasses.fields(cls):
        field_rules = f.metadata.get(_RULES_KEY, FieldRules())
        convert, dump, expected = _codec(hints[f.name], field_rules, f"{cls.__name__}.{f.name}")
        required = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        specs.append(_FieldSpec(f.name, required, field_rules, expected, convert, dump))
    return tuple(specs)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


_SCALARS: dict[type, tuple[Callable[[Any], bool], str, str]] = {  # type -> (accepts, singular, plural)
    str: (lambda v: isinstance(v, str), "a string", "strings"),
    int: (lambda v: isinstance(v, int) and not isinstance(v, bool), "an integer", "integers"),
    float: (_is_number, "a number", "numbers"),
    bool: (lambda v: isinstance(v, bool), "true or false", "true/false values"),
    dict: (lambda v: isinstance(v, dict), "an object", "objects"),
}


def _codec(annotation: Any, field_rules: FieldRules, name: str) -> tuple[Convert, Dump, str]:
    """(convert, dump, expected) of a field's annotation; expected describes a valid value."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin in (types.UnionType, typing.Union):
        inner = [a for a in args if a is not type(None)]
        if len(args) != 2 or len(inner) != 1:
            raise TypeError(f"{name}: only 'X | None' unions are supported, got {annotation}")
        convert, dump, expected = _codec(inner[0], field_rules, name)

        def convert_optional(value: Any, path: str) -> Any:
            if value is None:
                return None
            try:
                return convert(value, path)
            except FieldError as error:
                if error.field != path:  # an item's or nested field's error: already precise
                    raise
                raise FieldError(path, _or_null(error.expected), value) from None

        return convert_optional, dump, _or_null(expected)
    if origin is list:
        return _list_codec(args[0], field_rules, name)
    if field_rules.min_items:
        raise TypeError(f"{name}: min_items applies to list fields only")
    if isinstance(annotation, type) and issubclass(annotation, Record):
        _check_rules_apply(field_rules, None, name)
        return _record_codec(annotation)
    if annotation is dict or origin is dict:
        _check_rules_apply(field_rules, None, name)
        accepts, expected, _ = _SCALARS[dict]

        def convert_dict(value: Any, path: str) -> dict:
            if not accepts(value):
                raise FieldError(path, expected, value)
            return dict(value)

        return convert_dict, dict, expected
    if annotation in _SCALARS:
        convert, expected, _ = _scalar_codec(annotation, field_rules, name)
        return convert, _DUMP_SCALAR[annotation], expected
    raise TypeError(f"{name}: unsupported field type {annotation}")


def _check_rules_apply(r: FieldRules, scalar: type | None, name: str) -> None:
    """A value rule declared on a field of a type it cannot apply to (scalar None: an object or
    a record) is a bug in the record class: refuse it when the class is first used."""
    numeric = scalar in (int, float)
    misplaced = [
        rule for rule, applies in (
            ("non_empty", scalar is str), ("numbers_as_text", scalar is str), ("within", numeric),
            ("minimum", numeric), ("finite", scalar is float), ("one_of", scalar is not None),
        )
        if getattr(r, rule) not in (None, False) and not applies
    ]
    if misplaced:
        raise TypeError(f"{name}: rules {misplaced} do not apply to {getattr(scalar, '__name__', 'an object')}")


def _or_null(expected: str) -> str:
    """"true or false" -> "true, false or null"."""
    return f"{expected.replace(' or ', ', ')} or null"


def _identity(value: Any) -> Any:
    return value


# A float field written from an int (label=1 in code) still reads "1.0" on disk, as its type says.
_DUMP_SCALAR: dict[type, Dump] = {str: _identity, int: _identity, float: float, bool: _identity}


def _scalar_codec(scalar: type, field_rules: FieldRules, name: str) -> tuple[Convert, str, str]:
    """(convert, singular, plural) for str, int, float and bool under the value rules."""
    _check_rules_apply(field_rules, scalar, name)
    accepts, singular, plural = _SCALARS[scalar]
    r = field_rules
    if r.numbers_as_text:
        singular, plural = f"{singular} or a number", f"{plural} or numbers"
    if r.non_empty:
        singular, plural = f"a non-empty {singular.removeprefix('a ')}", f"non-empty {plural}"
    if r.one_of is not None:
        choices = ", ".join(repr(choice) for choice in r.one_of)
        singular, plural = f"one of {choices}", f"values each one of {choices}"
    if r.finite:
        singular, plural = f"a finite {singular.removeprefix('a ')}", f"finite {plural}"
    if r.within is not None:
        bounds = f"in [{r.within[0]}, {r.within[1]}]"
        singular, plural = f"{singular} {bounds}", f"{plural} {bounds}"
    if r.minimum is not None:
        singular, plural = f"{singular} >= {r.minimum}", f"{plural} >= {r.minimum}"

    def convert(value: Any, path: str) -> Any:
        if accepts(value):
            converted = float(value) if scalar is float else value
        elif r.numbers_as_text and _is_number(value):
            converted = str(value)
        else:
            raise FieldError(path, singular, value)
        if not _satisfies(converted, r):
            raise FieldError(path, singular, value)
        return converted

    return convert, singular, plural


def _satisfies(value: Any, r: FieldRules) -> bool:
    if r.non_empty and not value.strip():
        return False
    if r.one_of is not None and value not in r.one_of:
        return False
    if r.finite and not math.isfinite(value):
        return False
    if r.within is not None and not r.within[0] <= value <= r.within[1]:
        return False
    return r.minimum is None or value >= r.minimum


def _list_codec(item_type: Any, field_rules: FieldRules, name: str) -> tuple[Convert, Dump, str]:
    item_rules = dataclasses.replace(field_rules, min_items=0, omit_if_none=False)
    if isinstance(item_type, type) and issubclass(item_type, Record):
        _check_rules_apply(item_rules, None, name)
        convert_item, dump_item, _ = _record_codec(item_type)
        plural = f"objects {_key_list(item_type)}"
    elif item_type in _SCALARS and item_type is not dict:
        convert_item, _, plural = _scalar_codec(item_type, item_rules, name)
        dump_item = _DUMP_SCALAR[item_type]
    else:
        raise TypeError(f"{name}: unsupported list item type {item_type}")
    minimum = field_rules.min_items
    if minimum == 0:
        expected = f"a list of {plural}"
    elif minimum == 1:
        expected = f"a non-empty list of {plural}"
    else:
        expected = f"a list of at least {minimum} {plural}"

    def convert(value: Any, path: str) -> list:
        if not isinstance(value, list) or len(value) < minimum:
            raise FieldError(path, expected, value)
        return [convert_item(item, f"{path}[{index}]") for index, item in enumerate(value)]

    if dump_item is _identity:
        return convert, list, expected
    return convert, lambda items: [dump_item(item) for item in items], expected


def _record_codec(record_type: type[Record]) -> tuple[Convert, Dump, str]:
    expected = f"an object {_key_list(record_type)}"

    def convert(value: Any, path: str) -> Record:
        if not isinstance(value, dict):
            raise FieldError(path, expected, value)
        return record_type._from_fields(value, prefix=path)

    return convert, record_type.to_json, expected


def _key_list(record_type: type[Record]) -> str:
    return "{" + ", ".join(f.name for f in dataclasses.fields(record_type)) + "}"


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
            raise FieldError("root_n_correct", f"at most the number of root_rollouts ({len(self.root_rollouts)})",
                             self.root_n_correct)


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
class SearchRecord(Record):
    """The solution one search strategy returned for one problem at one k (make search): its
    steps, their PRM scores ([] for the unguided majority and for a solution without steps),
    whether it finished, the answer read from it (None: none stated) and the policy tokens
    generated for the problem, discarded candidates included (prm.search.SearchResult)."""

    problem_id: str = field(metadata=rules(non_empty=True))
    strategy: str = field(metadata=rules(non_empty=True))
    k: int = field(metadata=rules(minimum=1))
    steps: list[str]
    step_scores: list[float]
    finished: bool
    answer: str | None
    tokens_generated: int = field(metadata=rules(minimum=0))

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

    def check(self) -> None:
        n = len(self.steps)
        for name in ("step_log_scores", "answer_flags", "reference_step_logprobs"):
            values = getattr(self, name)
            if values is not None and len(values) != n:
                raise FieldError(name, f"one value per step ({n})", values)

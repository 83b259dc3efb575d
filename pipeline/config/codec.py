"""Values checked against their type annotations: the one codec behind the typed records
(pipeline.records) and the config loader (pipeline.config.loader).

``value_codec(annotation, rules)`` builds, from a field's annotation and the rules it declares,
a converter from a parsed JSON or YAML value to the field's value, a dumper back to plain JSON
and the words for a valid value. A converter raises ``FieldError`` naming the field's path
(``rollouts[3].correct``), what was expected and the value it got; each caller words the error
for its readers (records: "<file>:<line>: field 'x': expected ...", the config: "<file>: key
expects int, got ...").

    codec = value_codec(list[float], FieldRules(within=(0, 1)))
    codec.convert([1, 0.5], "step_scores")    -> [1.0, 0.5]
    codec.convert([1, 2], "step_scores")      -> FieldError: field 'step_scores[1]': expected a number
                                                 in [0, 1], got int 2
    codec.expected                            -> "a list of numbers in [0, 1]"

Annotations understood:
    str, bool            the JSON value of that type
    int                  an integer; a bool is not an int
    float                any number, ints widened (1 -> 1.0); from YAML also an exponent literal
                         such as 1e-4, which YAML 1.1 (PyYAML) reads as text
    dict                 any object; dict[K, V] checks every key and value
    list[X]              a list whose items are X (path ``name[i]``)
    X | None             X or null
    Literal[a, b]        one of its values
    a dataclass          an object of its fields, each read by its own annotation and rules
                         (``read_fields``); a missing field without a default is an error, keys the
                         class does not know are ignored, and its ``check()`` method, if any, runs
                         once every field is valid (rules that span fields)
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from typing import Any, Literal, NamedTuple

_ABSENT = object()  # stands for a key missing from the JSON object
_RULES_KEY = "field_rules"
_MAX_SHOWN_CHARS = 40  # an offending value is quoted in an error message up to this length
# PyYAML follows YAML 1.1, which reads 1e-4 (no dot) as a string.
_EXPONENT_FLOAT = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)[eE][-+]?\d+")


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
    omit_if_none:    write_fields leaves the key out when the value is None (else it writes null)
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
    """The ``metadata`` of a dataclass field, e.g. ``field(metadata=rules(within=(0, 1)))``;
    the keywords are FieldRules' fields."""
    return {_RULES_KEY: FieldRules(**kwargs)}


class FieldError(ValueError):
    """A value that breaks its field's contract. ``field`` is the field's path (``rollouts[3].correct``),
    ``expected`` a valid value in words, ``annotation`` the type the value was checked against
    (None for a rule across fields); ``read_fields`` of an enclosing object prefixes its path."""

    def __init__(self, field: str, expected: str, value: Any = _ABSENT, annotation: Any = None):
        self.field, self.expected, self.value, self.annotation = field, expected, value, annotation
        if value is _ABSENT:
            message = f"missing field '{field}' (expected {expected})"
        else:
            message = f"field '{field}': expected {expected}, got {describe_value(value)}"
        super().__init__(message)

    def inside(self, prefix: str) -> FieldError:
        """The same error for an object nested at ``prefix``."""
        return FieldError(f"{prefix}.{self.field}", self.expected, self.value, self.annotation)


def describe_value(value: Any) -> str:
    """A value's type and JSON text for an error message, cut to a few dozen characters."""
    if value is None:
        return "null"
    text = json.dumps(value, ensure_ascii=False, default=repr)
    if len(text) > _MAX_SHOWN_CHARS:
        text = text[: _MAX_SHOWN_CHARS - 3] + "..."
    return f"{type(value).__name__} {text}"


Convert = Callable[[Any, str], Any]  # (parsed value, field path) -> field value, or FieldError
Dump = Callable[[Any], Any]  # field value -> JSON value


class Codec(NamedTuple):
    convert: Convert
    dump: Dump
    expected: str  # one valid value in words: "an integer >= 0"
    plural: str  # several of them, for a list's description: "integers >= 0"


def value_codec(
    annotation: Any, field_rules: FieldRules = FieldRules(), name: str = "value", *, from_yaml: bool = False
) -> Codec:
    """The codec of a field declared ``annotation`` with ``field_rules``; ``name`` is the field's
    declaration (``Sample.steps``) in the TypeError raised for a type or rule it cannot have.
    from_yaml: the values come from PyYAML (a float field then accepts "1e-4")."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin in (types.UnionType, typing.Union):
        inner = [a for a in args if a is not type(None)]
        if len(args) != 2 or len(inner) != 1:
            raise TypeError(f"{name}: only 'X | None' unions are supported, got {annotation}")
        return _optional_codec(annotation, value_codec(inner[0], field_rules, name, from_yaml=from_yaml))
    if origin is list:
        return _list_codec(annotation, field_rules, name, from_yaml)
    if field_rules.min_items:
        raise TypeError(f"{name}: min_items applies to list fields only")
    if dataclasses.is_dataclass(annotation):
        _check_rules_apply(field_rules, None, name)
        return _object_codec(annotation)
    if annotation is dict or origin is dict:
        _check_rules_apply(field_rules, None, name)
        return _dict_codec(annotation, name, from_yaml)
    if origin is Literal:
        _check_rules_apply(field_rules, None, name)
        return _literal_codec(annotation)
    if annotation in _SCALARS:
        return _scalar_codec(annotation, field_rules, name, from_yaml)
    raise TypeError(f"{name}: unsupported field type {annotation}")


@dataclass(frozen=True)
class _FieldSpec:
    name: str
    required: bool
    rules: FieldRules
    codec: Codec


@cache
def _field_specs(cls: type) -> tuple[_FieldSpec, ...]:
    """How to read and write each field of a dataclass, built once per class."""
    if not dataclasses.is_dataclass(cls):
        raise TypeError(f"{cls.__name__}: read_fields needs a dataclass")
    hints = typing.get_type_hints(cls)
    specs = []
    for f in dataclasses.fields(cls):
        field_rules = f.metadata.get(_RULES_KEY, FieldRules())
        codec = value_codec(hints[f.name], field_rules, f"{cls.__name__}.{f.name}")
        required = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        specs.append(_FieldSpec(f.name, required, field_rules, codec))
    return tuple(specs)


def read_fields(cls: type, obj: dict, prefix: str = "") -> Any:
    """The ``cls`` instance held by the JSON object ``obj`` (a dict), its fields at ``prefix``;
    raises FieldError for a missing or ill-typed field or a broken rule (``check()``)."""
    values = {}
    for spec in _field_specs(cls):
        path = f"{prefix}.{spec.name}" if prefix else spec.name
        value = obj.get(spec.name, _ABSENT)
        if value is _ABSENT:
            if spec.required:
                raise FieldError(path, spec.codec.expected)
            continue  # the dataclass default
        values[spec.name] = spec.codec.convert(value, path)
    instance = cls(**values)
    check = getattr(instance, "check", None)
    if check is not None:
        try:
            check()
        except FieldError as error:
            raise (error.inside(prefix) if prefix else error) from None
    return instance


def write_fields(instance: Any) -> dict[str, Any]:
    """The plain dict of a dataclass instance: its fields in declaration order, nested objects as
    dicts, None as null unless the field is declared ``omit_if_none``."""
    out: dict[str, Any] = {}
    for spec in _field_specs(type(instance)):
        value = getattr(instance, spec.name)
        if value is None:
            if not spec.rules.omit_if_none:
                out[spec.name] = None
        else:
            out[spec.name] = spec.codec.dump(value)
    return out


def _object_codec(cls: type) -> Codec:
    keys = "{" + ", ".join(f.name for f in dataclasses.fields(cls)) + "}"
    expected = f"an object {keys}"

    def convert(value: Any, path: str) -> Any:
        if not isinstance(value, dict):
            raise FieldError(path, expected, value, cls)
        return read_fields(cls, value, prefix=path)

    return Codec(convert, write_fields, expected, f"objects {keys}")


def is_number(value: Any) -> bool:
    """An int or float that is not a bool."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


_SCALARS: dict[type, tuple[Callable[[Any], bool], str, str]] = {  # type -> (accepts, singular, plural)
    str: (lambda v: isinstance(v, str), "a string", "strings"),
    int: (lambda v: isinstance(v, int) and not isinstance(v, bool), "an integer", "integers"),
    float: (is_number, "a number", "numbers"),
    bool: (lambda v: isinstance(v, bool), "true or false", "true/false values"),
}


def _identity(value: Any) -> Any:
    return value


# A float field written from an int (label=1 in code) still reads "1.0" on disk, as its type says.
_DUMP_SCALAR: dict[type, Dump] = {str: _identity, int: _identity, float: float, bool: _identity}


def _check_rules_apply(r: FieldRules, scalar: type | None, name: str) -> None:
    """A value rule declared on a field of a type it cannot apply to (scalar None: an object, a
    record or a choice) is a bug in the declaring class: refuse it when the class is first used."""
    numeric = scalar in (int, float)
    misplaced = [
        rule
        for rule, applies in (
            ("non_empty", scalar is str),
            ("numbers_as_text", scalar is str),
            ("within", numeric),
            ("minimum", numeric),
            ("finite", scalar is float),
            ("one_of", scalar is not None),
        )
        if getattr(r, rule) not in (None, False) and not applies
    ]
    if misplaced:
        raise TypeError(f"{name}: rules {misplaced} do not apply to {getattr(scalar, '__name__', 'an object')}")


def _scalar_codec(scalar: type, field_rules: FieldRules, name: str, from_yaml: bool) -> Codec:
    """str, int, float and bool under the value rules."""
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
    text_floats = from_yaml and scalar is float

    def convert(value: Any, path: str) -> Any:
        if accepts(value):
            converted = float(value) if scalar is float else value
        elif r.numbers_as_text and is_number(value):
            converted = str(value)
        elif text_floats and isinstance(value, str) and _EXPONENT_FLOAT.fullmatch(value.strip()):
            converted = float(value)
        else:
            raise FieldError(path, singular, value, scalar)
        if not _satisfies(converted, r):
            raise FieldError(path, singular, value, scalar)
        return converted

    return Codec(convert, _DUMP_SCALAR[scalar], singular, plural)


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


def _literal_codec(annotation: Any) -> Codec:
    allowed = typing.get_args(annotation)
    choices = ", ".join(repr(choice) for choice in allowed)
    expected = f"one of {choices}"

    def convert(value: Any, path: str) -> Any:
        if value not in allowed:
            raise FieldError(path, expected, value, annotation)
        return value

    return Codec(convert, _identity, expected, f"values each one of {choices}")


def _optional_codec(annotation: Any, inner: Codec) -> Codec:
    expected = _or_null(inner.expected)

    def convert(value: Any, path: str) -> Any:
        if value is None:
            return None
        try:
            return inner.convert(value, path)
        except FieldError as error:
            if error.field != path:  # an item's or nested field's error: already precise
                raise
            raise FieldError(path, expected, value, annotation) from None

    def dump(value: Any) -> Any:
        return None if value is None else inner.dump(value)

    return Codec(convert, dump, expected, f"{inner.plural} or null")


def _or_null(expected: str) -> str:
    """ "true or false" -> "true, false or null"."""
    return f"{expected.replace(' or ', ', ')} or null"


def _list_codec(annotation: Any, field_rules: FieldRules, name: str, from_yaml: bool) -> Codec:
    item_rules = dataclasses.replace(field_rules, min_items=0, omit_if_none=False)
    (item_type,) = typing.get_args(annotation)
    item = value_codec(item_type, item_rules, name, from_yaml=from_yaml)
    minimum = field_rules.min_items
    if minimum == 0:
        expected = f"a list of {item.plural}"
    elif minimum == 1:
        expected = f"a non-empty list of {item.plural}"
    else:
        expected = f"a list of at least {minimum} {item.plural}"

    def convert(value: Any, path: str) -> list:
        if not isinstance(value, list) or len(value) < minimum:
            raise FieldError(path, expected, value, annotation)
        return [item.convert(entry, f"{path}[{index}]") for index, entry in enumerate(value)]

    if item.dump is _identity:
        return Codec(convert, list, expected, f"lists of {item.plural}")
    return Codec(convert, lambda items: [item.dump(entry) for entry in items], expected, f"lists of {item.plural}")


def _dict_codec(annotation: Any, name: str, from_yaml: bool) -> Codec:
    """dict: any object, copied; dict[K, V]: an object whose keys are K and values V (paths
    ``name.<key>`` and ``name.<the key>``)."""
    expected = "an object"
    if annotation is dict:

        def convert_any(value: Any, path: str) -> dict:
            if not isinstance(value, dict):
                raise FieldError(path, expected, value, annotation)
            return dict(value)

        return Codec(convert_any, dict, expected, "objects")
    key_type, value_type = typing.get_args(annotation)
    keys = value_codec(key_type, FieldRules(), name, from_yaml=from_yaml)
    values = value_codec(value_type, FieldRules(), name, from_yaml=from_yaml)

    def convert(value: Any, path: str) -> dict:
        if not isinstance(value, dict):
            raise FieldError(path, expected, value, annotation)
        return {keys.convert(k, f"{path}.<key>"): values.convert(v, f"{path}.{k}") for k, v in value.items()}

    return Codec(convert, lambda value: {keys.dump(k): values.dump(v) for k, v in value.items()}, expected, "objects")

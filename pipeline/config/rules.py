"""The rules a config field declares for its values: a numeric range or a closed list of names.

A numeric field declares its range with ``bounded`` (``k: int = bounded(16, ge=1)``; a seed with
``seed_field``), read back with ``declared_range``; a field that takes one of a few names is
typed ``Literal[...]``, whose names ``choices_of`` lists. The sections (pipeline.config.schema,
pipeline.config.asynchronous) declare them; the loader (pipeline.config.loader) checks every value
against them where it is set.
"""

from __future__ import annotations

import dataclasses
import math
import typing
from dataclasses import dataclass, field
from typing import Any, Literal


@dataclass(frozen=True)
class Range:
    """The values a numeric field accepts: finite numbers within the bounds (None: unbounded)."""

    ge: float | None = None
    gt: float | None = None
    le: float | None = None
    lt: float | None = None

    def contains(self, value: float) -> bool:
        return (
            math.isfinite(value)
            and (self.ge is None or value >= self.ge)
            and (self.gt is None or value > self.gt)
            and (self.le is None or value <= self.le)
            and (self.lt is None or value < self.lt)
        )

    def __str__(self) -> str:
        parts = [
            f"{op} {bound:.12g}"
            for op, bound in ((">=", self.ge), (">", self.gt), ("<=", self.le), ("<", self.lt))
            if bound is not None
        ]
        return " and ".join(parts) if parts else "any finite number"


_RANGE_KEY = "range"
SEED_MAX = 2**32 - 1  # numpy's seeds (accelerate's set_seed seeds numpy too)


def bounded(
    default: Any = dataclasses.MISSING,
    *,
    ge: float | None = None,
    gt: float | None = None,
    le: float | None = None,
    lt: float | None = None,
    default_factory: Any = dataclasses.MISSING,
) -> Any:
    """A numeric config field with its declared range, e.g. ``k: int = bounded(16, ge=1)``;
    None (for an optional field) is always accepted, a list's items are checked one by one."""
    return field(default=default, default_factory=default_factory, metadata={_RANGE_KEY: Range(ge, gt, le, lt)})


def seed_field(default: int = 0) -> Any:
    return bounded(default, ge=0, le=SEED_MAX)


def declared_range(spec: dataclasses.Field) -> Range | None:
    """The range a field declares with ``bounded`` (None: it declares none)."""
    return spec.metadata.get(_RANGE_KEY)


def choices_of(tp: Any) -> tuple | None:
    """The values a Literal annotation allows (None: ``tp`` is no Literal)."""
    return typing.get_args(tp) if typing.get_origin(tp) is Literal else None

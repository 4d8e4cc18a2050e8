"""The values of a ``State`` at one moment, frozen, and the record of a step's end: what the
step boundary's stages take.

``State`` holds the values; the stages around a recovery point (the integrity gate, the recovery
point's strategy) each take a ``Capture`` and do one thing with it; the stages of the step's end
(``_stages``) each take a ``StepEnd``.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, Mapping, Protocol, runtime_checkable

import numpy as np

INDEX = "__handlers__"  # a committed JSON document: each value's name and its handler's label


@dataclasses.dataclass(frozen=True)
class Capture:
    """Every value of a ``State`` as arrays, at one moment (local). The arrays are views of the
    live values: take a capture, hand it on and drop it within one call.

    ``local``: the names (or first dotted parts) of the values that may differ across ranks (the
    RNG states, a shard, the index); every other value must be equal on every rank. ``twinned``:
    those of them this rank's twins hold alike (an optimizer shard; see ``_points.TwinSteps``)."""

    arrays: Mapping[str, np.ndarray]
    local: frozenset[str]
    twinned: frozenset[str] = frozenset()

    def is_local(self, name: str) -> bool:
        return is_local(name, self.local)

    @property
    def unique(self) -> dict[str, np.ndarray]:
        """The values no other rank holds (the index with them): the local ones but the twinned."""
        return {name: a for name, a in self.arrays.items()
                if self.is_local(name) and not is_local(name, self.twinned)}

    @property
    def twin(self) -> dict[str, np.ndarray]:
        """The values this rank's twins hold alike."""
        return {name: a for name, a in self.arrays.items() if is_local(name, self.twinned)}

    @property
    def shared(self) -> dict[str, np.ndarray]:
        """The values every rank holds alike."""
        return {name: a for name, a in self.arrays.items() if not self.is_local(name)}


def is_local(name: str, local: frozenset[str]) -> bool:
    """``name`` is rank-unique under ``local`` (itself or the part before its first dot)."""
    return name in local or name.split(".", 1)[0] in local


def _no_values() -> Capture:
    return Capture({}, frozenset())


@dataclasses.dataclass(frozen=True)
class StepEnd:
    """What ``record_step`` knew of a step as it ended (local): the record each stage of the
    step's end takes (``_stages``). ``own_work``: the seconds of the step this rank did not spend
    waiting for its peers. ``capture``: the State's values now (views of the live values), taken
    the first time a stage reads it. ``changed``: values a stage changed (a data fault's flipped
    bit), which the State takes into its live ones."""

    step: int
    loss: float | None = None
    grad_norm: float | None = None
    total: int | None = None
    metrics: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    own_work: float = 0.0
    take: Callable[[], Capture] = _no_values
    changed: Mapping[str, np.ndarray] = dataclasses.field(default_factory=dict)

    @functools.cached_property
    def capture(self) -> Capture:
        return self.take()


@runtime_checkable
class StepStage(Protocol):
    """One stage of the step's end (``_stages``): it does one thing with the record."""

    def step_ended(self, end: StepEnd) -> StepEnd | None:
        """The step ``end`` describes has ended (local unless the stage says otherwise; a collective
        stage runs on every active rank alike). None, or the record as this stage changed the step."""
        ...

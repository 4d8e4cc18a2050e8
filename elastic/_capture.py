"""The values of a ``State`` at one moment, frozen: what the step boundary's stages take.

``State`` holds the values; the stages around a recovery point (the integrity gate, the recovery
point's strategy, stragglers, data faults) each take a ``Capture`` and do one thing with it.
"""
from __future__ import annotations

import dataclasses
from typing import Mapping

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

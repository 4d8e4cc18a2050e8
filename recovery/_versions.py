"""The versions a store keeps on one rank: the current one, and the older ones to fall back to.

A ``Version`` is what one rank holds of one agreed commit: its own payload (and any adopted since
a shrink), the pieces of others' payloads it keeps for them, and the layout they were placed
over. A ``VersionChain`` keeps the newest ``keep`` of them, the current one first; a commit
pushes a new one and retires the oldest (whose buffers the next commit reuses); ``fall_back``
goes back to an older one that every rank keeps (``newest_common`` says which, from what each
rank told); a recovery keeps only the current one (a replacement holds no other). Pure: no MPI.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import numpy as np

from ._payload import Payload
from ._placement import Layout, Piece


@dataclasses.dataclass
class Held:
    """A piece of another rank's payload kept here, with the checksum of each of its chunks."""

    piece: Piece
    data: np.ndarray
    sums: list[int]
    offset: int = 0  # in the buffer the version's copies arrived in


@dataclasses.dataclass
class Version:
    number: int
    layout: Layout                            # the ranks and domains it was committed over
    nbytes: dict[int, int]                    # payload sizes this rank knows: its own, those it holds pieces of
    payloads: dict[int, Payload]              # whole payloads here: its own, and any adopted since
    held: dict[tuple[int, int, int], Held]    # (owner, copy, first chunk) -> the piece kept for it
    complete: bool = True                     # every piece the layout gives this rank is here
    buffer: np.ndarray | None = None          # what the held pieces are views of
    parity: Any = None                        # a parity store's blocks instead of held pieces


class VersionChain:
    """The newest ``keep`` versions of one rank, the current one first (local)."""

    def __init__(self, keep: int) -> None:
        self.keep = keep
        self.current: Version | None = None
        self._older: list[Version] = []  # before the current one, newest first

    @property
    def number(self) -> int | None:
        return self.current.number if self.current is not None else None

    @property
    def older(self) -> list[int]:
        """The numbers of the older versions kept, newest first."""
        return [v.number for v in self._older]

    def retiring(self) -> Version | None:
        """The version the next ``push`` retires (none while fewer than ``keep`` are kept): its
        buffers are free for the new one to reuse."""
        kept = ([self.current] if self.current is not None else []) + self._older
        return kept[-1] if kept and len(kept) >= self.keep else None

    def push(self, version: Version) -> None:
        """Make ``version`` the current one, retiring the oldest kept past ``keep``."""
        if self.current is not None and self.keep > 1:
            self._older.insert(0, self.current)
            del self._older[self.keep - 1:]
        self.current = version

    def only(self, version: Version | None) -> None:
        """Keep ``version`` alone, as the current one: a recovery's (a replacement holds no older one,
        and after a shrink they lack the removed ranks' state), or an attached one."""
        self.current, self._older = version, []

    def fall_back(self, number: int) -> None:
        """Make the older version ``number`` the current one, dropping every newer one."""
        while self._older and self._older[0].number != number:
            self._older.pop(0)
        if not self._older:
            raise ValueError(f"version {number} is not kept here (kept: {self.older})")
        self.current = self._older.pop(0)


def newest_common(kept: Sequence[Sequence[int]]) -> int | None:
    """The newest version that every rank keeps, from what each told (``VersionChain.older``); None
    when there is none (the same on every rank)."""
    if not kept:
        return None
    common = set(kept[0]).intersection(*map(set, kept[1:]))
    return max(common) if common else None

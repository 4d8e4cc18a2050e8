"""Two kinds of rank identity, kept apart on purpose.

A *logical* rank names a piece of work (a shard, a stage); it survives rebuilds.
A *current* rank is a position in today's communicator; it changes with every rebuild.
"""
from __future__ import annotations

import enum


SPARE = -1  # membership-table entry of a parked spare (here, beside the ranks: importing it starts no MPI)


class LogicalRank(int):
    """The rank a piece of work belongs to; stable across rebuilds."""

    __slots__ = ()

    def __repr__(self) -> str:
        return f"LogicalRank({int(self)})"

    def __str__(self) -> str:  # the number, as an environment variable, a file name or a log line wants it
        return int.__repr__(self)


class CurrentRank(int):
    """A rank in the communicator of the current generation."""

    __slots__ = ()

    def __repr__(self) -> str:
        return f"CurrentRank({int(self)})"

    def __str__(self) -> str:  # the number, as an environment variable, a file name or a log line wants it
        return int.__repr__(self)


class Role(enum.Enum):
    """How this process came to hold its logical rank in this generation."""

    INITIAL = "initial"      # launched with the job and active from the start
    SURVIVOR = "survivor"    # lived through at least one rebuild
    RECOVERED = "recovered"  # took over a dead rank's logical rank (spare or spawned)
    SPARE = "spare"          # parked, waiting to be promoted

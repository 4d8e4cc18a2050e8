"""Who is in the job: one universe communicator and, for each of its ranks, a logical rank and a (host, pid).

The table is identical on every process: entry ``u`` is the logical rank that
universe rank ``u`` holds, or ``SPARE`` for a parked spare. Active ranks are
ordered by logical rank in the communicator users compute on.
"""
from __future__ import annotations

import dataclasses

from mpi4py import MPI

from ._ranks import SPARE, LogicalRank

Proc = tuple[str, int]  # (host, pid) of a universe rank


@dataclasses.dataclass
class Members:
    """One generation's (or one rebuild round's) universe: communicator, table, processes where known."""

    comm: MPI.Intracomm
    table: list[int]
    procs: list[Proc | None]

    def copy(self) -> "Members":
        return Members(self.comm, list(self.table), list(self.procs))

    def spares(self) -> int:
        return sum(1 for e in self.table if e == SPARE)

    def actives(self) -> int:
        return len(self.table) - self.spares()

    def logical_ranks(self) -> tuple[LogicalRank, ...]:
        """The active logical ranks, in current-rank order (ascending)."""
        return tuple(LogicalRank(e) for e in sorted(e for e in self.table if e != SPARE))

    def host_peers(self) -> list[int]:
        """The active logical ranks on this process's host, ascending (from the processes' hostnames)."""
        me, mine = self.procs[self.comm.Get_rank()], self.mine()
        peers = {e for e, p in zip(self.table, self.procs) if e != SPARE and p is not None and me is not None
                 and p[0] == me[0]}
        return sorted(peers | ({mine} if mine != SPARE else set()))

    def mine(self) -> int:
        """This process's table entry (a logical rank, or ``SPARE``)."""
        return self.table[self.comm.Get_rank()]

    def keep(self, alive: list[int], comm: MPI.Intracomm) -> None:
        """After a shrink: only universe ranks ``alive`` (in the old numbering) remain, in ``comm``."""
        self.comm, self.table, self.procs = comm, [self.table[u] for u in alive], [self.procs[u] for u in alive]

    def known_failed(self) -> set[int]:
        """Universe ranks this process knows have failed (local; empty when MPI cannot say)."""
        try:
            group = self.comm.Get_failed()
            failed = set(MPI.Group.Translate_ranks(group, list(range(group.Get_size())), self.comm.Get_group()))
            group.Free()
            return failed
        except MPI.Exception:
            return set()

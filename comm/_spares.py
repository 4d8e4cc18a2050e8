"""Parked spares: how they wait, how they are promoted, and how they are let go.

A spare blocks in a receive on the universe. A rebuild revokes the universe,
which wakes it into the same rebuild as everyone else; if it is given a lost
logical rank it returns from ``elastic.init()`` as a recovered rank. At the
end of the job the lowest live active rank sends it a release.
"""
from __future__ import annotations

import sys
from typing import TYPE_CHECKING

from mpi4py import MPI

from ._errors import Unrecoverable, agreed, translate
from ._membership import SPARE
from ._ranks import Role

if TYPE_CHECKING:
    from ._world import World

TAG_RELEASE = 7701


def park(world: "World") -> None:
    """Wait as a spare until promoted (returns) or released at the end of the job (exits)."""
    world.events.emit("parked")
    world.watchdog.watch_progress(False)  # waiting is a parked spare's job
    members = world.members
    world.fire(members, "park", index=members.table[:members.comm.Get_rank()].count(SPARE))
    while world.role is Role.SPARE:
        universe = world.members.comm
        try:
            universe.recv(source=MPI.ANY_SOURCE, tag=TAG_RELEASE)
        except MPI.Exception as exc:
            if exc.Get_error_class() == MPI.ERR_REVOKED:
                world.rebuild(join=False)
                continue
            if exc.Get_error_class() in (MPI.ERR_PROC_FAILED, MPI.ERR_PROC_FAILED_PENDING):
                universe.Ack_failed()  # the active ranks will revoke if it matters...
                failed = world.members.known_failed()
                if all(u in failed for u, e in enumerate(world.members.table) if e != SPARE):
                    # ...unless none is left to do it
                    raise agreed(Unrecoverable("every active rank died; the parked spares have nothing "
                                               "to take over from")) from None
                continue
            raise translate(exc, universe) from exc
        world.events.emit("released")
        world.events.write_outcome("spare-unused")
        world.lifecycle.finished = True
        sys.exit(0)
    world.events.emit("promoted", logical=world.logical_rank)
    world.watchdog.watch_progress(True)


def release(world: "World", released: set[int]) -> None:
    """Send the release to every parked spare, if this is the lowest live active process (local
    to the universe; called again after every failure on the way out). ``released``: done already."""
    members = world.members
    me = members.comm.Get_rank()
    if members.table[me] == SPARE:
        return
    failed = members.known_failed()
    actives = [u for u, e in enumerate(members.table) if e != SPARE and u not in failed]
    if not actives or actives[0] != me:
        return
    for u, entry in enumerate(members.table):
        if entry == SPARE and u not in failed and u not in released:
            try:
                members.comm.send(None, dest=u, tag=TAG_RELEASE)
                released.add(u)
            except MPI.Exception:
                pass  # a dead spare needs no release; the agreement acknowledges it

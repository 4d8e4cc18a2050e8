"""Parked spares: how they wait, how they are promoted, and how they are let go.

A spare waits for a receive on the universe, testing it every few
milliseconds and sleeping in between: a blocking MPI receive would spin on a
core that the active ranks on the node need. A rebuild revokes the universe,
which fails the receive and takes the spare into the same rebuild as everyone
else; if it is given a lost logical rank it returns from ``elastic.init()`` as
a recovered rank. At the end of the job the lowest live active rank sends it
a release (an empty message: nothing to decode).
"""
from __future__ import annotations

import contextlib
import sys
import time
from typing import TYPE_CHECKING

import numpy as np
from mpi4py import MPI

from ._errors import Unrecoverable, agreed, translate
from ._ranks import SPARE
from ._ranks import Role

if TYPE_CHECKING:
    from ._world import World

TAG_RELEASE = 7701
POLL_SECONDS = 0.002  # a promotion waits at most this long for the spare to notice the revoke


def park(world: "World") -> None:
    """Wait as a spare until promoted (returns) or released at the end of the job (exits)."""
    world.events.emit("parked")
    world.watchdog.watch_progress(False)  # waiting is a parked spare's job
    members = world.members
    world.fire(members, "park", index=members.table[:members.comm.Get_rank()].count(SPARE))
    while world.role is Role.SPARE:
        universe = world.members.comm
        try:
            _wait_for_release(universe)
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
                members.comm.Send(np.empty(0, np.uint8), dest=u, tag=TAG_RELEASE)
                released.add(u)
            except MPI.Exception:
                pass  # a dead spare needs no release; the agreement acknowledges it


def _wait_for_release(universe: MPI.Intracomm) -> None:
    """Return when the release arrives; raises what the receive fails with (a revoke, a death)."""
    request = universe.Irecv(np.empty(0, np.uint8), source=MPI.ANY_SOURCE, tag=TAG_RELEASE)
    try:
        while not request.Test():
            time.sleep(POLL_SECONDS)
    except MPI.Exception:
        # A revoked communicator completes the receive in error; one that failed otherwise may
        # still be pending and must not outlive this call.
        if request != MPI.REQUEST_NULL:
            with contextlib.suppress(MPI.Exception):
                request.Cancel()
                request.Free()
        raise

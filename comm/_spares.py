"""Parked spares' messages: how they wait, and how they are let go (``World.park`` is the loop).

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
import time

import numpy as np
from mpi4py import MPI

from ._membership import Members
from ._ranks import SPARE

TAG_RELEASE = 7701
POLL_SECONDS = 0.002  # a promotion waits at most this long for the spare to notice the revoke


def send_releases(members: Members, released: set[int]) -> None:
    """Send the release to every parked spare, if this is the lowest live active process (local
    to the universe; called again after every failure on the way out). ``released``: done already."""
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


def every_active_failed(members: Members) -> bool:
    """Every active rank is known dead here (local): a parked spare has nobody to take over from."""
    failed = members.known_failed()
    return all(u in failed for u, e in enumerate(members.table) if e != SPARE)


def wait_for_release(universe: MPI.Intracomm) -> None:
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

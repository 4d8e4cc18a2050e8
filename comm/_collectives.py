"""The data-plane collectives the layers above use through ``World``: bulk byte exchange and sums.

Both run on the active ranks' communicator and raise the project's
exceptions; neither votes (the callers' protocols do, where they decide
something together).
"""
from __future__ import annotations

from typing import Callable, Mapping, Sequence

import numpy as np
from mpi4py import MPI

from ._errors import Unrecoverable


def exchange(comm: MPI.Intracomm, outgoing: Sequence[list[np.ndarray]], incoming: Sequence[list[np.ndarray]],
             in_flight: Callable[[], None]) -> int:
    """Send byte arrays to every peer and receive into arrays given in advance (collective, blocking).

    ``outgoing[r]``: what goes to current rank ``r``; ``incoming[r]``: the
    writable byte arrays that what ``r`` sends lands in, in order. One
    ``Alltoallw`` over the arrays' own addresses: no packing copy on either
    side, and adjacent arrays travel as one block. ``in_flight`` runs once
    the sizes are agreed, before the transfer (a fault point). Returns the
    bytes sent.
    """
    send_counts = [sum(a.nbytes for a in arrays) for arrays in outgoing]
    expected = [sum(a.nbytes for a in arrays) for arrays in incoming]
    recv_counts = comm.alltoall(send_counts)
    if recv_counts != expected:  # a planning bug: never slice data by a plan the sender does not share
        raise Unrecoverable(f"transfer plan differs across ranks (a bug, please report it): expected "
                            f"{expected} bytes by rank, peers announced {recv_counts}")
    send_types = [_blocks_type(arrays) for arrays in outgoing]
    recv_types = [_blocks_type(arrays) for arrays in incoming]
    try:
        in_flight()
        comm.Alltoallw([MPI.BOTTOM, ([int(t != MPI.BYTE) for t in send_types], [0] * len(send_types)), send_types],
                       [MPI.BOTTOM, ([int(t != MPI.BYTE) for t in recv_types], [0] * len(recv_types)), recv_types])
    finally:
        for t in send_types + recv_types:
            if t != MPI.BYTE:
                t.Free()
    return sum(send_counts)


def _blocks_type(arrays: list[np.ndarray]) -> MPI.Datatype:
    """A datatype over ``arrays`` in order, at their own addresses, adjacent ones merged (MPI.BYTE when none)."""
    blocks: list[list[int]] = []  # [address, size]
    for a in arrays:
        if not a.nbytes:
            continue
        address = MPI.Get_address(a)
        if blocks and blocks[-1][0] + blocks[-1][1] == address:
            blocks[-1][1] += a.nbytes
        else:
            blocks.append([address, a.nbytes])
    if not blocks:
        return MPI.BYTE
    return MPI.BYTE.Create_hindexed([n for _, n in blocks], [a for a, _ in blocks]).Commit()


def allreduce_sum(comm: MPI.Intracomm, arrays: Sequence[np.ndarray], in_flight: Callable[[], None]) -> None:
    """Sum each array over the ranks, in place (collective, blocking); all reductions in flight together."""
    requests = [comm.Iallreduce(MPI.IN_PLACE, a, op=MPI.SUM) for a in arrays]
    in_flight()
    MPI.Request.Waitall(requests)


def by_rank(values: Mapping[int, list], order: Sequence[int]) -> list[list]:
    """``values`` keyed by logical rank, as a list in current-rank order (the order of ``order``)."""
    return [values.get(r, []) for r in order]

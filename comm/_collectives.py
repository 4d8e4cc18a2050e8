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

Buffer = Callable[[int], np.ndarray]  # nbytes -> a byte buffer to receive into


def exchange(comm: MPI.Intracomm, outgoing: Sequence[list[np.ndarray]], incoming: Sequence[list[int]],
             buffer: Buffer, in_flight: Callable[[], None]) -> tuple[list[list[np.ndarray]], np.ndarray, int]:
    """Send byte arrays to every peer and receive arrays of known sizes (collective, blocking).

    ``outgoing[r]`` / ``incoming[r]``: what goes to / comes from current rank
    ``r``. One ``Alltoallw``: arrays leave from where they lie (an indexed
    datatype of their addresses per peer, no packing copy) and arrive, in
    order, in one buffer from ``buffer``. ``in_flight`` runs once the sizes are
    agreed, before the transfer (a fault point). Returns the arrays received
    from each rank (views of that buffer), the buffer, and the bytes sent.
    """
    send_counts = [sum(a.nbytes for a in arrays) for arrays in outgoing]
    expected = [sum(sizes) for sizes in incoming]
    recv_counts = comm.alltoall(send_counts)
    if recv_counts != expected:  # a planning bug: never slice data by a plan the sender does not share
        raise Unrecoverable(f"transfer plan differs across ranks (a bug, please report it): expected "
                            f"{expected} bytes by rank, peers announced {recv_counts}")
    recvbuf = buffer(sum(recv_counts))
    types = [_gather_type(arrays) for arrays in outgoing]
    try:
        in_flight()
        comm.Alltoallw([MPI.BOTTOM, ([int(t != MPI.BYTE) for t in types], [0] * len(types)), types],
                       [recvbuf, (recv_counts, list(np.cumsum([0] + recv_counts[:-1]))),
                        [MPI.BYTE] * len(types)])
    finally:
        for t in types:
            if t != MPI.BYTE:
                t.Free()
    received: list[list[np.ndarray]] = []
    offset = 0
    for sizes in incoming:
        received.append([])
        for size in sizes:
            received[-1].append(recvbuf[offset:offset + size])
            offset += size
    return received, recvbuf, sum(send_counts)


def _gather_type(arrays: list[np.ndarray]) -> MPI.Datatype:
    """A datatype that sends ``arrays`` in order from their own addresses (MPI.BYTE when none)."""
    arrays = [a for a in arrays if a.nbytes]
    if not arrays:
        return MPI.BYTE
    return MPI.BYTE.Create_hindexed([a.nbytes for a in arrays], [MPI.Get_address(a) for a in arrays]).Commit()


def allreduce_sum(comm: MPI.Intracomm, arrays: Sequence[np.ndarray], in_flight: Callable[[], None]) -> None:
    """Sum each array over the ranks, in place (collective, blocking); all reductions in flight together."""
    requests = [comm.Iallreduce(MPI.IN_PLACE, a, op=MPI.SUM) for a in arrays]
    in_flight()
    MPI.Request.Waitall(requests)


def by_rank(values: Mapping[int, list], order: Sequence[int]) -> list[list]:
    """``values`` keyed by logical rank, as a list in current-rank order (the order of ``order``)."""
    return [values.get(r, []) for r in order]

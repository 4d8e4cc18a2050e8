"""The collectives the layers above use through ``World``, and the rebuild's control messages.

Bulk byte exchange, and ``allgather`` / ``bcast`` / ``alltoall`` of values:
those travel in ``wire``'s format (a checked JSON document beside the
arrays), never pickled, so what a peer sent builds nothing but data. None of
them votes (the callers' protocols do, where they decide something together).
"""
from __future__ import annotations

import bisect
import time
from typing import Any, Callable, Mapping, Sequence

import numpy as np
from mpi4py import MPI

from . import wire
from ._errors import ProcessFailure, Unrecoverable

REVOKED_GRACE_SECONDS = 1.0  # an agreement still pending this long after its communicator's revoke is given up
_abandoned: list[tuple[MPI.Request, np.ndarray]] = []  # given-up agreements: MPI may still write their flag


def agree(comm: MPI.Intracomm, flag: int) -> int:
    """The bitwise AND of every live rank's ``flag`` (collective, ULFM agreement), or
    ``ProcessFailure`` once ``comm`` is revoked and the agreement cannot complete.

    ULFM's agreement goes on through a revoke: it is how survivors agree on a revoked
    communicator. But a rank whose data-plane call failed where its peers' succeeded (a rank
    that died in the middle of an all-reduce can leave it so) goes straight to the rebuild: it
    revokes ``comm`` and waits on the universe, and never joins the agreement its peers go on
    into. A blocking ``Agree`` would wait for it for ever (the hang the external punisher found
    once in 100 runs). So the agreement is posted non-blocking and polled; still pending
    ``REVOKED_GRACE_SECONDS`` after the revoke (a peer that took part, and revoked on its way
    to the rebuild after it completed, is matched long before), it is given up, and this rank
    joins the rebuild too. The request and its buffer are kept: the communicator is never freed.
    """
    buffer = np.array([flag], dtype=np.intc)
    request = comm.Iagree(buffer)
    revoked_at: float | None = None
    while not request.Test():
        if revoked_at is None:
            if comm.Is_revoked():
                revoked_at = time.monotonic()
        elif time.monotonic() - revoked_at > REVOKED_GRACE_SECONDS:
            _abandoned.append((request, buffer))
            raise ProcessFailure("a peer began a recovery instead of this agreement (the communicator is revoked)")
    return int(buffer[0])


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
    recv_counts = _alltoall_counts(comm, send_counts).tolist()
    if recv_counts != expected:  # a planning bug: never slice data by a plan the sender does not share
        raise _plan_differs(f"expected {expected} bytes by rank, peers announced {recv_counts}")
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


EXCHANGE_TAG = 0x3E1A  # the known-plan exchange's messages (each pair's arrive in order: MPI does not overtake)


def exchange_known(comm: MPI.Intracomm, outgoing: Mapping[int, list[np.ndarray]],
                   incoming: Mapping[int, list[np.ndarray]], in_flight: Callable[[], None]) -> int:
    """``exchange`` where every receiver already knows what comes from whom (the same plan on
    every rank): no counts are exchanged, and only ranks that send to or receive from each other
    take part, one message per peer at the arrays' own addresses, so a rank waits for its peers
    and not for every rank. What arrived is checked against what was expected, as ``exchange``
    checks the counts (``Unrecoverable`` when they differ: a planning bug). A dead peer, or a
    peer's revoke, is ``ProcessFailure`` (the caller's ``mpi_errors``). ``outgoing`` and ``incoming``
    by current rank, the peers only (``by_current``): O(peers) at any job size. Returns the bytes sent."""
    send_counts = {peer: sum(a.nbytes for a in arrays) for peer, arrays in outgoing.items()}
    receives = [(peer, n) for peer, n in sorted((p, sum(a.nbytes for a in arrays)) for p, arrays in incoming.items())
                if n]  # (peer, bytes expected)
    types: list[MPI.Datatype] = []
    requests: list[MPI.Request] = []
    try:
        in_flight()
        for peer, _ in receives:
            types.append(_blocks_type(incoming[peer]))
            requests.append(comm.Irecv([MPI.BOTTOM, 1, types[-1]], peer, EXCHANGE_TAG))
        for peer, arrays in sorted(outgoing.items()):
            if send_counts[peer]:
                types.append(_blocks_type(arrays))
                requests.append(comm.Isend([MPI.BOTTOM, 1, types[-1]], peer, EXCHANGE_TAG))
        statuses = [MPI.Status() for _ in requests]
        MPI.Request.Waitall(requests, statuses)
    finally:
        for t in types:
            t.Free()
    arrived = [(peer, expected, statuses[i].Get_elements(MPI.BYTE)) for i, (peer, expected) in enumerate(receives)]
    wrong = [f"{got} bytes from rank {peer} where {expected} were expected" for peer, expected, got in arrived
             if got != expected]
    if wrong:
        raise _plan_differs("; ".join(wrong))
    return sum(send_counts.values())


def _plan_differs(detail: str) -> Unrecoverable:
    return Unrecoverable(f"transfer plan differs across ranks (a bug, please report it): {detail}")


def allgather(comm: MPI.Intracomm, value: Any) -> list[Any]:
    """Every rank's ``value``, by rank (collective)."""
    data = wire.encode(value)
    sizes = np.zeros(comm.Get_size(), np.int64)
    comm.Allgather(np.array([data.nbytes], np.int64), sizes)
    displs = np.concatenate(([0], np.cumsum(sizes)[:-1]))
    out = np.empty(int(sizes.sum()), np.uint8)
    comm.Allgatherv(data, [out, sizes.tolist(), displs.tolist(), MPI.BYTE])
    return [wire.decode(out[d:d + n]) for d, n in zip(displs, sizes)]


def bcast(comm: MPI.Intracomm, value: Any, root: int) -> Any:
    """Rank ``root``'s ``value`` on every rank (collective; the root gets its own object back)."""
    mine = comm.Get_rank() == root
    data = wire.encode(value) if mine else None
    size = np.array([data.nbytes if data is not None else 0], np.int64)
    comm.Bcast(size, root=root)
    if data is None:
        data = np.empty(int(size[0]), np.uint8)
    comm.Bcast(data, root=root)
    return value if mine else wire.decode(data)


def alltoall(comm: MPI.Intracomm, values: Sequence[Any]) -> list[Any]:
    """Send ``values[r]`` to rank ``r``; what each rank sent here, by rank (collective). None costs
    no bytes: a sparse exchange moves only what is there, plus one count per peer."""
    datas = [wire.encode(v) for v in values]
    send_sizes = np.array([d.nbytes for d in datas], np.int64)
    recv_sizes = _alltoall_counts(comm, send_sizes)
    send = np.concatenate(datas) if datas else np.empty(0, np.uint8)
    recv = np.empty(int(recv_sizes.sum()), np.uint8)
    send_displs = np.concatenate(([0], np.cumsum(send_sizes)[:-1]))
    recv_displs = np.concatenate(([0], np.cumsum(recv_sizes)[:-1]))
    comm.Alltoallv([send, send_sizes.tolist(), send_displs.tolist(), MPI.BYTE],
                   [recv, recv_sizes.tolist(), recv_displs.tolist(), MPI.BYTE])
    return [wire.decode(recv[d:d + n]) for d, n in zip(recv_displs, recv_sizes)]


def _alltoall_counts(comm: MPI.Intracomm, counts: Sequence[int] | np.ndarray) -> np.ndarray:
    recv = np.zeros(comm.Get_size(), np.int64)
    comm.Alltoall(np.asarray(counts, np.int64), recv)
    return recv


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


def by_current(values: Mapping[int, list[np.ndarray]], order: Sequence[int]) -> dict[int, list[np.ndarray]]:
    """``values`` keyed by logical rank, keyed by current rank instead (``order``: the active logical
    ranks ascending, which is current-rank order), those in ``order`` only: O(len(values) log n)."""
    out = {}
    for logical, arrays in values.items():
        at = bisect.bisect_left(order, logical)
        if at < len(order) and order[at] == logical:
            out[at] = arrays
    return out


def by_rank(values: Mapping[int, list[np.ndarray]], order: Sequence[int]) -> list[list[np.ndarray]]:
    """``values`` keyed by logical rank, as a list in current-rank order (the order of ``order``)."""
    return [values.get(r, []) for r in order]

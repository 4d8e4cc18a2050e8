"""Values every active rank holds alike, copied to the ranks that lack them: no replicas kept.

In data-parallel training the model and the optimizer are the same on every rank. Peer copies of
them would duplicate what every survivor holds anyway, so the store never takes them: a
replacement gets them from the survivors, each survivor sending an equal share of the bytes (no
one rank sends it all), straight from and into the arrays where they lie.
"""
from __future__ import annotations

from typing import Any, Mapping, Sequence

import numpy as np
from elastic.comm import Group, ProcessFailure, Unrecoverable, agreed


def share(world: Group, arrays: Mapping[str, np.ndarray] | None,
          receivers: Sequence[int]) -> dict[str, np.ndarray] | None:
    """Copy ``arrays`` (name -> array, alike on every rank that passes them) from the active ranks
    that have them to the logical ranks ``receivers`` (which pass None) (collective over the
    active ranks). Returns, on a receiver, the arrays (its own, writable); None elsewhere.

    Raises:
        ProcessFailure: a rank failed during the transfer (on every rank: a vote).
        Unrecoverable: every active rank is a receiver: no rank has the values (on every rank).
    """
    active = [int(r) for r in world.logical_ranks]
    me, taking = int(world.logical_rank), set(receivers)
    senders = [r for r in active if r not in taking]
    if not senders:
        raise agreed(Unrecoverable("no active rank holds the values every rank shares (every one that did died): "
                                   "nothing to copy them from"))
    manifest = world.bcast(_manifest(arrays) if me == senders[0] and arrays is not None else None,
                           root=active.index(senders[0]))
    out: dict[str, np.ndarray] | None = None
    outgoing: dict[int, list[np.ndarray]] = {}
    incoming: dict[int, list[np.ndarray]] = {}
    if me in taking:
        out, parts = _buffers(manifest)
        incoming = _split(parts, senders)
    else:
        assert arrays is not None
        parts = _views(arrays, manifest)
        mine = _split(parts, senders)[me]
        outgoing = {r: mine for r in receivers}
    _transfer(world, outgoing, incoming, "a rank could not finish its part of copying the shared values")
    world.events.emit("shared_copied", receivers=sorted(taking), senders=len(senders),
                      bytes=int(sum(p.nbytes for p in parts)))
    return out


def share_within(world: Group, arrays: Mapping[str, np.ndarray],
                 receivers: Mapping[int, Sequence[int]]) -> dict[str, np.ndarray] | None:
    """Copy to each logical rank in ``receivers`` the ``arrays`` its listed logical ranks hold alike
    (its twins: the same shard), each of them sending an equal part (collective over the active
    ranks; every rank passes the same ``receivers``, each with at least one live sender; a
    receiver's own ``arrays`` are not read: the first sender's manifest says what comes). Returns,
    on a receiver, the arrays (its own, writable); None elsewhere.

    Raises:
        ProcessFailure: a rank failed during the transfer (on every rank: a vote).
    """
    me = int(world.logical_rank)
    order = [int(r) for r in world.logical_ranks]
    manifest = _manifest(arrays)
    told = world.alltoall({order.index(r): manifest for r, senders in receivers.items() if senders[0] == me})
    out: dict[str, np.ndarray] | None = None
    outgoing: dict[int, list[np.ndarray]] = {}
    incoming: dict[int, list[np.ndarray]] = {}
    if me in receivers:
        out, parts = _buffers(next(t for t in told if t is not None))
        incoming = _split(parts, receivers[me])
    else:
        parts = _views(arrays, manifest)
        for r, senders in receivers.items():
            if me in senders:
                outgoing[r] = _split(parts, senders)[me]
    _transfer(world, outgoing, incoming, "a rank could not finish its part of copying a shard from its twins")
    if out is not None:
        world.events.emit("twin_copied", senders=list(receivers[me]), bytes=sum(p.nbytes for p in parts))
    return out


def _manifest(arrays: Mapping[str, np.ndarray]) -> list[list[Any]]:
    """What a receiver needs to make room for ``arrays``: name, dtype and shape, by name."""
    return [[name, a.dtype.str, list(a.shape)] for name, a in sorted(arrays.items())]


def _buffers(manifest: list[list[Any]]) -> tuple[dict[str, np.ndarray], list[np.ndarray]]:
    """A receiver's new arrays for ``manifest``, and their bytes in its order (views)."""
    out = {name: np.empty(tuple(shape), np.dtype(dtype)) for name, dtype, shape in manifest}
    return out, [out[name].reshape(-1).view(np.uint8) for name, _, _ in manifest]


def _views(arrays: Mapping[str, np.ndarray], manifest: list[list[Any]]) -> list[np.ndarray]:
    """A sender's bytes of ``arrays`` in ``manifest``'s order (views where contiguous)."""
    return [np.ascontiguousarray(arrays[name]).reshape(-1).view(np.uint8) for name, _, _ in manifest]


def _split(parts: list[np.ndarray], senders: Sequence[int]) -> dict[int, list[np.ndarray]]:
    """Each sender's equal part of the bytes ``parts`` make up (views)."""
    total = sum(p.nbytes for p in parts)
    bounds = [total * i // len(senders) for i in range(len(senders) + 1)]
    return {s: byte_slices(parts, bounds[i], bounds[i + 1] - bounds[i]) for i, s in enumerate(senders)}


def _transfer(world: Group, outgoing: Mapping[int, list[np.ndarray]], incoming: Mapping[int, list[np.ndarray]],
              why: str) -> None:
    """The exchange, then a vote: done on every rank, or ``ProcessFailure`` on every rank."""
    try:
        world.exchange(outgoing, incoming, point="restore")
        ok = True
    except ProcessFailure:
        ok = False
    world.vote(ok, why)


def byte_slices(segments: list[np.ndarray], start: int, size: int) -> list[np.ndarray]:
    """The parts of the byte arrays ``segments`` that make up bytes [start, start + size) of their
    concatenation (views, no copy)."""
    out, offset = [], 0
    for seg in segments:
        lo, hi = max(start, offset), min(start + size, offset + seg.nbytes)
        if lo < hi:
            out.append(seg[lo - offset:hi - offset])
        offset += seg.nbytes
        if offset >= start + size:
            break
    return out

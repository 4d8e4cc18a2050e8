"""Where a commit's copies go and where they land: the active ranks' failure domains, what each
holder is told to expect, and the one buffer the copies arrive in.

``layout_of`` places the active ranks in their failure domains (the store's ``domains``, else the
job's, else the hosts: one all-gather of host names), once per generation. A committing rank
tells each holder which of its pieces it gets (``announce``: one all-to-all of O(pieces) per
peer, skipped while every payload keeps its size), and each holder lays the copies it is told of
out in one buffer, a view per piece (``receive``, local). The exchange itself is the store's.
"""
from __future__ import annotations

import socket
from typing import Any, Callable, Mapping, Sequence

import numpy as np
from elastic.comm import Group, LogicalRank

from ._placement import Layout, Piece
from ._versions import Held


def layout_of(world: Group, domains: Mapping[int, str] | None) -> Layout:
    """The failure domains of the active ranks (collective when they come from the hosts)."""
    ranks = [int(r) for r in world.logical_ranks]
    if domains is not None:
        domain_of = {r: domains[r] for r in ranks}
    elif world.job.settings.domains:
        names = world.job.settings.domains
        domain_of = {r: names[r % len(names)] for r in ranks}
    else:
        domain_of = dict(zip(ranks, world.allgather(socket.gethostname())))
    return Layout.of(domain_of)


def announce(world: Group, mine: list[Piece], ranks: Sequence[LogicalRank], replicated: int) -> list[Any]:
    """What each holder gets from every rank (collective): this rank's pieces, each with its
    payload's replicated size, to their holders; what every rank sends this one, by current rank."""
    current = {int(r): i for i, r in enumerate(ranks)}
    notes: dict[int, list[tuple[int, int, int, int]]] = {}
    for p in mine:
        notes.setdefault(current[p.holder], []).append((p.copy, p.first, p.count, replicated))
    return world.alltoall(notes)


def receive(told: list[Any], ranks: Sequence[LogicalRank], me: int, chunk_bytes: int,
            buffer_of: Callable[[int], np.ndarray]
            ) -> tuple[np.ndarray, dict[tuple[int, int, int], Held], dict[int, list[np.ndarray]], dict[int, int]]:
    """Where the copies ``told`` of arrive (local): one buffer of ``buffer_of(nbytes)``, a view of it
    per piece in current-rank order; those views by sender, to receive into; and the size of each
    payload this rank holds pieces of (its own: the caller's)."""
    spans = [(int(ranks[r]), copy, first, count, size, min(size, (first + count) * chunk_bytes) - first * chunk_bytes)
             for r, got in enumerate(told) for copy, first, count, size in got or []]
    buffer = buffer_of(sum(span[-1] for span in spans))
    held: dict[tuple[int, int, int], Held] = {}
    incoming: dict[int, list[np.ndarray]] = {}
    sizes, offset = {}, 0
    for owner, copy, first, count, size, nbytes in spans:
        data = buffer[offset:offset + nbytes]
        held[(owner, copy, first)] = Held(Piece(owner, copy, first, count, me), data, [], offset)
        offset += nbytes
        incoming.setdefault(owner, []).append(data)
        sizes[owner] = size
    return buffer, held, incoming, sizes

"""A recovery's fetch: which dead ranks' payloads come back, to whom, from which holders, and the
one exchange that moves them.

``plan_fetch`` is pure: from what every active rank said it holds (an ``Offer`` each, gathered
once) and the version's layout it derives the dead owners (no live rank holds their payload
whole), the holders whose copies are all there, and each dead owner's receiver (a replacement
takes its own logical rank's; after a shrink a survivor adopts a removed one's), the same on
every rank, O(ranks). ``choose`` picks a holder for every piece (``_placement.plan``), each
holder checking what it is to send against its checksums first, a corrupted piece planned again
from another one; ``transfer`` moves the pieces in one exchange straight into the receivers'
payloads, then a vote. Both are collective, as ``_share`` is.
"""
from __future__ import annotations

import dataclasses
import time
from typing import Callable, Mapping, Sequence

import numpy as np
from elastic.comm import Group, ProcessFailure, agreed

from ._placement import DataLost, Layout, Piece, plan

# Who takes a removed rank's state after a shrink: removed -> survivor, or a function of (removed, survivors).
Adopt = Mapping[int, int] | Callable[[list[int], list[int]], Mapping[int, int]]
# What one active rank holds, as it tells the others: (the version, every copy the layout gives it
# of that version is here, the owners whose whole payload is here).
Offer = tuple[int | None, bool, Sequence[int]]


@dataclasses.dataclass(frozen=True)
class Fetch:
    """What a recovery brings back (the same on every rank)."""

    version: int
    dead: tuple[int, ...]         # owners of the version whose payload no live rank holds whole
    live: frozenset[int]          # the ranks whose copies of the version are all there
    receiver: Mapping[int, int]   # dead owner -> the logical rank that takes its payload


def newest(offers: Sequence[Offer]) -> tuple[int, int] | None:
    """The newest version any rank holds, and the current rank of the first that holds it (to
    broadcast its layout from); None when none holds any."""
    numbers = [offer[0] for offer in offers if offer[0] is not None]
    if not numbers:
        return None
    number = max(numbers)
    return number, next(i for i, offer in enumerate(offers) if offer[0] == number)


def plan_fetch(layout: Layout, active: Sequence[int], offers: Sequence[Offer], version: int,
               adopt: Adopt | None = None) -> Fetch:
    """The fetch of ``version`` over ``layout`` (pure; ``offers`` by current rank of ``active``).
    ``adopt``: who takes each removed rank's payload, a mapping or a function of (removed,
    survivors); by default round-robin over the survivors that hold the version."""
    whole = {o: r for r, offer in zip(active, offers) if offer[0] == version for o in offer[2]}
    live = frozenset(r for r, offer in zip(active, offers) if offer[0] == version and offer[1])
    dead = tuple(o for o in layout.ranks if o not in whole)
    here = set(active)
    survivors = sorted(here & set(whole.values()))
    removed = [o for o in dead if o not in here]
    if adopt is None:
        adopt = {o: survivors[i % len(survivors)] for i, o in enumerate(removed)}
    elif callable(adopt):
        adopt = adopt(removed, survivors)
    return Fetch(version, dead, live, {o: (o if o in here else int(adopt[o])) for o in dead})


def choose(world: Group, layout: Layout, fetch: Fetch, nbytes: Mapping[int, int], chunk_bytes: int,
           replication: int, intact: Callable[[Piece], bool], give_up: bool = False
           ) -> tuple[dict[tuple[int, int], Piece], list[int], float]:
    """A live holder for every piece of the dead owners, each checked by its holder (collective):
    the pieces, the owners given up (``give_up``: those with no live copy, instead of ``DataLost``),
    and the seconds this rank spent checking. ``nbytes``: the dead owners' payload sizes that
    some live rank knows; one no live rank knows had every holder die with it."""
    me = int(world.logical_rank)
    unknown: dict[int, list[int]] = {o: [] for o in fetch.dead if o not in nbytes}
    n_chunks = {o: -(-nbytes[o] // chunk_bytes) for o in fetch.dead if o in nbytes}
    bad: set[tuple[int, int, int]] = set()
    given_up: list[int] = []
    checked = 0.0
    while True:
        try:
            chosen = plan(layout, list(n_chunks), n_chunks, replication, fetch.live, bad)
            if unknown:
                raise DataLost(unknown)
        except DataLost as exc:  # the same on every rank: everyone planned from the same agreed data
            lost = DataLost({**unknown, **exc.lost})
            world.events.emit("data_lost", lost=lost.lost, given_up=give_up)
            if not give_up:
                raise agreed(lost) from None
            given_up = sorted(set(given_up) | set(lost.lost))
            unknown = {}
            n_chunks = {o: n for o, n in n_chunks.items() if o not in lost.lost}
            continue
        t0 = time.perf_counter()
        corrupt = [(me, p.owner, p.first) for p in chosen.values() if p.holder == me and not intact(p)]
        checked += time.perf_counter() - t0
        for _, owner, first in corrupt:
            world.events.emit("corrupt_copy", owner=owner, chunk=first, holder=me)
        reports = world.allgather(corrupt)
        if not any(reports):
            return chosen, given_up, checked
        bad |= {(int(h), int(o), int(f)) for report in reports for h, o, f in report}


def transfer(world: Group, chosen: Mapping[tuple[int, int], Piece], receiver: Mapping[int, int],
             nbytes: Mapping[int, int], chunk_bytes: int, held: Callable[[Piece], np.ndarray]
             ) -> tuple[dict[int, np.ndarray], int, dict[str, float]]:
    """Move the ``chosen`` pieces from their holders (``held``: the bytes this rank keeps of a piece)
    into their owners' payloads at the receivers, in one exchange, then a vote (collective: done
    on every rank, or ``ProcessFailure`` on every rank). Returns the payloads this rank received,
    by owner, the bytes it sent, and the seconds of the exchange and of the vote."""
    me = int(world.logical_rank)
    out = {o: np.empty(nbytes[o], np.uint8) for o in {p.owner for p in chosen.values()} if receiver[o] == me}
    outgoing: dict[int, list[np.ndarray]] = {}
    incoming: dict[int, list[np.ndarray]] = {}
    for key in sorted(chosen):
        p = chosen[key]
        if p.holder == me:
            outgoing.setdefault(receiver[p.owner], []).append(held(p))
        if receiver[p.owner] == me:  # lands where it belongs in the payload: no second copy
            start = p.first * chunk_bytes
            size = min(nbytes[p.owner], (p.first + p.count) * chunk_bytes) - start
            incoming.setdefault(p.holder, []).append(out[p.owner][start:start + size])
    t0 = time.perf_counter()
    sent = 0
    try:
        sent = world.exchange(outgoing, incoming, point="restore")
        ok = True
    except ProcessFailure:
        ok = False
    t1 = time.perf_counter()
    world.vote(ok, "a rank could not finish its part of the transfer")
    world.events.emit("restored", chunks=sum(p.count for p in chosen.values() if receiver[p.owner] == me),
                      bytes_in=int(sum(b.nbytes for b in out.values())), bytes_out=sent)
    return out, sent, {"exchange": t1 - t0, "vote": time.perf_counter() - t1}

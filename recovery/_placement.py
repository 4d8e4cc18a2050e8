"""Where copies live and who sends what after a failure: arithmetic, no table (pure, no MPI).

An owner's committed state is one payload cut into chunks. For each extra copy
``k`` (1 .. replication-1) the chunks are cut into contiguous *ranges*, and
each range goes to one holder, so a holder receives one contiguous block per
owner and copy. Where a range of owner ``o`` goes is a function of ``o``'s place
in the ``Layout`` (its failure domain and its index there), ``k`` and the
range's number alone; a rank computes its own placement in O(its ranges),
never a table of everybody's chunks.

* With more failure domains than copies, copy ``k`` of range ``g`` goes to the
  other domain ``(g + k - 1) mod (D - 1)`` places after the owner's, to the
  member there at ``(index + (g + k - 1) // (D - 1)) mod size``: the copies of a
  chunk sit in distinct domains, and the ranges of one owner (and of a whole
  dead domain) are spread over every member of every other domain, so they
  come back from many senders.
* Otherwise (one host, or more copies than other domains) the copies beyond
  the domains go round the ring of ranks, skipping the ranks already chosen.

``plan`` picks a live holder for every range of the dead owners: with
replication 2 there is one (no choice to make); with more, a max-flow over the
affected ranges only (networkx) keeps the busiest sender as light as possible,
and above ``FLOW_LIMIT`` ranges a greedy least-loaded choice does (the flow
took 10-14 s for a dead host at 1,024-4,096 ranks, the greedy choice ~30 ms and
1.0-1.1x the fair share).
"""
from __future__ import annotations

import bisect
import dataclasses
import math
from typing import AbstractSet as Set, Iterable, Mapping, Sequence


from elastic.comm import Unrecoverable
from elastic.comm.wire import message

Chunk = tuple[int, int]  # (owner logical rank, chunk index)


class DataLost(Unrecoverable):
    """Every holder of some chunks is dead, so the job cannot go on; ``lost`` maps owner -> chunk
    indices (empty: every chunk, when no live rank even knows the state's size)."""

    def __init__(self, lost: Mapping[int, Sequence[int]], what: str | None = None,
                 parity: bool = False) -> None:
        self.lost = {o: sorted(c) for o, c in lost.items()}
        owners = ", ".join(f"logical rank {o}: {f'chunks {c}' if c else 'every chunk'}"
                           for o, c in sorted(self.lost.items()))
        if parity:  # a group lost more members than its parity survives
            super().__init__(f"state lost, more members of a parity group died than it survives ({what}); choose "
                             "rs:K+M with a larger M, copies:R, or spread ranks over more failure domains")
            return
        super().__init__(f"state lost, every replica died ({what or owners}); raise the replication level "
                         "or spread ranks over more failure domains")


@message
@dataclasses.dataclass(frozen=True)
class Layout:
    """The active ranks by failure domain (identical on every rank; built once per generation)."""

    ranks: tuple[int, ...]                   # sorted logical ranks
    domains: tuple[tuple[int, ...], ...]     # the members of each domain, sorted; domains by first member
    place: Mapping[int, tuple[int, int]]     # rank -> (domain, index in the domain)

    @classmethod
    def of(cls, domain_of: Mapping[int, str]) -> "Layout":
        by_name: dict[str, list[int]] = {}
        for rank in sorted(domain_of):
            by_name.setdefault(domain_of[rank], []).append(rank)
        domains = tuple(sorted((tuple(m) for m in by_name.values()), key=lambda m: m[0]))
        place = {r: (d, i) for d, members in enumerate(domains) for i, r in enumerate(members)}
        return cls(tuple(sorted(domain_of)), domains, place)


@dataclasses.dataclass(frozen=True)
class Piece:
    """Chunks ``[first, first + count)`` of ``owner``'s payload, held by ``holder`` as copy ``copy``."""

    owner: int
    copy: int
    first: int
    count: int
    holder: int


def ranges(n_chunks: int, layout: Layout, owner: int) -> list[tuple[int, int]]:
    """How ``owner``'s chunks are cut for every copy: (first, count) per range, in order."""
    d = layout.place[owner][0]
    others = len(layout.ranks) - (len(layout.domains[d]) if len(layout.domains) > 1 else 1)
    groups = min(n_chunks, max(others, 1))
    bounds = [g * n_chunks // groups for g in range(groups + 1)] if groups else [0]
    return [(bounds[g], bounds[g + 1] - bounds[g]) for g in range(groups)]


def holders(layout: Layout, owner: int, g: int, replication: int) -> list[int]:
    """The holders of copies 1 .. replication-1 of ``owner``'s range ``g``, in copy order (O(replication))."""
    d, i = layout.place[owner]
    n, dn = len(layout.ranks), len(layout.domains)
    copies = min(replication, n) - 1
    chosen = [owner]
    for k in range(1, copies + 1):
        if k <= dn - 1:  # a distinct other domain for each copy, while there are domains left
            j = (d + 1 + (g + k - 1) % (dn - 1)) % dn
            members = layout.domains[j]
            chosen.append(members[(i + (g + k - 1) // (dn - 1)) % len(members)])
        else:  # the ring of ranks, skipping those already chosen (n - 1 candidates, fewer copies)
            pos = bisect.bisect_left(layout.ranks, owner)
            t = 0
            while True:
                candidate = layout.ranks[(pos + 1 + (g + k - 1 + t) % (n - 1)) % n]
                if candidate not in chosen:
                    break
                t += 1
            chosen.append(candidate)
    return chosen[1:]


def pieces(layout: Layout, owner: int, n_chunks: int, replication: int) -> list[Piece]:
    """Every copy of ``owner``'s chunks, as pieces (O(owner's ranges x replication))."""
    out = []
    for g, (first, count) in enumerate(ranges(n_chunks, layout, owner)):
        for k, holder in enumerate(holders(layout, owner, g, replication), start=1):
            out.append(Piece(owner, k, first, count, holder))
    return out


def plan(layout: Layout, dead: Iterable[int], n_chunks: Mapping[int, int], replication: int,
         live: Set[int], bad: Set[tuple[int, int, int]] = frozenset()) -> dict[tuple[int, int], Piece]:
    """A live holder for every range of the dead owners: (owner, first chunk) -> the piece to send.

    ``live``: ranks that hold their copies of the version; ``bad``: (holder, owner, first)
    copies found corrupt. With replication 2 each range has one live holder or none; with
    more, the affected ranges only go through a max-flow that minimises the busiest
    sender's load (in chunks).

    Raises:
        DataLost: some range has no live holder; names the chunks, the same on every rank.
    """
    options: dict[tuple[int, int], list[Piece]] = {}
    lost: dict[int, list[int]] = {}
    for owner in sorted(set(dead)):
        for g, (first, count) in enumerate(ranges(n_chunks[owner], layout, owner)):
            alive = [Piece(owner, k, first, count, h)
                     for k, h in enumerate(holders(layout, owner, g, replication), start=1)
                     if h in live and (h, owner, first) not in bad]
            if alive:
                options[(owner, first)] = alive
            else:
                lost.setdefault(owner, []).extend(range(first, first + count))
    if lost:
        raise DataLost(lost)
    if all(len(o) == 1 for o in options.values()):
        return {key: o[0] for key, o in options.items()}
    return _balance(options) if len(options) <= FLOW_LIMIT else _greedy(options)


FLOW_LIMIT = 512  # ranges: above this the max-flow costs seconds, and the greedy choice is within 2x of it


def _greedy(options: Mapping[tuple[int, int], list[Piece]]) -> dict[tuple[int, int], Piece]:
    """Each range to its least loaded live holder so far, the largest ranges first (deterministic)."""
    load: dict[int, int] = {}
    chosen = {}
    for key in sorted(options, key=lambda k: (-options[k][0].count, k)):
        piece = min(options[key], key=lambda p: (load.get(p.holder, 0), p.copy, p.holder))
        chosen[key] = piece
        load[piece.holder] = load.get(piece.holder, 0) + piece.count
    return chosen


def _balance(options: Mapping[tuple[int, int], list[Piece]]) -> dict[tuple[int, int], Piece]:
    """The senders that minimise the largest load (chunks), by max-flow and a binary search on the bound."""
    import networkx as nx  # here, not at import: only a recovery with a skewed plan needs it

    senders = sorted({p.holder for o in options.values() for p in o})
    total = sum(o[0].count for o in options.values())
    low, high = max(1, math.ceil(total / len(senders))), total
    best = None
    while low <= high:
        bound = (low + high) // 2
        graph = nx.DiGraph()
        for key, alive in options.items():
            graph.add_edge("src", key, capacity=alive[0].count)
            for p in alive:
                graph.add_edge(key, ("rank", p.holder), capacity=p.count)
        for h in senders:
            graph.add_edge(("rank", h), "sink", capacity=bound)
        value, flow = nx.maximum_flow(graph, "src", "sink")
        if value < total:
            low = bound + 1
            continue
        # A range goes whole to the holder that carries most of it in the flow.
        best = {key: max(alive, key=lambda p: (flow[key][("rank", p.holder)], -p.holder))
                for key, alive in options.items()}
        high = bound - 1
    assert best is not None  # bound == total always fits
    return best


# ------------------------------------------------------------------ per-chunk views (tests, tools)
def place_replicas(ranks: Sequence[int], domains: Mapping[int, str], replication: int,
                   chunks: Mapping[int, int]) -> dict[Chunk, tuple[int, ...]]:
    """Holders of every chunk, the owner first: the per-chunk view of ``pieces`` (deterministic)."""
    if replication < 1:
        raise ValueError(f"replication={replication}: must be at least 1")
    layout = Layout.of({r: domains[r] for r in ranks})
    placement: dict[Chunk, tuple[int, ...]] = {}
    for owner in layout.ranks:
        for g, (first, count) in enumerate(ranges(chunks.get(owner, 0), layout, owner)):
            held = (owner, *holders(layout, owner, g, replication))
            for c in range(first, first + count):
                placement[(owner, c)] = held
    return placement


def plan_transfers(placement: Mapping[Chunk, tuple[int, ...]], dead: set[int]) -> dict[Chunk, int]:
    """A live sender for every chunk of a dead owner, minimising the largest sender's load (unit chunks).

    Raises:
        DataLost: some chunk has no live holder; names them all.
    """
    wanted = {chunk: [h for h in held if h not in dead] for chunk, held in placement.items() if chunk[0] in dead}
    lost: dict[int, list[int]] = {}
    for (owner, c), alive in wanted.items():
        if not alive:
            lost.setdefault(owner, []).append(c)
    if lost:
        raise DataLost(lost)
    if not wanted:
        return {}
    options = {chunk: [Piece(chunk[0], k, chunk[1], 1, h) for k, h in enumerate(alive)]
               for chunk, alive in wanted.items()}
    if all(len(o) == 1 for o in options.values()):
        return {chunk: o[0].holder for chunk, o in options.items()}
    return {chunk: p.holder for chunk, p in _balance(options).items()}

"""Where replicas live and who sends what after a failure (pure functions, no MPI).

State is cut into chunks. Chunk ``c`` of owner ``o`` is held by the owner and by
``replication - 1`` other ranks, in distinct failure domains where the job has
enough of them. The walk that picks those ranks starts at an offset that turns
with ``c``, so one owner's chunks are spread over many holders and, after that
owner dies, many survivors share the work of sending them back (ReStore's idea).
"""
from __future__ import annotations

import math
from typing import Mapping, Sequence

import networkx as nx

from elastic.comm import Unrecoverable

Chunk = tuple[int, int]  # (owner logical rank, chunk index)


class DataLost(Unrecoverable):
    """Every holder of some chunks is dead, so the job cannot go on; ``lost`` maps owner -> chunk indices."""

    def __init__(self, lost: Mapping[int, Sequence[int]]) -> None:
        self.lost = {o: sorted(c) for o, c in lost.items()}
        owners = ", ".join(f"logical rank {o}: chunks {c}" for o, c in sorted(self.lost.items()))
        super().__init__(f"state lost, every replica died ({owners}); raise the replication level "
                         "or spread ranks over more failure domains")


def place_replicas(ranks: Sequence[int], domains: Mapping[int, str], replication: int,
                   chunks: Mapping[int, int]) -> dict[Chunk, tuple[int, ...]]:
    """Holders of every chunk, the owner first (deterministic: every rank computes the same).

    Args:
        ranks: the logical ranks taking part.
        domains: failure domain (e.g. host) of each rank.
        replication: copies of each chunk, owner's included (clipped to the number of ranks).
        chunks: how many chunks each owner has.
    """
    if replication < 1:
        raise ValueError(f"replication={replication}: must be at least 1")
    ring = sorted(ranks)
    n = len(ring)
    copies = min(replication, n)
    placement: dict[Chunk, tuple[int, ...]] = {}
    for i, owner in enumerate(ring):
        for c in range(chunks.get(owner, 0)):
            holders = [owner]
            used = {domains[owner]}
            start = 1 + (c % max(n - 1, 1))  # turn with the chunk index to spread the copies
            others = [ring[(i + start + k) % n] for k in range(n)]
            others = [r for r in others if r != owner]
            for prefer_new_domain in (True, False):
                for r in others:
                    if len(holders) == copies:
                        break
                    if r not in holders and (domains[r] not in used or not prefer_new_domain):
                        holders.append(r)
                        used.add(domains[r])
            placement[(owner, c)] = tuple(holders)
    return placement


def plan_transfers(placement: Mapping[Chunk, tuple[int, ...]], dead: set[int]) -> dict[Chunk, int]:
    """Pick a live sender for every chunk of a dead owner, minimising the largest sender's load.

    Chunks are equal units, so a max-flow per candidate bound (networkx) with a
    binary search on that bound gives the optimal balance.

    Raises:
        DataLost: some chunk has no live holder; names them all.
    """
    wanted = {chunk: [h for h in holders if h not in dead] for chunk, holders in placement.items()
              if chunk[0] in dead}
    lost: dict[int, list[int]] = {}
    for (owner, c), live in wanted.items():
        if not live:
            lost.setdefault(owner, []).append(c)
    if lost:
        raise DataLost(lost)
    if not wanted:
        return {}
    senders = sorted({h for live in wanted.values() for h in live})
    low, high = math.ceil(len(wanted) / len(senders)), len(wanted)
    best = None
    while low <= high:
        bound = (low + high) // 2
        flow = _assign(wanted, senders, bound)
        if flow is None:
            low = bound + 1
        else:
            best, high = flow, bound - 1
    assert best is not None  # bound == len(wanted) always fits
    return best


def _assign(wanted: Mapping[Chunk, list[int]], senders: list[int], bound: int) -> dict[Chunk, int] | None:
    graph = nx.DiGraph()
    for chunk, live in wanted.items():
        graph.add_edge("src", ("chunk", chunk), capacity=1)
        for h in live:
            graph.add_edge(("chunk", chunk), ("rank", h), capacity=1)
    for h in senders:
        graph.add_edge(("rank", h), "sink", capacity=bound)
    value, flow = nx.maximum_flow(graph, "src", "sink")
    if value < len(wanted):
        return None
    return {chunk: next(h for h in live if flow[("chunk", chunk)][("rank", h)] > 0)
            for chunk, live in wanted.items()}

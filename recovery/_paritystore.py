"""The store with parity instead of copies: ``xor:K`` and ``rs:K+M`` groups, a fraction of the memory.

``ParityStore`` is a ``ReplicatedStore`` whose commit encodes where the other copies: phase one
computes, in each parity group (``_parity.group_of``: one member per failure domain where the
domains allow), every member's parity blocks of the group's replicated payloads, in K-M rounds of
one exchange each (round t: every member sends its segment t to the holders of that segment's
codeword, straight from its arrays; each holder adds it into its blocks: the XOR, or its GF(2^8)
multiple), so that no rank ever stages more than its own parity's size; then the same vote, the
roll-back copy and the same chain of versions. A failure anywhere in a commit leaves the last
agreed version (its payloads and parity) on every survivor.

Recovery: a dead member's payload is decoded from its group's survivors (their payloads' segments
and parity, each parity checked by its checksum before it is sent) at its receiver, the
replacement or, after a shrink, the adopter (``plan_fetch`` says who, as for copies). A group
that lost more members than it survives (or whose survivors lost their parity in a recovery
since its last commit) is ``DataLost`` on every rank, naming the group. Parity is kept in process
memory only: the node-memory tier (a relaunch from node memory) needs copies.
"""
from __future__ import annotations

import dataclasses
import time
from typing import Mapping, Sequence

import numpy as np
from elastic.comm import ConfigError, Group, ProcessFailure, agreed

from ._copies import layout_of
from ._fetch import Adopt, Fetch, newest, plan_fetch
from ._parity import Code, Redundancy, _accumulate, coefficients, group_of
from ._payload import Payload
from ._placement import DataLost, Layout
from ._share import byte_slices
from ._store import ReplicatedStore, _Sent


@dataclasses.dataclass
class ParityHeld:
    """This member's parity of one version: its group, the code, its M blocks and their checksums."""

    group: tuple[int, ...]   # logical ranks, in code order
    code: Code
    blocks: np.ndarray       # (M, segment) uint8, in ``code.parity_of`` order
    sums: list[int]
    sizes: dict[int, int]    # each member's replicated bytes


def group_and_code(layout: Layout, rank: int, redundancy: Redundancy, sizes: Mapping[int, int] | None = None
                   ) -> tuple[tuple[int, ...], int]:
    """``rank``'s group and the losses it survives (fewer than asked where the group is too small:
    a group of one has no parity)."""
    group = group_of(layout, rank, redundancy.k)
    return group, min(redundancy.m, len(group) - 1)


def rounds(layout: Layout, redundancy: Redundancy) -> int:
    """The commit's exchanges: the most data blocks of a codeword in any group (every group's
    length is one of two, ``group_of``'s balanced runs)."""
    n = len(layout.ranks)
    runs = max(1, n // redundancy.k)
    lengths = {n // runs, -(-n // runs)}
    return max(length - min(redundancy.m, length - 1) if length > 1 else 0 for length in lengths)


@dataclasses.dataclass(frozen=True)
class Decode:
    """One group's part of a recovery (the same on every rank)."""

    group: tuple[int, ...]
    m: int
    lost: tuple[int, ...]        # members whose segments are rebuilt (dead, or without parity)
    dead: tuple[int, ...]        # of them, the ones whose payload comes back
    receiver: Mapping[int, int]  # dead member -> the rank that decodes it (each receives every survivor's blocks)

    @property
    def receivers(self) -> list[int]:
        return sorted(set(self.receiver.values()))


def plan_decodes(layout: Layout, fetch: Fetch, redundancy: Redundancy, no_parity: frozenset[int]
                 ) -> tuple[list[Decode], dict[tuple[int, ...], tuple[int, ...]]]:
    """Each group with a dead member: who decodes it; and the groups that cannot be decoded, with
    their lost members (pure). ``no_parity``: live ranks holding no parity of the version (a
    replacement since its last commit, a corrupt block)."""
    decodes, lost_groups = [], {}
    seen: set[tuple[int, ...]] = set()
    for owner in fetch.dead:
        group, m = group_and_code(layout, owner, redundancy)
        if group in seen:
            continue
        seen.add(group)
        dead = tuple(g for g in group if g in fetch.dead)
        lost = tuple(g for g in group if g in fetch.dead or g in no_parity)
        if len(lost) > m:
            lost_groups[group] = dead
            continue
        decodes.append(Decode(group, m, lost, dead, {o: fetch.receiver[o] for o in dead}))
    return decodes, lost_groups


def _lost_group(group: tuple[int, ...], dead: tuple[int, ...], no_parity: frozenset[int],
                redundancy: Redundancy) -> str:
    without = sorted(set(group) & no_parity - set(dead))
    return (f"parity group {list(group)} ({redundancy}) lost logical ranks {list(dead)}"
            + (f", and {without} hold no parity of it (recovered since its last commit, or corrupt)" if without
               else ""))


def _pieces(payload: Payload) -> list[np.ndarray]:
    return payload if isinstance(payload, list) else [payload]


def _span(size: int, t: int, segment: int) -> int:
    """Bytes of segment ``t`` of a payload of ``size`` bytes (the rest of the block is zeros)."""
    return max(0, min(segment, size - t * segment))


class ParityStore(ReplicatedStore):
    """Keeps every active rank's state recoverable by parity over groups of its peers
    (``redundancy``: ``xor:K`` or ``rs:K+M``). Create on every active rank."""

    def __init__(self, world: Group, redundancy: Redundancy, chunk_bytes: int = 1 << 20,
                 domains: Mapping[int, str] | None = None, rollback_copy: bool = True) -> None:
        if not redundancy.parity:
            raise ConfigError(f"ParityStore needs xor:K or rs:K+M, not {redundancy}: use ReplicatedStore")
        if world.job.settings.node_store and not world.job.alone:
            raise ConfigError(f"redundancy {redundancy} keeps its parity in process memory: the node-memory tier "
                              "(--relaunches, ELASTIC_NODE_STORE) needs copies:R; choose copies:2 there")
        if not world.job.alone and world.size < redundancy.m + 1:
            raise ConfigError(f"redundancy {redundancy} with {world.size} active ranks: a group survives at most "
                              f"size - 1 losses; use rs:K+M with M < {world.size}, or more ranks")
        super().__init__(world, replication=1, chunk_bytes=chunk_bytes, domains=domains,
                         rollback_copy=rollback_copy)
        self.redundancy = redundancy
        self._staging = np.empty(0, np.uint8)  # where blocks wait to be added in (kept: already touched)

    # -------------------------------------------------------------- commit
    def _send_copies(self, segments: list[np.ndarray], total: int, replicated: int, version: int,
                     bad_input: str | None) -> _Sent:
        """Phase one: the version checked alike everywhere, then this rank's parity blocks of its
        group's payloads (collective; ``ProcessFailure`` when a rank died on the way)."""
        world = self.world
        me = int(world.logical_rank)
        self._check_together(version, bad_input)
        if self._layout is None or self._layout[0] != world.generation:
            self._layout = (world.generation, layout_of(world, self._domains))
        layout = self._layout[1]
        group, m = group_and_code(layout, me, self.redundancy)
        if m < self.redundancy.m and not self._said_reduced:
            self._said_reduced = True  # shrunk below the group's losses: fewer than asked for
            world.events.emit("replication_reduced", redundancy=str(self.redundancy), ranks=len(layout.ranks))
        ranks = world.logical_ranks
        current = {int(r): i for i, r in enumerate(ranks)}
        told = world.alltoall({current[g]: replicated for g in group if g != me})
        sizes = {me: replicated, **{int(ranks[i]): int(v) for i, v in enumerate(told) if v is not None}}
        t1 = time.perf_counter()
        parity = None
        if m == 0:  # alone, or a group of one: nothing to encode, but the rounds are collective
            for _ in range(rounds(layout, self.redundancy)):
                world.exchange({}, {}, point="commit", step=version)
            self.bytes_moved = 0
            flat = np.empty(0, np.uint8)
        else:
            code = Code(len(group), m, max(sizes.values()))
            blocks = self._encode(group, code, sizes, segments, replicated, layout, version)
            flat = blocks.reshape(-1)
        t2 = time.perf_counter()
        if m:
            parity = ParityHeld(group, code, blocks, self._sums.of(flat), sizes)
        return _Sent(layout, sizes, {}, flat, False, (t1, t2, time.perf_counter()), parity)

    def _encode(self, group: tuple[int, ...], code: Code, sizes: Mapping[int, int], segments: list[np.ndarray],
                replicated: int, layout: Layout, version: int) -> np.ndarray:
        world, me = self.world, int(self.world.logical_rank)
        i, k, m, seg = group.index(me), code.k, code.m, code.segment
        data = k - m
        flat = self._backing.receive_buffer(m * seg, version)  # the retired version's parity buffer
        blocks = flat.reshape(m, seg)
        if self._staging.nbytes < m * seg:
            self._staging = np.empty(m * seg, np.uint8)
        staging = self._staging[:m * seg].reshape(m, seg)
        mine = code.parity_of(i)
        rows = coefficients(data, m)
        self.bytes_moved = 0
        for t in range(rounds(layout, self.redundancy)):
            outgoing: dict[int, list[np.ndarray]] = {}
            incoming: dict[int, list[np.ndarray]] = {}
            landed: list[tuple[int, int, int]] = []  # (block, bytes, coefficient) to add in after the round
            if t < data:
                c = (i - t) % k  # the codeword this rank's segment t is data block t of
                part = byte_slices(segments, t * seg, _span(replicated, t, seg))
                for h in code.parity_members(c):
                    outgoing[group[h]] = list(part)
                for b, (cw, j) in enumerate(mine):
                    src = group[(cw + t) % k]
                    n = _span(sizes[src], t, seg)
                    into_place = t == 0 and rows[j][0] == 1  # the first block lands where it is added up
                    incoming[src] = [(blocks if into_place else staging)[b][:n]]
                    if into_place:
                        blocks[b][n:] = 0
                    else:
                        landed.append((b, n, rows[j][t]))
                        if t == 0:
                            blocks[b][:] = 0
            self.bytes_moved += world.exchange({o: a for o, a in outgoing.items() if a},
                                               {o: a for o, a in incoming.items() if a[0].nbytes},
                                               point="commit", step=version)
            for b, n, coefficient in landed:
                _accumulate(blocks[b][:n], coefficient, staging[b][:n])
        return blocks

    # -------------------------------------------------------------- recovery
    def recover(self, adopt: Adopt | None = None, give_up: bool = False) -> bool:
        """As ``ReplicatedStore.recover``, the dead ranks' payloads decoded from their groups."""
        self._sums.settle()
        world = self.world
        self._chain.only(self._chain.current)
        active = [int(r) for r in world.logical_ranks]
        offers = world.allgather(self._status())
        found = newest(offers)
        if found is None and world.job.committed:
            lost = DataLost({r: [] for r in active})
            world.events.emit("data_lost", lost=lost.lost)
            raise agreed(lost)
        if found is None:
            return False
        number, root = found
        current = self._chain.current
        layout: Layout = world.bcast(current.layout if world.rank == root and current else None, root=root)
        fetch = plan_fetch(layout, active, offers, number, adopt)
        no_parity = frozenset(r for r, offer in zip(active, offers) if offer[0] != number or not offer[1])
        t0 = time.perf_counter()
        checked = 0.0
        while True:
            decodes, lost_groups = plan_decodes(layout, fetch, self.redundancy, no_parity)
            self.given_up = sorted(o for dead in lost_groups.values() for o in dead)
            if lost_groups:
                what = "; ".join(_lost_group(g, d, no_parity, self.redundancy) for g, d in lost_groups.items())
                lost = DataLost({o: [] for o in self.given_up}, what=what, parity=True)
                world.events.emit("data_lost", lost=lost.lost, given_up=give_up, groups=[list(g) for g in lost_groups])
                if not give_up:
                    raise agreed(lost)
            t1 = time.perf_counter()
            sending = current is not None and current.parity is not None and \
                any(int(world.logical_rank) in d.group and int(world.logical_rank) not in d.lost for d in decodes)
            corrupt = sending and not self._parity_intact()
            checked += time.perf_counter() - t1
            if corrupt:
                me = int(world.logical_rank)
                world.events.emit("corrupt_copy", owner=me, chunk=0, holder=me, parity=True)
            reports = world.allgather(corrupt)
            bad = {r for r, was in zip(active, reports) if was}
            if not bad:
                break
            no_parity |= bad
        sizes = self._sizes(world, decodes)
        fetched, phases = self._decode(world, decodes, sizes)
        self.last_recovery = {"fetch": time.perf_counter() - t0, "check": checked, **phases}
        self._keep_fetched(number, layout, {o: sizes[o] for o in fetched}, fetched)
        came_back = {o: "parity" for d in decodes for o in d.dead}
        world.events.emit("store_recovered", version=number, dead=list(fetch.dead), receivers=fetch.receiver,
                          bytes_moved=self.bytes_moved, durations=self.last_recovery, replicated=not fetch.dead,
                          given_up=self.given_up, came_back=came_back)
        return True

    def _parity_intact(self) -> bool:
        current = self._chain.current
        assert current is not None and current.parity is not None
        return bool(self._sums.of(current.parity.blocks.reshape(-1)) == current.parity.sums)

    def _sizes(self, world: Group, decodes: Sequence[Decode]) -> dict[int, int]:
        """Every affected group member's replicated bytes (collective: the survivors of each group
        know them all; a replacement none)."""
        members = {g for d in decodes for g in d.group}
        current = self._chain.current
        known = current.parity.sizes if current is not None and current.parity is not None else {}
        parts = world.allgather({o: n for o, n in known.items() if o in members})
        return {int(o): int(n) for part in parts for o, n in part.items()}

    def _decode(self, world: Group, decodes: Sequence[Decode], sizes: Mapping[int, int]
                ) -> tuple[dict[int, np.ndarray], dict[str, float]]:
        """Survivors send their segments and parity to each receiver of their group's dead; each
        receiver decodes the group (collective, one exchange and a vote)."""
        me = int(world.logical_rank)
        current = self._chain.current
        outgoing: dict[int, list[np.ndarray]] = {}
        incoming: dict[int, list[np.ndarray]] = {}
        work = []
        for d in decodes:
            code = Code(len(d.group), d.m, max(sizes[g] for g in d.group))
            survivors = [g for g in d.group if g not in d.lost]
            if me in survivors:
                assert current is not None and current.parity is not None
                part = byte_slices(_pieces(current.payloads[me]), 0, sizes[me]) + [current.parity.blocks.reshape(-1)]
                for r in d.receivers:
                    if r != me:
                        outgoing.setdefault(r, []).extend(part)
            if me in d.receivers:
                segs = {g: np.zeros((code.k - code.m, code.segment), np.uint8) for g in survivors}
                par = {g: np.empty((code.m, code.segment), np.uint8) for g in survivors}
                for g in survivors:
                    if g == me:
                        assert current is not None and current.parity is not None
                        segs[g].reshape(-1)[:sizes[g]] = np.concatenate(
                            [a.reshape(-1).view(np.uint8) for a in byte_slices(_pieces(current.payloads[me]), 0,
                                                                               sizes[me])])
                        par[g][:] = current.parity.blocks
                    else:
                        incoming.setdefault(g, []).extend([segs[g].reshape(-1)[:sizes[g]], par[g].reshape(-1)])
                work.append((d, code, segs, par))
        t0 = time.perf_counter()
        sent = 0
        try:
            sent = world.exchange(outgoing, incoming, point="restore")
            ok = True
        except ProcessFailure:
            ok = False
        t1 = time.perf_counter()
        world.vote(ok, "a rank could not finish its part of the transfer")
        t2 = time.perf_counter()
        out: dict[int, np.ndarray] = {}
        for d, code, segs, par in work:
            rebuilt = code.rebuild([d.group.index(g) for g in d.lost],
                                   {d.group.index(g): s for g, s in segs.items()},
                                   {d.group.index(g): p for g, p in par.items()})
            for g in d.dead:
                if d.receiver[g] == me:
                    out[g] = rebuilt[d.group.index(g)].reshape(-1)[:sizes[g]].copy()
        self.bytes_moved = sent
        world.events.emit("restored", chunks=len(out), bytes_in=int(sum(b.nbytes for b in out.values())),
                          bytes_out=sent)
        return out, {"exchange": t1 - t0, "vote": t2 - t1, "decode": time.perf_counter() - t2}

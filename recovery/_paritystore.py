"""The store with parity instead of copies: ``xor:K`` and ``rs:K+M`` groups, a fraction of the memory.

``ParityStore`` is a ``ReplicatedStore`` whose commit encodes where the other copies: phase one
computes, in each parity group (``_parity.group_of``: one member per failure domain where the
domains allow), every member's parity blocks of the group's replicated payloads, in at most 8
exchanges (each carries one piece of every member's segments, straight from its arrays, to that
segment's codeword's parity holders, who add it in: the XOR, or its GF(2^8) multiple), so that a
holder stages a quarter of its parity's size at most. The exchanges are point to point within
the group (every member knows the plan: no counts exchanged, no wait for the other groups), and
a holder XORs all of a piece's staged blocks into its parity in one pass (``xor_into``); then
the same vote, the roll-back copy and the same chain of versions. A failure anywhere in a
commit leaves the last agreed version (its payloads and parity) on every survivor.

Recovery: a dead member's payload is summed, piece by piece, at its receiver (the replacement
or, after a shrink, the adopter: ``plan_fetch`` says who, as for copies) from the blocks of its
group's survivors that determine it (``Code.terms``), each parity checked by its checksum
first. A group that lost more members than it survives, counting those without parity (removed
or recovered since its last commit), is ``DataLost`` on every rank, naming the group.

Tier 2 (``Config.node_store``): the parity blocks and the roll-back payload lie in node-memory
files, sealed with a manifest naming the group and the code before the vote, as copies are; a
relaunch after a node's loss attaches them on the surviving nodes and decodes the lost node's
ranks into their replacements (or adopters) as above. Groups span failure domains (the nodes),
so a lost node costs each group one member.
"""
from __future__ import annotations

import dataclasses
import time
from typing import Any, Mapping, Sequence

import numpy as np
from elastic.comm import ConfigError, Group, ProcessFailure, agreed

from ._backing import Recoverable, attached_copies, manifest
from ._copies import layout_of
from ._fetch import Fetch, Offer
from ._parity import ALIGN, Code, Redundancy, _accumulate, aligned_empty, group_of, xor_into
from ._payload import Payload
from ._placement import DataLost, Layout, Piece
from ._share import byte_slices
from ._store import ReplicatedStore, _Sent
from ._sums import INLINE_BYTES
from ._versions import Held, Version


@dataclasses.dataclass
class ParityHeld:
    """This member's parity of one version: its group, the code, its M blocks, the members' sizes."""

    group: tuple[int, ...]   # logical ranks, in code order
    code: Code
    blocks: np.ndarray       # (M, segment) uint8, in ``code.parity_of`` order (checksums: ``PARITY``'s held)
    sizes: dict[int, int]    # each member's replicated bytes


# The least a commit's exchange moves of each segment: more exchanges of less cost their latency
# (each waits for the group's slowest member) and save little of the staging they bound.
PIECE_BYTES = 1 << 20
PARITY = (-1, 0, 0)  # the version's ``held`` key of this member's parity blocks (their checksums)


def group_and_code(layout: Layout, rank: int, redundancy: Redundancy) -> tuple[tuple[int, ...], int]:
    """``rank``'s group and the losses it survives (fewer than asked where the group is too small:
    a group of one has no parity)."""
    group = group_of(layout, rank, redundancy.k)
    return group, min(redundancy.m, len(group) - 1)


@dataclasses.dataclass(frozen=True)
class Decode:
    """One group's part of a recovery (the same on every rank)."""

    group: tuple[int, ...]
    m: int
    lost: tuple[int, ...]        # members whose segments are rebuilt (dead, or without parity)
    dead: tuple[int, ...]        # of them, the ones whose payload comes back
    receiver: Mapping[int, int]  # dead member -> the rank its payload is summed at


def plan_decodes(layout: Layout, fetch: Fetch, redundancy: Redundancy, no_parity: frozenset[int]
                 ) -> tuple[list[Decode], dict[tuple[int, ...], tuple[int, ...]]]:
    """Each group with a dead member: who decodes it; and the groups that cannot be decoded, with
    their lost members (pure). ``no_parity``: the version's members whose parity is not on a live
    rank (dead, removed by a shrink, a replacement since the last commit, a corrupt block)."""
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


def parity_recoverable(redundancy: Redundancy) -> Recoverable:
    """Parity: every group with a dead member has at most M members dead or without parity (pure)."""
    def recoverable(layout: Layout, dead: list[int], live: set[int], sizes: Mapping[int, int]) -> bool:
        fetch = Fetch(0, tuple(dead), frozenset(live), {o: o for o in dead})
        return not plan_decodes(layout, fetch, redundancy, frozenset(set(layout.ranks) - live))[1]
    return recoverable


def _lost_group(group: tuple[int, ...], dead: tuple[int, ...], no_parity: frozenset[int],
                redundancy: Redundancy) -> str:
    without = sorted(set(group) & no_parity - set(dead))
    return (f"parity group {list(group)} ({redundancy}) lost logical ranks {list(dead)}"
            + (f", and {without} hold no parity of it (removed or recovered since its last commit, or corrupt)"
               if without else ""))


def decode_sums(decodes: Sequence[Decode], sizes: Mapping[int, int]
                ) -> list[tuple[int, int, int, int, list[tuple[int, str, int, int, int]]]]:
    """Every lost segment of a dead member and what it is the sum of, in one order on every rank
    (pure): (receiver, dead member, its segment, the group's segment bytes, [(holder, ``"data"`` or
    ``"parity"``, the holder's segment or parity block, coefficient, the holder's payload bytes)])."""
    out = []
    for d in decodes:
        code = Code(len(d.group), d.m, max(sizes[g] for g in d.group))
        lost = [d.group.index(g) for g in d.lost]
        for c in range(code.k):
            for t, known in code.terms(c, lost):
                owner, s = code.data_blocks(c)[t]
                x = d.group[owner]
                if x not in d.dead:
                    continue  # a live member without parity: its own payload is whole
                out.append((d.receiver[x], x, s, code.segment,
                            [(d.group[m], kind, index, coefficient, sizes[d.group[m]])
                             for kind, m, index, coefficient in known]))
    return out


@dataclasses.dataclass
class _Piece:
    """One exchange of a decode, as this rank takes part in it (pure): what it sends, what it
    receives (into a payload, or into its staging), which pieces of its payloads it zeroes, then
    what it adds where. A segment's first whole term of weight 1 from a peer lands in the payload
    itself: no zeroing, no staging and no pass to add it."""

    sends: list[tuple[int, str, int, int, int]]      # (receiver, kind, index, start, bytes)
    receives: list[tuple[int, int | None, int, int]]  # (holder, dead member or None: staging, offset, bytes)
    zeros: list[tuple[int, int, int]]                # (dead member, payload offset, bytes)
    adds: list[tuple[int, int, int, tuple[Any, ...]]]  # (dead member, payload offset, coefficient, source)
    staged: int = 0

    @classmethod
    def of(cls, sums: Sequence[tuple[int, int, int, int, list[tuple[int, str, int, int, int]]]],
           sizes: Mapping[int, int], me: int, q: int, pieces: int) -> "_Piece":
        plan = cls([], [], [], [])
        for receiver, x, s, seg, terms in sums:
            piece = 8 * -(-seg // (8 * pieces))
            lo, hi = min(seg, q * piece), min(seg, (q + 1) * piece)
            target = max(0, min(hi - lo, sizes[x] - s * seg - lo))  # beyond the payload's end: nothing
            starts = [index * seg + lo if kind == "data" else lo for _, kind, index, _, _ in terms]
            counts = [min(target, max(0, size - start) if kind == "data" else hi - lo)
                      for (_, kind, _, _, size), start in zip(terms, starts)]
            first = next((j for j, (holder, _, _, coefficient, _) in enumerate(terms)
                          if holder != me and coefficient == 1 and counts[j] == target), None)
            if receiver == me and target and first is None:
                plan.zeros.append((x, s * seg + lo, target))
            for j, (holder, kind, index, coefficient, _) in enumerate(terms):
                start, n = starts[j], counts[j]
                if not n or (holder != me and receiver != me):
                    continue
                if receiver != me:
                    plan.sends.append((receiver, kind, index, start, n))
                elif holder == me:
                    plan.adds.append((x, s * seg + lo, coefficient, ("local", kind, index, start, n)))
                elif j == first:
                    plan.receives.append((holder, x, s * seg + lo, n))
                else:
                    plan.receives.append((holder, None, plan.staged, n))
                    plan.adds.append((x, s * seg + lo, coefficient, ("staged", plan.staged, n)))
                    plan.staged += n
        return plan


def _arrays_of(payload: Payload) -> list[np.ndarray]:
    return payload if isinstance(payload, list) else [payload]


def _span(size: int, t: int, segment: int, length: int) -> int:
    """Bytes of a payload of ``size`` bytes in segment ``t``, ``length`` at most (the rest of the
    block is zeros)."""
    return max(0, min(length, size - t * segment))


class ParityStore(ReplicatedStore):
    """Keeps every active rank's state recoverable by parity over groups of its peers
    (``redundancy``: ``xor:K`` or ``rs:K+M``). Create on every active rank."""

    CAME_BACK = "parity"

    def __init__(self, world: Group, redundancy: Redundancy, chunk_bytes: int = 1 << 20,
                 domains: Mapping[int, str] | None = None, rollback_copy: bool = True) -> None:
        if not redundancy.parity:
            raise ConfigError(f"ParityStore needs xor:K or rs:K+M, not {redundancy}: use ReplicatedStore")
        if not world.job.alone and world.size < redundancy.m + 1:
            raise ConfigError(f"redundancy {redundancy} with {world.size} active ranks: a group survives at most "
                              f"size - 1 losses; use rs:K+M with M < {world.size}, or more ranks")
        super().__init__(world, replication=1, chunk_bytes=chunk_bytes, domains=domains,
                         rollback_copy=rollback_copy)
        self.redundancy = redundancy
        self._staging = np.empty(0, np.uint8)  # where blocks wait to be added in (kept: already touched)
        # Every rank's replicated bytes at the last commit, and for what (generation, own bytes): an
        # all-gather when one changes (O(ranks), then cached), none while every size stays.
        self._sizes: tuple[tuple[int, int], dict[int, int]] | None = None

    # -------------------------------------------------------------- commit
    def _send_copies(self, segments: list[np.ndarray], total: int, replicated: int, version: int,
                     bad_input: str | None) -> _Sent:
        """Phase one: the version checked alike everywhere, then this rank's parity blocks of its
        group's payloads (collective; ``ProcessFailure`` when a rank died on the way)."""
        world = self.world
        me = int(world.logical_rank)
        # Steady (every payload the size it had at the last commit of this generation): every rank
        # knows every size already, and the version check needs no more than the agreement.
        shape = (world.generation, replicated)
        known = self._sizes is not None and self._sizes[0] == shape
        steady = world.agree_equal(version, ok=bad_input is None and known)
        if not steady:  # the first commit of a generation, a size changed, or a refusal: said in full
            self._check_together(version, bad_input)
            self._sizes = (shape, dict(zip((int(r) for r in world.logical_ranks), world.allgather(replicated))))
        if self._layout is None or self._layout[0] != world.generation:
            self._layout = (world.generation, layout_of(world, self._domains))
        layout = self._layout[1]
        assert self._sizes is not None
        everyone = self._sizes[1]
        group, m = group_and_code(layout, me, self.redundancy)
        if m < self.redundancy.m and not self._said_reduced:
            self._said_reduced = True  # shrunk below the group's losses: fewer than asked for
            world.events.emit("replication_reduced", redundancy=str(self.redundancy), ranks=len(layout.ranks))
        sizes = {g: everyone[g] for g in group}
        t1 = time.perf_counter()
        phases = {"encode": 0.0}
        pieces = self._exchanges(layout, max(everyone.values()))
        held: dict[tuple[int, int, int], Held] = {}
        parity, flat = None, np.empty(0, np.uint8)
        if m == 0:  # alone, or a group of one: nothing to encode; its commit fault points fire as others' do
            for _ in range(pieces):
                world.exchange({}, {}, point="commit", step=version, known=True)
            self.bytes_moved = 0
        else:
            code = Code(len(group), m, max(sizes.values()))
            blocks = self._encode(group, code, sizes, segments, replicated, pieces, version, phases)
            flat = blocks.reshape(-1)
            parity = ParityHeld(group, code, blocks, sizes)
            held[PARITY] = Held(Piece(me, 0, 0, 0, me), flat, [])
        t2 = time.perf_counter()
        # As copies': after the vote, in a thread, unless node memory's manifest needs them first.
        hash_later = not self._backing.checksums_first and flat.nbytes > INLINE_BYTES
        if not hash_later:
            self._sums.take(held, later=False)
        described = {"parity": {"group": list(group), "m": m, "sums": held[PARITY].sums if held else []}}
        self._backing.stage(version, segments, total, lambda payload: manifest(
            me, self.chunk_bytes, self.way, layout, sizes, (int(payload.nbytes), self._sums.of(payload)),
            flat, {}, **described))
        return _Sent(layout, sizes, held, flat, hash_later, (t1, t2, time.perf_counter()), parity, phases)

    @property
    def way(self) -> str:
        return str(self.redundancy)

    def _exchanges(self, layout: Layout, longest: int) -> int:
        """The commit's exchanges, the same count on every rank: each carries one piece of every
        segment, of ``PIECE_BYTES`` (or ``chunk_bytes``, if less) at least, so that a holder stages a
        quarter of its parity's size at most, in 8 exchanges at most (each one waits for the group's
        slowest member); from the job's longest payload and its groups' shape."""
        n = len(layout.ranks)
        lengths = {n // max(1, n // self.redundancy.k), -(-n // max(1, n // self.redundancy.k))}
        m = self.redundancy.m
        data = max(1, min(length - min(m, length - 1) for length in lengths))
        staged = max((length - min(m, length - 1)) * min(m, length - 1) for length in lengths)  # blocks per exchange
        return self._piece_count(-(-longest // data), most=min(8, -(-4 * staged // m)))

    def _piece_count(self, segment: int, most: int = 8) -> int:
        """Exchanges for segments of ``segment`` bytes: pieces of ``PIECE_BYTES`` (or ``chunk_bytes``,
        if less) at least, ``most`` exchanges at most."""
        return max(1, min(most, -(-segment // min(PIECE_BYTES, self.chunk_bytes))))

    def _encode(self, group: tuple[int, ...], code: Code, sizes: Mapping[int, int], segments: list[np.ndarray],
                replicated: int, pieces: int, version: int, phases: dict[str, float]) -> np.ndarray:
        """This member's parity blocks, piece by piece: in exchange q every member sends piece q of
        each of its segments to that segment's codeword's parity holders, straight from its arrays;
        each holder receives the first data block of each of its codewords where it is added up
        and stages the others, then adds them in (collective)."""
        world, me = self.world, int(self.world.logical_rank)
        i, m, seg = group.index(me), code.m, code.segment
        piece = ALIGN * -(-seg // (ALIGN * pieces))  # whole aligned words: the staged blocks stay aligned
        # What lands where, the same every exchange: (block, data block t, sender, coefficient), by sender
        # then t (the order each sender sends in); the first data block lands in place when its weight is 1.
        lands = sorted(((b, t, group[owner], c) for b, t, owner, c in code.sources(i)), key=lambda x: (x[2], x[1]))
        staged = [x for x in lands if not (x[1] == 0 and x[3] == 1)]
        flat = self._backing.receive_buffer(m * seg, version)  # the retired version's parity buffer
        blocks = flat.reshape(m, seg)
        if self._staging.nbytes < len(staged) * piece:
            self._staging = aligned_empty(len(staged) * piece)
        slot = {(b, t): n for n, (b, t, _, _) in enumerate(staged)}
        summed = [b for b in range(m) if all((x[0], x[1]) in slot for x in lands if x[0] == b)]  # none lands in place
        sends = [(t, group[h]) for t, h in code.destinations(i)]
        self.bytes_moved = 0
        for q in range(pieces):
            lo, hi = min(seg, q * piece), min(seg, (q + 1) * piece)
            outgoing: dict[int, list[np.ndarray]] = {}
            for t, holder in sends:  # in t order: as the holder expects
                outgoing.setdefault(holder, []).extend(
                    byte_slices(segments, t * seg + lo, _span(replicated - lo, t, seg, hi - lo)))
            incoming: dict[int, list[np.ndarray]] = {}
            for b in summed:
                blocks[b][lo:hi] = 0
            landed = {(b, t): _span(sizes[src] - lo, t, seg, hi - lo) for b, t, src, _ in lands}  # bytes each
            for b, t, src, _ in lands:
                n = landed[(b, t)]
                if (b, t) in slot:
                    into = self._staging[slot[(b, t)] * piece:slot[(b, t)] * piece + n]
                else:
                    into = blocks[b][lo:lo + n]
                    blocks[b][lo + n:hi] = 0  # beyond the sender's bytes: the zeros it is padded with
                if n:
                    incoming.setdefault(src, []).append(into)
            self.bytes_moved += world.exchange({o: a for o, a in outgoing.items() if a}, incoming,
                                               point="commit", step=version, known=True)
            t0 = time.perf_counter()
            whole: dict[int, list[np.ndarray]] = {}  # parity block -> the staged blocks XORed in, whole pieces
            for b, t, _, coefficient in staged:
                n = landed[(b, t)]
                block = self._staging[slot[(b, t)] * piece:][:n]
                if coefficient == 1 and n == hi - lo:
                    whole.setdefault(b, []).append(block)
                else:
                    _accumulate(blocks[b][lo:lo + n], coefficient, block)
            for b, added in whole.items():  # one pass over the parity for all of them
                xor_into(blocks[b][lo:hi], added)
            phases["encode"] += time.perf_counter() - t0
        return blocks

    # ------------------------------------------------------- tier 2: a relaunch's attach (``_backing``)
    def _recoverable(self, layout: Layout, dead: list[int], live: set[int], sizes: Mapping[int, int]) -> bool:
        return parity_recoverable(self.redundancy)(layout, dead, live, sizes)

    def _attached(self, me: int, number: int, doc: dict[str, Any], own: np.ndarray | None,
                  buffer: np.ndarray | None) -> Version:
        """A found version with its parity: the manifest names the group and the code, the file holds
        the blocks (checked against their checksums before they are sent, as any parity)."""
        version = attached_copies(me, number, doc, own, buffer)
        described = doc.get("parity") or {}
        if buffer is not None and described.get("m"):
            group, m = tuple(int(g) for g in described["group"]), int(described["m"])
            code = Code(len(group), m, max(version.nbytes[g] for g in group))
            version.parity = ParityHeld(group, code, buffer.reshape(m, code.segment), dict(version.nbytes))
            version.held[PARITY] = Held(Piece(me, 0, 0, 0, me), buffer, list(described["sums"]))
        return version

    # -------------------------------------------------------------- recovery
    def _bring_back(self, layout: Layout, fetch: Fetch, active: list[int], offers: list[Offer], give_up: bool
                    ) -> tuple[dict[int, np.ndarray], dict[int, int]]:
        """The dead owners' payloads, decoded from their groups (collective; see the module)."""
        world = self.world
        current = self._chain.current
        # Members of the version's groups whose parity is not here: dead, removed by a shrink (an adopter
        # holds the payload, not the parity), or recovered since the last commit (no parity yet).
        with_parity = {r for r, offer in zip(active, offers) if offer[0] == fetch.version and offer[1]}
        no_parity = frozenset(o for o in layout.ranks if o not in with_parity)
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
            me = int(world.logical_rank)
            sending = current is not None and current.parity is not None and \
                any(me in d.group and me not in d.lost for d in decodes)
            corrupt = sending and not self._parity_intact()
            checked += time.perf_counter() - t1
            if corrupt:
                world.events.emit("corrupt_copy", owner=me, chunk=0, holder=me, parity=True)
            reports = world.allgather(corrupt)
            bad = {r for r, was in zip(active, reports) if was}
            if not bad:
                break
            no_parity |= bad
        sizes = self._group_sizes(world, decodes)
        fetched, phases = self._decode(world, decodes, sizes)
        self.last_recovery = {"fetch": time.perf_counter() - t0, "check": checked, **phases}
        return fetched, {o: sizes[o] for o in fetched}

    def _parity_intact(self) -> bool:
        current = self._chain.current
        assert current is not None and current.parity is not None
        return self._sums.intact(current.held[PARITY])

    def _group_sizes(self, world: Group, decodes: Sequence[Decode]) -> dict[int, int]:
        """Every affected group member's replicated bytes (collective: the survivors of each group
        know them all; a replacement none)."""
        members = {g for d in decodes for g in d.group}
        current = self._chain.current
        known = current.parity.sizes if current is not None and current.parity is not None else {}
        parts = world.allgather({o: n for o, n in known.items() if o in members})
        return {int(o): int(n) for part in parts for o, n in part.items()}

    def _decode(self, world: Group, decodes: Sequence[Decode], sizes: Mapping[int, int]
                ) -> tuple[dict[int, np.ndarray], dict[str, float]]:
        """Each dead member's payload, summed at its receiver piece by piece from the blocks of its
        group's survivors that determine it (collective: the same exchanges on every rank, then a
        vote). The receiver touches the payload once and stages a few pieces; each survivor sends
        straight from its roll-back payload and its parity."""
        me = int(world.logical_rank)
        current = self._chain.current
        sums = decode_sums(decodes, sizes)
        longest = max((seg for _, _, _, seg, _ in sums), default=0)
        pieces = self._piece_count(longest)
        out = {x: np.empty(sizes[x], np.uint8) for receiver, x, _, _, _ in sums if receiver == me}
        mine = _arrays_of(current.payloads[me]) if current is not None and me in current.payloads else []
        parity = current.parity.blocks if current is not None and current.parity is not None else None

        def block(kind: str, index: int, start: int, n: int) -> list[np.ndarray]:
            if kind == "data":
                return byte_slices(mine, start, n)
            assert parity is not None
            return [parity[index][start:start + n]]

        staging = np.empty(0, np.uint8)
        t0 = time.perf_counter()
        sent, ok, adding = 0, True, 0.0
        for q in range(pieces):
            plan = _Piece.of(sums, sizes, me, q, pieces)
            if staging.nbytes < plan.staged:
                staging = np.empty(plan.staged, np.uint8)
            outgoing: dict[int, list[np.ndarray]] = {}
            for receiver, kind, index, start, n in plan.sends:
                outgoing.setdefault(receiver, []).extend(block(kind, index, start, n))
            incoming: dict[int, list[np.ndarray]] = {}
            for holder, x, at, n in plan.receives:
                incoming.setdefault(holder, []).append(staging[at:at + n] if x is None else out[x][at:at + n])
            for x, at, n in plan.zeros:
                out[x][at:at + n] = 0
            try:
                sent += world.exchange(outgoing, incoming, point="restore", known=True)
            except ProcessFailure:
                ok = False
                break
            t1 = time.perf_counter()
            for x, at, coefficient, source in plan.adds:
                if source[0] == "staged":
                    parts = [staging[source[1]:source[1] + source[2]]]
                else:
                    parts = block(*source[1:])
                for part in parts:  # a segment can span the payload's arrays (a list payload)
                    _accumulate(out[x][at:at + part.nbytes], coefficient, part)
                    at += part.nbytes
            adding += time.perf_counter() - t1
        t2 = time.perf_counter()
        world.vote(ok, "a rank could not finish its part of the transfer")
        self.bytes_moved = sent
        world.events.emit("restored", chunks=len(out), bytes_in=int(sum(b.nbytes for b in out.values())),
                          bytes_out=sent)
        return out, {"exchange": t2 - t0 - adding, "decode": adding, "vote": time.perf_counter() - t2}

"""A ReStore-style replicated in-memory store: a dead rank's state comes back from its peers.

Each active rank commits named arrays: a *payload* (a small JSON header naming
the fields, then their bytes) cut into chunks. Every chunk is copied to
``replication - 1`` other ranks, in contiguous *pieces* placed by arithmetic
(``_placement``): no rank builds or exchanges a table of everybody's chunks.

A commit is two-phase and moves bytes once: the pieces leave straight from the
caller's arrays (no packing copy first), a ULFM vote (uniform: it succeeds
everywhere or fails everywhere) makes the version current, and only then does
each rank copy its arrays into its own roll-back payload, in the buffer of the
version it retires, and each holder checksum what it received (XXH3, in a
thread that runs on while the next steps do: xxhash lets go of the GIL; started
before the vote, it took the cores of peers still in their exchange). A failure
anywhere in a commit leaves the last agreed version on every survivor.

Recovery fetches each dead rank's payload once, from many holders, into the
rank that takes it over (a replacement, or a survivor after a shrink), and
goes on: copying the state again over the new world is left to the next
commit. Until then a second failure of the same data is not survivable: the
``store_recovered`` event says ``replicated: false`` and the next
``committed`` event marks its end.

Memory per rank, replication 2: the roll-back payload and the copies held for
others (2x the state, beside the state itself: 3x); during a commit the new
copies sit beside the old ones (4x), and in process memory the retired copies'
buffer is kept for the next commit's (4x between commits too: the room a
commit needs anyway, and already touched).

Where the versions live is a ``Backing`` (``_backing``): in the process, with
or without a roll-back copy, or, tier 2 (``Config.node_store``), in files in
node memory (same memory, no extra copy), always with a roll-back copy and
with the checksums taken before the vote, where the manifest that a relaunch
reads needs them. A relaunched job attaches them (``recover`` on its first
generation) and agrees on the newest version that the surviving nodes hold whole.
"""
from __future__ import annotations

import dataclasses
import socket
import threading
import time
from typing import Any, Callable, Collection, Mapping, Sequence

import numpy as np
import xxhash
from elastic.comm import ConfigError, Group, LogicalRank, ProcessFailure, agreed, wire

from ._backing import Backing, Found, Payload, backing
from ._errors import CommitRejected, NothingCommitted
from ._placement import DataLost, Layout, Piece, pieces, plan
from ._share import byte_slices

# Who takes a removed rank's state after a shrink: removed -> survivor, or a function of (removed, survivors).
Adopt = Mapping[int, int] | Callable[[list[int], list[int]], Mapping[int, int]]
_ALIGN = 64  # the header is padded so that the fields start aligned
_INLINE_SUMS = 1 << 20  # copies up to this size are checksummed at once (XXH3: ~0.2 ms), not in a thread


def checksum(data: np.ndarray) -> int:
    """A chunk's checksum: 64-bit XXH3 (several GB/s per rank, docs/measurements.md; zlib's CRC32
    was a third of a commit's time)."""
    return xxhash.xxh3_64_intdigest(data.data)


@dataclasses.dataclass(frozen=True)
class _Field:
    owner: int            # logical rank whose state this is
    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int           # in the payload
    nbytes: int


@dataclasses.dataclass
class _Held:
    """A piece of another rank's payload kept here, with the checksum of each of its chunks."""

    piece: Piece
    data: np.ndarray
    sums: list[int]
    offset: int = 0  # in the buffer the version's copies arrived in


@dataclasses.dataclass
class _Version:
    number: int
    layout: Layout                            # the ranks and domains it was committed over
    nbytes: dict[int, int]                    # payload sizes this rank knows: its own, those it holds pieces of
    payloads: dict[int, Payload]              # whole payloads here: its own, and any adopted since
    held: dict[tuple[int, int, int], _Held]   # (owner, copy, first chunk) -> the piece kept for it
    complete: bool = True                     # every piece the layout gives this rank is here
    buffer: np.ndarray | None = None          # what the held pieces are views of


class ReplicatedStore:
    """Replicates every active rank's state in its peers' memory. Create on every active rank."""

    def __init__(self, world: Group, replication: int = 2, chunk_bytes: int = 1 << 20,
                 domains: Mapping[int, str] | None = None, rollback_copy: bool = True, keep: int = 1) -> None:
        """``rollback_copy=False``: keep no copy of this rank's own committed state; the caller
        promises to leave the committed arrays unchanged until the next commit (a double-buffered
        simulation, a snapshot it made itself), and a commit then copies nothing locally and
        receives into the buffer the retired version held (no fresh memory). With the default, the
        arrays may change right after ``commit`` returns and ``restore`` gives the committed bytes.

        ``keep``: versions kept, the current one included: the older ones are what ``fall_back``
        goes back to (each costs what the current one does: its roll-back payload and the copies
        held for others). A recovery keeps only the current one (a replacement holds no other), so
        the chain starts again after every failure. In process memory with a roll-back copy only."""
        if keep < 1:
            raise ConfigError(f"keep={keep}: versions kept, the current one included: at least 1")
        if keep > 1 and (not rollback_copy or (world.job.settings.node_store and not world.job.alone)):
            raise ConfigError(f"keep={keep}: older versions are kept in process memory with a roll-back copy only; "
                              "use keep=1 with rollback_copy=False or a node store (tier 2)")
        if replication < 1:
            raise ConfigError(f"replication={replication}: need at least 1 (2 survives one failure)")
        if world.job.alone:
            replication = 1  # a single process run for debugging: no peer to hold a copy
        if replication > world.size:
            raise ConfigError(f"replication={replication} with {world.size} active ranks: a state cannot have "
                              f"more copies than there are ranks to hold them; use at most {world.size}")
        if chunk_bytes < 1:
            raise ConfigError(f"chunk_bytes={chunk_bytes}: must be positive")
        self.world = world
        self.replication = replication
        self.chunk_bytes = chunk_bytes
        self._domains = dict(domains) if domains is not None else None
        self._current: _Version | None = None
        self.keep = keep
        self._older: list[_Version] = []  # the versions before the current one, newest first (``keep``)
        self._layout: tuple[int, Layout] | None = None  # (generation, layout) of the active ranks
        self.bytes_moved = 0  # by this rank in the last commit or recovery
        self._said_reduced = False
        self.last_recovery: dict[str, float] = {}  # seconds: fetch (from peers), and its phases
        self.given_up: list[int] = []  # by the last recover(give_up=True): dead ranks whose state had no copy left
        self._hashing: threading.Thread | None = None  # the holder's checksums of the last commit's copies
        self._told: tuple[tuple[int, int], list[Any]] | None = None  # the last announcement heard, and for what
        self._backing: Backing = backing("" if world.job.alone else world.job.settings.node_store or "",
                                         int(world.logical_rank), rollback_copy, lambda: world.job.ended)

    # ------------------------------------------------------------ user calls
    @property
    def version(self) -> int | None:
        """The last agreed version (None before the first commit)."""
        return self._current.number if self._current else None

    def commit(self, state: Mapping[str, Any], version: int, unreplicated: Collection[str] = ()) -> None:
        """Replicate ``state`` (name -> array) as ``version`` (collective over the active ranks).

        The arrays must not change until it returns (they are sent from where they lie).
        ``unreplicated``: names kept in this rank's own payload (its roll-back copy, node memory)
        but copied to no peer: values every rank holds alike, which a replacement gets from the
        survivors instead (``share``). They lie at the payload's end, after the replicated bytes.

        Raises:
            ProcessFailure: a rank died; the previous version stays current everywhere.
            ConfigError: versions differ across ranks, or a value is not an array (on every rank).
        """
        self._commit({int(self.world.logical_rank): state}, version, frozenset(unreplicated))

    def restore(self) -> dict[str, np.ndarray]:
        """This rank's own state at the last agreed version (local; read-only views, valid until
        the next commit reuses their buffer: copy what you keep)."""
        return self.restore_owner(int(self.world.logical_rank))

    def restore_owner(self, owner: int) -> dict[str, np.ndarray]:
        """The state of logical rank ``owner`` held whole here (local; read-only views, as ``restore``)."""
        if self._current is None:
            raise NothingCommitted("nothing committed yet: call commit() before restore()")
        out: dict[str, np.ndarray] = {}
        for payload in self._current.payloads.values():
            out.update(_fields_of(payload, owner))
        if not out:
            raise ConfigError(f"logical rank {owner}'s state is not held here (held: {self.owners_here()})")
        return out

    def owners_here(self) -> list[int]:
        """Logical ranks whose state this rank holds whole (itself, plus adopted ones after a shrink)."""
        if self._current is None:
            return []
        return sorted({f.owner for payload in self._current.payloads.values() for f in _read_header(payload)})

    def recover(self, adopt: Adopt | None = None, give_up: bool = False) -> bool:
        """Bring the dead ranks' state back from peers' memory (collective over the new active ranks).

        Call right after ``World.recover()``; who needs what is derived from
        which ranks still hold the agreed version, so a recovery interrupted by
        another failure is simply called again. A replacement (spare or spawned)
        receives its logical rank's state; after a shrink, the state of each
        removed logical rank goes to ``adopt[removed] -> surviving logical rank``
        (``adopt`` may also be a function of (removed, survivors) giving that
        mapping, the same on every rank; default: round-robin over the
        survivors). Each holder checks its copies by checksum before it sends; a
        corrupted one is fetched from another holder. The copies are made again
        over the new world by the next commit. An adopted state is held here
        until this rank's next commit replaces it: commit it with your own to
        keep it (``State`` does).

        Returns False (on every rank) when no version was ever committed in the job: nothing to
        recover (and ``DataLost`` when one was, but every process that held it died).

        ``give_up=True``: partial recovery. The dead ranks whose state has no live copy left are
        named in ``given_up`` (the same on every rank) instead of raising ``DataLost``; the others
        come back as usual, and a replacement of a given-up rank holds the version with no payload
        of its own: the caller brings its state back some other way (a pipeline stage rebuilt from
        its neighbours) and commits it.

        Raises:
            DataLost: every replica of some chunk died (same error on every rank).
            ProcessFailure: another failure during recovery; recover the world again, then this.
        """
        self._settle()
        self._older = []  # a replacement holds none of them, and after a shrink they lack the removed ranks' state
        world = self.world
        me = int(world.logical_rank)
        active = [int(r) for r in world.logical_ranks]
        relaunched = world.last_rebuild is not None and world.last_rebuild.mode == "relaunch"
        if relaunched and self._current is None:
            self._attach()
        statuses = world.allgather(self._status())
        numbers = {s[0] for s in statuses if s[0] is not None}
        if not numbers and world.job.committed:  # every process that held a version died: the same everywhere
            lost = DataLost({r: [] for r in active})
            world.events.emit("data_lost", lost=lost.lost)
            raise agreed(lost)
        if not numbers:
            return False  # nothing was ever committed: nothing to recover
        number = max(numbers)
        root = next(i for i, s in enumerate(statuses) if s[0] == number)
        layout = world.bcast(self._current.layout if world.rank == root and self._current else None, root=root)
        whole = {o: r for r, s in zip(active, statuses) if s[0] == number for o in s[2]}
        live = {r for r, s in zip(active, statuses) if s[0] == number and s[1]}
        dead = sorted(o for o in layout.ranks if o not in whole)
        survivors = sorted(set(active) & set(whole.values()))
        removed = sorted(o for o in dead if o not in active)
        if adopt is None:
            adopt = {o: survivors[i % len(survivors)] for i, o in enumerate(removed)}
        elif callable(adopt):
            adopt = adopt(removed, survivors)
        receiver = {o: (o if o in active else int(adopt[o])) for o in dead}
        known = world.allgather({o: n for o, n in (self._current.nbytes.items() if self._current else ())
                                 if o in set(dead)})
        nbytes = {o: n for part in known for o, n in part.items()}
        t0 = time.perf_counter()
        fetched, phases = self._fetch(layout, dead, nbytes, live, receiver, number, give_up)
        self.last_recovery = {"fetch": time.perf_counter() - t0, **phases}
        if me in fetched:  # a replacement: its own payload, and none of the copies it should hold yet
            self._current = _Version(number, layout, {me: nbytes[me]}, {me: fetched.pop(me)}, {}, complete=False)
        elif me in self.given_up:  # a replacement whose state is gone: the version, with no payload
            self._current = _Version(number, layout, {}, {}, {}, complete=False)
        if self._current is not None:
            self._current.payloads.update(fetched)  # adopted after a shrink
            self._current.nbytes.update({o: nbytes[o] for o in fetched})
        world.events.emit("store_recovered", version=number, dead=dead, receivers=receiver,
                          bytes_moved=self.bytes_moved, durations=self.last_recovery, replicated=not dead,
                          given_up=self.given_up)
        return True

    def fall_back(self) -> int | None:
        """Make the newest older version that every active rank keeps the current one, dropping the
        newer ones (collective; the same on every rank): a corruption found after the current
        version passed the integrity gate. Returns its number, or None (nothing changed) when no
        older version is kept on every rank (``keep=1``, or a failure since: see ``keep``)."""
        self._settle()
        kept = self.world.allgather([v.number for v in self._older])
        common = set(kept[0]).intersection(*map(set, kept[1:])) if kept else set()
        if not common:
            return None
        target = max(common)
        while self._older and self._older[0].number != target:
            self._older.pop(0)
        self._current = self._older.pop(0)
        return self._current.number

    # -------------------------------------------------------------- commit
    def _announce(self, mine: list[Piece], ranks: Sequence[LogicalRank], replicated: int,
                  shape: tuple[int, int] | None) -> list[Any]:
        """What each holder gets from every rank (collective unless steady, ``shape`` None): the
        pieces with the payload's size, O(pieces) per peer; steady, what was said last time."""
        if shape is None:
            assert self._told is not None
            return self._told[1]
        current = {int(r): i for i, r in enumerate(ranks)}
        notes: dict[int, list[tuple[int, int, int, int]]] = {}
        for p in mine:
            notes.setdefault(current[p.holder], []).append((p.copy, p.first, p.count, replicated))
        told = self.world.alltoall(notes)
        self._told = (shape, told)
        return told

    def _receive(self, told: list[Any], ranks: Sequence[LogicalRank], version: int, replicated: int
                 ) -> tuple[np.ndarray, dict[tuple[int, int, int], _Held], dict[int, list[np.ndarray]], dict[int, int]]:
        """Where the copies arrive, in current-rank order, in one buffer: a view of it per piece; with
        what peers hold of each payload (its size) (local)."""
        me = int(self.world.logical_rank)
        spans = [(int(ranks[r]), copy, first, count, size, self._span(first, count, size)[1])
                 for r, got in enumerate(told) for copy, first, count, size in got or []]
        buffer = self._backing.receive_buffer(sum(span[-1] for span in spans), version)
        held: dict[tuple[int, int, int], _Held] = {}
        incoming: dict[int, list[np.ndarray]] = {}
        sizes, offset = {me: replicated}, 0
        for owner, copy, first, count, size, nbytes in spans:
            data = buffer[offset:offset + nbytes]
            held[(owner, copy, first)] = _Held(Piece(owner, copy, first, count, me), data, [], offset)
            offset += nbytes
            incoming.setdefault(owner, []).append(data)
            sizes[owner] = size
        return buffer, held, incoming, sizes

    def _commit(self, contents: Mapping[int, Mapping[str, Any]], version: int,
                unreplicated: frozenset[str] = frozenset()) -> None:
        self._settle()  # the last commit's checksums, before any buffer changes hands
        world = self.world
        me = int(world.logical_rank)
        t0 = time.perf_counter()
        try:
            segments, replicated, bad_input = *_segments(contents, unreplicated), None
        except ConfigError as exc:  # told to every rank below, so that no rank waits for this one
            segments, replicated, bad_input = [], 0, str(exc)
        total = sum(s.nbytes for s in segments)
        error: Exception | None = None
        hash_later = False
        try:  # phase one; errors are recorded, then every rank votes (never an Agree half the ranks skip)
            # Steady (every rank's payload the size it was at the last commit of this generation): the
            # holders know what comes, and the version check needs no announcement after it.
            shape = (world.generation, replicated)
            steady = world.agree_equal(version, ok=bad_input is None and self._told is not None and
                                       self._told[0] == shape)
            if not steady:  # the first commit of a generation, a size changed, or a refusal: said in full
                self._check_together(version, bad_input)
            layout = self._active_layout()
            n_chunks = -(-replicated // self.chunk_bytes)
            mine = pieces(layout, me, n_chunks, self.replication)
            if len(layout.ranks) < self.replication and not self._said_reduced:
                self._said_reduced = True  # shrunk below the replication: fewer copies than asked for
                world.events.emit("replication_reduced", replication=self.replication, ranks=len(layout.ranks))
            ranks = world.logical_ranks  # built from the membership table: read once
            told = self._announce(mine, ranks, replicated, shape if not steady else None)
            outgoing: dict[int, list[np.ndarray]] = {p.holder: [] for p in mine}
            for p in mine:
                outgoing[p.holder].extend(byte_slices(segments, *self._span(p.first, p.count, replicated)))
            buffer, held, incoming, sizes = self._receive(told, ranks, version, replicated)
            t1 = time.perf_counter()
            self.bytes_moved = world.exchange(outgoing, incoming, point="commit", step=version)
            t2 = time.perf_counter()
            hash_later = not self._backing.checksums_first and buffer.nbytes > _INLINE_SUMS
            if not hash_later:
                for h in held.values():  # (a few kilobytes, a per-step point's: cheaper than a thread)
                    h.sums = self._sums(h.data)
            self._backing.stage(version, segments, total, lambda payload: self._manifest(
                layout, sizes, payload, held, buffer))
            t3 = time.perf_counter()
        except ProcessFailure as exc:
            error = exc
        # Phase two: the new copies become current only if every rank got this far.
        try:
            self._vote(error is None)
        except ProcessFailure:
            self._backing.abandon(self.version)
            raise
        t4 = time.perf_counter()
        old = self._current  # kept as an older version (``keep``), or retired: its buffers are reused
        if old is not None and self.keep > 1:
            self._older.insert(0, old)
            old = self._older.pop() if len(self._older) >= self.keep else None
        payload = self._backing.keep(version, segments, total, old.payloads.get(me) if old else None,
                                     old.buffer if old else None, lambda: world.job.host_peers)
        self._current = _Version(version, layout, sizes, {me: payload}, held, True, buffer)
        if hash_later:  # the holder checks what it keeps, off everyone's path: from here, not while the
            self._hash_later(held)  # peers' exchanges still run (it took their cores: the vote waited)
        t5 = time.perf_counter()
        world.job.note_commit()
        world.events.emit("committed", version=version, bytes_out=self.bytes_moved,
                          durations={"prepare": t1 - t0, "exchange": t2 - t1, "checksum": t3 - t2,
                                     "vote": t4 - t3, "pack": t5 - t4},
                          payload_bytes=int(total), replicated_bytes=int(replicated),
                          held_chunks=sum(h.piece.count for h in held.values()),
                          replicated=True)

    def _check_together(self, version: int, bad_input: str | None) -> None:
        """Refuse on every rank alike a commit some rank cannot make (collective; O(log n), no table)."""
        world = self.world
        if world.agree_equal(version, ok=bad_input is None):
            return
        # Rare: say who and why, the same words everywhere.
        reports = world.allgather((version, bad_input))
        ranks = [int(r) for r in world.logical_ranks]
        problems = [f"logical rank {r}: {p}" for r, (_, p) in zip(ranks, reports) if p]
        if problems:
            raise agreed(CommitRejected("commit rejected, nothing was replaced: " + "; ".join(problems)), final=False)
        raise agreed(CommitRejected(f"commit version differs across ranks: {sorted({v for v, _ in reports})}; every "
                                 "rank must commit the same version together"), final=False)

    def _active_layout(self) -> Layout:
        """The failure domains of the active ranks, built once per generation (collective the first time)."""
        world = self.world
        if self._layout is None or self._layout[0] != world.generation:
            ranks = [int(r) for r in world.logical_ranks]
            if self._domains is not None:
                domain_of = {r: self._domains[r] for r in ranks}
            elif world.job.settings.domains:
                names = world.job.settings.domains
                domain_of = {r: names[r % len(names)] for r in ranks}
            else:
                domain_of = dict(zip(ranks, world.allgather(socket.gethostname())))
            self._layout = (world.generation, Layout.of(domain_of))
        return self._layout[1]

    # -------------------------------------------------------------- tier 2
    def _manifest(self, layout: Layout, sizes: Mapping[int, int], payload: np.ndarray,
                  held: Mapping[tuple[int, int, int], _Held], buffer: np.ndarray) -> dict[str, Any]:
        """What a relaunch needs to find a version again and check it (local; the copies' sums taken)."""
        return {
            "owner": int(self.world.logical_rank), "chunk_bytes": self.chunk_bytes, "replication": self.replication,
            "domains": [list(d) for d in layout.domains], "sizes": {str(o): n for o, n in sizes.items()},
            "own": {"nbytes": int(payload.nbytes), "sums": self._sums(payload)},
            "held": {"nbytes": int(buffer.nbytes), "pieces": [
                [h.piece.owner, h.piece.copy, h.piece.first, h.piece.count, h.offset, int(h.data.nbytes), h.sums]
                for h in held.values()]}}

    def _attach(self) -> None:
        """A relaunch: take this rank's versions up from its node's memory, agree with the others on
        the newest one that the live nodes hold whole, and keep that one (collective over the
        active ranks). When none is whole, the newest is kept: the recovery then names what is lost."""
        world = self.world
        offers: dict[int, Found] = self._backing.found(int(world.logical_rank), self.chunk_bytes, self.replication,
                                                       self._sums)
        # What each rank holds, without the layout (O(ranks) each): it is sent once per version looked at.
        summary = {v: ({int(o): int(n) for o, n in doc["sizes"].items()}, own is not None, buffer is not None)
                   for v, (doc, own, buffer) in offers.items()}
        try:
            everyone = world.allgather(summary)
        except ProcessFailure:
            if offers:  # lost during the attach: keep the newest here; the next recovery takes it from there
                self._keep(max(offers), *offers[max(offers)])
            raise
        def layout_of(version: int) -> Layout:  # collective: every rank asks for the same versions in turn
            root = next(i for i, offer in enumerate(everyone) if version in offer)
            layout: Layout = world.bcast(_layout(offers[version][0]["domains"]) if world.rank == root else None,
                                         root=root)
            return layout
        chosen = _newest_whole(everyone, [int(r) for r in world.logical_ranks], self.chunk_bytes, self.replication,
                               layout_of)
        world.events.emit("store_attached", versions=sorted(offers), chosen=chosen)
        if chosen is not None:
            world.job.note_commit()  # a version this job committed: losing it later is DataLost
            if chosen in offers:
                self._keep(chosen, *offers[chosen])

    def _keep(self, number: int, doc: dict[str, Any], own: np.ndarray | None, buffer: np.ndarray | None) -> None:
        """Make an attached version this rank's current one (local)."""
        me = int(self.world.logical_rank)
        held = {}
        if buffer is not None:
            for owner, copy, first, count, offset, nbytes, sums in doc["held"]["pieces"]:
                held[(owner, copy, first)] = _Held(Piece(owner, copy, first, count, me),
                                                   buffer[offset:offset + nbytes], list(sums), offset)
        self._current = _Version(number, _layout(doc["domains"]), {int(o): int(n) for o, n in doc["sizes"].items()},
                                 {me: own} if own is not None else {}, held, buffer is not None,
                                 buffer if buffer is not None else np.empty(0, np.uint8))

    # -------------------------------------------------------------- recovery
    def _status(self) -> tuple[int | None, bool, tuple[int, ...]]:
        """(version held, every copy the layout gives me is here, owners whose whole payload is here)."""
        if self._current is None:
            return None, False, ()
        return self._current.number, self._current.complete, tuple(self.owners_here())

    def _fetch(self, layout: Layout, dead: list[int], nbytes: Mapping[int, int], live: set[int],
               receiver: Mapping[int, int], number: int, give_up: bool = False
               ) -> tuple[dict[int, np.ndarray], dict[str, float]]:
        """Assemble every dead owner's payload at its receiver, from live holders (collective);
        with the seconds of its phases: check (the copies to send), exchange, vote.

        Each holder checks the pieces it is to send against their checksums
        first; a corrupted piece is planned again from another holder. ``give_up``: owners with
        no live copy go to ``given_up`` instead of raising ``DataLost``.
        """
        world = self.world
        me = int(world.logical_rank)
        # A dead owner whose size no live rank knows had every holder die with it.
        unknown: dict[int, list[int]] = {o: [] for o in dead if o not in nbytes}
        n_chunks = {o: -(-nbytes[o] // self.chunk_bytes) for o in dead if o in nbytes}
        bad: set[tuple[int, int, int]] = set()
        self.given_up = []
        checked = 0.0
        while True:
            try:
                chosen = plan(layout, list(n_chunks), n_chunks, self.replication, live, bad)
                if unknown:
                    raise DataLost(unknown)
            except DataLost as exc:  # the same on every rank: everyone planned from the same agreed data
                lost = DataLost({**unknown, **exc.lost})
                world.events.emit("data_lost", lost=lost.lost, given_up=give_up)
                if not give_up:
                    raise agreed(lost) from None
                self.given_up = sorted(set(self.given_up) | set(lost.lost))
                unknown = {}
                n_chunks = {o: n for o, n in n_chunks.items() if o not in lost.lost}
                continue
            t0 = time.perf_counter()
            corrupt = [(me, p.owner, p.first) for p in chosen.values() if p.holder == me and not self._intact(p)]
            checked += time.perf_counter() - t0
            for _, owner, first in corrupt:
                world.events.emit("corrupt_copy", owner=owner, chunk=first, holder=me)
            reports = world.allgather(corrupt)
            if not any(reports):
                break
            bad |= {(int(h), int(o), int(f)) for report in reports for h, o, f in report}
        out = {o: np.empty(nbytes[o], np.uint8) for o in n_chunks if receiver[o] == me}
        outgoing: dict[int, list[np.ndarray]] = {}
        incoming: dict[int, list[np.ndarray]] = {}
        for key in sorted(chosen):
            p = chosen[key]
            if p.holder == me:
                outgoing.setdefault(receiver[p.owner], []).append(self._held(p).data)
            if receiver[p.owner] == me:  # lands where it belongs in the payload: no second copy
                start, size = self._span(p.first, p.count, nbytes[p.owner])
                incoming.setdefault(p.holder, []).append(out[p.owner][start:start + size])
        t0 = time.perf_counter()
        try:
            self.bytes_moved = world.exchange(outgoing, incoming, point="restore")
            ok = True
        except ProcessFailure:
            ok = False
        t1 = time.perf_counter()
        self._vote(ok)
        phases = {"check": checked, "exchange": t1 - t0, "vote": time.perf_counter() - t1}
        world.events.emit("restored", chunks=sum(p.count for p in chosen.values() if receiver[p.owner] == me),
                          bytes_in=int(sum(b.nbytes for b in out.values())), bytes_out=self.bytes_moved)
        return out, phases

    def _held(self, p: Piece) -> _Held:
        assert self._current is not None
        return self._current.held[(p.owner, p.copy, p.first)]

    def _intact(self, p: Piece) -> bool:
        self._settle()
        held = self._held(p)
        return self._sums(held.data) == held.sums

    def _hash_later(self, held: Mapping[tuple[int, int, int], _Held]) -> None:
        """Checksum the copies just received in a thread (xxhash lets go of the GIL): the commit and
        the steps after it go on meanwhile. Anything that reads the sums or reuses the buffers
        waits for it (``_settle``; ``_commit`` already did for the last one)."""
        def run() -> None:
            for h in held.values():
                h.sums = self._sums(h.data)
        self._hashing = threading.Thread(target=run, name="elastic-store-checksums", daemon=True)
        self._hashing.start()

    def _settle(self) -> None:
        if self._hashing is not None:
            self._hashing.join()
            self._hashing = None

    # -------------------------------------------------------------- moving bytes
    def _vote(self, ok: bool) -> None:
        """Uniform decision over the active ranks: returns on all or raises ProcessFailure on all."""
        self.world.vote(ok, "a rank could not finish its part of the transfer")

    def _span(self, first: int, count: int, total: int) -> tuple[int, int]:
        """(byte offset, size) of chunks [first, first + count) in a payload of ``total`` bytes."""
        start = first * self.chunk_bytes
        return start, min(total, (first + count) * self.chunk_bytes) - start

    def _sums(self, data: np.ndarray) -> list[int]:
        return [checksum(data[i:i + self.chunk_bytes]) for i in range(0, data.nbytes, self.chunk_bytes)]


def _layout(domains: list[list[int]]) -> Layout:
    return Layout.of({r: str(d) for d, members in enumerate(domains) for r in members})


# What one rank holds of a version, as the ranks tell it each other: {owner: payload bytes}, own payload, copies.
Offer = tuple[dict[int, int], bool, bool]


def _newest_whole(offers: list[dict[int, Offer]], active: list[int], chunk_bytes: int, replication: int,
                  layout_of: Callable[[int], Layout]) -> int | None:
    """The newest version that the ranks' offers hold whole: every owner's payload on a live rank,
    or each of its chunks in some live rank's copies (the same on every rank; ``layout_of``
    gives a version's layout). When none is, the newest offered (its recovery then names what is
    lost); None when nothing is offered."""
    versions = sorted({v for offer in offers for v in offer}, reverse=True)
    for v in versions:
        layout = layout_of(v)
        whole = {r for r, offer in zip(active, offers) if v in offer and offer[v][1]}
        live = {r for r, offer in zip(active, offers) if v in offer and offer[v][2]}
        sizes = {o: n for offer in offers if v in offer for o, n in offer[v][0].items()}
        dead = [o for o in layout.ranks if o not in whole]
        if any(o not in sizes for o in dead):
            continue
        try:
            plan(layout, dead, {o: -(-sizes[o] // chunk_bytes) for o in dead}, replication, live)
            return v
        except DataLost:
            continue
    return versions[0] if versions else None


# ------------------------------------------------------------------ payloads
def _segments(contents: Mapping[int, Mapping[str, Any]], unreplicated: frozenset[str] = frozenset()
              ) -> tuple[list[np.ndarray], int]:
    """The payload as a list of byte arrays: the header (naming the fields), then each field where
    it lies, the ``unreplicated`` ones last; and the size of what is replicated (all before those)."""
    items = sorted(((owner, name, _as_array(contents[owner][name], name)) for owner in contents
                    for name in contents[owner]), key=lambda item: (item[1] in unreplicated, item[0], item[1]))
    fields, offset, replicated = [], 0, 0
    for owner, name, array in items:
        fields.append(_Field(owner, name, array.dtype.str, tuple(array.shape), offset, array.nbytes))
        offset += array.nbytes
        replicated += 0 if name in unreplicated else array.nbytes
    header = _header(fields)
    return [header] + [a.reshape(-1).view(np.uint8) for _, _, a in items], header.nbytes + replicated


def _header(fields: list[_Field]) -> np.ndarray:
    """The fields framed as a wire message (never pickle: payloads come back from peers), padded so
    that the first field starts aligned."""
    message = wire.encode([[f.owner, f.name, f.dtype, list(f.shape), f.offset, f.nbytes] for f in fields],
                          "a payload's header")
    header = np.zeros(-(-message.nbytes // _ALIGN) * _ALIGN, np.uint8)
    header[:message.nbytes] = message
    return header


def _read_header(payload: Payload) -> list[_Field]:
    if isinstance(payload, list):
        payload = payload[0]
    if payload.nbytes < 8:
        return []
    fields, framed = wire.decode_prefix(payload)
    size = -(-framed // _ALIGN) * _ALIGN
    return [_Field(int(o), str(n), str(d), tuple(int(x) for x in s), int(off) + size, int(nb))
            for o, n, d, s, off, nb in fields]


def _fields_of(payload: Payload, owner: int) -> dict[str, np.ndarray]:
    out = {}
    for i, f in enumerate(_read_header(payload)):
        if f.owner == owner and (isinstance(payload, list) or f.offset + f.nbytes <= payload.nbytes):
            # (a payload fetched from peers ends where its unreplicated fields begin)
            data = payload[i + 1] if isinstance(payload, list) else payload[f.offset:f.offset + f.nbytes]
            view = data.view(f.dtype).reshape(f.shape)
            view.flags.writeable = False
            out[f.name] = view
    return out


def _as_array(value: Any, name: str) -> np.ndarray:
    if hasattr(value, "__cuda_array_interface__") and hasattr(value, "get"):
        value = value.get()  # cupy: through host memory (ULFM's ob1 PML does not move GPU buffers)
    elif hasattr(value, "detach") and hasattr(value, "cpu"):
        value = value.detach().cpu().numpy()  # torch
    array = np.asarray(value)
    if array.dtype == object:
        raise ConfigError(f"state entry {name!r} is a {type(value).__name__}, not an array: "
                          "commit numpy arrays, torch tensors or cupy arrays (numbers as np.asarray(x))")
    return np.ascontiguousarray(array)  # sent from where it lies: one block per array

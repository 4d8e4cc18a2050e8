"""A ReStore-style replicated in-memory store: a dead rank's state comes back from its peers.

Each active rank commits named arrays: a *payload* (``_payload``: a small header naming the
fields, then their bytes) cut into chunks. Every chunk is copied to ``replication - 1`` other
ranks, in contiguous *pieces* placed by arithmetic (``_placement``): no rank builds or exchanges
a table of everybody's chunks.

A commit is two-phase and moves bytes once: the pieces leave straight from the caller's arrays
(no packing copy first) to their holders (``_copies``), a ULFM vote (uniform: it succeeds
everywhere or fails everywhere) makes the version current, and only then does each rank copy its
arrays into its own roll-back payload, in the buffer of the version it retires, and each holder
checksum what it received (``_sums``: after the vote, in a thread; before it, the checksums took
the cores of peers still in their exchange). A failure anywhere in a commit leaves the last
agreed version on every survivor. The versions kept are a chain (``_versions``).

Recovery fetches each dead rank's payload once, from many holders, into the rank that takes it
over (a replacement, or a survivor after a shrink): ``_fetch`` plans it from what every rank
holds and moves it in one exchange. Copying the state again over the new world is left to the
next commit; until then a second failure of the same data is not survivable: the
``store_recovered`` event says ``replicated: false`` and the next ``committed`` event marks its end.

Memory per rank, replication 2: the roll-back payload and the copies held for others (2x the
state, beside the state itself: 3x); during a commit the new copies sit beside the old ones (4x),
and in process memory the retired copies' buffer is kept for the next commit's (4x between
commits too: the room a commit needs anyway, and already touched).

Where the versions live is a ``Backing`` (``_backing``): in the process, with or without a
roll-back copy, or, tier 2 (``Config.node_store``), in files in node memory (same memory, no
extra copy), always with a roll-back copy and with the checksums taken before the vote, where
the manifest that a relaunch reads needs them. A relaunched job attaches them (``attach``, on
its first recovery) and agrees on the newest version that the surviving nodes hold whole.
"""
from __future__ import annotations

import dataclasses
import time
from typing import Any, Collection, Mapping

import numpy as np
from elastic.comm import ConfigError, Group, ProcessFailure, agreed

from ._backing import Backing, attach, attached_copies, backing, copies_recoverable, manifest
from ._copies import announce, layout_of, receive
from ._errors import CommitRejected, NothingCommitted
from ._fetch import Adopt, Fetch, Offer, choose, newest, plan_fetch, transfer
from ._payload import fields_of, read_header, segments as to_segments
from ._placement import DataLost, Layout, Piece, pieces
from ._share import byte_slices
from ._sums import INLINE_BYTES, Checksums
from ._versions import Held, Version, VersionChain, newest_common


@dataclasses.dataclass
class _Sent:
    """A commit's phase one, as this rank left it for the vote."""

    layout: Layout
    sizes: dict[int, int]                  # the payload sizes of the owners it holds pieces of, and its own
    held: dict[tuple[int, int, int], Held]
    buffer: np.ndarray                     # where the copies arrived
    hash_later: bool                       # their checksums are taken after the vote, in a thread
    seconds: tuple[float, float, float]    # the exchange's start, its end, the checksums' end
    parity: Any = None                     # a parity store's blocks of the group (``_paritystore``)
    phases: dict[str, float] = dataclasses.field(default_factory=dict)  # seconds inside the exchange's, by name


class ReplicatedStore:
    """Replicates every active rank's state in its peers' memory. Create on every active rank."""

    CAME_BACK = "copy"  # how a dead rank's state comes back (``store_recovered``'s ``came_back``)

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
        self._chain = VersionChain(keep)
        self._layout: tuple[int, Layout] | None = None  # (generation, layout) of the active ranks
        self.bytes_moved = 0  # by this rank in the last commit or recovery
        self._said_reduced = False
        self.last_recovery: dict[str, float] = {}  # seconds: fetch (from peers), and its phases
        self.given_up: list[int] = []  # by the last recover(give_up=True): dead ranks whose state had no copy left
        self._sums = Checksums(chunk_bytes)
        self._told: tuple[tuple[int, int], list[Any]] | None = None  # the last announcement heard, and for what
        self._backing: Backing = backing("" if world.job.alone else world.job.settings.node_store or "",
                                         int(world.logical_rank), rollback_copy, lambda: world.job.ended)

    # ------------------------------------------------------------ user calls
    @property
    def version(self) -> int | None:
        """The last agreed version (None before the first commit)."""
        return self._chain.number

    @property
    def keep(self) -> int:
        return self._chain.keep

    @property
    def way(self) -> str:
        """How the state is kept recoverable, as the redundancy setting says it (``copies:R``)."""
        return f"copies:{self.replication}"

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
        current = self._chain.current
        if current is None:
            raise NothingCommitted("nothing committed yet: call commit() before restore()")
        out: dict[str, np.ndarray] = {}
        for payload in current.payloads.values():
            out.update(fields_of(payload, owner))
        if not out:
            raise ConfigError(f"logical rank {owner}'s state is not held here (held: {self.owners_here()})")
        return out

    def owners_here(self) -> list[int]:
        """Logical ranks whose state this rank holds whole (itself, plus adopted ones after a shrink)."""
        current = self._chain.current
        if current is None:
            return []
        return sorted({f.owner for payload in current.payloads.values() for f in read_header(payload)})

    def recover(self, adopt: Adopt | None = None, give_up: bool = False) -> bool:
        """Bring the dead ranks' state back from peers' memory (collective over the new active ranks).

        Call right after ``World.recover()``; who needs what is derived from which ranks still hold
        the agreed version, so a recovery interrupted by another failure is simply called again. A
        replacement (spare or spawned) receives its logical rank's state; after a shrink, the state
        of each removed logical rank goes to ``adopt[removed] -> surviving logical rank`` (``adopt``
        may also be a function of (removed, survivors) giving that mapping, the same on every rank;
        default: round-robin over the survivors). Each holder checks its copies by checksum before
        it sends; a corrupted one is fetched from another holder. The copies are made again over
        the new world by the next commit. An adopted state is held here until this rank's next
        commit replaces it: commit it with your own to keep it (``State`` does).

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
        self._sums.settle()
        world = self.world
        self._chain.only(self._chain.current)  # a replacement holds no older one; after a shrink they lack state
        if world.last_rebuild is not None and world.last_rebuild.mode == "relaunch" and self._chain.current is None:
            attach(world, self._backing, self.chunk_bytes, self.way, self._sums.of, self._chain.only,
                   self._recoverable, self._attached)
        active = [int(r) for r in world.logical_ranks]
        offers = world.allgather(self._status())
        found = newest(offers)
        if found is None and world.job.committed:  # every process that held a version died: the same everywhere
            lost = DataLost({r: [] for r in active})
            world.events.emit("data_lost", lost=lost.lost)
            raise agreed(lost)
        if found is None:
            return False  # nothing was ever committed: nothing to recover
        number, root = found
        current = self._chain.current
        layout: Layout = world.bcast(current.layout if world.rank == root and current else None, root=root)
        fetch = plan_fetch(layout, active, offers, number, adopt)
        fetched, nbytes = self._bring_back(layout, fetch, active, offers, give_up)
        self._keep_fetched(number, layout, nbytes, fetched)
        world.events.emit("store_recovered", version=number, dead=list(fetch.dead), receivers=fetch.receiver,
                          bytes_moved=self.bytes_moved, durations=self.last_recovery, replicated=not fetch.dead,
                          given_up=self.given_up,
                          came_back={o: self.CAME_BACK for o in fetch.dead if o not in self.given_up})
        return True

    def _bring_back(self, layout: Layout, fetch: Fetch, active: list[int], offers: list[Offer], give_up: bool
                    ) -> tuple[dict[int, np.ndarray], dict[int, int]]:
        """The dead owners' payloads, here where this rank receives them, and their sizes
        (collective): from the live holders of their copies. Sets ``given_up``, ``bytes_moved``
        and ``last_recovery``."""
        world = self.world
        current = self._chain.current
        known = world.allgather({o: n for o, n in (current.nbytes.items() if current else ()) if o in fetch.dead})
        nbytes = {o: n for part in known for o, n in part.items()}
        t0 = time.perf_counter()
        chosen, self.given_up, checked = choose(world, layout, fetch, nbytes, self.chunk_bytes, self.replication,
                                                lambda p: self._sums.intact(self._held(p)), give_up)
        fetched, self.bytes_moved, phases = transfer(world, chosen, fetch.receiver, nbytes, self.chunk_bytes,
                                                     lambda p: self._held(p).data)
        self.last_recovery = {"fetch": time.perf_counter() - t0, "check": checked, **phases}
        return fetched, nbytes

    def fall_back(self) -> int | None:
        """Make the newest older version that every active rank keeps the current one, dropping the
        newer ones (collective; the same on every rank): a corruption found after the current
        version passed the integrity gate. Returns its number, or None (nothing changed) when no
        older version is kept on every rank (``keep=1``, or a failure since: see ``keep``)."""
        self._sums.settle()
        target = newest_common(self.world.allgather(self._chain.older))
        if target is not None:
            self._chain.fall_back(target)
        return target

    # -------------------------------------------------------------- commit
    def _commit(self, contents: Mapping[int, Mapping[str, Any]], version: int,
                unreplicated: frozenset[str] = frozenset()) -> None:
        self._sums.settle()  # the last commit's checksums, before any buffer changes hands
        world = self.world
        t0 = time.perf_counter()
        try:
            segments, replicated, bad_input = *to_segments(contents, unreplicated), None
        except ConfigError as exc:  # told to every rank below, so that no rank waits for this one
            segments, replicated, bad_input = [], 0, str(exc)
        total = sum(s.nbytes for s in segments)
        sent: _Sent | None = None
        try:  # phase one; errors are recorded, then every rank votes (never an Agree half the ranks skip)
            sent = self._send_copies(segments, total, replicated, version, bad_input)
        except ProcessFailure:
            pass
        # Phase two: the new copies become current only if every rank got this far.
        try:
            self.world.vote(sent is not None, "a rank could not finish its part of the transfer")
        except ProcessFailure:
            self._backing.abandon(self.version)
            raise
        assert sent is not None
        t4 = time.perf_counter()
        me = int(world.logical_rank)
        retired = self._chain.retiring()  # its buffers are the new version's to reuse
        payload = self._backing.keep(version, segments, total, retired.payloads.get(me) if retired else None,
                                     retired.buffer if retired else None, lambda: world.job.host_peers)
        self._chain.push(Version(version, sent.layout, sent.sizes, {me: payload}, sent.held, True, sent.buffer,
                                 sent.parity))
        if sent.hash_later:  # the holder checks what it keeps, off everyone's path: from here, not while the
            self._sums.take(sent.held, later=True)  # peers' exchanges still run (it took their cores: the vote waited)
        t5 = time.perf_counter()
        world.job.note_commit()
        t1, t2, t3 = sent.seconds
        world.events.emit("committed", version=version, bytes_out=self.bytes_moved,
                          durations={"prepare": t1 - t0, "exchange": t2 - t1, "checksum": t3 - t2,
                                     "vote": t4 - t3, "pack": t5 - t4, **sent.phases},
                          payload_bytes=int(total), replicated_bytes=int(replicated),
                          held_chunks=sum(h.piece.count for h in sent.held.values()), replicated=True)

    def _send_copies(self, segments: list[np.ndarray], total: int, replicated: int, version: int,
                     bad_input: str | None) -> _Sent:
        """A commit's phase one (collective): the version checked alike everywhere, this rank's
        pieces sent to their holders and the copies of others' received, what the backing keeps
        before the vote staged. ``ProcessFailure`` when a rank died on the way."""
        world = self.world
        me = int(world.logical_rank)
        # Steady (every rank's payload the size it was at the last commit of this generation): the
        # holders know what comes, and the version check needs no announcement after it.
        shape = (world.generation, replicated)
        steady = world.agree_equal(version, ok=bad_input is None and self._told is not None and self._told[0] == shape)
        if not steady:  # the first commit of a generation, a size changed, or a refusal: said in full
            self._check_together(version, bad_input)
        if self._layout is None or self._layout[0] != world.generation:  # once per generation
            self._layout = (world.generation, layout_of(world, self._domains))
        layout = self._layout[1]
        mine = pieces(layout, me, -(-replicated // self.chunk_bytes), self.replication)
        if len(layout.ranks) < self.replication and not self._said_reduced:
            self._said_reduced = True  # shrunk below the replication: fewer copies than asked for
            world.events.emit("replication_reduced", replication=self.replication, ranks=len(layout.ranks))
        ranks = world.logical_ranks  # built from the membership table: read once
        if not steady:
            self._told = (shape, announce(world, mine, ranks, replicated))
        assert self._told is not None
        outgoing: dict[int, list[np.ndarray]] = {p.holder: [] for p in mine}
        for p in mine:
            outgoing[p.holder].extend(byte_slices(segments, *self._span(p.first, p.count, replicated)))
        buffer, held, incoming, sizes = receive(self._told[1], ranks, me, self.chunk_bytes,
                                                lambda nbytes: self._backing.receive_buffer(nbytes, version))
        sizes = {me: replicated, **sizes}
        t1 = time.perf_counter()
        self.bytes_moved = world.exchange(outgoing, incoming, point="commit", step=version)
        t2 = time.perf_counter()
        hash_later = not self._backing.checksums_first and buffer.nbytes > INLINE_BYTES
        if not hash_later:  # (a few kilobytes, a per-step point's: cheaper than a thread)
            self._sums.take(held, later=False)
        self._backing.stage(version, segments, total, lambda payload: manifest(
            me, self.chunk_bytes, self.way, layout, sizes, (int(payload.nbytes), self._sums.of(payload)),
            buffer, held))
        return _Sent(layout, sizes, held, buffer, hash_later, (t1, t2, time.perf_counter()))

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

    # -------------------------------------------------------------- recovery
    def _status(self) -> tuple[int | None, bool, tuple[int, ...]]:
        """(version held, every copy the layout gives me is here, owners whose whole payload is here)."""
        current = self._chain.current
        if current is None:
            return None, False, ()
        return current.number, current.complete, tuple(self.owners_here())

    def _keep_fetched(self, number: int, layout: Layout, nbytes: Mapping[int, int],
                      fetched: dict[int, np.ndarray]) -> None:
        """What a recovery brought here joins the version (local): a replacement's own payload, and
        none of the copies it should hold yet; a shrink's adopter's new payloads."""
        me = int(self.world.logical_rank)
        if me in fetched:
            self._chain.only(Version(number, layout, {me: nbytes[me]}, {me: fetched.pop(me)}, {}, complete=False))
        elif me in self.given_up:  # a replacement whose state is gone: the version, with no payload
            self._chain.only(Version(number, layout, {}, {}, {}, complete=False))
        current = self._chain.current
        if current is not None:
            current.payloads.update(fetched)
            current.nbytes.update({o: nbytes[o] for o in fetched})

    # ------------------------------------------------------- tier 2: a relaunch's attach (``_backing``)
    def _recoverable(self, layout: Layout, dead: list[int], live: set[int], sizes: Mapping[int, int]) -> bool:
        return copies_recoverable(self.chunk_bytes, self.replication)(layout, dead, live, sizes)

    def _attached(self, me: int, number: int, doc: dict[str, Any], own: np.ndarray | None,
                  buffer: np.ndarray | None) -> Version:
        return attached_copies(me, number, doc, own, buffer)

    def _held(self, p: Piece) -> Held:
        assert self._chain.current is not None
        return self._chain.current.held[(p.owner, p.copy, p.first)]

    def _span(self, first: int, count: int, total: int) -> tuple[int, int]:
        """(byte offset, size) of chunks [first, first + count) in a payload of ``total`` bytes."""
        start = first * self.chunk_bytes
        return start, min(total, (first + count) * self.chunk_bytes) - start

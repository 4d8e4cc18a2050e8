"""A ReStore-style replicated in-memory store: a dead rank's state comes back from its peers.

Each active rank commits named arrays. They are packed into one payload, cut
into chunks, and every chunk is copied to ``replication - 1`` other ranks (see
``_placement``). A commit is two-phase: copies are staged, then a ULFM Agree
vote (uniform: it succeeds everywhere or fails everywhere) makes the staged
version current. A failure anywhere in a commit leaves the last agreed version
on every survivor.

Memory: a rank holds its own committed payload plus the copies it keeps for
others, about ``replication`` x its state; during a commit the staged version
sits beside the current one, so at most ``2 x replication`` x state.
"""
from __future__ import annotations

import dataclasses
import socket
import time
from typing import Any, Callable, Mapping

import numpy as np
import xxhash
from elastic.comm import ConfigError, ProcessFailure, World, agreed

from ._placement import Chunk, DataLost, place_replicas, plan_transfers

# Who takes a removed rank's state after a shrink: removed -> survivor, or a function of (removed, survivors).
Adopt = Mapping[int, int] | Callable[[list[int], list[int]], Mapping[int, int]]


def checksum(data: np.ndarray) -> int:
    """A chunk's checksum: 64-bit XXH3, ~20 GB/s here (zlib's CRC32 ran at ~2.5 GB/s and was
    a third of a commit's time)."""
    return xxhash.xxh3_64_intdigest(data.data)


@dataclasses.dataclass(frozen=True)
class _Field:
    owner: int            # logical rank whose state this is
    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int


@dataclasses.dataclass(frozen=True)
class _Meta:
    """What one rank committed: its fields and the checksum of every chunk."""

    fields: tuple[_Field, ...]
    nbytes: int
    sums: tuple[int, ...]


@dataclasses.dataclass
class _Version:
    number: int
    ranks: tuple[int, ...]                    # logical ranks that committed it
    metas: dict[int, _Meta]                   # by the committing (host) logical rank
    placement: dict[Chunk, tuple[int, ...]]
    payload: np.ndarray                       # this rank's own packed state
    held: dict[Chunk, np.ndarray]             # copies kept for others (views into `received`)
    received: np.ndarray | None = None        # the buffer the copies arrived in


class ReplicatedStore:
    """Replicates every active rank's state in its peers' memory. Create on every active rank."""

    def __init__(self, world: World, replication: int = 2, chunk_bytes: int = 1 << 20,
                 domains: Mapping[int, str] | None = None) -> None:
        if replication < 1:
            raise ConfigError(f"replication={replication}: need at least 1 (2 survives one failure)")
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
        # The retired version's buffers, reused by the next commit: fresh memory costs a page
        # fault per 4 KiB, which made a cold commit several times slower than a warm one.
        self._pool: list[np.ndarray] = []
        self.bytes_moved = 0  # by this rank in the last commit or recovery
        self._said_reduced = False
        self.last_recovery: dict[str, float] = {}  # seconds: fetch (from peers), rereplicate

    # ------------------------------------------------------------ user calls
    @property
    def version(self) -> int | None:
        """The last agreed version (None before the first commit)."""
        return self._current.number if self._current else None

    def commit(self, state: Mapping[str, Any], version: int) -> None:
        """Replicate ``state`` (name -> array) as ``version`` (collective over the active ranks).

        Raises:
            ProcessFailure: a rank died; the previous version stays current everywhere.
            ConfigError: versions differ across ranks, or a value is not an array.
        """
        me = int(self.world.logical_rank)
        self._commit({me: state}, version)

    def restore(self) -> dict[str, np.ndarray]:
        """This rank's own state at the last agreed version (local, copies)."""
        return self.restore_owner(int(self.world.logical_rank))

    def restore_owner(self, owner: int) -> dict[str, np.ndarray]:
        """The state of logical rank ``owner`` held in this rank's payload (local, copies)."""
        if self._current is None:
            raise ConfigError("nothing committed yet: call commit() before restore()")
        meta = self._current.metas[int(self.world.logical_rank)]
        out = {name: array.copy() for name, array in self._fields_of(self._current.payload, meta, owner).items()}
        if not out:
            raise ConfigError(f"logical rank {owner}'s state is not held here (held: {self.owners_here()})")
        return out

    def owners_here(self) -> list[int]:
        """Logical ranks whose state this rank's payload holds (itself, plus adopted ones after a shrink)."""
        if self._current is None:
            return []
        return sorted({f.owner for f in self._current.metas[int(self.world.logical_rank)].fields})

    def recover(self, adopt: Adopt | None = None) -> bool:
        """Bring the dead ranks' state back from peers' memory (collective over the new active ranks).

        Call right after ``World.recover()``; who needs what is derived from
        which ranks still hold the agreed version, so a recovery interrupted by
        another failure is simply called again. A replacement (spare or spawned)
        receives its logical rank's state; after a shrink, the state of each
        removed logical rank goes to ``adopt[removed] -> surviving logical rank``
        (``adopt`` may also be a function of (removed, survivors) giving that
        mapping, the same on every rank; default: round-robin over the survivors). Corrupted copies are detected
        by checksum and fetched from another replica. Ends by re-replicating the
        agreed version over the new world, so the next failure is survivable.

        Returns False (on every rank) when no version was ever committed: nothing to recover.

        Raises:
            DataLost: every replica of some chunk died (same error on every rank).
            ProcessFailure: another failure during recovery; recover the world again, then this.
        """
        world = self.world
        me = int(world.logical_rank)
        active = [int(r) for r in world.logical_ranks]
        held = world.allgather(self._current.number if self._current else None)
        if all(v is None for v in held):
            return False  # nothing was ever committed: nothing to recover
        root = next(i for i, v in enumerate(held) if v is not None)
        mine = self._current
        number, ranks, metas, placement = world.bcast(
            (mine.number, mine.ranks, mine.metas, mine.placement) if mine is not None and world.rank == root else None,
            root=root)
        version = _Version(number, ranks, metas, placement, np.empty(0, np.uint8), {})
        holders = {r for r, v in zip(active, held) if v == number}
        # Dead: committed the version but no live process holds it now (killed, replaced, or removed).
        dead = set(ranks) - holders
        survivors = sorted(holders)
        removed = sorted(set(ranks) - set(active))
        if adopt is None:
            adopt = {o: survivors[i % len(survivors)] for i, o in enumerate(removed)}
        elif callable(adopt):
            adopt = adopt(removed, survivors)
        receiver = {o: (o if o in active else int(adopt[o])) for o in dead}
        mine_before = self._current if me in holders else None
        t0 = time.perf_counter()
        chunks = self._fetch(version, dead, receiver)
        t1 = time.perf_counter()
        moved = self.bytes_moved
        if set(active) == set(ranks):
            # Substitution: the placement is unchanged, so only the copies the dead ranks held
            # are missing; everyone else keeps the version as it is.
            self._repair(version, dead, chunks)
        else:
            self._recommit(version, dead, receiver, chunks, mine_before)
        self.bytes_moved += moved
        self.last_recovery = {"fetch": t1 - t0, "rereplicate": time.perf_counter() - t1}
        world.events.emit("store_recovered", version=version.number, dead=sorted(dead),
                          bytes_moved=self.bytes_moved, durations=self.last_recovery)
        return True

    # -------------------------------------------------------------- internals
    def _repair(self, version: _Version, dead: set[int], chunks: Mapping[Chunk, np.ndarray]) -> None:
        """Give each replacement its payload (fetched) and the copies it should hold (collective).

        Every chunk it should hold comes from that chunk's owner, whose payload is
        whole again by now; the vote installs the version on the replacements only.
        """
        me = int(self.world.logical_rank)
        n_chunks = {o: len(m.sums) for o, m in version.metas.items()}
        if me in dead:
            payload = np.concatenate([chunks[(me, c)] for c in range(n_chunks[me])]) \
                if n_chunks[me] else np.empty(0, np.uint8)
        else:
            assert self._current is not None  # a rank that is not a replacement held the version
            payload = self._current.payload
        outgoing: dict[int, list[np.ndarray]] = {}
        for c in range(n_chunks[me]):
            for holder in version.placement[(me, c)][1:]:
                if holder in dead:
                    outgoing.setdefault(holder, []).append(self._chunk(payload, c))
        kept = {src: [c for c in range(n) if me in version.placement[(src, c)][1:]]
                for src, n in n_chunks.items() if src != me} if me in dead else {}
        incoming = {src: [self._chunk_size(version.metas[src].nbytes, c) for c in cs]
                    for src, cs in kept.items() if cs}
        try:
            received, into = self._exchange(outgoing, incoming, version.number, point="restore", pooled=True)
            ok = True
        except ProcessFailure:
            ok = False
        self._vote(ok)
        if me in dead:
            held = {(src, c): data for src, cs in kept.items() if cs for c, data in zip(cs, received[src])}
            self._install(_Version(version.number, version.ranks, version.metas, version.placement,
                                   payload, held, into))

    def _recommit(self, version: _Version, dead: set[int], receiver: Mapping[int, int],
                  chunks: Mapping[Chunk, np.ndarray], mine_before: _Version | None) -> None:
        """After a shrink: commit the same version again over the new world, adopted state included."""
        me = int(self.world.logical_rank)
        # What each rank re-commits: what it had, plus what it received.
        contents: dict[int, dict[str, np.ndarray]] = {}
        if mine_before is not None:
            for owner in {f.owner for f in mine_before.metas[me].fields}:
                contents[owner] = self._fields_of(mine_before.payload, mine_before.metas[me], owner)
        for host in sorted(dead):
            if receiver[host] == me:
                meta = version.metas[host]
                payload = np.concatenate([chunks[(host, c)] for c in range(len(meta.sums))]) \
                    if meta.sums else np.empty(0, np.uint8)
                for owner in {f.owner for f in meta.fields}:
                    contents[owner] = self._fields_of(payload, meta, owner)
        self._commit(contents, version.number)

    @staticmethod
    def _fields_of(payload: np.ndarray, meta: _Meta, owner: int) -> dict[str, np.ndarray]:
        return {f.name: payload[f.offset:f.offset + f.nbytes].view(f.dtype).reshape(f.shape)
                for f in meta.fields if f.owner == owner}

    def _domain_map(self, ranks: list[int]) -> dict[int, str]:
        """Failure domain of each rank: given, configured (``ELASTIC_DOMAINS``), else its host (collective)."""
        if self._domains is not None:
            return {r: self._domains[r] for r in ranks}
        names = self.world.config.domains
        if names:
            return {r: names[r % len(names)] for r in ranks}
        return dict(zip(ranks, self.world.allgather(socket.gethostname())))

    def _commit(self, contents: Mapping[int, Mapping[str, Any]], version: int) -> None:
        world = self.world
        me = int(world.logical_rank)
        ranks = [int(r) for r in world.logical_ranks]
        try:
            t0 = time.perf_counter()
            payload, meta = self._pack(contents)
            bad_input = None
        except ConfigError as exc:  # told to every rank below, so that no rank waits for this one
            payload, meta, bad_input = np.empty(0, np.uint8), _Meta((), 0, ()), str(exc)
        error: Exception | None = None
        try:  # phase one; errors are recorded, then every rank votes (never an Agree half the ranks skip)
            metas_list = world.allgather((version, meta, bad_input))  # the same list everywhere, or a failure
            problems = [f"logical rank {r}: {p}" for r, (_, _, p) in zip(ranks, metas_list) if p]
            if problems:
                raise agreed(ConfigError("commit rejected, nothing was replaced: " + "; ".join(problems)), final=False)
            versions = {v for v, _, _ in metas_list}
            if len(versions) != 1:
                raise agreed(ConfigError(f"commit version differs across ranks: {sorted(versions)}; every rank "
                                         "must commit the same version together"), final=False)
            metas = dict(zip(ranks, (m for _, m, _ in metas_list)))
            domains = self._domain_map(ranks)
            placement = place_replicas(ranks, domains, self.replication, {r: len(metas[r].sums) for r in ranks})
            if len(ranks) < self.replication and not self._said_reduced:
                self._said_reduced = True  # shrunk below the replication: fewer copies than asked for
                world.events.emit("replication_reduced", replication=self.replication, ranks=len(ranks))
            outgoing: dict[int, list[np.ndarray]] = {}
            for c in range(len(meta.sums)):
                for holder in placement[(me, c)][1:]:
                    outgoing.setdefault(holder, []).append(self._chunk(payload, c))
            kept = {src: [c for c in range(len(metas[src].sums)) if me in placement[(src, c)][1:]]
                    for src in ranks if src != me}
            incoming = {src: [self._chunk_size(metas[src].nbytes, c) for c in cs] for src, cs in kept.items() if cs}
            t1 = time.perf_counter()
            received, into = self._exchange(outgoing, incoming, version, point="commit", pooled=True)
            t2 = time.perf_counter()
            held = {(src, c): data for src, cs in kept.items() if cs for c, data in zip(cs, received[src])}
            staged = _Version(version, tuple(ranks), metas, placement, payload, held, into)
        except ProcessFailure as exc:
            error = exc
        # Phase two: the staged copies become current only if every rank got this far.
        self._vote(error is None)
        t3 = time.perf_counter()
        self._install(staged)
        world.note_commit()
        world.events.emit("committed", version=version, bytes_out=self.bytes_moved,
                          durations={"prepare": t1 - t0, "exchange": t2 - t1, "vote": t3 - t2},
                          payload_bytes=int(payload.nbytes), held_chunks=len(held))

    def _fetch(self, version: _Version, dead: set[int], receiver: Mapping[int, int]) -> dict[Chunk, np.ndarray]:
        """Move every chunk of the dead ranks to its receiver, verified by checksum (collective)."""
        world = self.world
        me = int(world.logical_rank)
        bad: dict[Chunk, set[int]] = {}
        got: dict[Chunk, np.ndarray] = {}
        pending = {chunk for chunk in version.placement if chunk[0] in dead}  # the same on every rank
        while True:
            placement = {chunk: tuple(h for h in holders if h not in bad.get(chunk, ()))
                         for chunk, holders in version.placement.items()}
            try:
                plan = plan_transfers(placement, dead)
            except DataLost as exc:  # the same on every rank: everyone planned from the same agreed data
                world.events.emit("data_lost", lost=exc.lost)
                raise agreed(exc) from None
            plan = {chunk: sender for chunk, sender in plan.items() if chunk in pending}
            outgoing: dict[int, list[np.ndarray]] = {}
            order: dict[int, list[Chunk]] = {}
            for chunk in sorted(plan):
                sender, dest = plan[chunk], receiver[chunk[0]]
                if sender == me and self._current is not None:
                    outgoing.setdefault(dest, []).append(self._current.held[chunk])
                if dest == me:
                    order.setdefault(sender, []).append(chunk)
            incoming = {src: [self._chunk_size(version.metas[o].nbytes, c) for o, c in chunks]
                        for src, chunks in order.items()}
            try:
                received, _ = self._exchange(outgoing, incoming, version.number, point="restore")
                failed = False
            except ProcessFailure:
                received, failed = {}, True
            self._vote(not failed)
            corrupt: list[Chunk] = []
            for src, chunks in order.items():
                for chunk, data in zip(chunks, received[src]):
                    if checksum(data) == version.metas[chunk[0]].sums[chunk[1]]:
                        got[chunk] = data
                    else:
                        corrupt.append(chunk)
                        world.events.emit("corrupt_copy", owner=chunk[0], chunk=chunk[1], holder=src)
            reports = world.allgather([(chunk, plan[chunk]) for chunk in corrupt])
            if not any(reports):
                world.events.emit("restored", chunks=len(got), bytes_in=int(sum(c.nbytes for c in got.values())),
                                  bytes_out=self.bytes_moved)
                return got
            pending = set()
            for report in reports:  # fetch corrupted chunks again, from another holder
                for chunk, holder in report:
                    bad.setdefault(tuple(chunk), set()).add(holder)
                    pending.add(tuple(chunk))

    def _vote(self, ok: bool) -> None:
        """Uniform decision over the active ranks: returns on all or raises ProcessFailure on all."""
        self.world.vote(ok, "a rank could not finish its part of the transfer")

    def _exchange(self, outgoing: Mapping[int, list[np.ndarray]], incoming: Mapping[int, list[int]],
                  step: int | None, point: str, pooled: bool = False) -> tuple[dict[int, list[np.ndarray]], np.ndarray]:
        """Chunks to and from peers by logical rank (collective, ``World.exchange``); they arrive in a
        pooled buffer when ``pooled``. Records the bytes this rank sent."""
        buffer = self._buffer if pooled else (lambda n: np.empty(n, np.uint8))
        received, into, self.bytes_moved = self.world.exchange(outgoing, incoming, buffer, point,
                                                                step if point == "commit" else None)
        return received, into

    def _pack(self, contents: Mapping[int, Mapping[str, Any]]) -> tuple[np.ndarray, _Meta]:
        """Copy the state into one payload (a reused buffer where one fits) and checksum its chunks."""
        fields, parts, offset = [], [], 0
        for owner in sorted(contents):
            for name in sorted(contents[owner]):
                array = _as_array(contents[owner][name], name)
                fields.append(_Field(owner, name, array.dtype.str, tuple(array.shape), offset, array.nbytes))
                parts.append(array)
                offset += array.nbytes
        payload = self._buffer(offset)
        for field, array in zip(fields, parts):
            payload[field.offset:field.offset + field.nbytes].view(array.dtype).reshape(array.shape)[...] = array
        n_chunks = -(-payload.nbytes // self.chunk_bytes)
        sums = tuple(checksum(self._chunk(payload, c)) for c in range(n_chunks))
        return payload, _Meta(tuple(fields), payload.nbytes, sums)

    def _buffer(self, nbytes: int) -> np.ndarray:
        """A byte buffer of ``nbytes``: a pooled one of exactly that size, else fresh memory (local)."""
        for i, buf in enumerate(self._pool):
            if buf.nbytes == nbytes:
                return self._pool.pop(i)
        return np.empty(nbytes, np.uint8)

    def _install(self, version: _Version) -> None:
        """Make ``version`` current; the one it replaces lends its buffers to the next commit."""
        old, self._current = self._current, version
        self._pool = [] if old is None else [b for b in (old.payload, old.received) if b is not None and b.nbytes]

    def _chunk(self, payload: np.ndarray, c: int) -> np.ndarray:
        return payload[c * self.chunk_bytes:(c + 1) * self.chunk_bytes]

    def _chunk_size(self, nbytes: int, c: int) -> int:
        return min(self.chunk_bytes, nbytes - c * self.chunk_bytes)


def _as_array(value: Any, name: str) -> np.ndarray:
    if hasattr(value, "__cuda_array_interface__") and hasattr(value, "get"):
        value = value.get()  # cupy: through host memory (ULFM's ob1 PML does not move GPU buffers)
    elif hasattr(value, "detach") and hasattr(value, "cpu"):
        value = value.detach().cpu().numpy()  # torch
    array = np.asarray(value)
    if array.dtype == object:
        raise ConfigError(f"state entry {name!r} is a {type(value).__name__}, not an array: "
                          "commit numpy arrays, torch tensors or cupy arrays (numbers as np.asarray(x))")
    return array

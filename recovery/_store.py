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
import os
import socket
import time
import zlib
from typing import Any, Mapping

import numpy as np
from mpi4py import MPI

from elastic.comm import ConfigError, ProcessFailure, World, mpi_errors

from ._placement import Chunk, DataLost, place_replicas, plan_transfers

DOMAINS_ENV = "ELASTIC_DOMAINS"  # comma-separated failure domain per logical rank, for tests


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
    crcs: tuple[int, ...]


@dataclasses.dataclass
class _Version:
    number: int
    ranks: tuple[int, ...]                    # logical ranks that committed it
    metas: dict[int, _Meta]                   # by the committing (host) logical rank
    placement: dict[Chunk, tuple[int, ...]]
    payload: np.ndarray                       # this rank's own packed state
    held: dict[Chunk, np.ndarray]             # copies kept for others


class ReplicatedStore:
    """Replicates every active rank's state in its peers' memory. Create on every active rank."""

    def __init__(self, world: World, replication: int = 2, chunk_bytes: int = 1 << 20,
                 domains: Mapping[int, str] | None = None) -> None:
        if replication < 1:
            raise ConfigError(f"replication={replication}: need at least 1 (2 survives one failure)")
        if chunk_bytes < 1:
            raise ConfigError(f"chunk_bytes={chunk_bytes}: must be positive")
        self.world = world
        self.replication = replication
        self.chunk_bytes = chunk_bytes
        self._domains = dict(domains) if domains is not None else None
        self._current: _Version | None = None
        self.bytes_moved = 0  # by this rank in the last commit or recovery
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
            raise KeyError(f"logical rank {owner}'s state is not held here")
        return out

    def owners_here(self) -> list[int]:
        """Logical ranks whose state this rank's payload holds (itself, plus adopted ones after a shrink)."""
        if self._current is None:
            return []
        return sorted({f.owner for f in self._current.metas[int(self.world.logical_rank)].fields})

    def recover(self, adopt: Mapping[int, int] | None = None) -> None:
        """Bring the dead ranks' state back from peers' memory (collective over the new active ranks).

        Call right after ``World.recover()``; who needs what is derived from
        which ranks still hold the agreed version, so a recovery interrupted by
        another failure is simply called again. A replacement (spare or spawned)
        receives its logical rank's state; after a shrink, the state of each
        removed logical rank goes to ``adopt[removed] -> surviving logical rank``
        (default: round-robin over the survivors). Corrupted copies are detected
        by checksum and fetched from another replica. Ends by re-replicating the
        agreed version over the new world, so the next failure is survivable.

        Raises:
            DataLost: every replica of some chunk died (same error on every rank).
            ProcessFailure: another failure during recovery; recover the world again, then this.
        """
        world = self.world
        me = int(world.logical_rank)
        active = [int(r) for r in world.logical_ranks]
        with mpi_errors(world.comm):
            held = world.comm.allgather(self._current.number if self._current else None)
            if all(v is None for v in held):
                raise ConfigError("no version was ever committed: nothing to recover")
            root = next(i for i, v in enumerate(held) if v is not None)
            number, ranks, metas, placement = world.comm.bcast(
                (self._current.number, self._current.ranks, self._current.metas, self._current.placement)
                if world.rank == root else None, root=root)
        version = _Version(number, ranks, metas, placement, np.empty(0, np.uint8), {})
        holders = {r for r, v in zip(active, held) if v == number}
        # Dead: committed the version but no live process holds it now (killed, replaced, or removed).
        dead = set(ranks) - holders
        survivors = sorted(holders)
        if adopt is None:
            removed = sorted(set(ranks) - set(active))
            adopt = {o: survivors[i % len(survivors)] for i, o in enumerate(removed)}
        receiver = {o: (o if o in active else int(adopt[o])) for o in dead}
        mine_before = self._current if me in holders else None
        t0 = time.perf_counter()
        chunks = self._fetch(version, dead, receiver)
        t1 = time.perf_counter()
        # What each rank re-commits: what it had, plus what it received.
        contents: dict[int, dict[str, np.ndarray]] = {}
        if mine_before is not None:
            for owner in {f.owner for f in mine_before.metas[me].fields}:
                contents[owner] = self._fields_of(mine_before.payload, mine_before.metas[me], owner)
        for host in sorted(dead):
            if receiver[host] == me:
                meta = version.metas[host]
                payload = np.concatenate([chunks[(host, c)] for c in range(len(meta.crcs))]) \
                    if meta.crcs else np.empty(0, np.uint8)
                for owner in {f.owner for f in meta.fields}:
                    contents[owner] = self._fields_of(payload, meta, owner)
        moved = self.bytes_moved
        self._commit(contents, version.number)
        self.bytes_moved += moved
        self.last_recovery = {"fetch": t1 - t0, "rereplicate": time.perf_counter() - t1}
        world.events.emit("store_recovered", version=version.number, dead=sorted(dead),
                          bytes_moved=self.bytes_moved, durations=self.last_recovery)

    # -------------------------------------------------------------- internals
    @staticmethod
    def _fields_of(payload: np.ndarray, meta: _Meta, owner: int) -> dict[str, np.ndarray]:
        return {f.name: payload[f.offset:f.offset + f.nbytes].view(f.dtype).reshape(f.shape)
                for f in meta.fields if f.owner == owner}

    def _domain_map(self, ranks: list[int]) -> dict[int, str]:
        if self._domains is not None:
            return {r: self._domains[r] for r in ranks}
        text = os.environ.get(DOMAINS_ENV)
        if text:
            names = text.split(",")
            return {r: names[r % len(names)] for r in ranks}
        hosts = self.world.comm.allgather(socket.gethostname())
        return dict(zip(ranks, hosts))

    def _commit(self, contents: Mapping[int, Mapping[str, Any]], version: int) -> None:
        world = self.world
        comm = world.comm
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
            with mpi_errors(comm):
                metas_list = comm.allgather((version, meta, bad_input))
            problems = [f"logical rank {r}: {p}" for r, (_, _, p) in zip(ranks, metas_list) if p]
            if problems:
                raise ConfigError("commit rejected, nothing was replaced: " + "; ".join(problems))
            versions = {v for v, _, _ in metas_list}
            if len(versions) != 1:
                # Every rank sees the same list, so every rank raises the same error.
                raise ConfigError(f"commit version differs across ranks: {sorted(versions)}; "
                                  "every rank must commit the same version together")
            metas = dict(zip(ranks, (m for _, m, _ in metas_list)))
            domains = self._domain_map(ranks)
            placement = place_replicas(ranks, domains, self.replication,
                                       {r: len(metas[r].crcs) for r in ranks})
            outgoing: dict[int, list[np.ndarray]] = {}
            for c in range(len(meta.crcs)):
                for holder in placement[(me, c)][1:]:
                    outgoing.setdefault(holder, []).append(self._chunk(payload, c))
            kept = {src: [c for c in range(len(metas[src].crcs)) if me in placement[(src, c)][1:]]
                    for src in ranks if src != me}
            incoming = {src: [self._chunk_size(metas[src].nbytes, c) for c in cs] for src, cs in kept.items() if cs}
            t1 = time.perf_counter()
            received = self._exchange(outgoing, incoming, version, point="commit")
            t2 = time.perf_counter()
            held = {(src, c): data for src, cs in kept.items() if cs for c, data in zip(cs, received[src])}
            staged = _Version(version, tuple(ranks), metas, placement, payload, held)
        except ProcessFailure as exc:
            error = exc
        # Phase two: the staged copies become current only if every rank got this far.
        self._vote(error is None)
        t3 = time.perf_counter()
        self._current = staged
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
            except DataLost as exc:
                world.events.emit("data_lost", lost=exc.lost)
                raise
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
                received = self._exchange(outgoing, incoming, version.number, point="restore")
                failed = False
            except ProcessFailure:
                received, failed = {}, True
            self._vote(not failed)
            corrupt: list[Chunk] = []
            for src, chunks in order.items():
                for chunk, data in zip(chunks, received[src]):
                    if zlib.crc32(data) == version.metas[chunk[0]].crcs[chunk[1]]:
                        got[chunk] = data
                    else:
                        corrupt.append(chunk)
                        world.events.emit("corrupt_copy", owner=chunk[0], chunk=chunk[1], holder=src)
            with mpi_errors(world.comm):
                reports = world.comm.allgather([(chunk, plan[chunk]) for chunk in corrupt])
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
        with mpi_errors(self.world.comm):
            if not self.world.comm.Agree(int(ok)):
                raise ProcessFailure("a rank could not finish its part of the transfer")

    def _exchange(self, outgoing: Mapping[int, list[np.ndarray]], incoming: Mapping[int, list[int]],
                  step: int, point: str) -> dict[int, list[np.ndarray]]:
        """Send chunks to peers and receive chunks of known sizes, keyed by logical rank.

        Collective over the active ranks (one Alltoallv): a failure surfaces on
        every rank instead of leaving a rank waiting on a peer's message.
        """
        world = self.world
        comm = world.comm
        ranks = [int(r) for r in world.logical_ranks]
        send_counts = [sum(c.nbytes for c in outgoing.get(r, [])) for r in ranks]
        expected = [sum(incoming.get(r, [])) for r in ranks]
        with mpi_errors(comm):
            recv_counts = comm.alltoall(send_counts)
            if recv_counts != expected:  # a planning bug, never silently mis-sliced data
                raise RuntimeError(f"store transfer plan differs across ranks: expected {expected} bytes "
                                   f"from ranks {ranks}, peers announced {recv_counts}")
            sendbuf = np.concatenate([c for r in ranks for c in outgoing.get(r, [])]) \
                if sum(send_counts) else np.empty(0, np.uint8)
            recvbuf = np.empty(sum(recv_counts), np.uint8)
            world.fault_point(step if point == "commit" else None, point)
            comm.Alltoallv([sendbuf, (send_counts, None), MPI.BYTE], [recvbuf, (recv_counts, None), MPI.BYTE])
        self.bytes_moved = sum(send_counts)
        received: dict[int, list[np.ndarray]] = {}
        offset = 0
        for r in ranks:
            for size in incoming.get(r, []):
                received.setdefault(r, []).append(recvbuf[offset:offset + size])
                offset += size
        return received

    def _pack(self, contents: Mapping[int, Mapping[str, Any]]) -> tuple[np.ndarray, _Meta]:
        fields, parts, offset = [], [], 0
        for owner in sorted(contents):
            for name in sorted(contents[owner]):
                array = _as_array(contents[owner][name], name)
                raw = np.ascontiguousarray(array).reshape(-1).view(np.uint8)
                fields.append(_Field(owner, name, array.dtype.str, tuple(array.shape), offset, raw.nbytes))
                parts.append(raw)
                offset += raw.nbytes
        payload = np.concatenate(parts) if parts else np.empty(0, np.uint8)
        n_chunks = -(-payload.nbytes // self.chunk_bytes)
        crcs = tuple(zlib.crc32(self._chunk(payload, c)) for c in range(n_chunks))
        return payload, _Meta(tuple(fields), payload.nbytes, crcs)

    def _chunk(self, payload: np.ndarray, c: int) -> np.ndarray:
        return payload[c * self.chunk_bytes:(c + 1) * self.chunk_bytes]

    def _chunk_size(self, nbytes: int, c: int) -> int:
        return min(self.chunk_bytes, nbytes - c * self.chunk_bytes)

    def corrupt_copy_for_test(self, owner: int) -> int:
        """Flip a byte in every copy of ``owner``'s chunks held here (integrity tests). Local; returns the count."""
        if self._current is None:
            return 0
        hit = 0
        for (o, c), data in sorted(self._current.held.items()):
            if o == owner and data.nbytes:
                self._current.held[(o, c)] = data.copy()
                self._current.held[(o, c)][0] ^= 0xFF
                hit += 1
        return hit


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

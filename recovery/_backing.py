"""Where a store's versions live: the one thing that differs between its three ways of keeping them.

The store's commit and recovery are the same whatever keeps the bytes; a
``Backing`` owns the buffers and what happens to them at each point of a
commit:

- ``ProcessMemory`` (the default): the roll-back payload and the copies held
  for others in this process; the roll-back copy is made after the vote, in the
  retired version's buffer, and the copies arrive in the buffer the retired
  version held.
- ``CallerArrays`` (``rollback_copy=False``): no roll-back copy at all; the
  caller keeps the committed arrays unchanged until the next commit.
- ``NodeMemory`` (tier 2, ``Config.node_store``): both in files in the node's
  memory (``_nodestore``), sealed with a manifest before the vote, so that a
  relaunch after the runtime's loss attaches them.

All of them are local: no communication. Beside ``NodeMemory`` is what serves it after a
relaunch: ``manifest`` (what a sealed version says of itself) and ``attach`` (collective: the
relaunched ranks agree on the newest version the surviving nodes hold whole, and keep it).
"""
from __future__ import annotations

import atexit
from typing import Any, Callable, Mapping, Protocol

import numpy as np
from elastic.comm import Group, ProcessFailure

from ._nodestore import NodeFiles
from ._parity import aligned_empty
from ._payload import Payload
from ._placement import DataLost, Layout, Piece, plan
from ._versions import Held, Version

# A version found in node memory: (its manifest, this rank's payload, the copies it held), either may be missing.
Found = tuple[dict[str, Any], np.ndarray | None, np.ndarray | None]


class Backing(Protocol):
    # The copies' checksums are needed before the vote (for the manifest); otherwise the store takes
    # them in the background, off the training's path.
    checksums_first: bool

    def receive_buffer(self, nbytes: int, version: int) -> np.ndarray:
        """Where a commit's copies of others' payloads land."""

    def stage(self, version: int, segments: list[np.ndarray], total: int,
              manifest: Callable[[np.ndarray], dict[str, Any]]) -> None:
        """Before the vote: whatever must already be kept if the vote succeeds and the process dies
        right after (``manifest(payload)`` describes the version)."""

    def keep(self, version: int, segments: list[np.ndarray], total: int, old: Payload | None,
             old_buffer: np.ndarray | None, peers: Callable[[], list[int]]) -> Payload:
        """After the vote: this rank's roll-back payload of ``version`` (``old`` and ``old_buffer``
        are the retired version's, free to reuse; ``peers()`` the logical ranks on this node)."""

    def abandon(self, current: int | None) -> None:
        """The vote failed: nothing of the new version stays; ``current`` is still the one."""

    def found(self, owner: int, chunk_bytes: int, way: str,
              sums: Callable[[np.ndarray], list[int]]) -> dict[int, Found]:
        """Versions of ``owner`` kept by a lost launch of the job by a store of the same chunk size
        and ``way`` (``copies:R``, ``xor:K``...), by number (a relaunch's attach)."""


def _pack(segments: list[np.ndarray], total: int, reuse: Payload | None) -> np.ndarray:
    """Copy the segments into one payload: the roll-back copy, in the retired version's buffer if it fits."""
    payload = reuse if isinstance(reuse, np.ndarray) and reuse.nbytes == total and reuse.flags.writeable else \
        np.empty(total, np.uint8)
    offset = 0
    for seg in segments:
        payload[offset:offset + seg.nbytes] = seg
        offset += seg.nbytes
    return payload


class ProcessMemory:
    """Everything in this process; the arrays may change as soon as ``commit`` returns. A commit's
    copies land in the buffer the retired version held: a fresh one is first touched inside the
    exchange (the kernel zeroing each page: 128 MB took a commit's exchange from ~45 to ~80 ms
    here), and the commit needs the room anyway, beside the current copies."""

    checksums_first = False

    def __init__(self) -> None:
        self._spare: np.ndarray | None = None

    def receive_buffer(self, nbytes: int, version: int) -> np.ndarray:
        spare, self._spare = self._spare, None  # aligned: parity's XOR runs in ISA-L's vector loads there
        return spare if spare is not None and spare.nbytes == nbytes else aligned_empty(nbytes)

    def stage(self, version: int, segments: list[np.ndarray], total: int,
              manifest: Callable[[np.ndarray], dict[str, Any]]) -> None:
        pass  # a process that dies takes its memory with it: nothing to keep beforehand

    def keep(self, version: int, segments: list[np.ndarray], total: int, old: Payload | None,
             old_buffer: np.ndarray | None, peers: Callable[[], list[int]]) -> Payload:
        self._spare = old_buffer
        return _pack(segments, total, old)  # after the vote: a failed commit copies nothing

    def abandon(self, current: int | None) -> None:
        pass

    def found(self, owner: int, chunk_bytes: int, way: str,
              sums: Callable[[np.ndarray], list[int]]) -> dict[int, Found]:
        return {}


class CallerArrays(ProcessMemory):
    """No roll-back copy: the committed arrays are the caller's, unchanged until the next commit; a
    commit copies nothing locally."""

    def keep(self, version: int, segments: list[np.ndarray], total: int, old: Payload | None,
             old_buffer: np.ndarray | None, peers: Callable[[], list[int]]) -> Payload:
        self._spare = old_buffer
        return segments


class NodeMemory:
    """Tier 2: this rank's payload and the copies it holds in files in the node's memory, each
    version sealed by a manifest before the vote; they outlive the process, and the job's
    directory goes when the job is over for good (``ended()``)."""

    checksums_first = True

    def __init__(self, root: str, logical: int, ended: Callable[[], bool]) -> None:
        self.files = NodeFiles(root, logical)
        self._logical = logical
        self._staged: np.ndarray | None = None
        _at_exit(self, ended)

    def receive_buffer(self, nbytes: int, version: int) -> np.ndarray:
        return self.files.create(version, "held", nbytes)

    def stage(self, version: int, segments: list[np.ndarray], total: int,
              manifest: Callable[[np.ndarray], dict[str, Any]]) -> None:
        self._staged = _pack(segments, total, self.files.create(version, "own", total))
        self.files.seal(version, manifest(self._staged))

    def keep(self, version: int, segments: list[np.ndarray], total: int, old: Payload | None,
             old_buffer: np.ndarray | None, peers: Callable[[], list[int]]) -> Payload:
        payload, self._staged = self._staged, None
        assert payload is not None, "keep() without stage()"
        self.files.retire(version)
        here = peers()
        if here and here[0] == self._logical:  # every rank sealed this version: ranks gone from here go
            self.files.prune(set(here))
        return payload

    def abandon(self, current: int | None) -> None:
        self._staged = None
        self.files.retire(current)  # this version's files: never voted

    def found(self, owner: int, chunk_bytes: int, way: str,
              sums: Callable[[np.ndarray], list[int]]) -> dict[int, Found]:
        out: dict[int, Found] = {}
        for doc in self.files.manifests():
            try:
                if (doc["owner"], doc["chunk_bytes"], doc["way"]) != (owner, chunk_bytes, way):
                    continue
                own = self.files.open(doc["version"], "own", doc["own"]["nbytes"])
                if own is not None and sums(own) != doc["own"]["sums"]:
                    own = None  # damaged, or written by something else: not this version's payload
                out[doc["version"]] = doc, own, self.files.open(doc["version"], "held", doc["held"]["nbytes"])
            except (KeyError, TypeError, ValueError):
                continue  # not a manifest this store wrote
        return out


def backing(node_store: str, logical: int, rollback_copy: bool, ended: Callable[[], bool]) -> Backing:
    """The backing a store uses: node memory when the job keeps its versions there (whatever the
    caller promises: the node needs its own copy), else in the process, with or without a roll-back copy."""
    if node_store:
        return NodeMemory(node_store, logical, ended)
    return ProcessMemory() if rollback_copy else CallerArrays()


# One exit hook for every node-memory backing of the process (not one per store), registered with the
# first: the job's files go when the job is over for good, and stay for a relaunch otherwise.
_NODE_BACKINGS: list[tuple[NodeMemory, Callable[[], bool]]] = []


def _at_exit(node: NodeMemory, ended: Callable[[], bool]) -> None:
    if not _NODE_BACKINGS:
        atexit.register(_remove_ended)
    _NODE_BACKINGS.append((node, ended))


def _remove_ended() -> None:
    for node, ended in _NODE_BACKINGS:
        if ended():
            node.files.remove()
    _NODE_BACKINGS.clear()


# ------------------------------------------------------------------ tier 2: a relaunch's attach
def manifest(owner: int, chunk_bytes: int, way: str, layout: Layout, sizes: Mapping[int, int],
             own: tuple[int, list[int]], buffer: np.ndarray, held: Mapping[tuple[int, int, int], Held],
             **more: Any) -> dict[str, Any]:
    """What a relaunch needs to find a version again and check it (local): ``own`` is this rank's
    payload's size and checksums; the copies' checksums are taken (``buffer``: where they lie;
    under parity, the parity blocks, described in ``more``)."""
    return {
        "owner": owner, "chunk_bytes": chunk_bytes, "way": way,
        "domains": [list(d) for d in layout.domains], "sizes": {str(o): n for o, n in sizes.items()},
        "own": {"nbytes": own[0], "sums": own[1]},
        "held": {"nbytes": int(buffer.nbytes), "pieces": [
            [h.piece.owner, h.piece.copy, h.piece.first, h.piece.count, h.offset, int(h.data.nbytes), h.sums]
            for h in held.values()]}, **more}


# Whether a version's dead owners come back: (its layout, the dead, the ranks holding their copies or
# parity, the payload sizes known) -> bool. Each way of keeping state has its own.
Recoverable = Callable[[Layout, list[int], set[int], Mapping[int, int]], bool]
# A found version as this rank's current one: (rank, number, manifest, own payload, copies) -> Version.
Attached = Callable[[int, int, dict[str, Any], "np.ndarray | None", "np.ndarray | None"], Version]


def copies_recoverable(chunk_bytes: int, replication: int) -> Recoverable:
    """Copies: every chunk of every dead owner has a copy on a live holder."""
    def recoverable(layout: Layout, dead: list[int], live: set[int], sizes: Mapping[int, int]) -> bool:
        try:
            plan(layout, dead, {o: -(-sizes[o] // chunk_bytes) for o in dead}, replication, live)
        except DataLost:
            return False
        return True
    return recoverable


def attach(world: Group, backing: Backing, chunk_bytes: int, way: str, sums: Callable[[np.ndarray], list[int]],
           keep: Callable[[Version], None], recoverable: Recoverable, attached: Attached) -> None:
    """A relaunch: take this rank's versions up from its node's memory, agree with the others on
    the newest one that the live nodes hold whole, and ``keep`` that one (collective over the
    active ranks). When none is whole, the newest is kept: the recovery then names what is lost."""
    me = int(world.logical_rank)
    offers = backing.found(me, chunk_bytes, way, sums)
    # What each rank holds, without the layout (O(ranks) each): it is sent once per version looked at.
    summary = {v: ({int(o): int(n) for o, n in doc["sizes"].items()}, own is not None, buffer is not None)
               for v, (doc, own, buffer) in offers.items()}
    try:
        everyone = world.allgather(summary)
    except ProcessFailure:
        if offers:  # lost during the attach: keep the newest here; the next recovery takes it from there
            keep(attached(me, max(offers), *offers[max(offers)]))
        raise

    def layout_of(version: int) -> Layout:  # collective: every rank asks for the same versions in turn
        root = next(i for i, offer in enumerate(everyone) if version in offer)
        layout: Layout = world.bcast(_layout(offers[version][0]["domains"]) if world.rank == root else None,
                                     root=root)
        return layout
    chosen = newest_whole(everyone, [int(r) for r in world.logical_ranks], layout_of, recoverable)
    world.events.emit("store_attached", versions=sorted(offers), chosen=chosen)
    if chosen is not None:
        world.job.note_commit()  # a version this job committed: losing it later is DataLost
        if chosen in offers:
            keep(attached(me, chosen, *offers[chosen]))


def attached_copies(me: int, number: int, doc: dict[str, Any], own: np.ndarray | None, buffer: np.ndarray | None
             ) -> Version:
    """An attached version, as this rank's current one (local)."""
    held = {}
    if buffer is not None:
        for owner, copy, first, count, offset, nbytes, sums in doc["held"]["pieces"]:
            held[(owner, copy, first)] = Held(Piece(owner, copy, first, count, me), buffer[offset:offset + nbytes],
                                              list(sums), offset)
    return Version(number, _layout(doc["domains"]), {int(o): int(n) for o, n in doc["sizes"].items()},
                   {me: own} if own is not None else {}, held, buffer is not None,
                   buffer if buffer is not None else np.empty(0, np.uint8))


def _layout(domains: list[list[int]]) -> Layout:
    return Layout.of({r: str(d) for d, members in enumerate(domains) for r in members})


# What one rank holds of a version, as the ranks tell it each other: {owner: payload bytes}, own payload, copies.
Kept = tuple[dict[int, int], bool, bool]


def newest_whole(offers: list[dict[int, Kept]], active: list[int], layout_of: Callable[[int], Layout],
                 recoverable: Recoverable) -> int | None:
    """The newest version that the ranks' offers hold whole: every owner's payload on a live rank,
    or ``recoverable`` from the live ranks' copies or parity (the same on every rank; ``layout_of``
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
        if recoverable(layout, dead, live, sizes):
            return v
    return versions[0] if versions else None

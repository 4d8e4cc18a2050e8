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

All of them are local: no communication.
"""
from __future__ import annotations

import atexit
from typing import Any, Callable, Protocol

import numpy as np

from ._nodestore import NodeFiles

# A payload: one byte array (header, then the fields), or the same as a list of arrays (the header,
# then each field where the caller keeps it: ``CallerArrays``).
Payload = np.ndarray | list[np.ndarray]
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

    def found(self, owner: int, chunk_bytes: int, replication: int,
              sums: Callable[[np.ndarray], list[int]]) -> dict[int, Found]:
        """Versions of ``owner`` kept by a lost launch of the job, by number (a relaunch's attach)."""


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
        spare, self._spare = self._spare, None
        return spare if spare is not None and spare.nbytes == nbytes else np.empty(nbytes, np.uint8)

    def stage(self, version: int, segments: list[np.ndarray], total: int,
              manifest: Callable[[np.ndarray], dict[str, Any]]) -> None:
        pass  # a process that dies takes its memory with it: nothing to keep beforehand

    def keep(self, version: int, segments: list[np.ndarray], total: int, old: Payload | None,
             old_buffer: np.ndarray | None, peers: Callable[[], list[int]]) -> Payload:
        self._spare = old_buffer
        return _pack(segments, total, old)  # after the vote: a failed commit copies nothing

    def abandon(self, current: int | None) -> None:
        pass

    def found(self, owner: int, chunk_bytes: int, replication: int,
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

    def found(self, owner: int, chunk_bytes: int, replication: int,
              sums: Callable[[np.ndarray], list[int]]) -> dict[int, Found]:
        out: dict[int, Found] = {}
        for doc in self.files.manifests():
            try:
                if (doc["owner"], doc["chunk_bytes"], doc["replication"]) != (owner, chunk_bytes, replication):
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

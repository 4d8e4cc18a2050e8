"""torch.distributed.checkpoint (DCP) into the replicated store: a storage in peers' memory.

``dcp.save(state_dict, storage_writer=PeerMemory(state))`` writes each rank's
items into ``state`` as per-rank values (``dcp.<logical rank>.<item>``, uint8
arrays) and the checkpoint's metadata on the coordinator (``dcp.meta.<rank>``);
the next ``state.commit()`` replicates them like any State value, so a dead
rank's items come back with the store (a spare or a spawned process gets them
as its own, a survivor adopts them after a shrink). ``dcp.load(state_dict,
storage_reader=PeerMemory(state))`` reads them back at any world size: DCP
plans which pieces of which saved chunks each rank needs (a 4-rank sharded
state onto 3 ranks), and ``read_data`` fetches the pieces other ranks hold in
one exchange over the World. The metadata travels as a ``wire`` document, not
pickled; the items' bytes are DCP's own (tensors raw, other values as
``torch.save`` writes them).
"""
from __future__ import annotations

import io
import json
from typing import Any

import numpy as np
import torch
from torch.distributed.checkpoint import Metadata, StorageReader, StorageWriter
from torch.distributed.checkpoint.metadata import (BytesStorageMetadata, ChunkStorageMetadata, MetadataIndex,
                                                   TensorProperties, TensorStorageMetadata)
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, SavePlan, SavePlanner
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from elastic.comm import ConfigError

from ._handlers import tensor_array
from ._state import State


class NothingSaved(ConfigError):
    """``dcp.load`` from peer memory before any ``dcp.save`` into it was committed."""


class PeerMemory(StorageWriter, StorageReader):
    """A DCP storage in the State's replicated store (``name``: the values' prefix, which must be
    one of the State's ``local`` names: each rank's items are its own)."""

    def __init__(self, state: State, name: str = "dcp") -> None:
        if not state._is_local(f"{name}.0"):
            raise ConfigError(f"PeerMemory(state, name={name!r}): each rank's checkpoint items are its own; make "
                              f"the State with local=({name!r},) (TorchState(world, local=({name!r},), ...))")
        self.state, self.name = state, name
        self._metadata: Metadata | None = None
        self._chunks: dict[str, tuple[torch.dtype, list[int]]] = {}  # item -> its saved chunk's dtype, shape

    # ----------------------------------------------------------------- writer
    def reset(self, checkpoint_id: Any = None) -> None:
        pass

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
        return False  # chosen by passing it, never by a path

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        for key in [k for k in self.state.names() if k.startswith(f"{self.name}.")]:
            del self.state[key]  # the last checkpoint: the store still has it until the next commit

    def prepare_local_plan(self, plan: Any) -> Any:
        return plan

    def prepare_global_plan(self, plans: list[Any]) -> list[Any]:
        return plans

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        rank = int(self.state.world.logical_rank)
        results = []
        for k, item in enumerate(plan.items):
            data = planner.resolve_data(item)
            if isinstance(data, torch.Tensor):
                array = tensor_array(data).copy().reshape(-1).view(np.uint8)  # a snapshot, in C order
            else:
                array = np.frombuffer(data.getbuffer(), np.uint8).copy()
            key = f"{self.name}.{rank}.{k}"
            self.state[key] = array
            results.append(WriteResult(index=item.index, size_in_bytes=array.nbytes, storage_data=key))
        future: Future[list[WriteResult]] = Future()
        future.set_result(results)
        return future

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        storage = {r.index: r.storage_data for rank in results for r in rank}
        doc = _encode(metadata, storage)
        self.state[f"{self.name}.meta.{int(self.state.world.logical_rank)}"] = doc

    def storage_meta(self) -> None:
        return None

    # ----------------------------------------------------------------- reader
    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        """The metadata from the rank that holds it (collective: DCP calls it on every rank)."""
        mine = self._meta_name()  # one rank holds it (the save's coordinator, or who took its place)
        docs = [d for d in self.state.world.allgather(self.state[mine] if mine is not None else None)
                if d is not None]
        if not docs:
            raise NothingSaved(f"no checkpoint in peer memory under {self.name!r}: dcp.save(..., storage_writer="
                               "PeerMemory(state)) and state.commit() first")
        self._metadata, self._chunks = _decode(docs[0])
        return self._metadata

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self._metadata = metadata

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        """Every item this rank's plan reads, the ones other ranks hold fetched in one exchange
        (collective: DCP calls it once on every rank)."""
        assert self._metadata is not None
        storage = self._metadata.storage_data
        blobs = self._fetch(sorted({storage[item.storage_index] for item in plan.items}))
        for item in plan.items:
            blob = blobs[storage[item.storage_index]]
            if item.type == LoadItemType.BYTE_IO:
                planner.load_bytes(item, io.BytesIO(blob.tobytes()))
                continue
            dtype, shape = self._chunks[storage[item.storage_index]]
            source = torch.from_numpy(blob if blob.flags.writeable else blob.copy()).view(dtype).reshape(shape)
            for dim, (start, length) in enumerate(zip(item.storage_offsets, item.lengths)):
                source = source.narrow(dim, start, length)
            target = planner.resolve_tensor(item).detach()
            target.copy_(source)
            planner.commit_tensor(item, target)
        future: Future[None] = Future()
        future.set_result(None)
        return future

    # -------------------------------------------------------------- internals
    def _meta_name(self) -> str | None:
        return next((k for k in self.state.names() if k.startswith(f"{self.name}.meta.")), None)

    def _fetch(self, needed: list[str]) -> dict[str, np.ndarray]:
        """The arrays of ``needed``: this rank's own, and the others' through one exchange (none where
        every rank reads only what it holds: a spare's promotion, the world's size unchanged)."""
        world, state = self.state.world, self.state
        held = {k: state[k] for k in state.names() if k.startswith(f"{self.name}.") and ".meta." not in k}
        sizes, wants = zip(*world.allgather(({k: int(a.nbytes) for k, a in held.items()}, needed)))
        owner: dict[str, int] = {}
        for rank, have in enumerate(sizes):  # the first current rank that holds an item sends it
            for key in have:
                owner.setdefault(key, rank)
        missing = [k for k in needed if k not in owner]
        if missing:
            raise NothingSaved(f"checkpoint items {missing[:3]} are held by no rank: the checkpoint is incomplete")
        logical = [int(r) for r in world.logical_ranks]
        me = int(world.rank)
        outgoing = {logical[p]: [np.ascontiguousarray(held[k]) for k in want if owner[k] == me]
                    for p, want in enumerate(wants) if p != me}
        incoming = {logical[p]: [np.empty(sizes[p][k], np.uint8) for k in needed if owner[k] == p]
                    for p in range(world.size) if p != me}
        if any(owner[k] != p for p, want in enumerate(wants) for k in want):  # (all-gathered: alike everywhere)
            world.exchange(outgoing, incoming, point="restore")  # none when every rank holds what it reads
        blobs = {k: held[k] for k in needed if owner[k] == me}
        for p in range(world.size):
            if p != me:
                blobs.update(zip([k for k in needed if owner[k] == p], incoming[logical[p]]))
        return blobs


def _encode(metadata: Metadata, storage: dict[MetadataIndex, str]) -> np.ndarray:
    tensors: dict[str, Any] = {}
    for fqn, m in metadata.state_dict_metadata.items():
        if isinstance(m, TensorStorageMetadata):
            tensors[fqn] = {"dtype": str(m.properties.dtype).removeprefix("torch."), "size": list(m.size),
                            "chunks": [[list(c.offsets), list(c.sizes)] for c in m.chunks]}
        else:
            tensors[fqn] = None
    doc = {"tensors": tensors, "version": metadata.version,
           "planner": {k: list(v) for k, v in (metadata.planner_data or {}).items()},
           "storage": [[i.fqn, list(i.offset) if i.offset is not None else None, key] for i, key in storage.items()]}
    return np.frombuffer(json.dumps(doc).encode(), np.uint8).copy()


def _decode(array: np.ndarray) -> tuple[Metadata, dict[str, tuple[torch.dtype, list[int]]]]:
    doc = json.loads(np.asarray(array, np.uint8).tobytes())
    state_dict_metadata: dict[str, Any] = {}
    for fqn, m in doc["tensors"].items():
        if m is None:
            state_dict_metadata[fqn] = BytesStorageMetadata()
            continue
        state_dict_metadata[fqn] = TensorStorageMetadata(
            TensorProperties(dtype=getattr(torch, m["dtype"])), torch.Size(m["size"]),
            [ChunkStorageMetadata(torch.Size(o), torch.Size(s)) for o, s in m["chunks"]])
    storage: dict[MetadataIndex, str] = {}
    chunks: dict[str, tuple[torch.dtype, list[int]]] = {}
    for fqn, offset, key in doc["storage"]:
        index = MetadataIndex(fqn, torch.Size(offset) if offset is not None else None)
        storage[index] = key
        m = doc["tensors"][fqn]
        if m is not None:
            sizes = next(s for o, s in m["chunks"] if o == offset)
            chunks[key] = (getattr(torch, m["dtype"]), sizes)
    metadata = Metadata(state_dict_metadata, planner_data=doc["planner"], storage_data=storage,
                        version=doc["version"])
    return metadata, chunks

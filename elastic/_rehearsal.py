"""A rehearsal: torch's default process group of the job's size, in one process, moving nothing.

A parked spare is promoted into a program that then shards its model, makes its optimizer and
takes a step, and torch does much of what those need on first use: FSDP2's and DTensor's
imports and set-up, each operator's first dispatch. ``rehearse(size, program)`` lets the spare do
that before it parks (``elastic.init(rehearse=...)``): a group of ``size`` ranks whose
collectives complete at once, as if every other rank held what this one holds.
"""
from __future__ import annotations

import contextlib
import datetime
import threading
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist

from ._mpigroup import _work

BACKEND = "rehearsal"


class Rehearsal(dist.ProcessGroup):
    """``size`` ranks, this one ``rank``; every collective returns at once with this rank's data in
    every other rank's place (a reduction leaves its input, a gather repeats it)."""

    def __init__(self, size: int, rank: int = 0) -> None:
        super().__init__(rank, size)  # type: ignore[call-arg]  # the stub lacks this overload
        self._group_name = ""

    def getBackendName(self) -> str:
        return BACKEND

    def name(self) -> str:
        return BACKEND

    def getGroupName(self) -> str:
        return self._group_name

    def _set_group_name(self, name: Any) -> None:
        super()._set_group_name(name)
        self._group_name = str(name)

    def allreduce(self, tensors: list[torch.Tensor], opts: Any = None) -> Any:
        return _work(tensors)

    def reduce(self, tensors: list[torch.Tensor], opts: Any = None) -> Any:
        return _work(tensors)

    def broadcast(self, tensors: list[torch.Tensor], opts: Any = None) -> Any:
        return _work(tensors)

    def barrier(self, opts: Any = None) -> Any:
        return _work([])

    def reduce_scatter_single(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> Any:
        output.reshape(-1).copy_(input.reshape(self.size(), -1)[self.rank()].clone())  # FSDP2's may overlap
        return _work([output])

    def all_gather_single(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> Any:
        output.reshape(self.size(), -1).copy_(input.reshape(1, -1).clone())  # FSDP2's input is in its output
        return _work([output])

    def allgather(self, outputs: list[list[torch.Tensor]], inputs: list[torch.Tensor], opts: Any = None) -> Any:
        for chunks, input in zip(outputs, inputs):
            for chunk in chunks:
                chunk.copy_(input)
        return _work(outputs)

    def reduce_scatter(self, outputs: list[torch.Tensor], inputs: list[list[torch.Tensor]], opts: Any = None) -> Any:
        for output, chunks in zip(outputs, inputs):
            output.copy_(chunks[self.rank()])
        return _work(outputs)

    def gather(self, outputs: list[list[torch.Tensor]], inputs: list[torch.Tensor], opts: Any = None) -> Any:
        return self.allgather(outputs, inputs)

    def scatter(self, outputs: list[torch.Tensor], inputs: list[list[torch.Tensor]], opts: Any = None) -> Any:
        for output, chunks in zip(outputs, inputs):
            if chunks:
                output.copy_(chunks[self.rank()])
        return _work(outputs)

    def all_to_all_single(self, output: torch.Tensor, input: torch.Tensor, output_split_sizes: list[int],
                          input_split_sizes: list[int], opts: Any = None) -> Any:
        flat = input.reshape(-1)
        output.reshape(-1).copy_(flat.repeat(output.numel() // max(flat.numel(), 1) + 1)[:output.numel()])
        return _work([output])

    def alltoall(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any = None) -> Any:
        for output, input in zip(outputs, inputs):
            output.copy_(input)
        return _work(outputs)

    def allreduce_coalesced(self, tensors: list[torch.Tensor], opts: Any = None) -> Any:
        return _work(tensors)

    def all_gather_single_coalesced(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor],
                                    opts: Any = None) -> Any:
        for output, input in zip(outputs, inputs):
            self.all_gather_single(output, input)
        return _work(outputs)

    def reduce_scatter_single_coalesced(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor],
                                        opts: Any = None) -> Any:
        for output, input in zip(outputs, inputs):
            self.reduce_scatter_single(output, input)
        return _work(outputs)

    # torch's older names for the same calls
    _allgather_base = all_gather_single
    _reduce_scatter_base = reduce_scatter_single
    alltoall_base = all_to_all_single
    allgather_into_tensor_coalesced = all_gather_single_coalesced
    reduce_scatter_tensor_coalesced = reduce_scatter_single_coalesced


def _create(options: Any, _backend_options: Any) -> Rehearsal:
    ranks = options.global_ranks_in_group  # empty for the default group
    return Rehearsal(len(ranks) if ranks else _default[0], 0 if ranks else _default[1])


_default = [0, 0]  # the default group's size and rank, while init_process_group makes it


@contextlib.contextmanager
def installed(size: int, rank: int = 0) -> Iterator[None]:
    """Torch's default group a ``Rehearsal`` of ``size`` ranks, this one ``rank``, inside (local;
    no group may be there)."""
    if dist.is_initialized():
        raise RuntimeError("a rehearsal needs torch.distributed uninitialised: it runs before the spare parks")
    if BACKEND.upper() not in dist.Backend._plugins:
        dist.Backend.register_backend(BACKEND, _create, extended_api=True, devices=["cpu"])
    _default[:] = [size, rank]
    dist.init_process_group(BACKEND, store=dist.HashStore(), rank=rank, world_size=size,
                            timeout=datetime.timedelta(seconds=60))
    try:
        yield
    finally:
        dist.destroy_process_group()


def rehearse(size: int, program: Callable[[], None]) -> None:
    """Run ``program`` inside ``installed(size)``, in a thread of its own, and raise what it
    raised. DeviceMeshes compare by their ranks, shape and thread, never by this rank's place in
    them, and torch caches what it derives from one (a parameter's offset in its tensor, DTensor's
    sharding of each operator's result) under it: made in this thread, the rehearsal's meshes
    never meet the World's, and what the promoted spare finds done is torch's first use of each
    operator, not rank 0's offsets."""
    raised: list[BaseException] = []

    def run() -> None:
        try:
            with installed(size):
                program()
        except BaseException as exc:  # handed to the caller's thread
            raised.append(exc)

    thread = threading.Thread(target=run, name="elastic-rehearsal")
    thread.start()
    thread.join()
    if raised:
        raise raised[0]

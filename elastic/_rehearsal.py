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
import gc
import weakref
from typing import Any, Callable, Iterable, Iterator

import torch
import torch.distributed as dist

from ._mpigroup import _pending, _work

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
    """Run ``program`` inside ``installed(size)``, in the caller's thread (torch keeps DTensor's
    sharding decisions in per-thread caches: made in another, the promoted spare would find none),
    and raise what it raised. Those caches hold the DeviceMeshes the rehearsal made, which compare
    equal to the promoted spare's whatever each one's place in them: ``take_place(rank)`` gives
    them the spare's place, or what torch derives from them (a DTensor's coordinate, its shard's
    offset in a checkpoint) would be rank 0's."""
    from torch.distributed.device_mesh import DeviceMesh

    try:
        with installed(size):
            program()
    finally:  # one that raised may have left meshes in the caches too
        # No mesh of the job's exists yet (a spare parks before torch.distributed is used): every
        # mesh alive now is the rehearsal's.
        _MESHES[:] = [weakref.ref(o) for o in gc.get_objects() if type(o) is DeviceMesh]  # isinstance would warn


_MESHES: list[weakref.ref] = []


def take_place(rank: int) -> None:
    """The promoted spare's place, ``rank``, in every mesh its rehearsal left in torch's caches (local).
    Their group they look up by name, the default group's, which the job's default group is named
    too (torch numbers groups from 0 again once the default one is destroyed)."""
    meshes = [mesh for mesh in (ref() for ref in _MESHES) if mesh is not None]
    _MESHES.clear()
    if any(mesh.ndim > 1 for mesh in meshes):
        # A mesh of more dimensions names rank 0's sub-groups, which no mending makes this rank's
        # (nor can its coordinate be computed before the job's group exists): DTensor decides
        # again, its caches emptied (this thread's, and torch's native one).
        from torch.distributed.tensor import DTensor

        DTensor._op_dispatcher.sharding_propagator.propagate_op_sharding.cache_clear()
        torch._C._clear_DTensor_sharding_propagator_cache()
        _DECIDED.clear()  # so the load's decisions are made again, after the next first step
        return
    for mesh in meshes:
        mesh._rank = rank
        mesh._coordinate_on_dim = mesh._compute_coordinate_on_dim()


# ------------------------------------------------------------------ a load's first copies, decided early
_DECIDED: set[Any] = set()  # the DTensor specs (mesh, placements, shape) whose copy this process decided


def warm_loads(parameters: Iterable[torch.Tensor]) -> None:
    """DTensor's sharding decision for a copy into each DTensor of ``parameters``, made now on meta
    tensors (nothing is copied, local). A load into a sharded model (``load_state_dict``, DCP's
    ``set_state_dict``) copies into every parameter, and a first copy into a DTensor of a new shape
    decides off DTensor's cache: on the 4-rank FSDP2 port, 30-50 ms of a recovery's first load on
    every rank, survivors and the promoted spare alike (a training step copies into none). A
    spec decided once is not decided again (a promoted spare's model has its rehearsal's specs:
    their meshes compare equal)."""
    from torch.distributed.tensor import DTensor

    with torch.no_grad():
        for p in parameters:
            if isinstance(p, DTensor) and p._spec not in _DECIDED:
                _DECIDED.add(p._spec)
                meta = torch.empty(p.to_local().shape, dtype=p.dtype, device="meta")
                alike = DTensor.from_local(meta, p.device_mesh, p.placements, run_check=False, shape=p.shape,
                                           stride=p.stride())
                alike.copy_(alike)


_WARM_HOOK: list[Any] = []
_WARMED: "weakref.WeakSet[Any]" = weakref.WeakSet()  # the optimizers whose parameters were warmed


def warm_loads_after_steps() -> None:
    """``warm_loads`` on each torch optimizer's parameters after its first step (local, installed
    once a process): in the training thread, whose caches a load after a failure uses, and in a
    spare's rehearsal, whose caches a promoted spare keeps. Every later step costs a set lookup."""
    from torch.optim.optimizer import register_optimizer_step_post_hook

    def warm(optimizer: Any, args: Any, kwargs: Any) -> None:
        if optimizer not in _WARMED:
            _WARMED.add(optimizer)
            warm_loads(p for group in optimizer.param_groups for p in group["params"])

    if not _WARM_HOOK:
        _WARM_HOOK.append(register_optimizer_step_post_hook(warm))


# ------------------------------------------------------------------ the program itself, rehearsed
PROGRAM: list[Any] = []  # while a spare rehearses its program: the World that elastic.init() returns there
STEPS = 1  # the steps of the program a spare rehearses (rehearse=True): its set-up and first step
SECONDS = 60.0  # and at most this long (a program whose loop reaches no step point)


class _Overtime(BaseException):
    """The rehearsal ran out of time (not an Exception: the program's handlers let it pass)."""


def program_file() -> str:
    """The Python file this process runs (``python PROGRAM.py``), which ``rehearse=True`` runs again."""
    import sys

    path = getattr(sys.modules.get("__main__"), "__file__", None)
    if not path or not str(path).endswith(".py"):
        raise RuntimeError("rehearse=True runs the program's file again: this process runs none (python -m or -c); "
                           "give rehearse= a function instead")
    return str(path)


def rehearse_program(size: int, path: str) -> None:
    """Run the program ``path`` again in this process, as rank 0 of ``size``, up to its first
    step's end: ``elastic.init()`` there returns a ``MirrorJob`` rank (every collective of the
    World completes at once with this rank's values), torch's default group is the rehearsal's
    (``init_process_group`` does nothing), its output goes nowhere, and the fault schedule ends it
    at step ``STEPS``'s point. The process's random generators and ``sys.argv`` come back as they
    were; what the program's own modules keep at module level stays (a spare is a fresh process:
    they hold what its first run put there)."""
    import contextlib
    import os
    import random
    import runpy
    import signal
    import sys

    import numpy as np

    from ._sim import MirrorJob, _Killed

    job = MirrorJob(size, inject=f"0@{STEPS}")
    world = job.rank(0)
    numpy_state, python_state, argv = np.random.get_state(), random.getstate(), list(sys.argv)
    real_init = dist.init_process_group

    def overtime(*_: Any) -> None:
        raise _Overtime()

    previous = signal.signal(signal.SIGALRM, overtime)
    signal.setitimer(signal.ITIMER_REAL, SECONDS)
    PROGRAM[:] = [world]

    def bare_init(*args: Any, **kwargs: Any) -> None:  # the program's init_process_group(): the rehearsal's stays
        if kwargs.get("store") is not None or kwargs.get("world_size", -1) != -1:
            real_init(*args, **kwargs)

    dist.init_process_group = bare_init
    try:
        with torch.random.fork_rng(), open(os.devnull, "w") as nowhere, contextlib.redirect_stdout(nowhere), \
                contextlib.redirect_stderr(nowhere):
            runpy.run_path(path, run_name="__main__")
    except (_Killed, _Overtime, SystemExit):
        pass  # the step's point, the time, or the program's end: as far as it goes
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        dist.init_process_group = real_init
        _pending.clear()  # a group the program's ProcessGroup handed over and no init took
        PROGRAM.clear()
        np.random.set_state(numpy_state)
        random.setstate(python_state)
        sys.argv[:] = argv
    if not job.of("step"):
        raise RuntimeError(f"{path} finished no step in its rehearsal (state.record_step), in {SECONDS:g} s or "
                           "before it ended")

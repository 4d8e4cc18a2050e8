"""A ``torch.distributed`` process group whose collectives run on the World's ULFM communicator.

Gloo has no abort in torch 2.13 (``elastic.distributed.abort`` shuts its connections down
instead). Here the data plane and the control plane
are one communicator, so a peer's death or a revoke ends a collective on every
rank within ULFM's detection time, as ``ProcessFailure`` (the loop recovers from
it as from any other), and a stopped peer is bounded by the sentinel's hang
bound, never by a group timeout.

Each collective is one non-blocking MPI call on numpy views of the tensors (a
copy only where no view exists: a non-contiguous tensor, or a 16-bit float
reduced in float32), waited for inside the call under ``world.mpi.guard()``,
with the World's ``collective`` fault point in flight in the reductions (``gather`` in the
all-gathers). On CPU the caller is the thread that runs the backward, so the ``Work`` handed back is
complete, its future already holding the result (DDP's buckets go through
``elastic.distributed``'s hook instead: one all-reduce per backward). A point-to-point transfer
(``send`` / ``recv``, torch's pipeline schedules' ``batch_isend_irecv``) is posted at once and its
``Work`` waits for it, under the guard too, so a batch's order of sends and receives cannot
deadlock and a peer lost mid-transfer ends the wait on every rank. The group is valid while the World keeps its shape
(a spare or a spawned process takes the lost rank's place: same size, same rank
here), whatever the generation: the communicator is looked up at each call. A
shrink changes the shape: a call then raises, saying to make a new group
(``elastic.distributed.ProcessGroup`` does). ``dist.new_group`` (``init_device_mesh``'s
groups, HSDP's replicate and shard dimensions) makes one over some of the ranks, on a
communicator of them the World makes per generation (``world.mpi.part``) and revokes with
its own.
"""
from __future__ import annotations

from typing import Any, Callable, Sequence

import numpy as np
import torch
import torch.distributed as dist
from mpi4py import MPI
from torch._C._distributed_c10d import _create_work_from_future  # type: ignore[attr-defined]

from elastic.comm import Unrecoverable, World

BACKEND = "ulfm"

_OPS = {dist.ReduceOp.SUM: MPI.SUM, dist.ReduceOp.AVG: MPI.SUM, dist.ReduceOp.MAX: MPI.MAX,
        dist.ReduceOp.MIN: MPI.MIN, dist.ReduceOp.PRODUCT: MPI.PROD, dist.ReduceOp.BAND: MPI.BAND,
        dist.ReduceOp.BOR: MPI.BOR, dist.ReduceOp.BXOR: MPI.BXOR}
_WIDENED = (torch.bfloat16, torch.float16)  # no MPI arithmetic on them: reduced in float32
_abandoned: list[list[MPI.Request]] = []  # requests a failure interrupted


class MPIGroup(dist.ProcessGroup):
    """The World's active ranks as a ``torch.distributed`` process group (CPU tensors)."""

    def __init__(self, world: World, ranks: Sequence[int] | None = None) -> None:
        """``ranks``: the World's current ranks this group spans (default every active rank)."""
        self._ranks = None if ranks is None else tuple(int(r) for r in ranks)
        rank, size = (world.rank, world.size) if self._ranks is None else \
            (self._ranks.index(world.rank), len(self._ranks))
        super().__init__(rank, size)  # type: ignore[call-arg]  # the stub lacks this overload
        self._world = world
        self._size_at_start = world.size  # the World's, which a subgroup's ranks index
        self._group_name = ""
        self._checked: MPI.Intracomm | None = None  # the communicator whose shape is this group's

    def getBackendName(self) -> str:
        return BACKEND

    def name(self) -> str:
        return BACKEND

    def getGroupName(self) -> str:  # DeviceMesh (FSDP2) finds a group by its name
        return self._group_name

    def _set_group_name(self, name: Any) -> None:  # dist.new_group names the groups it makes
        super()._set_group_name(name)
        self._group_name = str(name)

    def getGroupDesc(self) -> str:
        return "the World's active ranks" if self._ranks is None else f"the World's ranks {list(self._ranks)}"

    # ------------------------------------------------------------- reductions
    def allreduce(self, tensors: list[torch.Tensor], opts: Any = None) -> Any:
        self.reduce_in_place(tensors, _reduce_op(opts))
        return _work(tensors)

    def reduce_in_place(self, tensors: list[torch.Tensor], op: Any = dist.ReduceOp.SUM) -> None:
        """``allreduce`` without the ``Work`` (this package's own callers: DDP's gradients)."""
        bufs = [_Buffer(t, reduce=True) for t in tensors]
        self._run(lambda comm: [comm.Iallreduce(MPI.IN_PLACE, b.array, op=_OPS[op]) for b in bufs], "collective")
        for b in bufs:
            b.done(self.size() if op == dist.ReduceOp.AVG else 1)

    def allreduce_coalesced(self, tensors: list[torch.Tensor], opts: Any = None) -> Any:
        return self.allreduce(tensors, opts)

    def reduce(self, tensors: list[torch.Tensor], opts: Any) -> Any:
        op, root = _reduce_op(opts), opts.rootRank
        bufs = [_Buffer(t, reduce=True) for t in tensors]
        mine = self.rank() == root
        self._run(lambda comm: [comm.Ireduce(MPI.IN_PLACE if mine else b.array, b.array if mine else None,
                                             op=_OPS[op], root=root) for b in bufs], "collective")
        for b in bufs:
            b.done(self.size() if op == dist.ReduceOp.AVG and mine else 1)
        return _work(tensors)

    def reduce_scatter_single(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> Any:
        op = _reduce_op(opts)
        out, inp = _Buffer(output, reduce=True), _Buffer(input, reduce=True)
        self._check_chunks(out, inp)
        self._run(lambda comm: [comm.Ireduce_scatter_block(inp.array, out.array, op=_OPS[op])], "collective")
        out.done(self.size() if op == dist.ReduceOp.AVG else 1)
        return _work([output])

    def reduce_scatter(self, outputs: list[torch.Tensor], inputs: list[list[torch.Tensor]], opts: Any = None) -> Any:
        for output, chunks in zip(outputs, inputs):
            self.reduce_scatter_single(output, torch.cat([c.reshape(-1) for c in chunks]), opts)
        return _work(outputs)

    def reduce_scatter_single_coalesced(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor],
                                        opts: Any = None) -> Any:
        for output, input in zip(outputs, inputs):
            self.reduce_scatter_single(output, input, opts)
        return _work(outputs)

    # --------------------------------------------------------- data movement
    def broadcast(self, tensors: list[torch.Tensor], opts: Any) -> Any:
        bufs = [_Buffer(t) for t in tensors]
        self._run(lambda comm: [comm.Ibcast(b.array, root=opts.rootRank) for b in bufs])
        for b in bufs:
            b.done()
        return _work(tensors)

    def all_gather_single(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> Any:
        out, inp = _Buffer(output), _Buffer(input)
        self._check_chunks(inp, out)
        self._run(lambda comm: [comm.Iallgather(inp.array, out.array)], "gather")
        out.done()
        return _work([output])

    def all_gather_single_coalesced(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor],
                                    opts: Any = None) -> Any:
        for output, input in zip(outputs, inputs):
            self.all_gather_single(output, input, opts)
        return _work(outputs)

    def allgather(self, outputs: list[list[torch.Tensor]], inputs: list[torch.Tensor], opts: Any = None) -> Any:
        for chunks, input in zip(outputs, inputs):
            gathered = input.new_empty((self.size(), *input.shape))
            self.all_gather_single(gathered, input.contiguous())
            for chunk, row in zip(chunks, gathered):
                chunk.copy_(row)
        return _work(outputs)

    def gather(self, outputs: list[list[torch.Tensor]], inputs: list[torch.Tensor], opts: Any) -> Any:
        root = opts.rootRank
        for i, input in enumerate(inputs):
            inp = _Buffer(input)
            gathered = input.new_empty((self.size(), *input.shape)) if self.rank() == root else None
            out = _Buffer(gathered) if gathered is not None else None
            self._one("Igather", inp.array, out.array if out else None, root=root)
            if gathered is not None:
                for chunk, row in zip(outputs[i], gathered):
                    chunk.copy_(row)
        return _work([t for chunks in outputs for t in chunks])

    def scatter(self, outputs: list[torch.Tensor], inputs: list[list[torch.Tensor]], opts: Any) -> Any:
        root = opts.rootRank
        for i, output in enumerate(outputs):
            out = _Buffer(output)
            send = _Buffer(torch.stack([c.reshape(output.shape) for c in inputs[i]])) \
                if self.rank() == root else None
            self._one("Iscatter", send.array if send else None, out.array, root=root)
            out.done()
        return _work(outputs)

    def all_to_all_single(self, output: torch.Tensor, input: torch.Tensor, output_split_sizes: list[int],
                          input_split_sizes: list[int], opts: Any = None) -> Any:
        out, inp = _Buffer(output), _Buffer(input)
        n = self.size()
        row_out = out.array.size // max(output.shape[0], 1) if output.dim() else 1
        row_in = inp.array.size // max(input.shape[0], 1) if input.dim() else 1
        send = _counts(input_split_sizes, input.shape[0] if input.dim() else 0, n, row_in)
        recv = _counts(output_split_sizes, output.shape[0] if output.dim() else 0, n, row_out)
        self._one("Ialltoallv", [inp.array, send], [out.array, recv])
        out.done()
        return _work([output])

    def alltoall(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any = None) -> Any:
        gathered = torch.empty(sum(t.numel() for t in outputs), dtype=outputs[0].dtype)
        self.all_to_all_single(gathered, torch.cat([t.reshape(-1) for t in inputs]),
                               [t.numel() for t in outputs], [t.numel() for t in inputs])
        offset = 0
        for t in outputs:
            t.copy_(gathered[offset:offset + t.numel()].view_as(t))
            offset += t.numel()
        return _work(outputs)

    def barrier(self, opts: Any = None) -> Any:
        self._one("Ibarrier")
        return _work([])

    # ------------------------------------------------------- point to point
    def send(self, tensors: list[torch.Tensor], dstRank: int, tag: int = 0) -> Any:
        """``dist.isend`` / ``dist.send`` / a ``P2POp`` of ``batch_isend_irecv`` (torch's pipeline
        schedules): posted at once, waited for in the ``Work``'s ``wait()``."""
        bufs = [_Buffer(t) for t in tensors]
        return self._post(lambda comm, peer: [comm.Isend(b.array, peer, _tag(tag)) for b in bufs], dstRank, [])

    def recv(self, tensors: list[torch.Tensor], srcRank: int, tag: int = 0) -> Any:
        bufs = [_Buffer(t) for t in tensors]
        return self._post(lambda comm, peer: [comm.Irecv(b.array, peer, _tag(tag)) for b in bufs], srcRank, bufs)

    def recv_anysource(self, tensors: list[torch.Tensor], tag: int = 0) -> Any:
        raise ValueError(f"the {BACKEND} process group receives from a named rank only: pass src (or group_src) "
                         "to dist.recv / dist.irecv")

    def _post(self, start: Callable[[MPI.Intracomm, int], list[MPI.Request]], peer: int,
              received: list[_Buffer]) -> Any:
        """Post one side of a transfer with group rank ``peer``, the World's ``p2p`` fault point of its
        step with it in flight (``1@p20``: the first transfer of step 20 on logical rank 1, ``1@p20.5``
        its sixth); the ``Work`` waits for it."""
        if not 0 <= peer < self.size() or peer == self.rank():
            raise ValueError(f"point-to-point with group rank {peer} from group rank {self.rank()} of a group of "
                             f"{self.size()}: name another rank of the group")
        comm = self._comm()
        with self._world.mpi.guard():
            transfer = _Transfer(self._world, start(comm, peer), received)
        _fire_transfer(self._world)
        return transfer

    # torch's older names for the same calls (C++ callers and torch < 2.13 use them)
    _allgather_base = all_gather_single
    _reduce_scatter_base = reduce_scatter_single
    alltoall_base = all_to_all_single
    allgather_into_tensor_coalesced = all_gather_single_coalesced
    reduce_scatter_tensor_coalesced = reduce_scatter_single_coalesced

    # ----------------------------------------------------------- the common
    def _run(self, start: Callable[[MPI.Intracomm], list[MPI.Request]], point: str | None = None) -> None:
        """Post the requests and wait for all (a peer's death or a revoke: ``ProcessFailure`` from
        ``guard``), the World's fault ``point`` of its step with them in flight: ``collective`` in
        a reduction (DDP's all-reduce, FSDP2's reduce-scatter: ``1@c20`` stops rank 1 inside step
        20's first one), ``gather`` in an all-gather (FSDP2's forward: ``1@g20``)."""
        world = self._world
        comm = self._comm()
        with world.mpi.guard():
            requests = start(comm)
            try:
                if point is not None:
                    world.fault_point(world.job.step, point)
                MPI.Request.Waitall(requests)
            except BaseException:
                _abandoned.append(requests)  # MPI may still write their buffers (they hold them): never freed
                raise

    def _comm(self) -> MPI.Intracomm:
        """This generation's communicator of the group's ranks (its shape checked once per generation)."""
        world = self._world
        comm = world.mpi.comm
        if comm is not self._checked:  # a new generation's communicator
            self._check_shape()
            self._checked = comm
        return comm if self._ranks is None else world.mpi.part(self._ranks)

    def _one(self, call: str, *args: Any, **kwargs: Any) -> None:
        """``_run`` of one non-blocking call of the communicator, by name."""
        self._run(lambda comm: [getattr(comm, call)(*args, **kwargs)])

    def _check_shape(self) -> None:
        world = self._world
        if self._ranks is not None:
            if world.size != self._size_at_start or world.rank not in self._ranks:
                raise Unrecoverable(f"this process group spans the World's ranks {list(self._ranks)} of "
                                    f"{self._size_at_start}; the job has {world.size} now after a shrink: make new "
                                    "groups (a new DeviceMesh)")
            return
        if world.size != self.size() or world.rank != self.rank():
            raise Unrecoverable(f"this process group has {self.size()} ranks (this one {self.rank()}); the job has "
                                f"{world.size} now (this rank {world.rank}) after a shrink: make a new group "
                                "(elastic.distributed.ProcessGroup makes one at each rebuild)")

    def _check_chunks(self, chunk: _Buffer, whole: _Buffer) -> None:
        if whole.array.size != chunk.array.size * self.size():
            raise ValueError(f"the whole tensor has {whole.array.size} elements, not {self.size()} x the "
                             f"{chunk.array.size} of one rank's chunk: size it group size x chunk")


class _Buffer:
    """A tensor as a flat numpy array MPI reads and writes: a view where one exists, else a copy
    that ``done`` writes back (non-contiguous tensors; 16-bit floats: in float32 for a reduction,
    as int16 bits for a move)."""

    def __init__(self, tensor: torch.Tensor, *, reduce: bool = False) -> None:
        if tensor.device.type != "cpu":
            raise ValueError(f"the {BACKEND} process group takes CPU tensors, not {tensor.device}: use NCCL "
                             "for GPU tensors (elastic.distributed.ProcessGroup(world, backend='nccl'))")
        self.tensor = tensor
        source = tensor.detach()
        if tensor.dtype in _WIDENED:
            source = source.float() if reduce else source.view(torch.int16)
        source = source.contiguous()
        self._copy = source if source.data_ptr() != tensor.data_ptr() else None  # no view of the tensor
        self.array = source.numpy().reshape(-1)

    def done(self, divide: int = 1) -> None:
        """After MPI wrote the array: the average's division, and the copy back."""
        if divide != 1:
            np.divide(self.array, divide, out=self.array, casting="unsafe")
        if self._copy is not None:
            back = self._copy.view(self.tensor.dtype) if self._copy.dtype == torch.int16 else self._copy
            self.tensor.copy_(back.view(self.tensor.shape))


class _Transfer(dist._Work):  # torch's Python-side Work
    """The ``Work`` of a posted send or receive: ``wait()`` waits for it under the World's guard (a
    peer's death or a revoke: ``ProcessFailure``, the requests abandoned, never freed) and writes a
    receive's copies back."""

    def __init__(self, world: World, requests: list[MPI.Request], received: list[_Buffer]) -> None:
        super().__init__()
        self._world, self._requests, self._received = world, requests, received
        self._done = False
        _unwaited.add(self)  # MPI may write a receive's buffer until it is waited for: held until then

    def wait(self, timeout: Any = None) -> bool:
        if not self._done:
            with self._world.mpi.guard():
                MPI.Request.Waitall(self._requests)  # a failure: left in _unwaited, never freed
            for b in self._received:
                b.done()
            self._done = True
            _unwaited.discard(self)
        return True

    def is_completed(self) -> bool:
        return self._done

    def is_success(self) -> bool:
        return self._done


_unwaited: set[_Transfer] = set()
_P2P_TAGS = 1 << 20  # torch's tags, apart from the World's own messages on its communicator
_transfers: list[Any] = [None, 0]  # (generation, step) of this process's last transfer, and its count there


def _tag(tag: int) -> int:
    if not 0 <= tag < _P2P_TAGS:
        raise ValueError(f"point-to-point tag {tag}: the {BACKEND} process group takes tags 0 .. {_P2P_TAGS - 1}")
    return _P2P_TAGS + tag


def _fire_transfer(world: World) -> None:
    """The ``p2p`` fault point of one posted transfer: numbered within its step on this process."""
    step = world.job.step
    if _transfers[0] != (world.generation, step):
        _transfers[:] = [(world.generation, step), 0]
    index = _transfers[1]
    _transfers[1] += 1
    world.fault_point(step, "p2p", micro=index)


def _reduce_op(opts: Any) -> Any:
    op = opts.reduceOp.op if opts is not None and hasattr(opts, "reduceOp") else dist.ReduceOp.SUM
    if op not in _OPS:
        raise ValueError(f"the {BACKEND} process group cannot reduce with {op}: use one of "
                         f"{sorted(str(o) for o in _OPS)}")
    return op


def _counts(splits: Sequence[int], rows: int, n: int, row: int) -> tuple[list[int], list[int]]:
    sizes = list(splits) if splits else [rows // n] * n
    counts = [s * row for s in sizes]
    return counts, np.concatenate(([0], np.cumsum(counts)[:-1])).astype(int).tolist()


def _work(result: list[Any]) -> Any:
    future: torch.futures.Future = torch.futures.Future()
    future.set_result(result)
    return _create_work_from_future(future)


_pending: list[MPIGroup] = []  # the group init_process_group's creator hands over


def _create(options: Any, _backend_options: Any) -> MPIGroup:
    if _pending:
        return _pending.pop()
    default = dist.distributed_c10d._world.default_pg if dist.is_initialized() else None
    if not isinstance(default, MPIGroup):
        raise RuntimeError(f"the {BACKEND} backend is made by elastic.distributed.ProcessGroup (it needs the World)")
    # dist.new_group: a group of some of the default group's ranks, which are the World's
    return MPIGroup(default._world, options.global_ranks_in_group)


def install(group: MPIGroup, timeout: Any) -> None:
    """Make ``group`` torch's default process group (local: the group needs no rendezvous, so the
    store torch asks for is a local one)."""
    if BACKEND.upper() not in dist.Backend._plugins:
        dist.Backend.register_backend(BACKEND, _create, extended_api=True, devices=["cpu"])
    _pending.append(group)
    dist.init_process_group(BACKEND, store=dist.HashStore(), rank=group.rank(), world_size=group.size(),
                            timeout=timeout)
    group._group_name = dist.distributed_c10d._world.pg_names[group]

"""torch.distributed on the World: its communicator as a process group, DDP that follows the
generations, and DCP into peers' memory.

ULFM is the control plane (it sees a death, agrees on who is left, rebuilds) and, on CPU, the
data plane too: ``ProcessGroup`` (``_process_group``) makes the default process group a ``ulfm`` group
(``_mpigroup``: each collective non-blocking MPI on the World's communicator), so a death or a
revoke ends DDP's, FSDP2's and DCP's collectives on every rank at once, and a stopped peer is
bounded by the sentinel's hang bound, never by a group timeout. It is kept through a
substitution (same shape, the communicator looked up at each call) and made again after a shrink.
``DistributedDataParallel`` wraps a model in torch's DDP over the current group in each new
generation, one all-reduce per backward on the ``ulfm`` group. ``PeerMemory`` (``_dcp``) is a
DCP storage in the State's replicated store.

``backend="gloo"`` keeps torch's Gloo, bootstrapped through the World (current rank 0 opens a
``TCPStore`` on a free port and broadcasts its address over MPI) and made again after every
rebuild; its collectives fail at once on a closed connection, and torch 2.13's Gloo has no abort:
the ranks that see a failure shut the group's connections down, which ends every other rank's
wait in it at once (the group's timeout bounds only a collective whose peer is alive). NCCL
(``backend="nccl"``, the default where CUDA is present) is the GPU path: its watchdog raises in
the program (``TORCH_NCCL_ASYNC_ERROR_HANDLING=2``) instead of ending the process, and ``abort``
aborts its communicators. Written, and tested only where a GPU is (none here: ``tests/test_gpu.py``
skips, saying so). Multi-node Gloo: rank 0's address is its hostname's; Gloo picks its interface
from the hostname too (``GLOO_SOCKET_IFNAME`` chooses one, as with torchrun).
"""
from __future__ import annotations

from typing import Any

try:
    import torch
except ImportError as exc:  # the project's message, not torch's
    from ._needs import torch_missing

    raise torch_missing("elastic.distributed") from exc
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

from elastic.comm import Group, World

from . import _mpigroup
from ._dcp import NothingSaved, PeerMemory
from ._process_group import ProcessGroup, abort, end_iterations, is_peer_failure
from ._torchrun import serve_init_process_group

__all__ = ["ProcessGroup", "DistributedDataParallel", "PeerMemory", "NothingSaved", "is_peer_failure", "abort",
           "end_iterations", "serve_init_process_group"]

class DistributedDataParallel:
    """``torch.nn.parallel.DistributedDataParallel`` over the World's current group, wrapped again
    in each new generation (``ddp_options`` go to torch's: ``find_unused_parameters``, ...). Put
    ``module`` (not this wrapper) in the State; call this for the forward; torch DDP's other
    attributes (``no_sync()``, ``train()``, ``state_dict()``, ...) are the current wrapper's.

    DDP averages gradients over the ranks: for the global mean of a global batch shared unevenly
    (``GlobalBatches``), make each rank's loss ``sum over its samples * world.size / global batch``.

    On the ``ulfm`` group and on Gloo the gradients go in one all-reduce per backward, laid out by
    parameter, last first (``_Gradients``): DDP buckets a fresh wrapper's first step in another
    layout than its later ones, and a ring all-reduce rounds each element by where it lies in what
    it reduces, so in DDP's own buckets the sums after a re-wrap would differ in the last bits from
    a run that never re-wrapped. On NCCL each parameter is its own bucket unless ``ddp_options`` say
    otherwise (``bucket_cap_mb=...`` for fewer, larger all-reduces when bits do not matter).
    ``register_comm_hook(state, hook)`` (torch's) puts the program's own hook in place of that
    layout, on this wrapper and on every one a rebuild makes.
    """

    def __init__(self, world: World, module: torch.nn.Module, process_group: ProcessGroup | None = None,
                 **ddp_options: Any) -> None:
        self.module = module
        self._world = world
        self._pg = process_group or ProcessGroup(world)
        self._options = ddp_options
        self._ddp: Any = None
        self._hook: tuple[Any, Any] | None = None  # the program's comm hook: (state, hook)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.ddp(*args, **kwargs)

    def register_comm_hook(self, state: Any, hook: Any) -> None:
        """torch DDP's ``register_comm_hook``, kept: the hook goes on each generation's wrapper,
        in place of the library's own (DDP takes one). Call it on every rank alike, before the
        next forward (a wrapper made already is made again there, with it: collective)."""
        self._hook = (state, hook)
        if self._ddp is not None:
            self._retire(self._ddp)
            self._ddp = None

    def __getattr__(self, name: str) -> Any:
        """torch DDP's own attributes (``no_sync``, ``train``, ``eval``, ``state_dict``, ...),
        from the current generation's wrapper."""
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self.ddp, name)

    @property
    def ddp(self) -> torch.nn.parallel.DistributedDataParallel:
        """torch's DDP of the current generation (wrapped here on first use after a rebuild:
        collective, every active rank reaches it at the same point)."""
        if self._ddp is None or self._pg.stale:
            self._wrap()
        return self._ddp

    @staticmethod
    def _retire(old: Any) -> None:
        """A torch DDP object sits in a reference cycle: only the cyclic GC frees it, at a time no
        program controls. Until then a reducer whose backward a failure cut short keeps its hooks
        on the parameters, still expecting them, and they fire in the next backward of the new
        wrapper ("marked ready twice", or its buckets written back): a recovery that differed once
        in a while. Unhooked here, whenever the GC comes."""
        old._remove_autograd_hooks()

    def _wrap(self) -> None:
        old, self._ddp = self._ddp, None
        if old is not None:
            self._retire(old)
        group = self._pg.group
        options = self._options
        flat = isinstance(group, _mpigroup.MPIGroup) or dist.get_backend(group) == "gloo"
        if not flat and not {"bucket_cap_mb", "bucket_cap_mb_list"} & set(options):
            options = {**options, "bucket_cap_mb_list": [1e-6]}  # one parameter per bucket: see above
        ddp = torch.nn.parallel.DistributedDataParallel(self.module, process_group=group, **options)
        if self._hook is not None:
            ddp.register_comm_hook(*self._hook)
        elif flat:
            ddp.register_comm_hook(_Gradients(self._world, group, self.module), _gradients_hook)
        elif self._world.job.settings.faults_scheduled:  # the launcher's R@cS faults fire inside DDP's all-reduce
            ddp.register_comm_hook(self._world, _allreduce_with_fault_point)
        self._ddp = ddp


class _Gradients:
    """DDP's gradients on the World's communicator or on Gloo: one all-reduce per backward, over the
    gradients laid out in reverse parameter order, whatever DDP's buckets.

    DDP hands its buckets over one by one as the backward makes them; each waits here until the
    last, then all go in one flat all-reduce. One meeting of the ranks per step, not one per
    bucket (each costs a round of every rank, dear where ranks share cores); and every gradient
    element sits at the same place in it whatever DDP's bucket layout (a fresh wrapper's first
    step has another layout than its later ones), so a rank's sums never depend on a re-wrap.
    Reverse parameter order is the layout DDP settles on after its first backward where the
    gradients become ready last layer first: there its one bucket is all-reduced in place (no
    copy in, no copy out); any other layout is copied into that order and back."""

    def __init__(self, world: Group, group: Any, module: torch.nn.Module) -> None:
        self._world, self.group, self._module = world, group, module
        self._order: dict[int, int] = {}  # a parameter's address -> its place, last parameter first
        self._layout: list[int] = []  # the parameters' addresses in that order
        self._waiting: list[tuple[Any, torch.futures.Future]] = []

    def _place(self, parameter: torch.Tensor) -> int:
        if parameter.data_ptr() not in self._order:  # first use, or parameters moved since
            self._layout = [p.data_ptr() for p in self._module.parameters() if p.requires_grad][::-1]
            self._order = {address: i for i, address in enumerate(self._layout)}
        return self._order[parameter.data_ptr()]

    def hook(self, bucket: Any) -> torch.futures.Future:
        if bucket.index() == 0:
            self._waiting = []  # what a backward that failed half-way left
        future: torch.futures.Future = torch.futures.Future()
        self._waiting.append((bucket, future))
        if bucket.is_last():
            waiting, self._waiting = self._waiting, []
            if len(waiting) == 1 and [p.data_ptr() for p in bucket.parameters()] == self._layout:
                flat = bucket.buffer().div_(self.group.size())  # torch's mean; DDP copies it into .grad
                self._reduce(flat)
            else:
                self._reduce_in_layout(waiting)
            for b, done in waiting:
                done.set_result(b.buffer())
        return future

    def _reduce_in_layout(self, waiting: list[tuple[Any, torch.futures.Future]]) -> None:
        grads = sorted((self._place(p), g) for b, _ in waiting for p, g in zip(b.parameters(), b.gradients()))
        flat = torch.cat([g.reshape(-1) for _, g in grads]).div_(self.group.size())  # torch's mean
        self._reduce(flat)
        offset = 0
        for _, g in grads:
            g.copy_(flat[offset:offset + g.numel()].view_as(g))
            offset += g.numel()

    def _reduce(self, flat: torch.Tensor) -> None:
        """Sum ``flat`` over the ranks, in place: on the World's communicator (its ``collective``
        fault point in flight), or on Gloo (the fault point first, as DDP's own hook had it)."""
        if isinstance(self.group, _mpigroup.MPIGroup):
            self.group.reduce_in_place([flat])
            return
        if self._world.job.settings.faults_scheduled:  # the launcher's R@cS faults fire inside the all-reduce
            self._world.fault_point(self._world.job.step, "collective")
        dist.all_reduce(flat, group=self.group)


def _gradients_hook(state: _Gradients, bucket: Any) -> torch.futures.Future:
    return state.hook(bucket)


def _allreduce_with_fault_point(world: Group, bucket: Any) -> torch.futures.Future:
    """DDP's default all-reduce (torch's own hook: the same bits), after the
    ``collective`` fault point of the step the World is at: ``1@c20`` kills rank 1 in the middle
    of step 20's backward, inside DDP's all-reduce."""
    world.fault_point(world.job.step, "collective")
    group = dist.group.WORLD  # the default group: the one DDP wraps
    assert group is not None
    return default_hooks.allreduce_hook(group, bucket)


# DDP checks a hook's annotations as objects; this module's are strings (postponed evaluation).
_gradients_hook.__annotations__ = {"bucket": dist.GradBucket, "return": torch.futures.Future[torch.Tensor]}
_allreduce_with_fault_point.__annotations__ = {"bucket": dist.GradBucket,
                                               "return": torch.futures.Future[torch.Tensor]}

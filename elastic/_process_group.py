"""The ``torch.distributed`` default group on the World, and what a failure does to it.

``ProcessGroup`` makes the default process group a ``ulfm`` group (``_mpigroup``: each collective
non-blocking MPI on the World's communicator, kept through a substitution, made again after a
shrink), or Gloo / NCCL bootstrapped through the World and made again after every rebuild. On a
failure the recovery driver calls ``abort`` (Gloo: its connections shut down, so every rank's
wait in it ends at once; NCCL: its communicators aborted; ``ulfm``: nothing, the revoke ended
them) and ends the iteration a failure cut short in every FSDP2 model (``end_iterations``);
``is_peer_failure`` tells a data plane's peer death from other errors. Importing this registers
both with the driver. A light module: ``torch.distributed.init_process_group()`` under elastic
(``_torchrun``) makes the group from here without importing ``elastic.distributed`` (DCP).
"""
from __future__ import annotations

import contextlib
import datetime
import os
import socket
from typing import Any, Iterator

import torch
import torch.distributed as dist

from elastic.comm import ConfigError, World

from . import _mpigroup
from ._driver import register_data_plane
from ._mpigroup import BACKEND
from ._torchstate import end_iteration

# A peer gone, or one that did not answer within the group's timeout (a stopped process: the
# recovery's agreement then waits for the sentinel to kill it).
_FAILURE_WORDS = ("gloo/transport", "Connection closed by peer", "Connection reset by peer", "NCCL error",
                  "ProcessGroupNCCL", "Broken pipe", "Application timeout caused pair closure", "Timed out waiting")


def is_peer_failure(exc: BaseException) -> bool:
    """Whether ``exc`` is a data-plane collective failing because a peer is gone (local)."""
    if isinstance(exc, getattr(dist, "DistNetworkError", ())) or isinstance(exc, getattr(dist, "DistBackendError", ())):
        return True
    return isinstance(exc, RuntimeError) and any(word in str(exc) for word in _FAILURE_WORDS)


class ProcessGroup:
    """The default ``torch.distributed`` group over the World's active ranks, in current-rank order.

    ``backend``: ``"ulfm"`` (the default on CPU: the World's communicator, kept through a
    substitution, made again, locally, after a shrink), ``"gloo"`` or ``"nccl"`` (the default
    where CUDA is present). The ``ulfm`` group is the default group as soon as this is constructed
    (local); a Gloo or NCCL group needs a rendezvous, made where every active rank reads ``group``
    (collective: a promoted spare constructs this while the survivors recover, so not here). Both
    are made again after every rebuild, at ``group``. ``timeout`` (Gloo, NCCL): how long one of their
    collectives may wait: the bound on one whose peer is alive but stuck (a healthy collective must
    not wait longer for its slowest rank). A peer's death ends a Gloo collective on every rank at
    once: the ranks that see it shut the group's connections down (``abort``)."""

    def __init__(self, world: World, backend: str | None = None, timeout: float = 60.0) -> None:
        if backend not in (None, BACKEND, "gloo", "nccl"):
            raise ConfigError(f"ProcessGroup(backend={backend!r}): use {BACKEND!r} (the World's communicator, the "
                              "CPU default), 'gloo', or 'nccl' (GPUs)")
        self.world = world
        self.backend = backend or ("nccl" if torch.cuda.is_available() else BACKEND)
        self.timeout = datetime.timedelta(seconds=timeout)
        self._generation: int | None = None
        self._store: Any = None
        self._mpi: _mpigroup.MPIGroup | None = None
        if self.backend == BACKEND:  # local, no rendezvous: the default group from here on (fully_shard,
            self._make()             # DCP and torch's own calls find it); Gloo's and NCCL's meet in .group

    @property
    def group(self) -> Any:
        """The group of the current generation (made on first use after a rebuild)."""
        if self.stale or not dist.is_initialized():
            self._make()
        return dist.group.WORLD

    @property
    def stale(self) -> bool:
        return self._generation != self.world.generation

    def _make(self) -> None:
        world = self.world
        if self.backend == BACKEND:
            self._adopt_mpi_group()
        else:
            self._make_with_store()
        self._generation = world.generation

    def _adopt_mpi_group(self) -> None:
        """The World's communicator as the default group: the one already made while the World keeps
        its shape (its communicator is looked up at each call), else a new one (local, no rendezvous)."""
        world = self.world
        if getattr(world, "rehearsal", False) and dist.is_initialized():  # a spare's rehearsal (_rehearsal)
            return
        kept = self._mpi is not None and dist.is_initialized() and dist.group.WORLD is self._mpi \
            and (self._mpi.size(), self._mpi.rank()) == (world.size, world.rank)
        if not kept:
            if dist.is_initialized():
                dist.destroy_process_group()
            self._mpi = _mpigroup.MPIGroup(world)
            _mpigroup.install(self._mpi, self.timeout)
        world.events.emit("process_group", backend=self.backend, size=world.size, generation=world.generation,
                          kept=kept)

    def _make_with_store(self) -> None:
        world = self.world
        if dist.is_initialized():
            dist.destroy_process_group()
        host, port = None, None
        if world.rank == 0:
            host = _address()
            self._store = dist.TCPStore(host, 0, world.size, True, timeout=self.timeout, wait_for_workers=False)
            port = self._store.port
        host, port = world.bcast((host, port), root=0)
        if world.rank != 0:
            self._store = dist.TCPStore(host, port, world.size, False, timeout=self.timeout)
        prefixed = dist.PrefixStore(f"elastic/{world.generation}", self._store)
        if self.backend == "nccl":  # a peer's death raises here instead of tearing this process down
            os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "2")
        before = _sockets() if self.backend == "gloo" else {}
        dist.init_process_group(self.backend, store=prefixed, rank=world.rank, world_size=world.size,
                                timeout=self.timeout)
        if self.backend == "gloo":  # Gloo connects every pair in there: what abort() shuts down
            _track_gloo_connections(world, before)
        world.events.emit("process_group", backend=self.backend, size=world.size, generation=world.generation)


def abort() -> None:
    """Let go of the current group at once (local), after a failure: peers blocked in one of its
    collectives leave it for the recovery instead of waiting. The ``ulfm`` group needs nothing
    (the World's revoke ends its collectives, and a substitution keeps it); NCCL's communicators
    are aborted (torch's ``_abort_process_group``: no wait on a kernel a dead peer never joins);
    a Gloo group has its connections shut down, then is destroyed."""
    if not dist.is_initialized() or isinstance(dist.group.WORLD, _mpigroup.MPIGroup):
        return
    if dist.get_backend() == "nccl" and hasattr(dist.distributed_c10d, "_abort_process_group"):
        dist.distributed_c10d._abort_process_group()
        return
    _shut_gloo_connections()
    dist.destroy_process_group()


# torch 2.13's Gloo has no abort (its abort() and shutdown() leave the connections open), and a
# group a program still holds (DDP's reducer does) is not freed by destroy_process_group: a peer
# blocked in a collective with this rank, waiting for a message it will never send, would wait
# out the group's timeout (10 s a failure in bench_ddp). Shutting the group's sockets down ends
# its collectives everywhere at once, as a process's exit does ("Connection closed by peer").
_GLOO_SOCKETS: dict[int, int] = {}  # fd -> inode of the current Gloo group's connections


def _track_gloo_connections(world: World, before: dict[int, int]) -> None:
    """The Gloo group's connections (collective): sockets opened by ``init_process_group`` that end
    at this rank's Gloo listener (accepted) or at a peer's, whose ports the ranks gather. Anything
    else new (an MPI connection made meanwhile) stays out: shut down, it would look like a death."""
    known = set(before.values())  # (a dict's values() is searched one by one: a full mesh's n sockets, n times)
    new = {fd: inode for fd, inode in _sockets().items() if inode not in known}
    ends = {fd: e for fd in new if (e := _tcp_ends(fd)) is not None}
    mine = [local for listening, local, _ in ends.values() if listening]
    listeners = {port for ports in world.allgather(mine) for port in ports}
    _GLOO_SOCKETS.clear()
    _GLOO_SOCKETS.update((fd, new[fd]) for fd, (listening, local, remote) in ends.items()
                         if not listening and (local in mine or remote in listeners))


@contextlib.contextmanager
def _borrowed(fd: int) -> Iterator[socket.socket | None]:
    """The socket on ``fd``, left open after (Gloo owns it); None where it was closed meanwhile
    (Gloo closes its own on a peer's error)."""
    try:
        sock = socket.socket(fileno=fd)
    except OSError:
        yield None
        return
    try:
        yield sock
    finally:
        sock.detach()


def _tcp_ends(fd: int) -> tuple[bool, int, int] | None:
    """(listening, local port, remote port) of a TCP socket (remote 0 when listening); None for
    another kind, or one closed meanwhile."""
    with _borrowed(fd) as sock:
        if sock is None or sock.family not in (socket.AF_INET, socket.AF_INET6) or sock.type != socket.SOCK_STREAM:
            return None
        try:
            listening = bool(sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN))
            return listening, sock.getsockname()[1], 0 if listening else sock.getpeername()[1]
        except OSError:
            return None


def _sockets() -> dict[int, int]:
    """This process's open sockets, fd -> inode (Linux's /proc; none elsewhere)."""
    out: dict[int, int] = {}
    try:
        fds = os.listdir("/proc/self/fd")
    except OSError:
        return out
    for name in fds:
        try:
            target = os.readlink(f"/proc/self/fd/{name}")
        except OSError:  # closed meanwhile (the listing's own fd, too)
            continue
        if target.startswith("socket:["):
            out[int(name)] = int(target[8:-1])
    return out


def _shut_gloo_connections() -> None:
    """Shut down (not close: Gloo still owns them) the connections the Gloo group opened, each only
    if its fd still names the same socket (local). Never its listening socket: Gloo's loop ends the
    process when accept() fails."""
    now = _sockets()
    for fd, inode in _GLOO_SOCKETS.items():
        if now.get(fd) != inode:
            continue
        with _borrowed(fd) as sock, contextlib.suppress(OSError):  # OSError: closed or shut already
            if sock is not None:
                sock.shutdown(socket.SHUT_RDWR)
    _GLOO_SOCKETS.clear()


def end_iterations() -> None:
    """End the iteration a failure cut short in every FSDP2 model of this process (local): FSDP2's
    per-iteration state and every gradient, the unsharded ones its root unit keeps included
    (``end_iteration``), so the program calls nothing FSDP2-specific after a failure. FSDP2 keeps
    its units in ``torch.distributed._composable_state``'s weak map: each root found there. With no
    process group there is no FSDP2 model to end (a simulated job's threads share one process:
    they must not touch what another test left in the map)."""
    from torch.distributed._composable_state import _module_state_mapping
    from torch.distributed.fsdp import FSDPModule

    if not dist.is_initialized():
        return

    for module, state in list(_module_state_mapping.items()):
        if isinstance(module, FSDPModule) and getattr(state(), "_is_root", None) is not False:  # None: no forward yet
            end_iteration(module)


def _after_failure() -> None:
    abort()
    end_iterations()


register_data_plane(is_peer_failure, _after_failure)


def _address() -> str:
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"

"""The resilient world: this process's place in the job, and the calls the layers above make.

Two communicators: the *universe* (``members.comm``: every live process, active
ranks and parked spares, where every rebuild runs) and ``comm`` (the active
ranks, ordered by logical rank: what users compute on). The layers above use
the ``Group`` below, never ``comm`` itself: agreed collectives (``vote``,
``allgather``, ``bcast``, ``alltoall``: the outcome is the same on every rank),
data-plane ones (``exchange``, ``allreduce``), fault points, the event log and
``job`` (the job's facts as this process knows them). The World's own public
surface adds only ``recover``, ``finish`` and ``mpi`` (the communicators, for
programs that call mpi4py themselves); everything else is private. The rebuild is
``_rebuild``'s, the spares' messages ``_spares``', how a process joins ``_join``'s
and how it ends ``_lifecycle``'s. None of them writes here: a join or a rebuild
hands over a frozen ``Generation`` (membership, communicators, role, streak) and
``_adopt`` takes it whole, so the modules below see the World only through the
read-only protocols they declare (``RebuildHost``, ``lifecycle.Host``).
"""
from __future__ import annotations

import contextlib
import dataclasses
import os
import sys
import time
import warnings
import zlib
from typing import TYPE_CHECKING, Any, Callable, Iterator, Mapping, NoReturn, Sequence, TypeVar, cast

import numpy as np
from mpi4py import MPI

from . import _collectives, _spares
from ._config import Config
from ._group import Settings, first_survivor
from ._halo import HaloComm
from ._errors import ConfigError, ElasticError, ProcessFailure, Unrecoverable, agreed, mpi_errors, translate
from .events import EventLog
from .faults import QUIET_ACTIONS, FaultInjector, Injection
from ._lifecycle import Lifecycle
from ._membership import Members
from ._policy import Decision, Outlook, RebuildContext, RebuildPolicy, would_fill
from ._ranks import SPARE, CurrentRank, LogicalRank, Role
from ._rebuild import Generation, Rebuild, Rebuilder, stop_a_programming_error, stop_a_repeated_error
from ._watchdog import Watchdog

# One per process (the sentinel's page); its heartbeat starts with the join (``init``).
WATCHDOG = Watchdog.from_env()
_T = TypeVar("_T")


class World:
    """The job's live processes and this process's place among them. Build it with ``init()``."""

    def __init__(self, generation: Generation, config: Config, policy: RebuildPolicy, initial_size: int, *,
                 history: set[tuple[str, Any]] | None = None, step: int | None = None, alone: bool = False,
                 environ: Mapping[str, str] | None = None) -> None:
        self._now = generation                # changed by _adopt() only: a join's, then each rebuild's
        self._config, self._policy, self._initial_size = config, policy, initial_size
        self._environ = os.environ if environ is None else environ  # the layers above read their settings here
        self._step = step                     # the loop's last step, as told by fault_point / progress
        self._collectives = 0                 # calls on the active ranks so far (guarded MPI calls)
        self._waited = 0.0                    # seconds spent in those calls (waiting for peers, mostly)
        # A replacement (spawned or relaunched) exists because of a failure.
        self._failures_seen = generation.rebuild is not None or generation.role is Role.RECOVERED
        self._history = history if history is not None else set()  # software errors seen, to stop a repeat
        self._watchdog = WATCHDOG
        self.events = EventLog(config.run_dir, self._context)
        self._lifecycle = Lifecycle(self)
        self._faults = FaultInjector(config.inject, self._announce_fault, config.warm_socket)
        self._released: set[int] = set()
        self._alone = alone  # a single process started without mpiexec (debugging): nothing survivable
        self.job = WorldJob(self)
        self.mpi = WorldMpi(self)

    def _adopt(self, generation: Generation) -> None:
        """Make ``generation`` this process's (local): the one place where its membership changes."""
        self._now = generation

    # ------------------------------------------------------------ identity
    @property
    def generation(self) -> int:
        return self._now.number

    @property
    def role(self) -> Role:
        return self._now.role

    @property
    def last_rebuild(self) -> Rebuild | None:
        return self._now.rebuild

    @property
    def logical_rank(self) -> LogicalRank:
        """This process's logical rank (an active rank always has one; spares are never handed out)."""
        entry = self._members.mine()
        if entry == SPARE:
            raise Unrecoverable("a parked spare has no logical rank (a bug: spares are not handed out)")
        return LogicalRank(entry)

    @property
    def rank(self) -> CurrentRank:
        """This process's rank in the active communicator (``mpi.comm``) of this generation."""
        return CurrentRank(self._comm.Get_rank())

    @property
    def size(self) -> int:
        return self._comm.Get_size()

    @property
    def logical_ranks(self) -> tuple[LogicalRank, ...]:
        """The active logical ranks, in current-rank order (ascending)."""
        return self._members.logical_ranks()

    # ------------------------------------------------------------ faults, record
    def fault_point(self, step: int | None, point: str = "step", *, implied: bool = False,
                    micro: int | None = None) -> None:
        """Fire the fault schedule's entries for this rank at ``point`` (local); a step is progress.

        A program needs no call of its own: the library's calls that know the step
        (``State.record_step``, the data sampler) mark the step with ``implied=True``, and
        count until the program marks its steps itself (``fault_point(step)``); the
        collectives are ``collective`` points. ``micro``: a micro-batch of the step (the data
        sampler's, with accumulation), for the schedule's ``R@S.M`` only."""
        if point == "step" and micro is None:
            self._progress(step)
        if self._faults.schedule:
            self._faults.point(point, int(self.logical_rank), self.generation, step, implied=implied, micro=micro)

    # ------------------------------------------------- agreed collectives
    def vote(self, ok: bool, why: str = "a rank could not finish its part") -> None:
        """Returns on every active rank or raises ``ProcessFailure`` on every one (collective, ULFM Agree)."""
        with self._guard():
            if not _collectives.agree(self._comm, int(ok)):
                raise ProcessFailure(why)

    def agree_equal(self, value: int, ok: bool = True) -> bool:
        """True on every active rank iff every one passed the same ``value`` (its low 30 bits) and
        ``ok``; False on every one otherwise (collective, three ULFM Agrees: O(log n), no table)."""
        low, mask = value & 0x3FFFFFFF, 0x3FFFFFFF
        with self._guard():
            same = _collectives.agree(self._comm, low) == low and \
                _collectives.agree(self._comm, ~low & mask) == ~low & mask
            return bool(_collectives.agree(self._comm, int(same and ok)))

    def allgather(self, obj: Any) -> list[Any]:
        """Every active rank's ``obj`` in current-rank order, or ``ProcessFailure`` everywhere (collective)."""
        return self._agreed(lambda: _collectives.allgather(self._comm, obj))

    def bcast(self, obj: Any, root: int) -> Any:
        """``obj`` of current rank ``root`` on every active rank, or ``ProcessFailure`` everywhere (collective)."""
        return self._agreed(lambda: _collectives.bcast(self._comm, obj, root))

    def alltoall(self, objs: Mapping[int, Any]) -> list[Any]:
        """Send ``objs[r]`` (None if absent) to current rank ``r``; returns what each rank sent here,
        by current rank, or ``ProcessFailure`` everywhere (collective, agreed)."""
        return self._agreed(lambda: _collectives.alltoall(self._comm, [objs.get(r) for r in range(self.size)]))

    def _agreed(self, call: Callable[[], _T]) -> _T:
        # A collective can fail on some ranks and succeed on others; the vote makes the outcome the
        # same everywhere, so that no rank goes on to a later Agree that another never reaches.
        result, ok = None, False
        try:
            with self._guard():
                result, ok = call(), True
        except ProcessFailure:
            pass
        self.vote(ok, "a rank could not finish a collective")
        return cast(_T, result)  # the vote passed: every rank has its result

    # ---------------------------------------------------------- data plane
    def allreduce(self, arrays: list[np.ndarray], step: int | None = None) -> None:
        """Sum each array over the active ranks, in place, all in flight together (collective);
        a ``collective`` fault of ``step`` (default: the loop's step) fires in flight."""
        at = self._step if step is None else step
        with self._guard():
            _collectives.allreduce_sum(self._comm, arrays, lambda: self.fault_point(at, "collective"))

    def exchange(self, outgoing: Mapping[int, list[np.ndarray]], incoming: Mapping[int, list[np.ndarray]],
                 point: str = "commit", step: int | None = None, known: bool = False) -> int:
        """Byte arrays to peers, and into given arrays from them, by logical rank (collective; see
        ``_collectives.exchange``). The ``point`` fault (commit or restore) fires with the transfer
        about to start. ``known``: every receiver knows what comes (one plan on every rank): only the
        ranks that exchange bytes wait for each other (``_collectives.exchange_known``). Returns the
        bytes sent."""
        order = self.logical_ranks
        with self._guard():
            if known:  # the peers only, by current rank: O(peers) at any job size
                return _collectives.exchange_known(self._comm, _collectives.by_current(outgoing, order),
                                                   _collectives.by_current(incoming, order),
                                                   lambda: self.fault_point(step, point))
            return _collectives.exchange(self._comm, _collectives.by_rank(outgoing, order),
                                         _collectives.by_rank(incoming, order), lambda: self.fault_point(step, point))

    def neighbors(self, sends: list[tuple[int, int, np.ndarray]], receives: list[tuple[int, int, np.ndarray]],
                  step: int | None = None) -> None:
        """Point-to-point exchange with some peers, e.g. a stencil's halos (collective among the
        ranks named, blocking). ``sends``: (current rank, tag, array); ``receives``: (current
        rank, tag, writable array). Every transfer is posted non-blocking, then one ``Waitall``:
        a dead peer, or a peer's revoke of ``comm`` (it began a recovery), is ``ProcessFailure``
        here. (``Sendrecv`` with a dead peer has crashed survivors inside Open MPI.) A
        ``collective`` fault of ``step`` (default: the loop's step) fires in flight."""
        at = self._step if step is None else step
        comm = self._comm
        with self._guard():
            requests = [comm.Irecv(array, source, tag) for source, tag, array in receives]
            requests += [comm.Isend(array, dest, tag) for dest, tag, array in sends]
            self.fault_point(at, "collective")
            MPI.Request.Waitall(requests)

    # ------------------------------------------------------- the lifecycle
    def interrupt(self) -> None:
        """Revoke the active communicator (local): every peer leaves what it waits for in it with
        ``ProcessFailure`` (one that waits for this rank's point-to-point message, say)."""
        for comm in (self._comm, *self.mpi._derived()):
            try:
                comm.Revoke()
            except MPI.Exception:
                pass  # revoked by a peer already

    def fail(self, kind: str, message: str) -> NoReturn:
        """This process fails alone, now (local): recorded as ``kind`` with ``message``, then killed,
        so that the others see a failure at once and recover from it. Never returns."""
        self._lifecycle.fail(kind, message)
        raise AssertionError("unreachable: the lifecycle kills this process")

    def recover(self, outlook: Outlook | None = None) -> Rebuild:
        """Rebuild after a ``ProcessFailure`` (collective over every survivor, blocking).

        Revokes the communicators so that every rank, parked spares included,
        leaves what it was doing, agrees on the failed set and rebuilds as the
        policy decides (``outlook``: the loop's view ahead, for the policy).

        Raises:
            Unrecoverable: no mode can fill the gap, or the same software error came
                back after a recovery (the same on every process).
        """
        self.events.emit("failure_seen")
        for comm in (self._comm, self._universe, *self.mpi._derived()):
            try:
                comm.Revoke()
            except MPI.Exception:
                pass  # already revoked by a peer
        return self._rebuild(join=False, outlook=outlook)

    def finish(self) -> None:
        """End the job cleanly (collective over the active ranks): record the outcome.

        Raises ``ProcessFailure`` on every active rank alike (ULFM Agree is
        uniform), so a failure at the very end is recovered like any other.
        Parked spares are released when the processes leave (``_lifecycle``).
        """
        self.fault_point(None, "finish")
        # One Agree: every rank is here (bit 0), and whether no rank ever told a step (bit 1).
        with self._guard():
            told = _collectives.agree(self._comm, 1 | (int(self._step is None) << 1))
        if told & 2 and self._faults.wants_steps():
            raise agreed(ConfigError(
                f"the fault schedule {[e.to_dict() for e in self._faults.schedule]} never fired: this program "
                "reaches no injection point. Call world.fault_point(step) at the top of each step, or "
                "state.record_step(step) after it, or reduce gradients with elastic.allreduce_gradients"))
        self.events.emit("finished")
        self.events.write_outcome("finished")
        self._lifecycle.finished = True
        self._watchdog.watch_progress(False)

    # ------------------------------------------------------------ internals
    @property
    def _members(self) -> Members:
        return self._now.members

    @property
    def _comm(self) -> MPI.Intracomm:
        """The active ranks of this generation, by logical rank (COMM_NULL on a parked spare)."""
        return self._now.comm

    @property
    def _universe(self) -> MPI.Intracomm:
        return self._members.comm

    @property
    def _streak(self) -> int:
        """Rebuilds since the last successful commit."""
        return self._now.streak

    @property
    def _committed(self) -> bool:
        return self._now.committed

    def _context(self) -> dict[str, Any]:
        try:
            entry = self._members.mine()
            current = self._comm.Get_rank() if self._comm != MPI.COMM_NULL else None
        except MPI.Exception:
            entry, current = SPARE, None
        return {"logical": None if entry == SPARE else entry, "rank": current, "gen": self.generation,
                "role": self.role.value}

    @contextlib.contextmanager
    def _guard(self) -> Iterator[None]:
        self._collectives += 1
        start = time.perf_counter()
        try:
            with self._watchdog.waiting(), mpi_errors(self._comm):
                yield
        finally:
            self._waited += time.perf_counter() - start

    def _progress(self, step: int | None = None) -> None:
        """Tell the watchdog that the loop moved on (local, cheap); ``step``: where it is now."""
        if step is not None:
            self._step = step
        self._watchdog.progress(step)

    def _note_commit(self) -> None:
        self._now = dataclasses.replace(self._now, streak=0, committed=True)
        self._progress()

    def _rebuild(self, join: bool, outlook: Outlook | None = None) -> Rebuild:
        self._failures_seen = True
        self._watchdog.progress()  # the recovery is this process's progress now: its clock starts here
        rebuilder = Rebuilder(self, outlook or Outlook(), self._members.copy())
        try:
            with self._watchdog.waiting():  # a rebuild waits for every live process
                generation = rebuilder.run(join)
        except ElasticError:
            # An agreed stop: leaving together needs the communicator every process shares now.
            self._adopt(dataclasses.replace(self._now, members=rebuilder.members))
            raise
        self._adopt(generation)
        rebuild = generation.rebuild
        assert rebuild is not None
        self._announce(rebuild)
        if self.role is not Role.SPARE:
            self._progress()
        stop_a_programming_error(rebuild)
        stop_a_repeated_error(rebuild, self._history)
        self._export_env()
        return rebuild

    def _announce(self, rebuild: Rebuild, **extra: Any) -> None:
        """The ``rebuilt`` event of this generation (local): the report's and the tools' record of it."""
        spare = self.role is Role.SPARE
        self.events.emit("rebuilt", mode=rebuild.mode, failed=rebuild.failed, replaced=rebuild.replaced,
                         removed=rebuild.removed, lost_spares=rebuild.lost_spares, attempts=rebuild.attempts,
                         size=self._members.actives(), durations=rebuild.durations, causes=list(rebuild.causes),
                         streak=rebuild.streak, local=None if spare else [self.job.local_rank, self.job.local_size],
                         **extra)

    def _export_env(self) -> None:
        """RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE as torchrun sets them (current ranks), for
        libraries that read them; set at the join and after every rebuild (local; not on a spare)."""
        if self._members.mine() != SPARE:
            os.environ.update(RANK=str(self.rank), WORLD_SIZE=str(self.size), LOCAL_RANK=str(self.job.local_rank),
                              LOCAL_WORLD_SIZE=str(self.job.local_size))

    def _park(self) -> None:
        """Wait as a spare until promoted (returns) or released at the end of the job (exits)."""
        self.events.emit("parked")
        self._watchdog.watch_progress(False)  # waiting is a parked spare's job
        members = self._members
        self._fire_for(members, "park", index=members.table[:members.comm.Get_rank()].count(SPARE))
        while self.role is Role.SPARE:
            universe = self._universe
            try:
                _spares.wait_for_release(universe)
            except MPI.Exception as exc:
                if exc.Get_error_class() == MPI.ERR_REVOKED:
                    self._rebuild(join=False)
                    continue
                if exc.Get_error_class() in (MPI.ERR_PROC_FAILED, MPI.ERR_PROC_FAILED_PENDING):
                    universe.Ack_failed()  # the active ranks will revoke if it matters...
                    if _spares.every_active_failed(self._members):  # ...unless none is left to do it
                        raise agreed(Unrecoverable("every active rank died; the parked spares have nothing "
                                                   "to take over from")) from None
                    continue
                raise translate(exc, universe) from exc
            self.events.emit("released")
            self.events.write_outcome("spare-unused")
            self._lifecycle.finished = True
            sys.exit(0)
        self.events.emit("promoted", logical=self.logical_rank)
        self._watchdog.watch_progress(True)

    def _release_spares(self) -> None:
        _spares.send_releases(self._members, self._released)

    def _fire_for(self, members: Members, point: str, index: int | None = None) -> None:
        """Fire ``point`` faults for this process: a logical rank, or the ``index``-th parked spare."""
        entry = members.mine() if index is None else index
        if self._faults.schedule and (entry != SPARE or index is not None):
            self._faults.fire(point, entry, self.generation)

    def _handover(self) -> dict[str, Any]:
        """What a spawned process needs to become a member (sent with the merge)."""
        return {"config": self._config, "initial_size": self._initial_size,
                "environ": {k: v for k, v in self._environ.items() if k.startswith("ELASTIC_")},
                "generation": self.generation, "history": self._history, "streak": self._streak,
                "step": self._step, "committed": self._committed}

    def _announce_fault(self, entry: Injection) -> None:
        self.events.emit("inject", **entry.to_dict())
        if entry.action in QUIET_ACTIONS:  # nothing ends here: what the layers above make of it is the outcome
            return
        self.events.write_outcome(f"injected-{entry.action}", injection=entry.to_dict(), step=self._step)
        self._lifecycle.injected()


class WorldJob:
    """The job as this process knows it (``world.job``): its first size, its settings, its place on
    its host, whether a version was committed, whether it is over (local, no communication)."""

    def __init__(self, world: World) -> None:
        self._world = world

    @property
    def initial_size(self) -> int:
        """The active ranks the job started with: what programs shard their data by."""
        return self._world._initial_size

    @property
    def settings(self) -> Settings:
        return self._world._config

    @property
    def environ(self) -> Mapping[str, str]:
        """The environment the launcher gave this process (a spawned one: its parents'
        ``ELASTIC_*``), where the layers above read their own settings."""
        return self._world._environ

    @property
    def alone(self) -> bool:
        """A single process started without mpiexec (debugging): nothing is survivable."""
        return self._world._alone

    @property
    def step(self) -> int | None:
        """The loop's last step, as told by ``fault_point`` and the library's step points."""
        return self._world._step

    @property
    def host_peers(self) -> list[int]:
        """The active logical ranks on this rank's host, ascending (this one included)."""
        return self._world._members.host_peers()

    @property
    def collectives(self) -> int:
        """How many calls on the active ranks (collectives, data plane) this process has made: a
        count that moves whenever it talked to its peers."""
        return self._world._collectives

    @property
    def local_rank(self) -> int:
        """This rank's place among the active ranks on its host, by logical rank (follows rebuilds)."""
        return self.host_peers.index(int(self._world.logical_rank))

    @property
    def local_size(self) -> int:
        """How many active ranks share this rank's host."""
        return len(self.host_peers)

    @property
    def spares(self) -> int:
        """How many spares are parked right now."""
        return self._world._members.spares()

    @property
    def waited(self) -> float:
        """Seconds this process has spent in calls on the active ranks (collectives, data plane):
        a step's time less what it waited is its own work (the straggler detector's measure)."""
        return self._world._waited

    def rebuild_decision(self, lost: Sequence[int], outlook: Outlook) -> Decision:
        """What the rebuild would decide if the logical ranks ``lost`` died now: this job's policy,
        asked as the rebuild asks it, its modes kept where the fill rule places every lost rank."""
        world, gone = self._world, {int(r) for r in lost}
        active = [int(r) for r in world.logical_ranks if int(r) not in gone]
        return would_fill(world._policy, RebuildContext.of(lost, active, world._members.spares(), outlook,
                                                           world._initial_size))

    def data_fault(self, action: str) -> Injection | None:
        """An injected data fault (``nan``, ``bitflip``, ``slow``) armed for this process, if any
        (local; see ``elastic.comm.faults``): the layers above apply it."""
        return self._world._faults.data_fault(action)

    @property
    def first_survivor(self) -> CurrentRank:
        """The lowest current rank that lived through the last rebuild: a safe root to resync from."""
        return first_survivor(self._world)

    @property
    def committed(self) -> bool:
        """A commit was agreed in this job (known to replacements too)."""
        return self._world._committed

    def note_commit(self) -> None:
        """A commit succeeded on every active rank, or a committed version was found again (local):
        failures in a row start again from 0."""
        self._world._note_commit()

    @property
    def ended(self) -> bool:
        """The job is over for good on this process: finished, or stopped on every process alike."""
        lifecycle = self._world._lifecycle
        return lifecycle.finished or lifecycle.stopped


class WorldMpi:
    """The communicators under the World (``world.mpi``), for programs that call mpi4py themselves:
    wrap such calls in ``guard()``. Valid for this generation only: a rebuild makes new ones."""

    def __init__(self, world: World) -> None:
        self._world = world
        self._halo: tuple[MPI.Intracomm, MPI.Intracomm] | None = None  # (this generation's, as HaloComm)
        self._parts: tuple[MPI.Comm, dict[tuple[int, ...], MPI.Intracomm]] = (MPI.COMM_NULL, {})

    @property
    def comm(self) -> MPI.Intracomm:
        """The active ranks of this generation, by logical rank (COMM_NULL on a parked spare), as a
        ``HaloComm``: mpi4py's communicator whose ``Sendrecv`` / ``sendrecv`` a peer's failure
        ends cleanly (Open MPI's blocking one has crashed survivors)."""
        comm = self._world._comm
        if self._halo is None or self._halo[0] is not comm:
            self._halo = (comm, HaloComm(comm) if comm != MPI.COMM_NULL else comm)
        return self._halo[1]

    @property
    def universe(self) -> MPI.Intracomm:
        """Every live process of the job: the active ranks and the parked spares."""
        return self._world._universe

    def neighbors(self, sends: list[tuple[int, int, np.ndarray]], receives: list[tuple[int, int, np.ndarray]],
                  step: int | None = None) -> None:
        """Deprecated: ``world.neighbors`` (the old name, kept for one release)."""
        warnings.warn("world.mpi.neighbors is world.neighbors now; the old name goes in the next release",
                      DeprecationWarning, stacklevel=2)
        self._world.neighbors(sends, receives, step)

    def part(self, ranks: Sequence[int]) -> MPI.Intracomm:
        """Some active ranks (current ranks, in the order given) as a communicator of this
        generation: collective over ``ranks`` the first time in a generation (every one of them
        asks at the same point of its program), then kept. A recovery or ``interrupt`` on any rank
        revokes it with ``comm``, so a wait in it ends when a peer leaves for a recovery. For torch
        process groups over part of the world (HSDP's replicate and shard groups)."""
        comm = self._world._comm
        if self._parts[0] is not comm:
            self._parts = (comm, {})
        key = tuple(int(r) for r in ranks)
        made = self._parts[1].get(key)
        if made is None:
            # Groups made at once must differ in tag (overlapping ones would mix their messages).
            tag = zlib.crc32(repr(key).encode()) % 32000 + 1
            with self.guard():
                made = comm.Create_group(comm.Get_group().Incl(list(key)), tag)
            self._parts[1][key] = made
        return made

    def _derived(self) -> list[MPI.Intracomm]:
        """This generation's communicators made by ``part``."""
        return list(self._parts[1].values()) if self._parts[0] is self._world._comm else []

    def guard(self) -> contextlib.AbstractContextManager[None]:
        """Context manager around MPI calls on ``comm``: their errors become ``ProcessFailure`` /
        ``Unrecoverable``, and the watchdog knows this rank is waiting for its peers, not stuck."""
        return self._world._guard()

    def Allgather(self, sendbuf: Any, recvbuf: Any, step: int | None = None) -> None:
        """Allgather of buffers over ``comm`` (collective, blocking); a ``collective`` fault fires in flight."""
        with self.guard():
            request = self.comm.Iallgather(sendbuf, recvbuf)
            self._world.fault_point(step, "collective")
            request.Wait()


if TYPE_CHECKING:
    from ._group import Recoverable

    def _keeps_the_contract(world: World) -> Recoverable:  # mypy checks that World implements it
        return world

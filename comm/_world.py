"""The resilient world: who is alive, which logical rank each process holds, and the rebuild.

Two communicators are kept:

* ``universe``: every live process of the job, active ranks and parked spares.
  Every rebuild runs on it, so spares and spawned processes take part in the
  same agreement as the survivors.
* ``comm``: the active ranks only, ordered by logical rank; this is what the
  user computes on.

A membership table, identical on every process, maps each universe rank to its
logical rank (or ``SPARE``). Every completed rebuild bumps ``generation``.
"""
from __future__ import annotations

import atexit
import dataclasses
import os
import signal
import socket
import sys
import time
from typing import Any, Callable, Iterable, Mapping

from mpi4py import MPI

from ._errors import ConfigError, ProcessFailure, Unrecoverable, mpi_errors, translate
from ._events import RUN_DIR_ENV, EventLog
from ._faults import INJECT_ENV, FaultInjector, Injection, parse_schedule
from ._ranks import CurrentRank, LogicalRank, Role
from ._ulfm import agree_on_failed, check_ulfm

SPARES_ENV = "ELASTIC_SPARES"
REBUILD_ENV = "ELASTIC_REBUILD"
MIN_SIZE_ENV = "ELASTIC_MIN_SIZE"
MODES = ("spare", "spawn", "shrink")
SPARE = -1  # membership-table entry of a parked spare
_TAG_RELEASE = 7701

# decide(lost, spares, active, outlook) -> (modes to apply in order, reason); see elastic.recovery.Policy.
Decide = Callable[[int, int, int, Mapping[str, float]], "tuple[tuple[str, ...], str]"]


@dataclasses.dataclass(frozen=True)
class Rebuild:
    """What a completed rebuild did; identical on every process of the new world."""

    generation: int
    mode: str                              # "spare", "spawn", "shrink" or a mix such as "spare+shrink"
    failed: frozenset[LogicalRank]         # active logical ranks whose process died
    replaced: frozenset[LogicalRank]       # those now held by a promoted spare or a spawned process
    removed: frozenset[LogicalRank]        # those dropped (shrink): their work must be re-sharded
    lost_spares: int                       # parked spares that died
    attempts: int                          # > 1 when a failure hit the rebuild itself
    durations: dict[str, float]            # seconds per phase: agree, shrink, substitute, install


@dataclasses.dataclass(frozen=True)
class _Config:
    modes: tuple[str, ...]
    min_size: int
    initial_size: int
    run_dir: str | None
    schedule: tuple[Injection, ...]
    decide: Decide | None = None


class World:
    """The job's live processes and this process's place among them. Build it with ``init()``."""

    def __init__(self, universe: MPI.Intracomm, table: list[int], config: _Config,
                 generation: int, role: Role) -> None:
        self.universe = universe
        self.comm: MPI.Intracomm = MPI.COMM_NULL
        self._table = table
        self._config = config
        self.generation = generation
        self.role = role
        self.last_rebuild: Rebuild | None = None
        # The loop's view ahead ("step_seconds", "remaining_steps"), read by a cost-based decide.
        self.outlook: dict[str, float] = {}
        self._procs: list[tuple[str, int]] = []
        self._finished = False
        self._failures_seen = False
        self._failed = False
        self.events = EventLog(config.run_dir, self._context)
        self._faults = FaultInjector(config.schedule, self._announce_fault)

    # ------------------------------------------------------------------ views
    @property
    def logical_rank(self) -> LogicalRank | None:
        """This process's logical rank; None while it is a parked spare."""
        entry = self._table[self.universe.Get_rank()]
        return None if entry == SPARE else LogicalRank(entry)

    @property
    def rank(self) -> CurrentRank:
        """This process's rank in ``comm`` (the active ranks of this generation)."""
        return CurrentRank(self.comm.Get_rank())

    @property
    def size(self) -> int:
        return self.comm.Get_size()

    @property
    def logical_ranks(self) -> tuple[LogicalRank, ...]:
        """The active logical ranks, in current-rank order (ascending)."""
        return tuple(LogicalRank(e) for e in sorted(e for e in self._table if e != SPARE))

    @property
    def initial_size(self) -> int:
        """How many logical ranks the job started with."""
        return self._config.initial_size

    @property
    def spares(self) -> int:
        """How many spares are parked right now."""
        return sum(1 for e in self._table if e == SPARE)

    def current_rank_of(self, logical: int) -> CurrentRank:
        """Where logical rank ``logical`` sits in ``comm`` (local)."""
        try:
            return CurrentRank(self.logical_ranks.index(LogicalRank(logical)))
        except ValueError:
            raise KeyError(f"logical rank {logical} is not active in generation {self.generation}") from None

    @property
    def first_survivor(self) -> CurrentRank:
        """The lowest current rank that lived through the last rebuild: a safe root to resync from."""
        new = self.last_rebuild.replaced if self.last_rebuild else frozenset()
        for current, logical in enumerate(self.logical_ranks):
            if logical not in new:
                return CurrentRank(current)
        raise Unrecoverable("no active rank survived: every holder of the job's state is gone")

    def _context(self) -> dict[str, Any]:
        try:
            logical = self.logical_rank
            current = self.comm.Get_rank() if self.comm != MPI.COMM_NULL else None
        except MPI.Exception:
            logical, current = None, None
        return {"logical": logical, "rank": current, "gen": self.generation, "role": self.role.value}

    # ------------------------------------------------------------ user calls
    def guard(self):
        """Context manager: MPI errors inside become ``ProcessFailure`` / ``Unrecoverable``."""
        return mpi_errors(self.comm)

    def fault_point(self, step: int | None, point: str = "step") -> None:
        """Fire the fault schedule's entries for this rank at ``point`` (local)."""
        if self._faults.schedule and self.logical_rank is not None:
            self._faults.fire(point, int(self.logical_rank), self.generation, step)

    def Allgather(self, sendbuf: Any, recvbuf: Any, step: int | None = None) -> None:
        """Allgather over ``comm`` (collective over the active ranks, blocking).

        Started non-blocking so that a ``collective`` fault fires with the
        exchange in flight.
        """
        with self.guard():
            request = self.comm.Iallgather(sendbuf, recvbuf)
            if self._faults.schedule and step is not None:
                self._faults.fire("collective", int(self.logical_rank), self.generation, step)
            request.Wait()

    def recover(self) -> Rebuild:
        """Rebuild after a ``ProcessFailure`` (collective over every survivor, blocking).

        Revokes the communicators so that every rank, including parked spares,
        leaves what it was doing, agrees on the failed set, and rebuilds by
        the configured modes. Survives further failures during the rebuild.

        Raises:
            Unrecoverable: too few ranks remain, or no mode can fill the gap.
        """
        self.events.emit("failure_seen")
        for comm in (self.comm, self.universe):
            try:
                comm.Revoke()
            except MPI.Exception:
                pass  # already revoked by a peer
        return self._rebuild(self.universe, list(self._table), install_only=False)

    def finish(self) -> None:
        """End the job cleanly (collective over the active ranks): release spares, record the outcome.

        Raises ``ProcessFailure`` on every active rank alike (ULFM Agree is
        uniform), so a failure at the very end is recovered like any other.
        """
        with self.guard():
            self.comm.Agree(1)
        if self.comm.Get_rank() == 0:
            for u, entry in enumerate(self._table):
                if entry == SPARE:
                    try:
                        self.universe.send(None, dest=u, tag=_TAG_RELEASE)
                    except MPI.Exception:
                        pass  # a dead spare needs no release
        self.events.emit("finished")
        self.events.write_outcome("finished")
        self._finished = True

    # --------------------------------------------------------------- rebuild
    def _rebuild(self, universe: MPI.Intracomm, table: list[int], install_only: bool) -> Rebuild:
        """The rebuild loop, run by every live process of ``universe`` (spares and spawned ones too).

        One round: agree on the dead, fence them, shrink, fill the gaps
        (spare / spawn / shrink), install the new communicators, then vote.
        The vote (ULFM Agree) succeeds everywhere or fails everywhere, so every
        process either leaves the loop or starts another round on the newest
        communicator; a failure during the rebuild costs one more round.
        """
        started = time.perf_counter()
        self._failures_seen = True
        failed: set[int] = set()
        replaced: set[int] = set()
        removed: set[int] = set()
        lost_spares = 0
        modes_used: list[str] = []
        durations: dict[str, float] = {}
        attempts = 0
        if not install_only:
            self._fire_rebuild_point("agree", table, universe)
        while True:
            attempts += 1
            try:
                if not install_only:
                    t = time.perf_counter()
                    dead = agree_on_failed(universe)
                    durations["agree"] = durations.get("agree", 0.0) + time.perf_counter() - t
                    self.events.emit("agreed", failed=[table[u] for u in sorted(dead) if table[u] != SPARE],
                                     failed_universe=sorted(dead), attempt=attempts)
                    self._fence(dead)
                    self._fire_rebuild_point("rebuild", table, universe)
                    t = time.perf_counter()
                    shrunk = universe.Shrink()
                    shrunk.Set_errhandler(MPI.ERRORS_RETURN)
                    alive = MPI.Group.Translate_ranks(shrunk.Get_group(), list(range(shrunk.Get_size())),
                                                      universe.Get_group())
                    gone = sorted(set(range(universe.Get_size())) - set(alive))
                    lost = sorted(table[u] for u in gone if table[u] != SPARE)
                    lost_spares += sum(1 for u in gone if table[u] == SPARE)
                    failed.update(lost)
                    universe, table = shrunk, [table[u] for u in alive]
                    durations["shrink"] = durations.get("shrink", 0.0) + time.perf_counter() - t
                    t = time.perf_counter()
                    universe, table, round_modes, filled = self._fill(universe, table, lost)
                    replaced = (replaced | filled) - (set(lost) - filled)
                    removed |= set(lost) - filled
                    modes_used.extend(m for m in round_modes if m not in modes_used)
                    durations["substitute"] = durations.get("substitute", 0.0) + time.perf_counter() - t
                install_only = False
                t = time.perf_counter()
                summary = (sorted(failed), sorted(replaced), sorted(removed), lost_spares, modes_used, attempts)
                summary = self._install(universe, table, summary)
                if not universe.Agree(int(summary is not None)):
                    raise ProcessFailure("a process could not install the rebuilt communicator")
                durations["install"] = durations.get("install", 0.0) + time.perf_counter() - t
                break
            except (ProcessFailure, MPI.Exception) as exc:
                if isinstance(exc, MPI.Exception):
                    error = translate(exc, universe)
                    if not isinstance(error, ProcessFailure):
                        raise error from exc
                self.events.emit("rebuild_retry", attempt=attempts, error=str(exc))
                try:
                    universe.Revoke()
                except MPI.Exception:
                    pass
        # Every process, a spawned one too, takes the summary of universe rank 0 (an old member).
        failed_l, replaced_l, removed_l, lost_spares, modes_used, attempts = summary
        self.generation += 1
        mine = self.logical_rank
        self.role = Role.SPARE if mine is None else Role.RECOVERED if mine in replaced_l else Role.SURVIVOR
        durations["total"] = time.perf_counter() - started
        result = Rebuild(self.generation, "+".join(modes_used) or "none",
                         frozenset(map(LogicalRank, failed_l)), frozenset(map(LogicalRank, replaced_l)),
                         frozenset(map(LogicalRank, removed_l)), lost_spares, attempts, durations)
        self.last_rebuild = result
        self.events.emit("rebuilt", mode=result.mode, failed=result.failed, replaced=result.replaced,
                         removed=result.removed, lost_spares=lost_spares, attempts=attempts,
                         size=len(self.logical_ranks), durations=durations)
        return result

    def _fill(self, universe: MPI.Intracomm, table: list[int],
              lost: list[int]) -> tuple[MPI.Intracomm, list[int], list[str], set[int]]:
        """Give the lost logical ranks new processes, by the configured modes in order.

        Collective over ``universe`` (the shrunk one); every process computes the
        same decision from the same table. Returns the (possibly merged) universe,
        its table, the modes used and the logical ranks that were filled.
        """
        todo = list(lost)
        used: list[str] = []
        filled: set[int] = set()
        modes = self._decide(universe, table, len(lost)) if lost else ()
        for mode in modes:
            if not todo:
                break
            if mode == "spare":
                spare_slots = [u for u, e in enumerate(table) if e == SPARE]
                for u, logical in zip(spare_slots, list(todo)):
                    table[u] = logical
                    todo.remove(logical)
                    filled.add(logical)
                    if "spare" not in used:
                        used.append("spare")
            elif mode == "spawn":
                universe, table = self._spawn(universe, table, todo)
                filled.update(todo)
                todo = []
                used.append("spawn")
            elif mode == "shrink":
                active = sum(1 for e in table if e != SPARE)
                if active < self._config.min_size:
                    raise Unrecoverable(
                        f"only {active} active ranks remain, below the minimum of {self._config.min_size} "
                        f"({MIN_SIZE_ENV}); add spares (--spares) or allow spawn ({REBUILD_ENV}=spare,spawn,shrink)")
                todo = []
                used.append("shrink")
        if todo:
            raise Unrecoverable(
                f"logical ranks {todo} were lost and the rebuild modes {self._config.modes} cannot replace them "
                f"(spares left: {sum(1 for e in table if e == SPARE)}); allow 'spawn' or 'shrink' in {REBUILD_ENV}")
        if not any(e != SPARE for e in table):
            raise Unrecoverable("every active rank died; nothing is left to continue from")
        return universe, table, used, filled

    def _decide(self, universe: MPI.Intracomm, table: list[int], lost: int) -> tuple[str, ...]:
        """The modes for this rebuild (collective over ``universe``): the configured order, or
        the ``decide`` callable's answer on universe rank 0, broadcast so every process agrees."""
        decide = self._config.decide
        if decide is None:
            return self._config.modes
        answer = None
        if universe.Get_rank() == 0:
            spares = sum(1 for e in table if e == SPARE)
            answer = decide(lost, spares, len(table) - spares, dict(self.outlook))
        modes, reason = universe.bcast(answer, root=0)
        self.events.emit("decision", modes=modes, reason=reason, lost=lost)
        if not modes:
            raise Unrecoverable(f"cannot rebuild: {reason}")
        return tuple(modes)

    def _spawn(self, universe: MPI.Intracomm, table: list[int],
               logical: list[int]) -> tuple[MPI.Intracomm, list[int]]:
        """Start one new process per lost logical rank and merge it in (collective over ``universe``)."""
        command, args = sys.executable, list(getattr(sys, "orig_argv", sys.argv)[1:])
        try:
            inter = universe.Spawn(command, args, maxprocs=len(logical), root=0)
            inter.Set_errhandler(MPI.ERRORS_RETURN)
            merged = inter.Merge(high=False)
            merged.Set_errhandler(MPI.ERRORS_RETURN)
            new_table = table + list(logical)  # children come after the parents (high=True on their side)
            merged.bcast({"table": new_table, "generation": self.generation, "config": self._config}, root=0)
        except MPI.Exception as exc:
            raise Unrecoverable(f"spawning replacements for logical ranks {logical} failed: {exc}; "
                                f"use spares or shrink instead ({REBUILD_ENV})") from exc
        return merged, new_table

    def _install(self, universe: MPI.Intracomm, table: list[int], summary: Any = None) -> Any:
        """Build ``comm`` from ``universe``, learn every pid, share rank 0's ``summary`` (collective).

        Returns the shared summary (True when none was given), or None when
        this process could not finish; the caller's vote makes that uniform.
        """
        self.universe, self._table = universe, table
        try:
            mine = table[universe.Get_rank()]
            comm = universe.Split(MPI.UNDEFINED if mine == SPARE else 0, max(mine, 0))
            if comm != MPI.COMM_NULL:
                comm.Set_errhandler(MPI.ERRORS_RETURN)
            self.comm = comm
            self._procs = universe.allgather((socket.gethostname(), os.getpid()))
            return True if summary is None else universe.bcast(summary, root=0)
        except MPI.Exception as exc:
            self.events.emit("install_failed", error=str(exc))
            return None

    def _fence(self, dead: Iterable[int]) -> None:
        """Kill dead-declared processes on this host: a hung rank would keep mpiexec alive (local)."""
        host = socket.gethostname()
        for u in dead:
            if u < len(self._procs) and self._procs[u][0] == host and self._procs[u][1] != os.getpid():
                try:
                    os.kill(self._procs[u][1], signal.SIGKILL)
                    self.events.emit("fenced", pid=self._procs[u][1])
                except (ProcessLookupError, PermissionError):
                    pass

    def _fire_rebuild_point(self, point: str, table: list[int], universe: MPI.Intracomm) -> None:
        entry = table[universe.Get_rank()]
        if self._faults.schedule and entry != SPARE:
            self._faults.fire(point, entry, self.generation)

    def _announce_fault(self, entry: Injection) -> None:
        self.events.emit("inject", **entry.to_dict())
        self.events.write_outcome(f"injected-{entry.action}", injection=entry.to_dict())
        self._finished = True  # an injected death is this process's intended end

    # ---------------------------------------------------------------- spares
    def _park(self) -> None:
        """Wait as a spare until promoted (returns) or released at the end of the job (exits)."""
        self.events.emit("parked")
        while self.role is Role.SPARE:
            try:
                self.universe.recv(source=MPI.ANY_SOURCE, tag=_TAG_RELEASE)
            except MPI.Exception as exc:
                if exc.Get_error_class() == MPI.ERR_REVOKED:
                    self._rebuild(self.universe, list(self._table), install_only=False)
                    continue
                if exc.Get_error_class() in (MPI.ERR_PROC_FAILED, MPI.ERR_PROC_FAILED_PENDING):
                    self.universe.Ack_failed()  # the active ranks will revoke if it matters
                    continue
                raise translate(exc, self.universe) from exc
            self.events.emit("released")
            self.events.write_outcome("spare-unused")
            self._finished = True
            sys.exit(0)
        self.events.emit("promoted", logical=self.logical_rank)

    # ------------------------------------------------------------------- exit
    def _excepthook(self, kind: type, exc: BaseException, tb: Any) -> None:
        """Record an uncaught error as this process's outcome, then report it as usual."""
        if not self._finished and not issubclass(kind, SystemExit):
            self.events.emit("error", kind=kind.__name__, message=str(exc))
            self.events.write_outcome("error", kind=kind.__name__, message=str(exc))
            self._finished = True
            self._failed = True
        sys.__excepthook__(kind, exc, tb)

    def _at_exit(self) -> None:
        """Skip MPI_Finalize once failures happened: it can hang or crash then (ompi #11404)."""
        if not self._finished:
            self._failed = True
            self.events.write_outcome("exited-without-finish")
        if self._failures_seen:  # set by every rebuild, a spawned process's first one included
            sys.stdout.flush()
            sys.stderr.flush()
            # Leave together: Open MPI's launcher kills the remaining processes as soon as
            # one exits without finalizing, even those still busy after finish().
            try:
                self.universe.Agree(1)
            except MPI.Exception:
                pass  # someone died on the way out; nothing is left to protect
            os._exit(1 if self._failed else 0)


def _env_modes(value: str | Iterable[str] | None) -> tuple[str, ...]:
    if value is None:
        value = os.environ.get(REBUILD_ENV, "spare,shrink")
    modes = tuple(m.strip() for m in (value.split(",") if isinstance(value, str) else value) if m.strip())
    bad = [m for m in modes if m not in MODES]
    if not modes or bad:
        raise ConfigError(f"rebuild modes {modes!r}: give an ordered list drawn from {MODES}, "
                          "e.g. 'spare,shrink' or 'spawn'")
    return modes


def init(*, spares: int | None = None, rebuild: str | Iterable[str] | None = None, min_size: int | None = None,
         run_dir: str | None = None, inject: str | None = None, decide: Decide | None = None) -> World:
    """Join the resilient world (collective over every process of the job, blocking).

    Args:
        spares: how many of the launched processes park as hot spares
            (default ``ELASTIC_SPARES`` or 0). The last ``spares`` ranks park.
        rebuild: modes tried in order to fill a lost rank: "spare", "spawn",
            "shrink" (default ``ELASTIC_REBUILD`` or "spare,shrink").
        min_size: fewest active ranks to continue with (default ``ELASTIC_MIN_SIZE`` or 1).
        run_dir: where JSON-line events and outcome files go (default ``ELASTIC_RUN_DIR``; none: off).
        inject: a fault schedule (default ``ELASTIC_INJECT``), see ``elastic.comm`` faults.
        decide: chooses the modes of each rebuild instead of the fixed order
            (e.g. ``elastic.recovery.Policy``); must pickle, spawned processes get it too.

    Returns the World on an active rank. A spare returns only once promoted
    (role RECOVERED), or exits when the job finishes without needing it. A
    spawned replacement returns as RECOVERED.

    Raises:
        UlfmUnavailable: MPI cannot survive failures (says what to run instead).
        ConfigError: a setting is wrong.
    """
    check_ulfm()
    parent = MPI.Comm.Get_parent()
    if parent != MPI.COMM_NULL:
        return _join_as_spawned(parent)
    universe = MPI.COMM_WORLD.Dup()
    universe.Set_errhandler(MPI.ERRORS_RETURN)
    n = universe.Get_size()
    spares = int(os.environ.get(SPARES_ENV, "0")) if spares is None else spares
    min_size = int(os.environ.get(MIN_SIZE_ENV, "1")) if min_size is None else min_size
    if not 0 <= spares < n:
        raise ConfigError(f"spares={spares} with {n} processes: keep at least one active rank (0 <= spares < {n})")
    if min_size < 1:
        raise ConfigError(f"min_size={min_size}: must be at least 1")
    config = _Config(_env_modes(rebuild), min_size, n - spares, run_dir or os.environ.get(RUN_DIR_ENV),
                     parse_schedule(os.environ.get(INJECT_ENV) if inject is None else inject), decide)
    table = [r if r < n - spares else SPARE for r in range(n)]
    role = Role.SPARE if table[universe.Get_rank()] == SPARE else Role.INITIAL
    world = World(universe, table, config, 0, role)
    atexit.register(world._at_exit)
    sys.excepthook = world._excepthook
    with mpi_errors(universe):
        if world._install(universe, table) is None:
            raise ProcessFailure("a process failed while the job started")
    world.events.emit("started", size=n - spares, spares=spares, modes=config.modes)
    if role is Role.SPARE:
        world._park()
    return world


def _join_as_spawned(parent: MPI.Intercomm) -> World:
    """A spawned replacement: merge with the survivors and finish their rebuild with them."""
    parent.Set_errhandler(MPI.ERRORS_RETURN)
    with mpi_errors(parent):
        merged = parent.Merge(high=True)
        merged.Set_errhandler(MPI.ERRORS_RETURN)
        payload = merged.bcast(None, root=0)
    world = World(merged, payload["table"], payload["config"], payload["generation"], Role.RECOVERED)
    atexit.register(world._at_exit)
    sys.excepthook = world._excepthook
    world.events.emit("spawned")
    world._rebuild(merged, payload["table"], install_only=True)
    return world

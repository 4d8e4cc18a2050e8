"""The resilient world: who is alive, which logical rank each process holds, and the rebuild.

Two communicators are kept:

* ``universe``: every live process of the job, active ranks and parked spares.
  Every rebuild runs on it, so spares and spawned processes take part in the
  same agreement as the survivors.
* ``comm``: the active ranks only, ordered by logical rank; this is what the
  user computes on.

A membership table, identical on every process, maps each universe rank to its
logical rank (or ``SPARE``). Every completed rebuild bumps ``generation``.
How a process ends (together with the others, or alone) is ``_lifecycle``'s.
"""
from __future__ import annotations

import contextlib
import dataclasses
import os
import signal
import socket
import sys
import time
from typing import Any, Callable, Iterable, Iterator

from mpi4py import MPI

from ._errors import ConfigError, ProcessFailure, Unrecoverable, agreed, mpi_errors, translate
from ._events import RUN_DIR_ENV, EventLog, read_cause
from ._faults import INJECT_ENV, FaultInjector, Injection, parse_schedule
from ._lifecycle import Lifecycle
from ._ranks import CurrentRank, LogicalRank, Role
from ._settings import MIN_SIZE_ENV, MODES, REBUILD_ENV, SPARES_ENV
from ._ulfm import agree_on_failed, check_ulfm
from ._watchdog import Watchdog

SPARE = -1  # membership-table entry of a parked spare
JOIN_SECONDS = 30.0  # a spawned process that has not joined its parents by then is abandoned
_TAG_RELEASE = 7701

# decide(lost, spares, active, outlook, unavailable=...) -> (modes to apply in order, reason);
# see elastic.recovery.Policy. ``unavailable``: modes that failed in this rebuild (spawn).
Decide = Callable[..., "tuple[tuple[str, ...], str]"]
Proc = tuple[str, int]  # (host, pid) of a universe rank

# The heartbeat starts with MPI: from here on a stopped or frozen process is found by its sentinel.
_WATCHDOG = Watchdog.from_env()
_WATCHDOG.start()


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
    causes: tuple[dict[str, Any], ...] = ()  # how the dead processes ended, where they said so
    streak: int = 1                        # rebuilds since the last successful commit


@dataclasses.dataclass
class _Members:
    """One round's universe: the communicator, its table, and each rank's (host, pid) where known."""

    comm: MPI.Intracomm
    table: list[int]
    procs: list[Proc | None]

    def spares(self) -> int:
        return sum(1 for e in self.table if e == SPARE)


@dataclasses.dataclass
class _Progress:
    """What the rounds of one rebuild have done so far (every process keeps its own copy)."""

    failed: set[int] = dataclasses.field(default_factory=set)
    pending: set[int] = dataclasses.field(default_factory=set)  # lost, not yet replaced or removed
    replaced: set[int] = dataclasses.field(default_factory=set)
    removed: set[int] = dataclasses.field(default_factory=set)
    lost_spares: int = 0
    modes: list[str] = dataclasses.field(default_factory=list)
    attempts: int = 0
    causes: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    durations: dict[str, float] = dataclasses.field(default_factory=dict)

    def placed(self, mode: str, logical: list[int], replaced: bool) -> None:
        """``logical`` got a new process (``replaced``) or was dropped (a shrink) by ``mode``."""
        if not logical:
            return
        self.pending -= set(logical)
        (self.replaced if replaced else self.removed).update(logical)
        if mode not in self.modes:
            self.modes.append(mode)

    def timed(self, phase: str, since: float) -> None:
        self.durations[phase] = self.durations.get(phase, 0.0) + time.perf_counter() - since

    def summary(self, streak: int) -> dict[str, Any]:
        return {"failed": sorted(self.failed), "replaced": sorted(self.replaced), "removed": sorted(self.removed),
                "lost_spares": self.lost_spares, "modes": list(self.modes), "attempts": self.attempts,
                "causes": list(self.causes), "streak": streak}


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

    def __init__(self, members: _Members, config: _Config, generation: int, role: Role) -> None:
        self.universe = members.comm
        self.comm: MPI.Intracomm = MPI.COMM_NULL
        self._table = members.table
        self._procs = members.procs
        self._config = config
        self.generation = generation
        self.role = role
        self.last_rebuild: Rebuild | None = None
        # The loop's view ahead ("step_seconds", "remaining_steps"), read by a cost-based decide.
        self.outlook: dict[str, float] = {}
        self.step: int | None = None     # the loop's last step, as told by fault_point / progress
        self.failures_seen = False
        self._history: set[tuple[str, Any]] = set()  # software errors seen, to stop one that repeats
        self._streak = 0
        self._released: set[int] = set()
        self.watchdog = _WATCHDOG
        self.events = EventLog(config.run_dir, self._context)
        self.lifecycle = Lifecycle(self)
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
        raise agreed(Unrecoverable("no active rank survived: every holder of the job's state is gone"))

    def _context(self) -> dict[str, Any]:
        try:
            logical = self.logical_rank
            current = self.comm.Get_rank() if self.comm != MPI.COMM_NULL else None
        except MPI.Exception:
            logical, current = None, None
        return {"logical": logical, "rank": current, "gen": self.generation, "role": self.role.value}

    # ------------------------------------------------------------ user calls
    @contextlib.contextmanager
    def guard(self) -> Iterator[None]:
        """Context manager around MPI calls on ``comm``: their errors become ``ProcessFailure`` /
        ``Unrecoverable``, and the watchdog knows this rank is waiting for its peers, not stuck."""
        with self.watchdog.waiting(), mpi_errors(self.comm):
            yield

    def progress(self, step: int | None = None) -> None:
        """Tell the watchdog that the loop moved on (local, cheap); ``step``: where it is now."""
        if step is not None:
            self.step = step
        self.watchdog.progress(step)

    def fault_point(self, step: int | None, point: str = "step") -> None:
        """Fire the fault schedule's entries for this rank at ``point`` (local); a step is progress."""
        if point == "step":
            self.progress(step)
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

    def vote(self, ok: bool, why: str = "a rank could not finish its part") -> None:
        """Uniform decision over the active ranks: returns on all of them or raises
        ``ProcessFailure`` on all of them (collective over ``comm``, ULFM Agree)."""
        with self.guard():
            if not self.comm.Agree(int(ok)):
                raise ProcessFailure(why)

    def allgather(self, obj: Any) -> list[Any]:
        """Every active rank's ``obj``, in current-rank order, or ``ProcessFailure`` on every
        active rank alike (collective over ``comm``; an allgather, then a vote)."""
        return self._agreed_call(lambda: self.comm.allgather(obj))

    def bcast(self, obj: Any, root: int) -> Any:
        """``obj`` of current rank ``root`` on every active rank, or ``ProcessFailure`` on every
        active rank alike (collective over ``comm``; a broadcast, then a vote)."""
        return self._agreed_call(lambda: self.comm.bcast(obj, root=root))

    def _agreed_call(self, call: Callable[[], Any]) -> Any:
        # A collective can fail on some ranks and succeed on others; the vote makes the outcome
        # the same everywhere, so that no rank goes on to a later Agree that another never reaches.
        try:
            with self.guard():
                result, ok = call(), True
        except ProcessFailure:
            result, ok = None, False
        self.vote(ok, "a rank could not finish a collective")
        return result

    def note_commit(self) -> None:
        """A commit succeeded on every active rank (local): failures in a row start again from 0."""
        self._streak = 0
        self.progress()

    def recover(self) -> Rebuild:
        """Rebuild after a ``ProcessFailure`` (collective over every survivor, blocking).

        Revokes the communicators so that every rank, including parked spares,
        leaves what it was doing, agrees on the failed set, and rebuilds by
        the configured modes. Survives further failures during the rebuild.

        Raises:
            Unrecoverable: too few ranks remain, no mode can fill the gap, or the
                same software error came back after a recovery (the same on every process).
        """
        self.events.emit("failure_seen")
        for comm in (self.comm, self.universe):
            try:
                comm.Revoke()
            except MPI.Exception:
                pass  # already revoked by a peer
        return self._rebuild(self._members(), join=False)

    def finish(self) -> None:
        """End the job cleanly (collective over the active ranks): record the outcome.

        Raises ``ProcessFailure`` on every active rank alike (ULFM Agree is
        uniform), so a failure at the very end is recovered like any other.
        Parked spares are released when the processes leave (``_lifecycle``).
        """
        self.fault_point(None, "finish")
        with self.guard():
            self.comm.Agree(1)
        self.events.emit("finished")
        self.events.write_outcome("finished")
        self.lifecycle.finished = True
        self.watchdog.watch_progress(False)

    def release_spares(self) -> None:
        """Send the release to every parked spare, if this is the lowest live active process
        (local to the universe; called again after every failure on the way out)."""
        universe, table = self.universe, self._table
        me = universe.Get_rank()
        if table[me] == SPARE:
            return
        try:
            failed_group = universe.Get_failed()
            failed = set(MPI.Group.Translate_ranks(failed_group, list(range(failed_group.Get_size())),
                                                   universe.Get_group()))
            failed_group.Free()
        except MPI.Exception:
            failed = set()
        actives = [u for u, e in enumerate(table) if e != SPARE and u not in failed]
        if not actives or actives[0] != me:
            return
        for u, entry in enumerate(table):
            if entry == SPARE and u not in failed and u not in self._released:
                try:
                    universe.send(None, dest=u, tag=_TAG_RELEASE)
                    self._released.add(u)
                except MPI.Exception:
                    pass  # a dead spare needs no release; the agreement acknowledges it

    # --------------------------------------------------------------- rebuild
    def _members(self) -> _Members:
        return _Members(self.universe, list(self._table), list(self._procs))

    def _rebuild(self, members: _Members, join: bool) -> Rebuild:
        """The rebuild loop, run by every live process of the universe (spares and spawned ones too).

        One round: agree on the dead, fence them, shrink, fill the gaps
        (spare / spawn / shrink), install the new communicators, then vote.
        The vote (ULFM Agree) succeeds everywhere or fails everywhere, so every
        process either leaves the loop or starts another round on the newest
        communicator (``members`` always holds it); a failure during the
        rebuild costs one more round. A spawned process ``join``s at the install.
        """
        with self.watchdog.waiting():  # a rebuild waits for every live process
            return self._rebuild_rounds(members, join)

    def _rebuild_rounds(self, members: _Members, join: bool) -> Rebuild:
        started = time.perf_counter()
        self.failures_seen = True
        done = _Progress()
        if not join:
            self._fire_rebuild_point("agree", members)
        while True:
            done.attempts += 1
            try:
                if not join:
                    self._round(members, done)
                join = False
                t = time.perf_counter()
                summary = self._install(members, done.summary(self._streak + 1))
                if not members.comm.Agree(int(summary is not None)):
                    raise ProcessFailure("a process could not install the rebuilt communicator")
                done.timed("install", t)
                break
            except (ProcessFailure, MPI.Exception) as exc:
                if isinstance(exc, MPI.Exception):
                    error = translate(exc, members.comm)
                    if not isinstance(error, ProcessFailure):
                        raise error from exc
                self.events.emit("rebuild_retry", attempt=done.attempts, error=str(exc))
                try:
                    members.comm.Revoke()
                except MPI.Exception:
                    pass
        # Every process, a spawned one too, takes the summary of universe rank 0 (an old member).
        self.generation += 1
        self._streak = summary["streak"]
        mine = self.logical_rank
        self.role = Role.SPARE if mine is None else Role.RECOVERED if mine in summary["replaced"] else Role.SURVIVOR
        done.durations["total"] = time.perf_counter() - started
        result = Rebuild(self.generation, "+".join(summary["modes"]) or "none",
                         frozenset(map(LogicalRank, summary["failed"])),
                         frozenset(map(LogicalRank, summary["replaced"])),
                         frozenset(map(LogicalRank, summary["removed"])), summary["lost_spares"],
                         summary["attempts"], done.durations, tuple(summary["causes"]), summary["streak"])
        self.last_rebuild = result
        self.events.emit("rebuilt", mode=result.mode, failed=result.failed, replaced=result.replaced,
                         removed=result.removed, lost_spares=result.lost_spares, attempts=result.attempts,
                         size=len(self.logical_ranks), durations=done.durations, causes=list(result.causes),
                         streak=result.streak)
        if mine is not None:
            self.progress()
        self._stop_a_repeated_error(result)
        return result

    def _round(self, members: _Members, done: _Progress) -> None:
        """Agree on the dead, fence them, shrink and fill the gaps (collective over ``members.comm``)."""
        t = time.perf_counter()
        dead = agree_on_failed(members.comm)
        done.timed("agree", t)
        self.events.emit("agreed", failed=[members.table[u] for u in sorted(dead) if members.table[u] != SPARE],
                         failed_universe=sorted(dead), attempt=done.attempts)
        self._fence(dead, members.procs)
        done.causes.extend(self._causes(dead, members))
        self._fire_rebuild_point("rebuild", members)
        t = time.perf_counter()
        shrunk = members.comm.Shrink()
        shrunk.Set_errhandler(MPI.ERRORS_RETURN)
        alive = MPI.Group.Translate_ranks(shrunk.Get_group(), list(range(shrunk.Get_size())),
                                          members.comm.Get_group())
        gone = sorted(set(range(members.comm.Get_size())) - set(alive))
        lost = {members.table[u] for u in gone if members.table[u] != SPARE}
        done.lost_spares += sum(1 for u in gone if members.table[u] == SPARE)
        done.failed |= lost
        done.replaced -= lost  # a replacement that died in this rebuild must be replaced again
        done.pending |= lost
        members.comm = shrunk
        members.table = [members.table[u] for u in alive]
        members.procs = [members.procs[u] for u in alive]
        done.timed("shrink", t)
        t = time.perf_counter()
        self._fill(members, done)
        done.timed("substitute", t)

    def _fill(self, members: _Members, done: _Progress) -> None:
        """Give the lost logical ranks (``done.pending``) new processes (collective over ``members.comm``).

        The modes come from the policy (asked on universe rank 0, broadcast);
        when spawning turns out not to work, the policy is asked again without
        it. ``done`` and ``members`` are updated as each rank is placed, so a
        failure half-way leaves them consistent for the next round. Every
        process computes the same from the same table.
        """
        unavailable: set[str] = set()
        while done.pending:
            modes = self._decide(members, len(done.pending), frozenset(unavailable))
            for mode in modes:
                todo = sorted(done.pending)
                if not todo:
                    break
                if mode == "spare":
                    placed = []
                    for u, logical in zip([u for u, e in enumerate(members.table) if e == SPARE], todo):
                        members.table[u] = logical
                        placed.append(logical)
                    done.placed(mode, placed, replaced=True)
                elif mode == "spawn":
                    if not self._spawn(members, todo):
                        unavailable.add("spawn")
                        break  # ask again: the policy chooses what stands in for the spawn
                    done.placed(mode, todo, replaced=True)
                elif mode == "shrink":
                    active = sum(1 for e in members.table if e != SPARE)
                    if active < self._config.min_size:
                        self._stop(members, f"only {active} active ranks remain, below the minimum of "
                                   f"{self._config.min_size} ({MIN_SIZE_ENV}); add spares (--spares) or allow "
                                   f"spawn ({REBUILD_ENV}=spare,spawn,shrink)")
                    done.placed(mode, todo, replaced=False)
            else:
                if done.pending:
                    self._stop(members, f"logical ranks {sorted(done.pending)} were lost and the rebuild modes "
                               f"{modes} cannot replace them (spares left: {members.spares()}); allow 'spawn' "
                               f"or 'shrink' in {REBUILD_ENV}")
        if not any(e != SPARE for e in members.table):
            self._stop(members, "every active rank died; nothing is left to continue from")

    def _decide(self, members: _Members, lost: int, unavailable: frozenset[str]) -> tuple[str, ...]:
        """The modes for this rebuild (collective over ``members.comm``): the configured order, or
        the ``decide`` callable's answer on universe rank 0, broadcast so every process agrees."""
        decide = self._config.decide
        answer = None
        if members.comm.Get_rank() == 0:
            if decide is None:
                modes = tuple(m for m in self._config.modes if m not in unavailable)
                answer = (modes, "configured order" + (f" ({', '.join(sorted(unavailable))} failed)"
                                                       if unavailable else ""))
            else:
                spares = members.spares()
                answer = decide(lost, spares, len(members.table) - spares, dict(self.outlook),
                                unavailable=unavailable)
        modes, reason = members.comm.bcast(answer, root=0)
        self.events.emit("decision", modes=modes, reason=reason, lost=lost)
        modes = tuple(m for m in modes if m not in unavailable)
        if not modes:
            self._stop(members, f"cannot rebuild: {reason}")
        return modes

    def _stop(self, members: _Members, message: str) -> None:
        """End the job with ``message`` on every process of the round (collective). Never returns.

        A vote first: if a process failed on the way here, every process goes
        round again instead, so that no process stops while another rebuilds.
        """
        if not members.comm.Agree(1):
            raise ProcessFailure("a process could not reach the decision")
        self.universe, self._table, self._procs = members.comm, members.table, members.procs
        raise agreed(Unrecoverable(message))

    def _spawn(self, members: _Members, logical: list[int]) -> bool:
        """Start one new process per lost logical rank and merge it in (collective over ``members.comm``).

        Returns False, on every process alike, when spawning does not work here;
        a failure of a process during the spawn is a ``ProcessFailure`` (one more
        round). Once merged, the new processes are part of ``members``.
        """
        command, args = sys.executable, list(getattr(sys, "orig_argv", sys.argv)[1:])
        if self.watchdog.active:  # the replacement runs under a sentinel too
            command, args = sys.executable, ["-m", "elastic.comm._sentinel", "--", sys.executable] + args
        inter, error = None, None
        try:
            inter = members.comm.Spawn(command, args, maxprocs=len(logical), root=0)
            inter.Set_errhandler(MPI.ERRORS_RETURN)
        except MPI.Exception as exc:
            error = exc
        self._fire_rebuild_point("spawn", members)
        # A vote before the merge: Open MPI's Merge spins forever when a parent is dead.
        try:
            everyone = members.comm.Agree(int(inter is not None))
        except MPI.Exception:
            self._abandon(inter)
            raise
        if not everyone:
            self._abandon(inter)
            self.events.emit("spawn_failed", lost=logical, error=str(error) if error else "on another process")
            return False
        merged = inter.Merge(high=False)
        merged.Set_errhandler(MPI.ERRORS_RETURN)
        # From here on the new processes are members: a failure now is one more round on `merged`.
        members.comm = merged
        members.table = members.table + list(logical)  # children come after the parents (high=True there)
        members.procs = members.procs + [None] * len(logical)
        merged.bcast({"table": members.table, "procs": members.procs, "generation": self.generation,
                      "config": self._config, "history": self._history, "streak": self._streak,
                      "step": self.step}, root=0)
        return True

    @staticmethod
    def _abandon(inter: MPI.Intercomm | None) -> None:
        """Let go of spawned processes that will not be merged (they die by their join deadline)."""
        if inter is not None:
            try:
                inter.Revoke()
            except MPI.Exception:
                pass

    def _install(self, members: _Members, summary: dict[str, Any]) -> dict[str, Any] | None:
        """Build ``comm`` from the round's universe, learn every pid, share rank 0's ``summary`` (collective).

        Returns the shared summary, or None when this process could not
        finish; the caller's vote makes that uniform.
        """
        self.universe, self._table, self._procs = members.comm, members.table, members.procs
        try:
            mine = members.table[members.comm.Get_rank()]
            comm = members.comm.Split(MPI.UNDEFINED if mine == SPARE else 0, max(mine, 0))
            if comm != MPI.COMM_NULL:
                comm.Set_errhandler(MPI.ERRORS_RETURN)
            self.comm = comm
            self._procs = members.procs = members.comm.allgather((socket.gethostname(), os.getpid()))
            return members.comm.bcast(summary, root=0)
        except MPI.Exception as exc:
            self.events.emit("install_failed", error=str(exc))
            return None

    def _fence(self, dead: Iterable[int], procs: list[Proc | None]) -> None:
        """Kill dead-declared processes on this host: a hung rank would keep mpiexec alive (local).

        ``procs`` belongs to the communicator the agreement ran on, so only a
        process every survivor agreed is dead can be hit.
        """
        host = socket.gethostname()
        for u in dead:
            proc = procs[u] if u < len(procs) else None
            if proc is not None and proc[0] == host and proc[1] != os.getpid():
                try:
                    os.kill(proc[1], signal.SIGKILL)
                    self.events.emit("fenced", pid=proc[1])
                except (ProcessLookupError, PermissionError):
                    pass

    def _causes(self, dead: Iterable[int], members: _Members) -> list[dict[str, Any]]:
        """How the dead processes ended, from their outcome and sentinel files (universe rank 0 only:
        its list goes to everyone in the summary)."""
        if members.comm.Get_rank() != 0 or self.events.run_dir is None:
            return []
        causes = []
        for u in sorted(dead):
            proc = members.procs[u] if u < len(members.procs) else None
            if proc is not None:
                cause = read_cause(self.events.run_dir, *proc)
                if cause is not None:
                    causes.append({"logical": None if members.table[u] == SPARE else members.table[u], **cause})
        return causes

    def _stop_a_repeated_error(self, rebuild: Rebuild) -> None:
        """The same software error at the same step twice: recovering again would only repeat it.

        Every process decides alike: the causes came with the agreed summary,
        and the history is shared with spares (they take part in every rebuild)
        and spawned processes (it comes with their start).
        """
        for cause in rebuild.causes:
            if not cause.get("software") or cause.get("injected") or cause.get("step") is None:
                continue
            key = (cause["what"], cause.get("step"))
            if key in self._history:
                raise agreed(Unrecoverable(
                    f"logical rank {cause.get('logical')} failed with the same error at step {cause.get('step')} as "
                    f"before the last recovery ({cause['what']}); recovering again would repeat it: fix the "
                    "error and start the job again"))
            self._history.add(key)

    def _fire_rebuild_point(self, point: str, members: _Members) -> None:
        entry = members.table[members.comm.Get_rank()]
        if self._faults.schedule and entry != SPARE:
            self._faults.fire(point, entry, self.generation)

    def _announce_fault(self, entry: Injection) -> None:
        self.events.emit("inject", **entry.to_dict())
        self.events.write_outcome(f"injected-{entry.action}", injection=entry.to_dict(), step=self.step)
        self.lifecycle.injected()

    # ---------------------------------------------------------------- spares
    def _park(self) -> None:
        """Wait as a spare until promoted (returns) or released at the end of the job (exits)."""
        self.events.emit("parked")
        self.watchdog.watch_progress(False)  # waiting is a parked spare's job
        if self._faults.schedule:
            self._faults.fire("park", self._table[:self.universe.Get_rank()].count(SPARE), self.generation)
        while self.role is Role.SPARE:
            try:
                self.universe.recv(source=MPI.ANY_SOURCE, tag=_TAG_RELEASE)
            except MPI.Exception as exc:
                if exc.Get_error_class() == MPI.ERR_REVOKED:
                    self._rebuild(self._members(), join=False)
                    continue
                if exc.Get_error_class() in (MPI.ERR_PROC_FAILED, MPI.ERR_PROC_FAILED_PENDING):
                    self.universe.Ack_failed()  # the active ranks will revoke if it matters...
                    if self._every_active_failed():  # ...unless none is left to do it
                        raise agreed(Unrecoverable("every active rank died; the parked spares have nothing "
                                                   "to take over from")) from None
                    continue
                raise translate(exc, self.universe) from exc
            self.events.emit("released")
            self.events.write_outcome("spare-unused")
            self.lifecycle.finished = True
            sys.exit(0)
        self.events.emit("promoted", logical=self.logical_rank)
        self.watchdog.watch_progress(True)

    def _every_active_failed(self) -> bool:
        failed_group = self.universe.Get_failed()
        failed = set(MPI.Group.Translate_ranks(failed_group, list(range(failed_group.Get_size())),
                                               self.universe.Get_group()))
        failed_group.Free()
        return all(u in failed for u, e in enumerate(self._table) if e != SPARE)


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
    members = _Members(universe, table, [None] * n)
    world = World(members, config, 0, role)
    world.lifecycle.install()
    with mpi_errors(universe):
        if world._install(members, {}) is None:
            raise ProcessFailure("a process failed while the job started")
    world.events.emit("started", size=n - spares, spares=spares, modes=config.modes,
                      sentinel=world.watchdog.active)
    if role is Role.SPARE:
        world._park()
    else:
        world.watchdog.watch_progress(True)
    return world


def _join_as_spawned(parent: MPI.Intercomm) -> World:
    """A spawned replacement: merge with the survivors and finish their rebuild with them.

    When the parents give up on it (a failure during the spawn), the merge
    fails or never comes: the process then dies, by its own hand or by the
    sentinel's join deadline, without ever having been a member.
    """
    parent.Set_errhandler(MPI.ERRORS_RETURN)
    _WATCHDOG.deadline(JOIN_SECONDS)
    try:
        merged = parent.Merge(high=True)
        merged.Set_errhandler(MPI.ERRORS_RETURN)
        payload = merged.bcast(None, root=0)
    except MPI.Exception as exc:
        sys.stderr.write(f"[elastic] a spawned process was abandoned by its parents ({exc}); leaving\n")
        sys.stderr.flush()
        EventLog(os.environ.get(RUN_DIR_ENV), dict).write_outcome("spawn-abandoned", message=str(exc))
        os.kill(os.getpid(), signal.SIGKILL)
    _WATCHDOG.deadline(None)
    members = _Members(merged, payload["table"], payload["procs"])
    world = World(members, payload["config"], payload["generation"], Role.RECOVERED)
    world._history, world._streak, world.step = payload["history"], payload["streak"], payload["step"]
    world.failures_seen = True
    world.lifecycle.install()
    world.events.emit("spawned", sentinel=world.watchdog.active)
    world._rebuild(members, join=True)
    world.watchdog.watch_progress(True)
    return world

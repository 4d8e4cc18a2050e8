"""The rebuild: from a failure seen to a new world, identical on every live process.

One round, run by every live process of the universe (parked spares and
spawned processes too): shrink (which agrees on the dead), fence them, fill the
gaps (spare / spawn / shrink, as the policy decides), install the new
communicators, then a vote. The vote (ULFM Agree) succeeds everywhere or fails
everywhere, so every process either leaves or starts another round on the
newest communicator; a failure during the rebuild costs one more round. A
process that starts another round revokes the universe first; a vote still
waiting on it is then given up (``_collectives.agree``), so nobody waits in a
vote for a process gone to the next round's shrink.
Decisions that stop the job are raised only after a vote as well.
"""
from __future__ import annotations

import dataclasses
import os
import signal
import socket
import sys
import time
from typing import Any, Iterable, Protocol, cast

from mpi4py import MPI

from ._collectives import agree, allgather, bcast
from ._errors import ConfigError, ProcessFailure, Unrecoverable, agreed, translate
from ._config import Config
from .events import REBUILD_PHASES, EventLog, read_cause
from ._membership import Members, Proc
from ._policy import Decision, Outlook, RebuildContext, RebuildPolicy, asked, fill
from ._ranks import SPARE, LogicalRank, Role
from ._watchdog import Watchdog
from .wire import message

JOIN_SECONDS = 30.0  # a spawned process that has not joined its parents by then is given up
HOST_VERDICT_SECONDS = 5.0  # how long survivors wait for the runtime's end after a whole host's processes died


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
    durations: dict[str, float]            # seconds per phase (``events.REBUILD_PHASES``), and total
    causes: tuple[dict[str, Any], ...] = ()  # how the dead processes ended, where they said so
    streak: int = 1                        # rebuilds since the last successful commit


@dataclasses.dataclass(frozen=True)
class Generation:
    """This process's view of one generation of the job: what a join or a rebuild hands the World
    (which adopts it whole, in one place) and what stays true until the next rebuild."""

    number: int
    members: Members                       # the universe: every live process, parked spares too
    comm: MPI.Intracomm                    # the active ranks by logical rank (COMM_NULL on a spare)
    role: Role
    rebuild: Rebuild | None = None         # how this generation came to be (None: the job's start)
    streak: int = 0                        # rebuilds since the last successful commit
    committed: bool = False                # a commit was agreed in this job (state exists that must not be lost)


class RebuildHost(Protocol):
    """What a rebuild needs of the process it runs in (the World's internals, comm's own), read-only:
    it writes nothing there and hands back a ``Generation``."""

    @property
    def _config(self) -> Config: ...
    @property
    def _policy(self) -> RebuildPolicy: ...
    @property
    def events(self) -> EventLog: ...
    @property
    def _watchdog(self) -> Watchdog: ...
    @property
    def generation(self) -> int: ...
    @property
    def _streak(self) -> int: ...
    @property
    def _committed(self) -> bool: ...
    @property
    def _initial_size(self) -> int: ...

    def _fire_for(self, members: Members, point: str, index: int | None = None) -> None: ...
    def _handover(self) -> dict[str, Any]: ...


@message
@dataclasses.dataclass
class Summary:
    """What the rounds of one rebuild have done so far; universe rank 0's copy is what all adopt."""

    failed: set[int] = dataclasses.field(default_factory=set)
    pending: set[int] = dataclasses.field(default_factory=set)  # lost, not yet replaced or removed
    replaced: set[int] = dataclasses.field(default_factory=set)
    removed: set[int] = dataclasses.field(default_factory=set)
    lost_spares: int = 0
    modes: list[str] = dataclasses.field(default_factory=list)
    attempts: int = 0
    causes: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    streak: int = 1
    committed: bool = False  # some version was agreed in this job: state exists that must not be lost

    def placed(self, mode: str, logical: list[int], replaced: bool) -> None:
        """``logical`` got a new process (``replaced``) or was dropped (a shrink) by ``mode``."""
        if not logical:
            return
        self.pending -= set(logical)
        (self.replaced if replaced else self.removed).update(logical)
        if mode not in self.modes:
            self.modes.append(mode)


class Rebuilder:
    """Runs one rebuild for ``world`` (every method collective over the round's universe).

    The rounds change ``members`` in place: after an agreed stop it is the universe every
    live process shares, the one to leave together on."""

    def __init__(self, world: RebuildHost, outlook: Outlook, members: Members) -> None:
        self.world = world
        self.outlook = outlook
        self.members = members
        self.comm = cast(MPI.Intracomm, MPI.COMM_NULL)  # the active ranks' communicator, once installed
        self.durations: dict[str, float] = {}

    def _timed(self, phase: str, since: float) -> None:
        assert phase in REBUILD_PHASES, phase  # the report reads them by these names
        self.durations[phase] = self.durations.get(phase, 0.0) + time.perf_counter() - since

    def run(self, join: bool) -> Generation:
        """Rounds until one succeeds everywhere; a spawned process ``join``s at the install."""
        world, members = self.world, self.members
        started = time.perf_counter()
        done = Summary(streak=world._streak + 1, committed=world._committed)
        if not join:
            world._fire_for(members, "agree")
        while True:
            done.attempts += 1
            try:
                if not join:
                    self._round(members, done)
                join = False
                t = time.perf_counter()
                summary = self._install(members, done)
                if not agree(members.comm, int(summary is not None)):
                    raise ProcessFailure("a process could not install the rebuilt communicator")
                self._timed("install", t)
                break
            except (ProcessFailure, MPI.Exception) as exc:
                if isinstance(exc, MPI.Exception):
                    error = translate(exc, members.comm)
                    if not isinstance(error, ProcessFailure):
                        raise error from exc
                world.events.emit("rebuild_retry", attempt=done.attempts, error=str(exc))
                try:
                    members.comm.Revoke()
                except MPI.Exception:
                    pass
        self.durations["total"] = time.perf_counter() - started
        assert summary is not None
        return self._generation(summary)

    def _generation(self, summary: Summary) -> Generation:
        """Every process, a spawned one too, takes universe rank 0's summary (an old member's)."""
        world, members = self.world, self.members
        mine = members.mine()
        number = world.generation + 1
        rebuild = Rebuild(number, "+".join(summary.modes) or "none",
                          frozenset(map(LogicalRank, summary.failed)), frozenset(map(LogicalRank, summary.replaced)),
                          frozenset(map(LogicalRank, summary.removed)), summary.lost_spares, summary.attempts,
                          self.durations, tuple(summary.causes), summary.streak)
        role = Role.SPARE if mine == SPARE else Role.RECOVERED if mine in summary.replaced else Role.SURVIVOR
        return Generation(number, members, self.comm, role, rebuild, summary.streak,
                          world._committed or summary.committed)

    # ------------------------------------------------------------------ one round
    def _round(self, members: Members, done: Summary) -> None:
        """Agree on the dead (the shrink), fence them, fill the gaps.

        ``Shrink`` is itself ULFM's agreement on who is alive: every survivor gets
        the same communicator, so the dead are the ranks missing from it, known in
        one round (an Agree on bitmasks would take one round per 30 ranks).
        """
        world = self.world
        t = time.perf_counter()
        shrunk = cast(MPI.Intracomm, members.comm.Shrink())
        shrunk.Set_errhandler(MPI.ERRORS_RETURN)
        alive = MPI.Group.Translate_ranks(shrunk.Get_group(), list(range(shrunk.Get_size())),
                                          members.comm.Get_group())
        dead = sorted(set(range(members.comm.Get_size())) - set(alive))
        self._timed("agree", t)
        world.events.emit("agreed", failed=[members.table[u] for u in dead if members.table[u] != SPARE],
                          failed_universe=dead, attempt=done.attempts)
        _fence(world.events, dead, members)
        self._await_the_runtime(dead, members)
        done.causes.extend(self._causes(dead, members))
        world._fire_for(members, "rebuild")
        # A death since the shrink is found here, before any communicator is built on the shrunk one:
        # Open MPI's communicator creation can spin for ever when a member is dead (seen with Merge).
        if not shrunk.Agree(1):
            raise ProcessFailure("a process could not take part in the rebuild")
        lost = {members.table[u] for u in dead if members.table[u] != SPARE}
        done.lost_spares += sum(1 for u in dead if members.table[u] == SPARE)
        done.failed |= lost
        done.replaced -= lost  # a replacement that died in this rebuild must be replaced again
        done.pending |= lost
        members.keep(alive, shrunk)
        t = time.perf_counter()
        self._fill(members, done)
        self._timed("substitute", t)

    def _await_the_runtime(self, dead: list[int], members: Members) -> None:
        """When every process of a host died at once, wait up to ``HOST_VERDICT_SECONDS`` before
        rebuilding in process (collective in effect: every survivor decides alike from the agreed
        dead set and the shared process table).

        A node lost with its runtime daemon makes Open MPI 5.0 end the job ~0.1 s later (and the
        launcher relaunches from the nodes' memory, where it keeps some); a shrink done in that
        window (and, with short steps, a whole run finished in it) would give another result from
        the same loss, decided by a race (ranks that yield their cores while they wait won it: a
        run of 40 steps finished on 3 ranks, rc 0). So either the runtime ends this process while
        it waits, or the host's daemon is alive (only its processes died) and the rebuild goes on
        in process.
        """
        world = self.world
        lost = hosts_lost(members.procs, dead)
        if not lost:
            return
        t = time.perf_counter()
        with world._watchdog.bounded(HOST_VERDICT_SECONDS + JOIN_SECONDS):
            time.sleep(HOST_VERDICT_SECONDS)  # the runtime's end, if it comes, comes as a signal
        world.events.emit("host_processes_lost", hosts=lost, waited=time.perf_counter() - t)

    def _fill(self, members: Members, done: Summary) -> None:
        """Give the lost logical ranks (``done.pending``) new processes, as the policy decides.

        When spawning turns out not to work, the policy is asked again without
        it. ``done`` and ``members`` are updated as each rank is placed, so a
        failure half-way leaves them consistent for the next round.
        """
        unavailable: set[str] = set()
        while done.pending:
            decision = self._decide(members, sorted(done.pending), frozenset(unavailable))
            for mode, take in fill(decision.modes, sorted(done.pending), members.spares()):
                if mode == "spare":
                    for u, logical in zip([u for u, e in enumerate(members.table) if e == SPARE], take):
                        members.table[u] = logical
                    done.placed(mode, take, replaced=True)
                elif mode == "spawn":
                    if not self._spawn(members, take):
                        unavailable.add("spawn")
                        break  # ask again: the policy chooses what stands in for the spawn
                    done.placed(mode, take, replaced=True)
                else:  # shrink
                    done.placed(mode, take, replaced=False)
            else:
                if done.pending:
                    self._stop(members, f"logical ranks {sorted(done.pending)} were lost and the decided modes "
                                        f"{decision.modes} could not fill them ({decision.reason})")
        if not members.actives():
            self._stop(members, "every active rank died; nothing is left to continue from")

    def _decide(self, members: Members, pending: list[int], unavailable: frozenset[str]) -> Decision:
        """The policy's decision on universe rank 0, broadcast so every process executes the same one."""
        answer = None
        if members.comm.Get_rank() == 0:  # whatever the policy does, every process must get one decision
            answer = asked(self.world._policy, RebuildContext.of(pending, members.logical_ranks(), members.spares(),
                                                                 self.outlook, self.world._initial_size, unavailable))
        decision: Decision = bcast(members.comm, answer, 0)
        self.world.events.emit("decision", modes=decision.modes, reason=decision.reason, lost=len(pending))
        modes = tuple(m for m in decision.modes if m not in unavailable)
        if not modes:
            self._stop(members, f"cannot rebuild: {decision.reason}")
        return Decision(modes, decision.reason)

    def _stop(self, members: Members, message: str) -> None:
        """End the job with ``message`` on every process of the round. Never returns.

        A vote first: if a process failed on the way here, every process goes
        round again instead, so that no process stops while another rebuilds.
        """
        if not agree(members.comm, 1):
            raise ProcessFailure("a process could not reach the decision")
        raise agreed(Unrecoverable(message))

    # ------------------------------------------------------------------ spawn
    def _spawn(self, members: Members, logical: list[int]) -> bool:
        """Start one new process per lost logical rank and merge it in.

        Returns False, on every process alike, when spawning does not work here;
        a failure of a process during the spawn is a ``ProcessFailure`` (one more
        round). Once merged, the new processes are part of ``members``.
        """
        world = self.world
        command, args = sys.executable, list(getattr(sys, "orig_argv", sys.argv)[1:])
        if world._watchdog.active:  # the replacement runs under a sentinel too
            command, args = sys.executable, ["-m", "elastic.comm._sentinel", "--", sys.executable] + args
        inter, error = None, None
        try:
            # The child starts Python and imports what the program imports before it joins: seconds
            # that the progress timeout must not count (the spawn has the join's bound instead).
            with world._watchdog.bounded(JOIN_SECONDS):
                inter = members.comm.Spawn(command, args, maxprocs=len(logical), root=0)
            inter.Set_errhandler(MPI.ERRORS_RETURN)
        except MPI.Exception as exc:
            error = exc
        world._fire_for(members, "spawn")
        # A vote before the merge: Open MPI's Merge spins for ever when a parent is dead.
        try:
            everyone = agree(members.comm, int(inter is not None))
        except (MPI.Exception, ProcessFailure):
            _abandon(inter)
            raise
        if not everyone:
            _abandon(inter)
            world.events.emit("spawn_failed", lost=logical, error=str(error) if error else "on another process")
            return False
        assert inter is not None
        with world._watchdog.bounded(JOIN_SECONDS):  # as the child's join: Merge can block for ever
            merged = inter.Merge(high=False)
        merged.Set_errhandler(MPI.ERRORS_RETURN)
        # From here on the new processes are members: a failure now is one more round on `merged`.
        members.comm = merged
        members.table = members.table + list(logical)  # children come after the parents (high=True there)
        members.procs = members.procs + [None] * len(logical)
        bcast(merged, {"members": (members.table, members.procs), "world": world._handover()}, 0)
        return True

    # ------------------------------------------------------------------ install
    def _install(self, members: Members, done: Summary) -> Summary | None:
        """Build the active communicator, learn every pid, share rank 0's summary.

        Returns the shared summary, or None when this process could not
        finish; the caller's vote makes that uniform.
        """
        world = self.world
        try:
            if not agree(members.comm, 1):  # nobody died since: Split must not meet a dead member (it can spin)
                return None
            self.comm = split_actives(members)
            members.procs = allgather(members.comm, (socket.gethostname(), os.getpid()))
            shared: Summary = bcast(members.comm, done, 0)
            return shared
        except (MPI.Exception, ProcessFailure) as exc:
            world.events.emit("install_failed", error=str(exc))
            return None

    # ------------------------------------------------------------------ the dead
    def _causes(self, dead: Iterable[int], members: Members) -> list[dict[str, Any]]:
        """How the dead processes ended, from their outcome and fate files (universe rank 0 only:
        its list goes to everyone in the summary)."""
        run_dir = self.world.events.run_dir
        if members.comm.Get_rank() != 0 or run_dir is None:
            return []
        causes = []
        for u in sorted(dead):
            proc = members.procs[u] if u < len(members.procs) else None
            cause = read_cause(run_dir, *proc) if proc is not None else None
            if cause is not None:
                causes.append({"logical": None if members.table[u] == SPARE else members.table[u], **cause})
        return causes


def stop_a_programming_error(rebuild: Rebuild) -> None:
    """A rank that died of an error saying the program is wrong (``ConfigError``: a value the
    library refuses, a bad setting) stops the job with that error: a replacement or the
    survivors would run the same program. Every process decides alike (the agreed causes)."""
    for cause in rebuild.causes:
        if cause.get("programming"):
            raise agreed(ConfigError(
                f"logical rank {cause.get('logical')} raised {cause['what']} (at step {cause.get('step')}): a "
                "programming error, not a failure to recover from; fix it and start the job again"))


def stop_a_repeated_error(rebuild: Rebuild, history: set[tuple[str, Any]]) -> None:
    """The same software error at the same step twice: recovering again would only repeat it.

    Every process decides alike: the causes came with the agreed summary,
    and the history is shared with spares (they take part in every rebuild)
    and spawned processes (it comes with their start).
    """
    for cause in rebuild.causes:
        if not cause.get("software") or cause.get("injected") or cause.get("step") is None:
            continue
        key = (cause["what"], cause["step"])
        if key in history:
            raise agreed(Unrecoverable(
                f"logical rank {cause.get('logical')} failed with the same error at step {cause['step']} as "
                f"before the last recovery ({cause['what']}); recovering again would repeat it: fix the "
                "error and start the job again"))
        history.add(key)


def hosts_lost(procs: list[Proc | None], dead: Iterable[int]) -> list[str]:
    """The hosts every process of which is in ``dead`` (universe ranks), while some other host
    still has a live one (local; O(processes))."""
    dead = set(dead)
    hosts = {p[0] for p in procs if p is not None}
    alive = {p[0] for u, p in enumerate(procs) if u not in dead and p is not None}
    return sorted(hosts - alive) if alive else []


def split_actives(members: Members) -> MPI.Intracomm:
    """The active ranks' communicator, ordered by logical rank (collective over ``members.comm``)."""
    mine = members.mine()
    comm = cast(MPI.Intracomm, members.comm.Split(MPI.UNDEFINED if mine == SPARE else 0, max(mine, 0)))
    if comm != MPI.COMM_NULL:
        comm.Set_errhandler(MPI.ERRORS_RETURN)
    return comm


def _fence(events: EventLog, dead: Iterable[int], members: Members) -> None:
    """Kill dead-declared processes on this host: a hung rank would keep mpiexec alive (local).

    ``members`` is the communicator the agreement ran on, so only a process
    every survivor agreed is dead can be hit. The event names the victim in
    fields of its own: the event's ``pid`` and ``logical`` are the fencer's.
    """
    host = socket.gethostname()
    for u in dead:
        proc: Proc | None = members.procs[u] if u < len(members.procs) else None
        if proc is not None and proc[0] == host and proc[1] != os.getpid():
            try:
                os.kill(proc[1], signal.SIGKILL)
                events.emit("fenced", victim_pid=proc[1], victim_host=proc[0],
                            victim_logical=None if members.table[u] == SPARE else members.table[u])
            except (ProcessLookupError, PermissionError):
                pass


def _abandon(inter: MPI.Intercomm | None) -> None:
    """Let go of spawned processes that will not be merged (they die by their join deadline)."""
    if inter is not None:
        try:
            inter.Revoke()
        except MPI.Exception:
            pass

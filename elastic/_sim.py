"""A simulated job: N ranks as threads over an in-memory fabric, each a ``Group``, no MPI.

The store, ``State``, ``elastic.run`` and the rebuild policy run here unchanged:
the same fault schedule (``R@STEP``, ``R@cSTEP``, ``R@commitV``, ``R@restore``)
kills a rank at the same points, the same ``Policy`` decides each rebuild
(spare, spawn, shrink), and a replacement runs the program again as a
RECOVERED rank. What travels between ranks goes through ``wire`` as in a real
job, so a value a real job could not send fails here too. A test of recovery
logic takes milliseconds instead of seconds of ``mpiexec``::

    job = SimJob(4, spares=1, inject="1@3")
    results = job.run(main)              # main(world) on every rank, replacements too
    assert job.of("rebuilt")[0]["mode"] == "spare"

The schedule fires through the real ``FaultInjector`` (the same matching, the
same once-only data faults, the same implied step points); only what an action
does differs: ``raise`` raises, every other one ends the rank's thread.
Simplifications, on purpose: every collective fails on every rank alike when
a rank of the generation is dead (the World's agreed calls behave so; MPI's
data plane need not), a rebuild itself cannot fail, and there is no process
to stop or hang. Killing and hanging real processes stays with the ``mpiexec`` tests.
"""
from __future__ import annotations

import dataclasses
import threading
import time
from typing import TYPE_CHECKING, Any, Callable, Mapping, NoReturn, Sequence, TypeVar

import numpy as np

from elastic.comm import (
    Config, ConfigError, CurrentRank, Decision, LogicalRank, Outlook, ProcessFailure, Rebuild, RebuildContext,
    Recoverable, Role, Settings, Unrecoverable, agreed, wire,
)
from elastic.comm.runtime import asked, fill, first_survivor, is_agreed, would_fill
from elastic.comm.faults import FaultInjector, InjectedFault, Injection, parse_schedule
from elastic.recovery import Policy

from ._settings import FIELDS as TRAINING_FIELDS
from ._settings import Training

T = TypeVar("T")


class _Killed(BaseException):
    """Ends a simulated rank's thread (not an Exception: the program's handlers let it pass)."""


@dataclasses.dataclass
class _Fabric:
    """What the ranks share (guarded by ``SimJob._cv``)."""

    generation: int = 0
    active: list[int] = dataclasses.field(default_factory=list)  # logical ranks, current-rank order
    dead: set[int] = dataclasses.field(default_factory=set)      # active ranks dead in this generation
    spares: int = 0
    slots: dict[tuple[int, int], dict[int, Any]] = dataclasses.field(default_factory=dict)
    readers: dict[tuple[int, int], int] = dataclasses.field(default_factory=dict)
    arrived: set[int] = dataclasses.field(default_factory=set)   # at this generation's rebuild
    rebuild: Rebuild | None = None
    streak: int = 0
    committed: bool = False
    revoked: bool = False  # a rank interrupted this generation: every collective in it fails
    mail: dict[tuple[int, int, int, int], list[Any]] = dataclasses.field(default_factory=dict)  # neighbors()


class SimJob:
    """N simulated ranks (and ``spares`` parked ones) running one program in threads.

    Args:
        n: active ranks at the start (logical ranks 0..n-1).
        spares: parked spares, taken by the ``spare`` mode.
        inject: a fault schedule in the launcher's compact form (``"1@3,2@commit4"``).
        config: the job's settings (``rebuild`` modes, ``min_size``, ...); keyword ``settings``
            override single fields, of it or of the training settings (``max_failures``, ...).
        timeout: seconds any rank may wait for the others before the job counts as hung.
    """

    def __init__(self, n: int, *, spares: int = 0, inject: str = "", config: Config | None = None,
                 timeout: float = 30.0, **settings: Any) -> None:
        if n < 1 or spares < 0:
            raise ConfigError(f"SimJob({n}, spares={spares}): need n >= 1 and spares >= 0")
        training = Training(**{k: settings.pop(k) for k in list(settings) if k in TRAINING_FIELDS})
        config = (config or Config()).replace(inject=parse_schedule(inject), spares=spares, **settings)
        self.config, self.initial_size, self.timeout = config, n, timeout
        self.policy = Policy.from_config(config)
        self.environ = training.to_env()
        self.events: list[dict[str, Any]] = []
        self._cv = threading.Condition()
        self._fabric = _Fabric(active=list(range(n)), spares=spares)
        self._program: Callable[[SimRank], Any] | None = None
        self._threads: list[threading.Thread] = []
        self._results: dict[int, Any] = {}
        self._errors: list[tuple[int, BaseException]] = []
        self._deadline = 0.0
        self._stop: BaseException | None = None  # a rebuild that could not fill the lost ranks

    # ------------------------------------------------------------------ driving
    def rank(self, logical: int) -> "SimRank":
        """Rank ``logical`` of generation 0, to call local methods on without running a program."""
        return SimRank(self, logical, Role.INITIAL)

    def run(self, program: Callable[["SimRank"], T]) -> dict[int, T]:
        """Run ``program(world)`` on every rank (and on each replacement) until all end.

        Returns what each logical rank's last process returned. Raises the agreed error
        that stopped every rank (``DataLost``, ``Unrecoverable``, ...), or ``AssertionError``
        when a rank failed alone and nobody recovered from it, or the job hung."""
        if self._program is not None:
            raise ConfigError("a SimJob runs once: make another for the next run")
        self._program, self._deadline = program, time.monotonic() + self.timeout
        for r in range(self.initial_size):
            self._start(SimRank(self, r, Role.INITIAL))
        while True:
            with self._cv:
                alive = [t for t in self._threads if t.is_alive()]
            if not alive:
                break
            alive[0].join(max(self._deadline - time.monotonic(), 0.01))
            if time.monotonic() > self._deadline + 1:
                raise AssertionError(f"the simulated job hung (over {self.timeout} s); events: {self.events[-10:]}")
        if self._errors:  # an agreed error stopped every rank alike
            raise self._errors[0][1]
        missing = sorted(set(self._fabric.active) - set(self._results))
        assert not missing, f"logical ranks {missing} never finished; errors: {self.of('error')}"
        return {r: self._results[r] for r in sorted(self._results) if r in self._fabric.active}

    def of(self, name: str) -> list[dict[str, Any]]:
        """The events called ``name``, in the order they happened."""
        return [e for e in self.events if e["event"] == name]

    def _start(self, rank: "SimRank") -> None:
        thread = threading.Thread(target=self._main, args=(rank,), name=f"sim-rank-{rank.logical}", daemon=True)
        self._threads.append(thread)
        thread.start()

    def _main(self, rank: "SimRank") -> None:
        assert self._program is not None
        try:
            result = self._program(rank)
        except _Killed:
            return
        except BaseException as exc:  # noqa: B036 (a rank's end, whatever it is, is recorded)
            if is_agreed(exc):
                with self._cv:
                    self._errors.append((rank.logical, exc))
            else:  # an error in one rank only: that rank fails, as in a real job, and the others recover
                rank.events.emit("error", scope="rank", kind=type(exc).__name__, message=str(exc))
                self._kill(rank.logical)
            return
        with self._cv:
            self._results[rank.logical] = result

    # ------------------------------------------------------------------ the fabric
    def _kill(self, logical: int) -> None:
        with self._cv:
            if logical in self._fabric.active:
                self._fabric.dead.add(logical)
            self._cv.notify_all()

    def _wait(self, rank: "SimRank | None", ready: Callable[[], bool], fail: Callable[[], bool]) -> None:
        """Wait (holding the lock) until ``ready()``; ``ProcessFailure`` once ``fail()`` and not ready.
        The time ``rank`` spends here is what it waited for its peers (``job.waited``), as a real
        rank's in its MPI calls: the rest of a step is its own work (the straggler detector's measure)."""
        began = time.perf_counter()
        try:
            while not ready():
                if fail():
                    raise ProcessFailure("a rank of this generation died")
                if not self._cv.wait(max(self._deadline - time.monotonic(), 0.001)) and \
                        time.monotonic() > self._deadline:
                    raise AssertionError("the simulated job hung: a rank waited past the job's timeout")
        finally:
            if rank is not None:
                rank._waited += time.perf_counter() - began

    def _collective(self, rank: "SimRank", value: Any) -> dict[int, Any]:
        """Every active rank's ``value`` by logical rank, or ``ProcessFailure`` on every one."""
        with self._cv:
            f = self._fabric
            if rank.generation != f.generation:
                raise ProcessFailure("this rank's generation is gone (a rebuild happened)")
            if f.revoked:
                raise ProcessFailure("a rank interrupted this generation")
            key = (f.generation, rank._sequence)
            rank._sequence += 1
            rank._collectives += 1
            slot = f.slots.setdefault(key, {})
            slot[rank.logical] = value
            self._cv.notify_all()
            self._wait(rank, lambda: len(slot) == len(f.active), lambda: bool(f.dead) or f.revoked)
            f.readers[key] = f.readers.get(key, 0) + 1
            if f.readers[key] == len(f.active):
                del f.slots[key], f.readers[key]
            return dict(slot)

    def _neighbors(self, rank: "SimRank", sends: list[tuple[int, int, np.ndarray]],
                   receives: list[tuple[int, int, np.ndarray]]) -> None:
        """Point to point: each send posted in a mailbox, each receive waits for its message, or
        ``ProcessFailure`` once its peer is dead or the generation revoked (a dead rank it does not
        talk to is none of its business, as in MPI)."""
        with self._cv:
            f = self._fabric
            if rank.generation != f.generation or f.revoked:
                raise ProcessFailure("this rank's generation is gone or interrupted")
            rank._collectives += 1
            for dest, tag, array in sends:
                f.mail.setdefault((f.generation, rank.logical, f.active[dest], tag), []).append(np.array(array))
            self._cv.notify_all()
            for source, tag, buffer in receives:
                buffer[...] = self._receive(rank, f.active[source], tag)

    def _receive(self, rank: "SimRank", peer: int, tag: int) -> Any:
        f, key = self._fabric, (self._fabric.generation, peer, rank.logical, tag)
        self._wait(rank, lambda: bool(f.mail.get(key)),
                   lambda: peer in f.dead or f.revoked or rank.generation != f.generation)
        return f.mail[key].pop(0)

    def _rebuild(self, rank: "SimRank", outlook: Outlook) -> None:
        """Every live rank arrives; the first to see them all applies the policy's decision (as
        universe rank 0 would), including when the last one dies on its way instead."""
        with self._cv:
            f = self._fabric
            generation = f.generation
            f.arrived.add(rank.logical)
            self._cv.notify_all()
            while f.generation == generation:
                if f.arrived >= set(f.active) - f.dead:
                    self._apply(outlook)
                    break
                self._wait(None, lambda: f.generation != generation or f.arrived >= set(f.active) - f.dead,
                           lambda: False)

    def _apply(self, outlook: Outlook) -> None:
        f = self._fabric
        lost = sorted(f.dead & set(f.active))
        live = [r for r in f.active if r not in f.dead]
        decision = asked(self.policy, RebuildContext.of(lost, live, f.spares, outlook, self.initial_size))
        replaced: list[int] = []
        plan = fill(decision.modes, lost, f.spares)  # the real rebuild's rule
        used = [mode for mode, _ in plan]
        for mode, take in plan:
            if mode == "spare":
                f.spares -= len(take)
            if mode != "shrink":
                replaced += take
        pending = sorted(set(lost) - {r for _, take in plan for r in take})
        streak = f.streak + 1
        f.generation += 1
        f.active = sorted(live + replaced)
        f.dead, f.arrived, f.slots, f.readers, f.revoked, f.mail = set(), set(), {}, {}, False, {}
        f.streak = streak
        if pending or not f.active:  # the same stop as the real rebuild's, on every rank
            self._stop = agreed(Unrecoverable(f"logical ranks {pending or lost} were lost and cannot be filled: "
                                              f"{decision.reason}"))
        f.rebuild = Rebuild(f.generation, "+".join(used) or "none", frozenset(map(LogicalRank, lost)),
                            frozenset(map(LogicalRank, replaced)),
                            frozenset(map(LogicalRank, set(lost) - set(replaced))), 0, 1, {}, (), streak)
        self.events.append({"event": "rebuilt", "gen": f.generation, "mode": f.rebuild.mode, "failed": lost,
                            "replaced": replaced, "removed": sorted(set(lost) - set(replaced)), "streak": streak})
        for r in replaced:
            self._start(SimRank(self, r, Role.RECOVERED))
        self._cv.notify_all()


class _Events:
    """The rank's event sink: into the job's list, with the context a real event carries."""

    def __init__(self, rank: "SimRank") -> None:
        self._rank = rank
        self.run_dir = None

    def emit(self, event: str, **fields: Any) -> None:
        r = self._rank
        with r._job._cv:
            r._job.events.append({"event": event, "logical": r.logical, "gen": r.generation, "role": r.role.value,
                                  **fields})


class SimRank:
    """One simulated rank: a ``Recoverable`` (a ``Group``: what the store and the stage rebuild use;
    and what ``elastic.run``, ``roll_forward`` and ``State`` drive: ``recover``, ``finish``,
    ``interrupt``, ``fail``)."""

    def __init__(self, job: SimJob, logical: int, role: Role) -> None:
        self._job, self.logical, self._role = job, logical, role
        self._sequence = 0  # collectives called in this generation (every rank calls them in one order)
        self._collectives = 0  # every generation's: Job.collectives
        self._waited = 0.0     # seconds in the fabric's waits: Job.waited
        self._generation = job._fabric.generation
        self._step: int | None = None
        self._ended = False
        self.events = _Events(self)
        self._faults = FaultInjector(job.config.inject, lambda entry: self.events.emit("inject", **entry.to_dict()),
                                     act=self._act)
        self.job = _SimJobView(self)

    # ------------------------------------------------------------------ identity
    @property
    def generation(self) -> int:
        return self._generation

    @property
    def role(self) -> Role:
        return self._role

    @property
    def last_rebuild(self) -> Rebuild | None:
        return self._job._fabric.rebuild if self._generation else None

    @property
    def logical_rank(self) -> LogicalRank:
        return LogicalRank(self.logical)

    @property
    def logical_ranks(self) -> tuple[LogicalRank, ...]:
        return tuple(map(LogicalRank, self._job._fabric.active))

    @property
    def rank(self) -> CurrentRank:
        return CurrentRank(self._job._fabric.active.index(self.logical))

    @property
    def size(self) -> int:
        return len(self._job._fabric.active)

    # ------------------------------------------------------------------ agreed calls
    def vote(self, ok: bool, why: str = "a rank could not finish its part") -> None:
        if not all(self._job._collective(self, bool(ok)).values()):
            raise ProcessFailure(why)

    def agree_equal(self, value: int, ok: bool = True) -> bool:
        got = self._job._collective(self, (value & 0x3FFFFFFF, bool(ok))).values()
        return len({v for v, _ in got}) == 1 and all(k for _, k in got)

    def allgather(self, obj: Any) -> list[Any]:
        got = self._job._collective(self, wire.encode(obj))
        return [wire.decode(got[r]) for r in self._job._fabric.active]

    def bcast(self, obj: Any, root: int) -> Any:
        mine = self.rank == root
        got = self._job._collective(self, wire.encode(obj) if mine else None)
        return wire.decode(got[self._job._fabric.active[root]])

    def alltoall(self, objs: Mapping[int, Any]) -> list[Any]:
        got = self._job._collective(self, {r: wire.encode(o) for r, o in objs.items() if o is not None})
        me = int(self.rank)
        return [wire.decode(got[r][me]) if me in got[r] else None for r in self._job._fabric.active]

    # ------------------------------------------------------------------ data plane
    def exchange(self, outgoing: Mapping[int, list[np.ndarray]], incoming: Mapping[int, list[np.ndarray]],
                 point: str = "commit", step: int | None = None, known: bool = False) -> int:
        self.fault_point(step, point)
        # As one Alltoallw (``known``: the same bytes, point to point): what a sender's arrays hold, back to
        # back, fills the receiver's in order.
        sent = {r: _packed(arrays) for r, arrays in outgoing.items() if arrays and sum(a.nbytes for a in arrays)}
        got = self._job._collective(self, sent)
        for source, arrays in incoming.items():
            arriving = got.get(source, {}).get(self.logical, np.empty(0, np.uint8))
            if arriving.nbytes != sum(a.nbytes for a in arrays):
                raise Unrecoverable(f"transfer plan differs across ranks (a bug, please report it): logical rank "
                                    f"{self.logical} expected {sum(a.nbytes for a in arrays)} bytes from "
                                    f"{source}, which sent {arriving.nbytes}")
            _unpack(arriving, arrays)
        return sum(a.nbytes for a in sent.values())

    def neighbors(self, sends: list[tuple[int, int, np.ndarray]], receives: list[tuple[int, int, np.ndarray]],
                  step: int | None = None) -> None:
        self.fault_point(self._step if step is None else step, "collective")
        self._job._neighbors(self, sends, receives)

    def allreduce(self, arrays: list[np.ndarray], step: int | None = None) -> None:
        self.fault_point(self._step if step is None else step, "collective")
        got = self._job._collective(self, [np.array(a, copy=True) for a in arrays])
        for i, array in enumerate(arrays):
            array[...] = sum(got[r][i] for r in self._job._fabric.active)  # current-rank order, as MPI's

    # ------------------------------------------------------------------ faults, progress
    def fault_point(self, step: int | None, point: str = "step", *, implied: bool = False,
                    micro: int | None = None) -> None:
        if point == "step" and micro is None:
            self._step = step
        self._faults.point(point, self.logical, self.generation, step, implied=implied, micro=micro)

    def _act(self, entry: Injection, where: str) -> None:
        """What an injection does to a simulated rank: ``raise`` raises, every other action ends
        the rank's thread (a process killed, stopped or stalled alike: the others recover)."""
        if entry.action == "raise":
            raise InjectedFault(where)
        self.fail("injected", f"{entry.action} at {where}")

    # ------------------------------------------------------------------ what elastic.run drives
    def recover(self, outlook: Outlook | None = None) -> Rebuild:
        self.events.emit("failure_seen")
        self._job._rebuild(self, outlook or Outlook())
        fabric = self._job._fabric
        self._generation, self._sequence, self._role = fabric.generation, 0, Role.SURVIVOR
        if self._job._stop is not None:
            raise self._job._stop
        if self.logical not in fabric.active:  # shrunk away: this process leaves
            raise _Killed()
        assert fabric.rebuild is not None
        return fabric.rebuild

    def finish(self) -> None:
        self.fault_point(None, "finish")
        self.vote(True, "a rank died before the end")
        self._ended = True
        self.events.emit("finished")

    def interrupt(self) -> None:
        """A revoke: every collective of this generation fails, on every rank, from now on (one
        already complete stays complete)."""
        job = self._job
        with job._cv:
            if self.generation == job._fabric.generation:
                job._fabric.revoked = True
            job._cv.notify_all()

    def fail(self, kind: str, message: str) -> NoReturn:
        """This rank fails alone (an injected kill, ``sys.exit`` in the program): the others recover."""
        self.events.emit("error", scope="rank", kind=kind, message=message)
        self._job._kill(self.logical)
        raise _Killed()


class MirrorJob(SimJob):
    """A simulated job of ``n`` ranks of which one runs (``rank(logical)``, in the caller's thread):
    every collective completes at once with its value in every rank's place, a transfer fills
    what it receives with what it sends of that size, a point-to-point receive leaves its buffer
    (a spare's rehearsal of the program: ``elastic._rehearsal.rehearse_program``)."""

    def _collective(self, rank: "SimRank", value: Any) -> dict[int, Any]:
        rank._sequence += 1
        rank._collectives += 1
        return {r: value for r in self._fabric.active}

    def _neighbors(self, rank: "SimRank", sends: list[tuple[int, int, np.ndarray]],
                   receives: list[tuple[int, int, np.ndarray]]) -> None:
        rank._collectives += 1

    def rank(self, logical: int) -> "SimRank":
        return _MirrorRank(self, logical, Role.INITIAL)


class _MirrorRank(SimRank):
    rehearsal = True  # elastic.distributed.ProcessGroup over it keeps torch's default group, the rehearsal's

    def exchange(self, outgoing: Mapping[int, list[np.ndarray]], incoming: Mapping[int, list[np.ndarray]],
                 point: str = "commit", step: int | None = None, known: bool = False) -> int:
        self.fault_point(step, point)
        sent = [_packed(arrays) for arrays in outgoing.values() if arrays and sum(a.nbytes for a in arrays)]
        for arrays in incoming.values():
            size = sum(a.nbytes for a in arrays)
            _unpack(next((b for b in sent if b.nbytes == size), np.zeros(size, np.uint8)), arrays)
        return sum(b.nbytes for b in sent)


def _packed(arrays: Sequence[np.ndarray]) -> np.ndarray:
    """The arrays' bytes back to back (what one sender's part of an Alltoallw carries)."""
    return np.concatenate([np.ascontiguousarray(a).reshape(-1).view(np.uint8) for a in arrays])


def _unpack(arriving: np.ndarray, arrays: Sequence[np.ndarray]) -> None:
    """Fill ``arrays`` in order from ``arriving``'s bytes."""
    offset = 0
    for target in arrays:
        target.reshape(-1).view(np.uint8)[:] = arriving[offset:offset + target.nbytes]
        offset += target.nbytes


class _SimJobView:
    """``rank.job``: the job as a simulated rank knows it (one host, no node memory)."""

    def __init__(self, rank: SimRank) -> None:
        self._rank = rank
        self.alone = False

    @property
    def initial_size(self) -> int:
        return self._rank._job.initial_size

    @property
    def settings(self) -> Settings:
        return self._rank._job.config

    @property
    def environ(self) -> Mapping[str, str]:
        return self._rank._job.environ

    @property
    def step(self) -> int | None:
        return self._rank._step

    @property
    def host_peers(self) -> list[int]:
        return sorted(self._rank._job._fabric.active)  # one host

    @property
    def first_survivor(self) -> CurrentRank:
        return first_survivor(self._rank)

    @property
    def committed(self) -> bool:
        return self._rank._job._fabric.committed

    @property
    def collectives(self) -> int:
        return self._rank._collectives

    @property
    def waited(self) -> float:
        return self._rank._waited

    @property
    def spares(self) -> int:
        return self._rank._job._fabric.spares

    def rebuild_decision(self, lost: Sequence[int], outlook: Outlook) -> Decision:
        job, gone = self._rank._job, {int(r) for r in lost}
        active = [r for r in job._fabric.active if r not in gone]
        return would_fill(job.policy, RebuildContext.of(lost, active, job._fabric.spares, outlook, job.initial_size))

    def data_fault(self, action: str) -> Injection | None:
        return self._rank._faults.data_fault(action)

    def note_commit(self) -> None:
        with self._rank._job._cv:
            self._rank._job._fabric.streak, self._rank._job._fabric.committed = 0, True

    @property
    def ended(self) -> bool:
        return self._rank._ended

    @property
    def local_rank(self) -> int:
        return self.host_peers.index(self._rank.logical)


if TYPE_CHECKING:
    def _keeps_the_contract(rank: SimRank) -> Recoverable:  # mypy checks that a simulated rank is one
        return rank

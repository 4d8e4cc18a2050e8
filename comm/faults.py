"""Fault injection as data: which logical rank fails, where, and how.

A schedule comes from ``ELASTIC_INJECT``: a JSON list (inline or a file path)
of ``{"rank": 1, "step": 3, "point": "step", "action": "kill", "gen": 0}``, or
the compact form ``RANK@WHERE[:ACTION][/gGEN]`` joined by commas, e.g.
``1@3`` (kill logical rank 1 at step 3), ``1@3,2@3`` (two at once), ``1@12.1``
(at the second micro-batch of step 12: gradient accumulation),
``2@c5:hang`` (hang in the middle of step 5's collective), ``1@g5`` (die inside
step 5's first all-gather: FSDP2's forward), ``1@p5`` (inside step 5's first point-to-point
transfer: a pipeline's activation; ``1@p5.4`` its fifth), ``1@u5`` (die inside step 5's
optimizer step, past its per-step recovery point if it has one), ``3@rebuild/g0``
(die in the middle of the first rebuild), ``1@commit4`` (die in the middle
of the commit of version 4), ``2@restore`` (die while sending recovery data),
``0@spawn`` (die while a replacement is being spawned), ``s0@park:hang``
(the first parked spare hangs).

Points: ``step`` (``World.fault_point(step)``, called by the user loop; with a ``micro``,
the data sampler's micro-batch of the step),
``collective`` (inside ``world.allreduce`` or ``world.mpi.Allgather`` after the exchange started;
on the ``ulfm`` process group, its first reduction: DDP's all-reduce, FSDP2's reduce-scatter),
``gather`` (the ``ulfm`` process group's first all-gather of the step: FSDP2's forward),
``p2p`` (a point-to-point transfer on the ``ulfm`` process group, posted and in flight: torch's
pipeline schedules' activations and gradients; ``R@pS`` the first of step S on that rank, ``R@pS.M``
its (M+1)-th, each send or receive counting one),
``update`` (inside a torch optimizer's ``step()``; with a per-step recovery point, once the point
passed, whose twin or store already holds what the step makes),
``commit`` / ``restore`` (inside the replicated store's transfers),
``agree`` (at the start of a rebuild), ``rebuild`` (after the failed set is
agreed, before the communicator is rebuilt), ``spawn`` (after ``Spawn``
returned, before the new process is merged in), ``park`` (a spare, as soon as
it parks: there ``rank`` counts the spares, 0 being the first), ``finish``
(in ``World.finish()``, before the last agreement). An entry fires only in the
generation ``gen`` (default 0), so a replacement that replays the same step
does not die again.

Actions: ``kill`` (SIGKILL), ``exit`` (``os._exit(3)``: a non-zero exit
without a signal), ``raise`` (``InjectedFault``, an exception in user code),
``hang`` (SIGSTOP: found by the sentinel's heartbeat, or ``--detector``),
``stall`` (alive and beating, but stuck for ever, like a deadlock or a read
that never returns: found by the progress timeout), ``node`` (the rank's whole
node: its runtime daemon and every process under it, frozen at once, then
killed; only on simulated nodes, whose memory dies with them: the launcher
writes ``nodeK@STEP`` as this on node K's first rank), ``runtime`` (SIGKILL to
the job's ``prterun``: the runtime is gone, every node's memory stays; the
processes are left to the launcher), ``warm`` (SIGKILL to this host's warm process, which forks
ranks, ``elastic.comm._warm``; the rank goes on: the next rank started here starts cold),
``warm-stop`` (SIGSTOP to it: a rank started here waits ``_warm.ANSWER_SECONDS`` for it, then
starts cold; the launcher kills a warm process stopped that long).
"""
from __future__ import annotations

import dataclasses
import json
import os
import signal
import time
from pathlib import Path
from typing import Callable

from ._errors import ConfigError, ElasticError
from ._watchdog import WARM_CHILD_ENV
from .wire import message

__all__ = ["Injection", "InjectedFault", "FaultInjector", "parse_schedule", "POINTS", "LOOP_POINTS", "ACTIONS",
           "INJECT_ENV"]

INJECT_ENV = "ELASTIC_INJECT"
POINTS = ("step", "collective", "gather", "p2p", "update", "commit", "agree", "rebuild", "restore", "spawn", "park",
          "finish")
ACTIONS = ("kill", "exit", "raise", "hang", "stall", "node", "runtime", "nan", "bitflip", "slow", "warm", "warm-stop")
DATA_ACTIONS = ("nan", "bitflip", "slow")  # armed for the layers above (``FaultInjector.data_fault``), no process dies
QUIET_ACTIONS = DATA_ACTIONS + ("warm", "warm-stop")  # the process goes on: no outcome is written for them
STEP_POINTS = ("step", "collective", "gather", "p2p", "update", "commit")
LOOP_POINTS = ("step", "collective", "gather", "p2p", "update")  # inside a step the loop tells
EXIT_CODE = 3  # what the ``exit`` action exits with


class InjectedFault(ElasticError):
    """Raised by an injection with action ``raise``: a software fault in user code."""


@message
@dataclasses.dataclass(frozen=True)
class Injection:
    rank: int
    step: int | None = None
    point: str = "step"
    action: str = "kill"
    gen: int = 0
    factor: float = 0.0  # ``slow``: how many times slower
    micro: int | None = None  # a micro-batch of step ``step`` (gradient accumulation), counting from 0

    def __post_init__(self) -> None:
        if self.point not in POINTS:
            raise ConfigError(f"fault injection point {self.point!r}: use one of {POINTS}")
        if self.action not in ACTIONS:
            raise ConfigError(f"fault injection action {self.action!r}: use one of {ACTIONS}")
        if self.point in STEP_POINTS and self.step is None:
            raise ConfigError(f"fault injection at point {self.point!r} needs a step")
        if self.rank < 0:
            raise ConfigError(f"fault injection rank {self.rank}: ranks count from 0")
        if self.action == "slow" and not self.factor > 1:
            raise ConfigError(f"fault injection 'slow' with factor {self.factor:g}: write slow=X with X > 1, "
                              "e.g. '2@10:slow=3' (logical rank 2 runs 3 times slower from step 10)")
        if self.micro is not None and (self.point not in ("step", "p2p") or self.micro < 0):
            raise ConfigError(f"fault injection micro-batch {self.micro} at point {self.point!r}: a micro-batch is "
                              "one of a step's, counting from 0, e.g. '1@12.1' (the second of step 12), and "
                              "'1@p12.3' the fourth point-to-point transfer of step 12")
        if self.action in DATA_ACTIONS and self.point != "step":
            raise ConfigError(f"fault injection {self.action!r} at point {self.point!r}: data faults are armed at "
                              "a step, e.g. '1@20:nan'")

    def to_dict(self) -> dict[str, object]:
        out = dataclasses.asdict(self)
        if not self.factor:
            del out["factor"]  # only ``slow`` has one, only a micro-batch entry a micro: every other
        if self.micro is None:  # entry reads as it always did
            del out["micro"]
        return out


def parse_schedule(text: str | None) -> tuple[Injection, ...]:
    """Parse ``ELASTIC_INJECT`` (JSON, a JSON file, or the compact form)."""
    if not text or not text.strip():
        return ()
    text = text.strip()
    if not text.startswith("[") and Path(text).is_file():
        text = Path(text).read_text()
    try:
        if text.startswith("["):
            return tuple(Injection(**entry) for entry in json.loads(text))
        return tuple(_parse_compact(item) for item in text.split(",") if item.strip())
    except (TypeError, ValueError, json.JSONDecodeError) as exc:
        if isinstance(exc, ConfigError):
            raise
        raise ConfigError(
            f"cannot parse {INJECT_ENV}={text!r} ({exc}); write e.g. '1@3', '1@3,2@3', "
            "'2@c5:hang', '3@rebuild/g1', 's0@park:hang', '1@20:nan', '2@10:slow=3' or a JSON list of "
            "{rank, step, point, action, gen, factor}") from exc


def _parse_compact(item: str) -> Injection:
    item = item.strip()
    gen = 0
    if "/g" in item:
        item, gen_text = item.split("/g", 1)
        gen = int(gen_text)
    action, factor = "kill", 0.0
    if ":" in item:
        item, action = item.split(":", 1)
    if action.startswith("slow="):
        action, factor = "slow", float(action[5:])
    rank_text, where = item.split("@", 1)
    if rank_text.startswith("s") != (where == "park"):
        raise ConfigError(f"fault injection {item!r}: a parked spare is named sK@park (K counts the spares), "
                          "an active rank by its logical rank")
    if where in ("agree", "rebuild", "restore", "spawn", "park", "finish"):
        return Injection(int(rank_text.removeprefix("s")), None, where, action, gen, factor)
    if where.startswith("commit"):
        return Injection(int(rank_text), int(where[6:]), "commit", action, gen, factor)
    if where.startswith("c"):
        return Injection(int(rank_text), int(where[1:]), "collective", action, gen, factor)
    if where.startswith("g"):
        return Injection(int(rank_text), int(where[1:]), "gather", action, gen, factor)
    if where.startswith("u"):
        return Injection(int(rank_text), int(where[1:]), "update", action, gen, factor)
    if where.startswith("p"):  # the first transfer of the step unless a later one is named
        step_text, _, index = where[1:].partition(".")
        return Injection(int(rank_text), int(step_text), "p2p", action, gen, factor, int(index or 0))
    step, _, micro = where.partition(".")
    return Injection(int(rank_text), int(step), "step", action, gen, factor, int(micro) if micro else None)


class FaultInjector:
    """Fires the schedule's entries that match this process (local, no communication).

    What an entry does is ``act(entry, where)``: by default ``EFFECTS``, on this process (a
    simulated job passes its own, a thread's end); the matching, the once-only data faults and the
    step points the library implies are the same for both."""

    def __init__(self, schedule: tuple[Injection, ...], announce: Callable[[Injection], None],
                 warm_socket: str | None = None, act: Callable[[Injection, str], None] | None = None) -> None:
        self.schedule = schedule
        self._announce = announce
        self._warm_socket = warm_socket
        self._act = act or self._on_this_process
        self._armed: dict[str, Injection] = {}  # data faults that fired, for the layers above
        self._spent: set[Injection] = set()     # data faults act once per process
        self._own_step_points = False           # the program marks its steps itself

    def data_fault(self, action: str) -> Injection | None:
        """The armed data fault ``action`` of this process, if any (local): ``nan`` and ``bitflip``
        are taken (they act once), ``slow`` stays in force."""
        entry = self._armed.get(action)
        if entry is not None and action != "slow":
            del self._armed[action]
        return entry

    def wants_steps(self) -> bool:
        """Some entry fires at a step the program's loop must tell (``LOOP_POINTS``)."""
        return any(entry.point in LOOP_POINTS for entry in self.schedule)

    def point(self, point: str, logical_rank: int, generation: int, step: int | None = None, *,
              implied: bool = False, micro: int | None = None) -> None:
        """A fault point reached. The library's calls that know the step (``State.record_step``,
        the data sampler) mark it ``implied``, and count until the program marks its steps
        itself: then only the program's do. ``micro``: micro-batch ``micro`` of step ``step``
        (the sampler's, with accumulation), which only ``R@S.M`` entries match."""
        if point == "step" and micro is None:
            if implied and self._own_step_points:
                return
            self._own_step_points |= not implied
        self.fire(point, logical_rank, generation, step, micro)

    def fire(self, point: str, logical_rank: int, generation: int, step: int | None = None,
             micro: int | None = None) -> None:
        for entry in self.schedule:
            if not (entry.point == point and entry.rank == logical_rank and entry.gen == generation
                    and (entry.step is None or entry.step == step) and entry.micro == micro):
                continue
            if entry.action in DATA_ACTIONS:
                if entry not in self._spent:  # a roll-back replays the step: it runs clean
                    self._spent.add(entry)
                    self._announce(entry)
                    self._armed[entry.action] = entry
                continue
            self._announce(entry)
            self._act(entry, f"injected fault at {point} step={step} on logical rank {logical_rank}")

    def _on_this_process(self, entry: Injection, where: str) -> None:
        EFFECTS[entry.action](self._warm_socket, where)


def _stall(warm_socket: str | None, where: str) -> None:
    while True:
        time.sleep(3600)


def _raise(warm_socket: str | None, where: str) -> None:
    raise InjectedFault(where)


# What each action does to this process (the data actions are armed instead, ``FaultInjector.fire``).
EFFECTS: dict[str, Callable[[str | None, str], None]] = {
    "kill": lambda warm, where: os.kill(os.getpid(), signal.SIGKILL),
    "exit": lambda warm, where: os._exit(EXIT_CODE),
    "hang": lambda warm, where: os.kill(os.getpid(), signal.SIGSTOP),
    "stall": _stall,
    "node": lambda warm, where: _kill_node(),
    "runtime": lambda warm, where: _kill_runtime(),
    "warm": lambda warm, where: _signal_warm(warm, signal.SIGKILL),
    "warm-stop": lambda warm, where: _signal_warm(warm, signal.SIGSTOP),
    "raise": _raise,
}


def _started_by() -> int:
    """The process the runtime started for this rank: its sentinel (this process's parent, or the
    one that had a warm process fork it), or this process itself without a sentinel."""
    sentinel = os.environ.get(WARM_CHILD_ENV, "")
    return int(sentinel) if sentinel.isdigit() else os.getppid()


def _kill_node() -> None:
    """SIGKILL this process's node: the runtime daemon above it (``prted``) and all it started; on a
    simulated node, every process of its UTS namespace as well."""
    daemon = _started_by()
    while daemon > 1 and _proc_field(daemon, "comm") != "prted":
        daemon = int(_proc_field(daemon, "ppid") or 1)
    pids = [int(entry.name) for entry in Path("/proc").iterdir() if entry.name.isdigit()]
    children: dict[int, list[int]] = {}
    for pid in pids:
        parent = _proc_field(pid, "ppid")
        if parent:
            children.setdefault(int(parent), []).append(pid)
    node, todo = [], [daemon] if daemon > 1 else []  # no daemon above: mpiexec runs this host's ranks itself
    while todo:
        pid = todo.pop()
        node.append(pid)
        todo.extend(children.get(pid, []))
    uts = _namespace(os.getpid())
    if uts is not None and uts != _namespace(1):
        # A simulated node is its own UTS namespace: all of it goes, whatever the process tree says
        # (no daemon may be found above the injecting rank at all).
        node += [pid for pid in pids if pid not in node and _namespace(pid) == uts]
    ancestors, pid = [], _started_by()
    while pid > 1:
        ancestors.append(pid)
        pid = int(_proc_field(pid, "ppid") or 1)
    others = _kill_order(node, os.getpid(), ancestors)
    for sig in (signal.SIGSTOP, signal.SIGKILL):  # frozen first: nothing on the node reacts to the rest dying
        for pid in others:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
    os.kill(os.getpid(), signal.SIGKILL)


def _kill_order(node: list[int], me: int, ancestors: list[int]) -> list[int]:
    """The order in which process ``me`` kills the other processes of ``node``: its own ancestors
    (``ancestors``: parent first) last, its parent (the sentinel) the very last. The sentinel's
    death takes ``me`` with it (PR_SET_PDEATHSIG), and what it had not killed by then lived on,
    frozen until its orphaned process group got SIGHUP and SIGCONT (a rank of a killed fake node
    was found alive, training on its own)."""
    return [p for p in node if p != me and p not in ancestors] + [p for p in reversed(ancestors) if p in node]


def _namespace(pid: int) -> str | None:
    """The UTS namespace of a process (None when it is gone or hidden)."""
    try:
        return os.readlink(f"/proc/{pid}/ns/uts")
    except OSError:
        return None


def _signal_warm(path: str | None, sig: int) -> None:
    """Send ``sig`` to the warm process listening at ``path``."""
    from ._warm import serving_pid

    pid = serving_pid(path) if path else None
    if pid is not None:
        os.kill(pid, sig)


def _kill_runtime() -> None:
    """SIGKILL the job's runtime (``prterun``, an ancestor of every rank), then wait to be ended."""
    runtime = _started_by()
    while runtime > 1 and _proc_field(runtime, "comm") != "prterun":
        runtime = int(_proc_field(runtime, "ppid") or 1)
    if runtime > 1:
        os.kill(runtime, signal.SIGKILL)
    while True:  # the launcher ends what the runtime left behind
        time.sleep(3600)


def _proc_field(pid: int, field: str) -> str | None:
    """``comm`` or ``ppid`` of a process, from /proc (None when it is gone)."""
    try:
        stat = (Path("/proc") / str(pid) / "stat").read_text()
    except OSError:
        return None
    comm, rest = stat[stat.index("(") + 1:stat.rindex(")")], stat[stat.rindex(")") + 2:].split()
    return comm if field == "comm" else rest[1]

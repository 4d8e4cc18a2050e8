"""How a process joins the world: launched with the job (``init``), or spawned as a replacement."""
from __future__ import annotations

import dataclasses
import logging
import os
import signal
import socket
import sys
import time
from typing import Any, Callable, Mapping, cast

from mpi4py import MPI

from . import _log
from ._collectives import allgather, bcast
from ._config import Config
from ._errors import ConfigError, mpi_errors
from .events import EventLog
from ._membership import Members
from ._policy import FixedOrder, RebuildPolicy
from ._ranks import SPARE, LogicalRank, Role
from ._rebuild import JOIN_SECONDS, Generation, Rebuild, split_actives
from ._ulfm import check_ulfm
from ._watchdog import WARM_CHILD_ENV, WARM_HOST_ENV
from ._world import WATCHDOG, World


# How this process came to be, for the report's start-up phases: when it began (forked from a warm
# process, or a new interpreter), when MPI_Init began and how long it took.
_STARTUP: dict[str, float] = {}


def _process_began() -> float:
    """The wall-clock time this process began (local; /proc: its start in clock ticks since boot)."""
    try:
        with open("/proc/self/stat") as stat:
            ticks = int(stat.read().rsplit(")", 1)[1].split()[19])
        boot = time.time() - time.clock_gettime(time.CLOCK_BOOTTIME)  # /proc/stat's btime is whole seconds
        return boot + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, AttributeError):
        return time.time()


def init(config: Config | None = None, *, policy: RebuildPolicy | None = None,
         environ: Mapping[str, str] | None = None, before_parking: Callable[[World], None] | None = None,
         **settings: Any) -> World:
    """Join the resilient world (collective over every process of the job, blocking).

    Args:
        config: the job's settings (default ``Config.from_env()``: what the launcher set);
            keyword ``settings`` override single fields (``spares=1``, ``run_dir=...``).
        policy: decides each rebuild (default: the configured modes in order, ``FixedOrder``),
            on the lowest live process; a spawned replacement runs the program again and uses the
            policy its own ``init`` is given (nothing of it travels between processes).
        environ: where the layers above read their own settings (``job.environ``; default
            ``os.environ``); a spawned replacement gets its parents' ``ELASTIC_*`` variables.
        before_parking: a spare calls it once, with its World, before it parks (local: the spare
            has no active communicator yet; a rebuild that needs it waits until it parks).

    Returns the World on an active rank. A spare returns only once promoted
    (role RECOVERED), or exits when the job finishes without needing it. A
    spawned replacement returns as RECOVERED.

    Raises:
        UlfmUnavailable: MPI cannot survive failures (says what to run instead).
        ConfigError: a setting is wrong.
    """
    config = Config.from_env(**settings) if config is None else config.replace(**settings)
    mpi_start = time.time()
    if not MPI.Is_initialized():  # a tool's main() told mpi4py not to initialize
        MPI.Init_thread(MPI.THREAD_MULTIPLE)
    _STARTUP.update(began=_process_began(), mpi_start=mpi_start, mpi_init=time.time() - mpi_start)
    WATCHDOG.start(config.run_dir)  # from here on a stopped or frozen process is found by its sentinel
    _log.setup(config.log_level)
    alone = _started_alone()
    check_ulfm(config.require_ulfm if config.require_ulfm is not None else not alone)
    if alone and not config.require_ulfm:
        logging.getLogger("elastic.comm").warning(
            "[elastic] a single process without mpiexec: a world of 1 that cannot survive a failure (for "
            "debugging). Launch with `python -m elastic.launch -n N -- ...`; ELASTIC_REQUIRE_ULFM=1 makes this "
            "an error.")
    parent = MPI.Comm.Get_parent()
    if parent != MPI.COMM_NULL:
        return _join_as_spawned(parent, policy)
    universe = MPI.COMM_WORLD.Dup()
    universe.Set_errhandler(MPI.ERRORS_RETURN)
    n = universe.Get_size()
    if config.spares >= n:
        raise ConfigError(f"spares={config.spares} with {n} processes: keep at least one active rank "
                          f"(0 <= spares < {n})")
    relaunch = config.relaunch
    if relaunch is not None and len(relaunch.table) != n:
        raise ConfigError(f"ELASTIC_RELAUNCH names {len(relaunch.table)} processes but the job has {n}: it is the "
                          "launcher's; start relaunches through python -m elastic.launch")
    table = list(relaunch.table) if relaunch else [r if r < n - config.spares else SPARE for r in range(n)]
    members = Members(universe, table, [None] * n)
    # A relaunch's processes are all replacements: their state comes back from the nodes' memory.
    role = Role.SPARE if members.mine() == SPARE else Role.RECOVERED if relaunch else Role.INITIAL
    rebuild = None
    if relaunch is not None:
        rebuild = Rebuild(relaunch.generation, "relaunch", frozenset(map(LogicalRank, relaunch.failed)),
                          frozenset(map(LogicalRank, relaunch.replaced)), frozenset(map(LogicalRank, relaunch.removed)),
                          0, relaunch.count, {}, tuple({"what": f"node {n} lost"} for n in relaunch.lost_nodes))
    # A relaunch's committed: then losing every copy is DataLost, not a fresh start.
    start = Generation(rebuild.generation if rebuild else 0, members, cast(MPI.Intracomm, MPI.COMM_NULL), role,
                       rebuild, committed=relaunch.committed if relaunch else False)
    world = World(start, config, policy or FixedOrder(config.rebuild, config.min_size),
                  relaunch.initial_size if relaunch else n - config.spares, alone=alone and not config.require_ulfm,
                  environ=environ)
    world._lifecycle.install()
    with mpi_errors(universe):
        world._adopt(dataclasses.replace(start, comm=split_actives(members)))
        members.procs = allgather(universe, (socket.gethostname(), os.getpid()))
    world.events.emit("started", size=members.actives(), spares=members.spares(), modes=config.rebuild,
                      sentinel=world._watchdog.active, sentinel_pid=world._watchdog.sentinel_pid,
                      warm=WARM_CHILD_ENV in os.environ, warm_host=os.environ.get(WARM_HOST_ENV), **_STARTUP,
                      **({"relaunch": relaunch.count} if relaunch else {}))
    if relaunch is not None and rebuild is not None:  # the report's timeline: a recovery by a relaunch
        world._announce(rebuild, lost_nodes=relaunch.lost_nodes)
    if role is Role.SPARE:
        if before_parking is not None:
            before_parking(world)
        world._park()
    else:
        world._export_env()
        world._watchdog.watch_progress(True)
    return world


def _join_as_spawned(parent: MPI.Intercomm, policy: RebuildPolicy | None) -> World:
    """A spawned replacement: merge with the survivors and finish their rebuild with them.

    When the parents give up on it (a failure during the spawn), the merge
    fails or never comes: the process then dies, by its own hand or by the
    sentinel's join deadline, without ever having been a member.
    """
    parent.Set_errhandler(MPI.ERRORS_RETURN)
    WATCHDOG.deadline(JOIN_SECONDS)
    try:
        merged = parent.Merge(high=True)
        merged.Set_errhandler(MPI.ERRORS_RETURN)
        payload = bcast(merged, None, 0)
    except MPI.Exception as exc:
        sys.stderr.write(f"[elastic] a spawned process was abandoned by its parents ({exc}); leaving\n")
        sys.stderr.flush()
        EventLog(Config.from_env().run_dir, dict).write_outcome("spawn-abandoned", message=str(exc))
        os.kill(os.getpid(), signal.SIGKILL)
    WATCHDOG.deadline(None)
    table, procs = payload["members"]
    state = payload["world"]
    config = state["config"]  # the job's, as the parents run it
    joining = Generation(state["generation"], Members(merged, table, procs), cast(MPI.Intracomm, MPI.COMM_NULL),
                         Role.RECOVERED, streak=state["streak"], committed=state["committed"])
    world = World(joining, config, policy or FixedOrder(config.rebuild, config.min_size), state["initial_size"],
                  history=state["history"], step=state["step"], environ={**os.environ, **state["environ"]})
    world._lifecycle.install()
    world.events.emit("spawned", sentinel=world._watchdog.active, sentinel_pid=world._watchdog.sentinel_pid,
                      warm=WARM_CHILD_ENV in os.environ, warm_host=os.environ.get(WARM_HOST_ENV), **_STARTUP)
    world._rebuild(join=True)
    world._watchdog.watch_progress(True)
    return world


def _started_alone() -> bool:
    """A single process that no MPI launcher started (`python train.py`): MPI's singleton mode."""
    launched = any(v in os.environ for v in ("OMPI_COMM_WORLD_SIZE", "PMIX_RANK", "PMI_RANK", "PMI_SIZE"))
    return not launched and MPI.COMM_WORLD.Get_size() == 1

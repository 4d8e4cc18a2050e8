"""Launch a job under ``mpiexec --with-ft ulfm`` and report what each process did.

    python -m elastic.launch -n 4 --spares 1 --inject 1@10 -- python examples/jacobi.py
    python -m elastic.launch --slurm --spares 1 -- python examples/train.py   # inside sbatch / salloc
    python -m elastic.launch --simulate-nodes 2 -n 4 --spares 1 -- python examples/train.py   # fake nodes
    python -m elastic.launch --simulate-nodes 3 --spare-nodes 1 -n 6 --inject node1@20 -- python examples/train.py

The launcher is four parts, each testable without MPI: the plan (``_plan``:
the command line checked and resolved into a frozen ``LaunchPlan``), the
mpiexec command (``_mpiexec``), the supervision of a run and its verdict
(``_supervise``), and the relaunch planner (``_relaunch``); this module runs
them in order.

Every rank runs under a sentinel (``elastic.comm._sentinel``) that makes each
way a rank can end or stall (a crash, a non-zero exit, an exception, a hang) a
failure the survivors see at once. ULFM's mpiexec exit status says nothing about
which ranks died or why, so every process writes an outcome file, every
sentinel a fate file, and this launcher decides from those, as mpirun and
torchrun users expect: exit 0 when the training finished, whatever ranks died
on the way (each death is listed); 1 when it did not; 124 when ``--timeout``
ran out; 128 + N when the launcher got signal N (SIGTERM, SIGINT: passed on to
the ranks, which get ``--grace`` seconds before every process left is killed).

Tier 2: a job on more than one host keeps its committed state in each node's
memory as well (``--relaunches``, default 2 there), and when the runtime
ends with the training unfinished and no agreed error (a node lost: Open MPI
5.0 then ends every rank), this launcher starts the job again on the hosts
that are left plus ``--spare-nodes``, the lost nodes' logical ranks on spare
nodes or removed (a shrink); the new processes take the state back from the
surviving nodes' memory and resume.
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from elastic.comm import Config, ConfigError
from elastic.comm.runtime import keep_mpi_uninitialized, warm_serving_pid

from . import _nodes
from ._mpiexec import build_command, job_env, omp_threads
from ._plan import LaunchPlan, missing_program, parse_args, slurm_slots
from ._relaunch import next_launch
from ._supervise import Attempt, run_pids, report, summarize

__all__ = ["main", "parse_args", "build_command", "summarize", "slurm_slots", "LaunchPlan"]


@dataclasses.dataclass
class _Launches:
    """What the launches of one job came to, for the verdict (local)."""

    attempt: Attempt | None = None          # the last mpiexec run
    config: Config = dataclasses.field(default_factory=Config)  # the last launch's (what it still owed)
    notes: list[str] = dataclasses.field(default_factory=list)
    hidden: int = 0                         # Open MPI's interrupted-collective notices hidden
    leftovers: int = 0                      # processes killed after the job, unasked
    relaunches: int = 0
    restarts: int = 0                       # launches made again because the runtime failed to come up
    lost: set[str] = dataclasses.field(default_factory=set)
    times: list[dict[str, float]] = dataclasses.field(default_factory=list)  # wall clock: launched, ended


def main(argv: list[str] | None = None) -> int:
    keep_mpi_uninitialized()  # a tool: nothing it reads starts MPI here (importing this module changes nothing)
    plan = parse_args(argv)
    missing = missing_program(plan)
    if missing:
        print(f"python -m elastic.launch: error: {missing}", file=sys.stderr, flush=True)
        return 2
    plan.run_dir.mkdir(parents=True, exist_ok=True)
    for stale in [p for pattern in ("outcome-*.json", "events-*.jsonl", "fate-*.json", "summary.json")
                  for p in plan.run_dir.glob(pattern)]:
        stale.unlink()
    memory = Path("/dev/shm") / f"{plan.job}-nodes"  # the simulated nodes' memory
    agent = _nodes.write_agent(plan.run_dir, memory) if plan.simulate_nodes else None
    done = _Launches(config=plan.config)
    got: list[int] = []

    def on_signal(sig: int, _frame: Any) -> None:
        got.append(sig)
        if done.attempt is not None:
            done.attempt.stop(f"got {signal.Signals(sig).name}")

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)}
    threads = omp_threads(plan)
    if threads is not None and not plan.quiet:
        print(f"[launch] OMP_NUM_THREADS={threads} for each process ({os.cpu_count()} cores here, "
              f"{plan.nprocs + plan.spares} processes; set OMP_NUM_THREADS to choose)", flush=True)
    shared = _shared_warm(plan)
    warm: dict[str, subprocess.Popen[str]] = {}
    if shared is not None:  # forked from a warm process that outlives this job: nothing of it to start or end
        done.config = done.config.replace(warm_socket=shared[0])
        here = {"this host": shared[1]}
    else:
        warm, here = _start_warm(plan, agent, done.notes)
    if not warm and shared is None:
        done.config = done.config.replace(warm_socket=None)  # the sentinels start their ranks cold: said here
    try:
        _launch_until_done(plan, agent, memory, done, got, here)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        _end_warm(list(warm.values()))
        if warm and not plan.simulate_nodes:  # this machine's (a simulated node's goes with its memory, below)
            Path(plan.config.warm_socket or "").unlink(missing_ok=True)
        if plan.simulate_nodes:
            shutil.rmtree(memory, ignore_errors=True)
        elif not plan.hosts:  # this machine is the job's only node: its memory is this launcher's to free
            shutil.rmtree(Path("/dev/shm") / plan.job, ignore_errors=True)
    return _verdict(plan, done, got)


def _start_warm(plan: LaunchPlan, agent: Path | None, notes: list[str]
                ) -> tuple[dict[str, subprocess.Popen[str]], dict[str, int]]:
    """The warm processes (``elastic.comm._warm``): each imports what the ranks import, then forks
    each rank of its host, a spawned replacement or a relaunched rank as well, in milliseconds
    instead of an interpreter's start. One on each host of the job, the spare nodes too, started on
    this machine directly and elsewhere through what starts mpiexec's daemons there (``_nodes.on_host``:
    srun in a Slurm allocation, else the ssh agent; the node agent on simulated nodes, which kills a
    lost node's with its memory), so that a relaunch forks warm on whichever hosts it uses. Each reads
    its standard input until the launcher closes it (``_warm.serve``): it ends with the job, also
    across ssh. Waits until they serve (what one cold start takes); a host whose warm process cannot
    serve gets a note, and its ranks start cold. Returns them by host, and the pids of those that run
    on this machine (simulated nodes' too), whose children are ranks (a remote one's process here is
    the ssh or srun that carries it)."""
    if not plan.config.warm_socket:
        return {}, {}
    programs = [program] if (program := _program_file(plan)) is not None else []
    if any(_asks_cold(program) for program in programs):
        print(f"[launch] {programs[0]} asks for cold starts ({COLD_PRAGMA}): every rank starts a new interpreter",
              flush=True)
        notes.append(f"cold starts, as the program asks ({COLD_PRAGMA})")
        return {}, {}
    # Imported, not run with -m: elastic.comm imports the module itself, and runpy would warn of it and
    # run a second copy of it as __main__.
    serve = [sys.executable, "-c", "import sys; from elastic.comm._warm import main; sys.exit(main(sys.argv[1:]))",
             "serve", plan.config.warm_socket, *programs]
    env = job_env(plan.config, plan.training, omp_threads(plan))
    env.update({name: os.environ[name] for name in ("PYTHONPATH",) if name in os.environ})
    commands = {}
    for host in [h for h, _ in plan.hosts] + list(plan.spare_hosts):
        if plan.simulate_nodes and agent is not None:
            commands[host] = _nodes.on_host(host, serve, slurm=False, agent=[str(agent)], env=env)
        elif host in (socket.gethostname(), "localhost"):
            if serve not in commands.values():  # this machine under two names: one warm process
                commands[host] = serve
        else:
            commands[host] = _nodes.on_host(host, serve, slurm=plan.slurm, agent=_nodes.rsh_agent(plan.mca), env=env)
    commands = commands or {"this host": serve}
    procs = {host: subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                    start_new_session=True, env={**os.environ, **env})  # own sessions: no ^C
             for host, command in commands.items()}
    deadline = time.monotonic() + WARM_START_SECONDS
    serving = {}
    for host, proc in procs.items():
        assert proc.stdout is not None
        # Bounded: a warm process stuck in an import must not hold the job (its ranks then start cold).
        left = max(0.0, deadline - time.monotonic())
        ready = proc.stdout.readline() if select.select([proc.stdout], [], [], left)[0] else \
            f"not ready after {WARM_START_SECONDS:g} s"
        if ready.startswith("[warm] ready"):
            serving[host] = proc
            continue
        proc.kill()  # (one stuck in its imports reads no input)
        proc.wait()
        where = "every rank" if len(procs) == 1 else f"the ranks on {host}"
        notes.append(f"no warm process on {host} ({ready.strip() or 'it ended'}): {where} started cold")
        print(f"[launch] {notes[-1]}", flush=True)
    return serving, {host: proc.pid for host, proc in serving.items() if commands[host] is serve or plan.simulate_nodes}


WARM_SERVER_ENV = "ELASTIC_WARM_SERVER"


def _shared_warm(plan: LaunchPlan) -> tuple[str, int] | None:
    """The socket and pid of a warm process already serving on this machine for every job started
    here (``ELASTIC_WARM_SERVER``: a test session's, ``python -c 'from elastic.comm._warm import
    main; main()' serve SOCKET MODULE...``, holding library modules only, never a program's own),
    so that a job skips the cold start of one of its own; None where it is not set or not serving,
    or where the job needs warm processes of its own (other hosts, simulated nodes, a batch
    allocation, a program that asks for cold starts)."""
    path = os.environ.get(WARM_SERVER_ENV)
    if not path or not plan.config.warm_socket or plan.hosts or plan.simulate_nodes or plan.slurm:
        return None
    program = _program_file(plan)
    if program is not None and _asks_cold(program):
        return None
    pid = warm_serving_pid(path)
    return None if pid is None else (path, pid)


def _end_warm(procs: list[subprocess.Popen[str]]) -> None:
    """End warm processes: their standard input closed (a remote one ends on that, and removes its
    socket), then killed where still there after a moment (the ssh or srun that carried it)."""
    for proc in procs:
        if proc.stdin is not None:
            with contextlib.suppress(OSError):
                proc.stdin.close()
    deadline = time.monotonic() + WARM_END_SECONDS
    for proc in procs:
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(max(0.0, deadline - time.monotonic()))
        proc.kill()
        proc.wait()


COLD_PRAGMA = "# elastic: cold-start"  # a program that must not be forked from a warm process says so
WARM_START_SECONDS = 120.0  # what one cold start of a rank takes, and more
WARM_END_SECONDS = 5.0  # for the warm processes to end on their closed input, ssh's round trip included


def _program_file(plan: LaunchPlan) -> str | None:
    """The Python file of ``python PROGRAM.py ...``, whose imports a warm process makes (None otherwise)."""
    return plan.command[1] if len(plan.command) > 1 and plan.command[1].endswith(".py") else None


def _asks_cold(program: str) -> bool:
    """The program says it cannot run in a forked process (it initialises CUDA as it imports, say)."""
    try:
        return any(line.strip() == COLD_PRAGMA for line in Path(program).read_text().splitlines())
    except (OSError, UnicodeDecodeError):
        return False


def _launch_until_done(plan: LaunchPlan, agent: Path | None, memory: Path, done: _Launches, got: list[int],
                       warm: dict[str, int] | None = None) -> None:
    """Run mpiexec, and again from the nodes' memory while the job ends unfinished with a node lost
    and relaunches are left."""
    deadline = None if plan.timeout is None else time.monotonic() + plan.timeout
    placement, spare_hosts = plan.placement, plan.spare_hosts
    warm = dict(warm or {})  # host -> its warm process's pid
    while True:
        hosts = placement.counts() if plan.hosts else None
        cmd = build_command(plan, len(placement.table), hosts if done.relaunches or plan.simulate_nodes else None,
                            agent)
        if not plan.quiet:
            print(f"[launch] {' '.join(cmd)}", flush=True)
        done.times.append({"launched": time.time()})
        done.attempt = attempt = Attempt(plan, cmd, job_env(done.config, plan.training, omp_threads(plan)), warm)
        if got:
            attempt.stop(f"got {signal.Signals(got[0]).name}")
        attempt.wait(deadline)
        done.times[-1]["ended"] = time.time()
        if attempt.outlived is not None:
            done.times[-1]["outlived"] = round(attempt.outlived, 1)
            done.notes.append(f"mpiexec outlived every process of the job by {attempt.outlived:.0f} s (Open MPI's "
                              "runtime hung at the job's end): ended by the launcher")
        done.hidden += attempt.hidden
        done.leftovers += len(attempt.leftovers) if not attempt.stopping else 0
        mine = run_pids(plan.run_dir) - attempt.before
        if not mine and attempt.start_failure and not attempt.stopping and not done.restarts:
            done.restarts += 1  # nothing of the job ran: nothing is lost by starting it again, once
            print(f"[launch] the runtime failed to come up ({attempt.start_failure}) before any process of the "
                  "job began: starting it again", flush=True)
            continue
        this = summarize(plan.run_dir, done.config.inject, mine)
        lost = attempt.lost_nodes | {o["host"] for o in this.outcomes if o["status"] == "injected-node"}
        lost_before, done.lost = set(done.lost), done.lost | lost
        if plan.simulate_nodes:
            for node in lost:  # its memory goes with it, and its warm process (in namespaces of its own)
                shutil.rmtree(memory / node, ignore_errors=True)
                if node in warm:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(warm.pop(node), signal.SIGKILL)
        if this.finished or attempt.stopping or this.stopped_by or not plan.relaunches:
            return
        if done.relaunches >= plan.relaunches:
            done.notes.append(f"the job ended unfinished and its {plan.relaunches} relaunch(es) (--relaunches) are "
                              "used up")
            return
        done.relaunches += 1
        try:
            nxt = next_launch(plan, placement, done.config, spare_hosts, mine, lost, lost_before, done.relaunches)
        except (_nodes.GiveUp, ConfigError) as exc:
            done.notes.append(f"no relaunch: {exc}")
            return
        done.lost |= nxt.probed
        placement, spare_hosts, done.config = nxt.placement, nxt.spare_hosts, nxt.config
        print(f"[launch] {nxt.describe(plan, lost)}", flush=True)


def _verdict(plan: LaunchPlan, done: _Launches, got: list[int]) -> int:
    """The exit status, as mpirun and torchrun users expect, with the report and ``summary.json``:
    0 when the training finished, whatever died on the way; 1 when it did not; 124 on the
    timeout; 128 + N on signal N."""
    attempt = done.attempt
    assert attempt is not None
    notes = done.notes
    timed_out = bool(attempt.stopping) and not got
    stopped = signal.Signals(got[0]).name if got else "timeout" if timed_out else None
    summary = summarize(plan.run_dir, done.config.inject, stopped=stopped,  # what the last launch still owed
                        since=attempt.stopped_at)
    if timed_out:
        rc = 124
        notes.append(f"TIMED OUT after {plan.timeout:g} s")
    elif got:
        rc = 128 + got[0]
        notes.append(f"stopped by {signal.Signals(got[0]).name}")
    else:
        rc = 0 if summary.finished else 1
    if rc == 0 and summary.reached and not plan.allow_unfired:  # a test that tested nothing must not pass
        rc = 1
        notes.append(f"{len(summary.reached)} injection(s) reached but never fired: exit 1 (--allow-unfired: 0)")
    if done.hidden:
        notes.append(f"({done.hidden} 'NBC_Progress' / 'NBC_Start_round' lines of Open MPI hidden: non-blocking "
                     "collectives interrupted by a failure, expected)")
    if done.lost and not done.relaunches:
        notes.append(f"node(s) {', '.join(sorted(done.lost))} lost with every process on them: Open MPI 5.0's "
                     "runtime ends the whole job when a node's daemon dies, and the state in memory goes with it "
                     + ("(--relaunches 0: no relaunch from the other nodes' memory)" if not plan.relaunches else ""))
    if done.relaunches:
        notes.append(f"{done.relaunches} relaunch(es) from the nodes' memory (nodes lost: "
                     f"{', '.join(sorted(done.lost)) or 'none'})")
    if done.restarts:
        notes.append("started twice: the first time the runtime failed to come up before any process began")
    if done.leftovers:
        notes.append(f"killed {done.leftovers} processes left behind by the job")
    if plan.relaunches and rc and plan.hosts and not plan.simulate_nodes:
        notes.append(f"node memory of this job may be left in /dev/shm/{plan.job} on the hosts: remove it there")
    report(summary, plan.run_dir, notes)
    document = summary.document(ok=rc == 0, rc=rc, timed_out=timed_out, mpiexec_rc=attempt.proc.returncode,
                                signal=signal.Signals(got[0]).name if got else None, relaunches=done.relaunches,
                                restarts=done.restarts, launches=done.times, lost_nodes=sorted(done.lost),
                                job=plan.job)
    (plan.run_dir / "summary.json").write_text(json.dumps(document, indent=1, default=str))
    return rc


if __name__ == "__main__":
    sys.exit(main())

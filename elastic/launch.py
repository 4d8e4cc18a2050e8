"""Launch a job under ``mpiexec --with-ft ulfm`` and report what each process did.

    python -m elastic.launch -n 4 --spares 1 --inject 1@10 -- python examples/jacobi.py
    python -m elastic.launch --slurm --spares 1 -- python examples/train.py   # inside sbatch / salloc
    python -m elastic.launch --simulate-nodes 2 -n 4 --spares 1 -- python examples/train.py   # fake nodes
    python -m elastic.launch --simulate-nodes 3 --spare-nodes 1 -n 6 --inject node1@20 -- python examples/train.py

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

import argparse
import contextlib
import dataclasses
import json
import os
import re
import shutil
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import IO, Any

from elastic.comm import Config, ConfigError
from elastic.comm.faults import Injection, parse_schedule
from elastic.comm._config import Relaunch
from elastic.comm.events import SIGNAL_ERRORS, describe_end, read_events, read_fates, read_outcomes
from elastic.comm._lazy import keep_mpi_uninitialized
from elastic.comm._watchdog import STOPPED_SENTINEL_SECONDS

from . import _nodes

_EXPECTED_END = ("finished", "spare-unused")
LEFTOVER_SECONDS = 3.0  # after mpiexec ends, how long the job's last processes get to end on their own
SWEEP_SECONDS = 1.0     # how often this launcher looks for stopped sentinels
DETECTOR_MCA = (("mpi_ft_detector", "true"), ("mpi_ft_detector_period", "0.5"), ("mpi_ft_detector_timeout", "2"))
# Open MPI prints this for every non-blocking collective a failure interrupted; it reads like a crash.
_NOISE = b"NBC_Progress: an error"
# PRRTE's words when a node's daemon is gone (it then ends every rank of the job).
_LOST_NODE = re.compile(rb"Remote daemon: \S+ on node (\S+)")


def slurm_slots(tasks_per_node: str, hosts: list[str]) -> list[tuple[str, int]]:
    """Pair Slurm's expanded node list with SLURM_TASKS_PER_NODE (e.g. '2(x3),1') (local)."""
    counts: list[int] = []
    for part in tasks_per_node.split(","):
        count, _, repeat = part.partition("(x")
        counts += [int(count)] * (int(repeat.rstrip(")")) if repeat else 1)
    if len(counts) != len(hosts):
        raise SystemExit(f"SLURM_TASKS_PER_NODE={tasks_per_node!r} does not match the {len(hosts)} allocated nodes")
    return list(zip(hosts, counts))


def slurm_allocation() -> list[tuple[str, int]]:
    """(host, slots) of the Slurm allocation this launcher runs in."""
    nodelist, tasks = os.environ.get("SLURM_JOB_NODELIST"), os.environ.get("SLURM_TASKS_PER_NODE")
    if not nodelist or not tasks:
        raise SystemExit("--slurm outside a Slurm allocation: run it from an sbatch script or inside salloc")
    hosts = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True,
                           check=True, timeout=30).stdout.split()
    return slurm_slots(tasks, hosts)


def build_command(args: argparse.Namespace, nprocs: int, hosts: list[tuple[str, int]] | None = None) -> list[str]:
    """The mpiexec command line for this machine (root, core count, Slurm allocation) and options;
    ``hosts``: (host, processes) of this launch, filled in order (default: the hosts' slots)."""
    mpiexec = args.mpiexec or shutil.which("mpiexec") or "mpiexec"
    cmd = [mpiexec, "--with-ft", "ulfm", "-n", str(nprocs)]
    slots = os.cpu_count() or 1
    if hosts is not None:
        cmd += ["--host", ",".join(f"{h}:{n}" for h, n in hosts), "--map-by", "slot"]  # as the table says
        slots = nprocs
    elif args.hosts:
        cmd += ["--host", ",".join(f"{h}:{n}" for h, n in args.hosts)]
        slots = sum(n for _, n in args.hosts)
    if len(hosts if hosts is not None else args.hosts) > 1:
        for key, value in _nodes.MULTI_NODE_MCA:
            cmd += ["--mca", key, value]
    if args.simulate_nodes:
        cmd += ["--mca", "plm_rsh_agent", str(args.agent)]
    if os.geteuid() == 0:
        cmd.append("--allow-run-as-root")
    # PRRTE does not give a dead process's slot to a spawned one: with every slot taken, Spawn fails
    # (MPI_ERR_UNKNOWN). Across hosts the launcher fills every slot itself, so it lets a replacement
    # take the dead one's core; on one host given full, the rebuild falls through to the next mode.
    spawns = "spawn" in args.config.rebuild and len(hosts if hosts is not None else args.hosts) > 1
    if args.oversubscribe or nprocs > slots or spawns:
        cmd.append("--oversubscribe")
    if nprocs > (os.cpu_count() or 1):
        cmd += ["--bind-to", "none"]  # more processes than cores (slots can exceed them under Slurm)
    if args.detector:
        for key, value in DETECTOR_MCA:
            cmd += ["--mca", key, value]
    if (not args.hosts or args.simulate_nodes) and not any(k == "btl" for k, _ in args.mca) \
            and "OMPI_MCA_btl" not in os.environ:
        # One machine: shared memory and TCP carry everything. The libfabric BTL only probes its
        # providers, 1 s of every process's MPI_Init here (a spawned replacement's too).
        cmd += ["--mca", "btl", "^ofi"]
    for key, value in args.mca:
        cmd += ["--mca", key, value]
    for name in sorted(_job_env(args)):
        cmd += ["-x", name]
    # The sentinel runs with this launcher's Python; the program with whatever the command names.
    return cmd + [sys.executable, "-m", "elastic.comm._sentinel", "--"] + args.command


def _job_env(args: argparse.Namespace) -> dict[str, str]:
    # The job's whole configuration travels with it (to other hosts too, through -x).
    return {**args.config.to_env(), "PYTHONUNBUFFERED": "1"}


# ---------------------------------------------------------------------------- the outcome
def summarize(run_dir: Path, schedule: tuple[Injection, ...] = (), only: set[int] | None = None,
              stopped: str | None = None) -> dict[str, Any]:
    """What became of the job and of each process, from the files they wrote (local).

    ``finished``: the training finished (some process finished, none stopped the
    job with an error, none failed after finishing). ``deaths``: every process
    that did not leave together with the others, with how it ended. ``never_fired``: schedule
    entries that no process announced. ``only``: these processes (one launch of several).
    ``stopped``: why this launcher stopped the job (a signal's name, a timeout): a process
    that said nothing of its own end, or ended by a termination signal, ended by that request.
    """
    outcomes = {o["pid"]: o for o in read_outcomes(run_dir) if only is None or o["pid"] in only}
    fates = {f["pid"]: f for f in read_fates(run_dir) if only is None or f["pid"] in only}
    events = [e for e in read_events(run_dir) if only is None or e["pid"] in only]
    last_seen: dict[int, dict] = {}
    for e in events:
        last_seen[e["pid"]] = e
    pids = sorted(set(outcomes) | set(fates) | set(last_seen))
    deaths = []
    for pid in pids:
        outcome, fate = outcomes.get(pid), fates.get(pid)
        info = outcome if outcome is not None else last_seen.get(pid, {})
        status = outcome["status"] if outcome else None
        left_together = status in _EXPECTED_END + ("error",) and not info.get("after_finish") and \
            (fate is None or fate["end"] == "exited")
        if left_together:  # finished, released, or stopped with the job's agreed error (told once, below)
            continue
        how = f"stopped on request ({stopped})" if stopped and _ended_by_a_stop(outcome, fate) else \
            _how(outcome, fate)
        deaths.append({"pid": pid, "logical": info.get("logical"), "gen": info.get("gen"),
                       "role": info.get("role"), "status": status, "how": how,
                       "injected": bool(status and status.startswith("injected-"))})
    statuses = [o["status"] for o in outcomes.values()]
    stop = next((o for o in outcomes.values() if o["status"] == "error"), None)
    after_finish = [o for o in outcomes.values() if o.get("after_finish")]
    finished = "finished" in statuses and stop is None and not after_finish
    fired = {(e["rank"], e["step"], e["point"], e["action"], e["gen"]) for e in events if e["event"] == "inject"}
    never = [i for i in schedule if (i.rank, i.step, i.point, i.action, i.gen) not in fired]
    counts: dict[str, int] = {}
    for pid in pids:  # by what the process said, else by what its sentinel saw
        key = "stopped on request" if stopped and _ended_by_a_stop(outcomes.get(pid), fates.get(pid)) else \
            outcomes[pid]["status"] if pid in outcomes else fates[pid]["end"] if pid in fates else \
            "died without a word"
        counts[key] = counts.get(key, 0) + 1
    return {"finished": finished, "processes": len(pids), "counts": counts, "deaths": deaths,
            "stopped_by": {"kind": stop["kind"], "message": stop["message"]} if stop else None,
            "never_fired": [i.to_dict() for i in never], "outcomes": list(outcomes.values()),
            "fates": list(fates.values())}


def _ended_by_a_stop(outcome: dict | None, fate: dict | None) -> bool:
    """A process that left no word of its own end, or was ended by a termination signal: what a
    stop of the whole job (the launcher's SIGTERM, passed on to everyone) leaves behind."""
    if outcome is not None:
        return outcome["status"] == "failed" and outcome.get("kind") in SIGNAL_ERRORS
    return fate is None or fate["end"] == "terminated" or fate.get("signal") in ("SIGTERM", "SIGINT", "SIGHUP",
                                                                                   "SIGKILL")


def _how(outcome: dict | None, fate: dict | None) -> str:
    """One line on how a process ended."""
    end = describe_end(outcome, fate)
    if end is None:
        return "died without a word (no outcome, no sentinel record)"
    if outcome is not None and outcome["status"] in ("failed", "error"):
        scope = "stopped the job" if outcome["status"] == "error" else "failed"
        scope += " after finishing" if outcome.get("after_finish") else ""
    else:
        scope = ""
    step = f" at step {end['step']}" if end["step"] is not None and not end["injected"] else ""
    return f"{scope}{step}: {end['what']}" if scope else f"{end['what']}{step}"


def _report(summary: dict[str, Any], run_dir: Path, notes: list[str]) -> None:
    told = ", ".join(f"{v} {k}" for k, v in sorted(summary["counts"].items()))
    if summary["processes"]:
        print(f"[launch] {summary['processes']} processes: {told}; events in {run_dir}", flush=True)
    else:
        print(f"[launch] no process of the job left a word (events, outcome, sentinel record) in {run_dir}: "
              "none started, or mpiexec failed before them (see its output above)", flush=True)
    for d in summary["deaths"]:
        who = "parked spare" if d["role"] == "spare" else f"logical rank {d['logical']}"
        print(f"[launch]   pid {d['pid']} ({who}, generation {d['gen']}): {d['how']}", flush=True)
    for entry in summary["never_fired"]:
        print(f"[launch] warning: injection {entry} never fired (that rank, step or point was not reached)",
              flush=True)
    for note in notes:
        print(f"[launch] {note}", flush=True)
    if summary["finished"]:
        print("[launch] training finished", flush=True)
    elif summary["stopped_by"]:
        print(f"[launch] training did not finish: {summary['stopped_by']['kind']}: "
              f"{summary['stopped_by']['message']}", flush=True)
    else:
        print("[launch] training did not finish: no process finished it (see the deaths above)", flush=True)


# ---------------------------------------------------------------------------- arguments
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m elastic.launch", description=__doc__.splitlines()[0])
    parser.add_argument("-n", "--nprocs", type=int, help="active ranks (with --slurm: the allocation's "
                        "tasks minus --spares)")
    parser.add_argument("--slurm", action="store_true",
                        help="run on the Slurm allocation around this launcher: its nodes and task slots "
                             "(each node is a failure domain for the replicated store)")
    parser.add_argument("--host", help="hosts and their slots as mpirun takes them, e.g. nodea:4,nodeb:4")
    parser.add_argument("--simulate-nodes", type=int, metavar="N",
                        help="a test bed: N fake nodes on this machine (own hostname, own /dev/shm, TCP between "
                             "them; root); ranks fill them in order; inject nodeK@STEP to kill node K")
    parser.add_argument("--hostfile", type=Path, help="hosts as mpirun reads them: one per line, 'host slots=N' "
                        "(or host:N)")
    parser.add_argument("--spare-nodes", type=int, default=0, metavar="K",
                        help="whole nodes held back for a relaunch after a node's loss (the last K hosts; with "
                             "--simulate-nodes, K more fake nodes)")
    parser.add_argument("--relaunches", type=int, default=None,
                        help="relaunches from the nodes' memory when the runtime ends unfinished (a node lost); "
                             "default 2 when the job spans hosts, else 0 (0: off, no node memory kept)")
    parser.add_argument("--spares", type=int, default=0, help="hot spare ranks launched on top of -n")
    parser.add_argument("--rebuild", help="rebuild modes in order, e.g. spare,shrink or spawn")
    parser.add_argument("--min-size", type=int, help="fewest active ranks to continue with")
    parser.add_argument("--inject", help="fault schedule, e.g. 1@10 or 1@5,2@10/g1 (see elastic.comm)")
    parser.add_argument("--hang-timeout", type=float,
                        help="seconds without a heartbeat before a rank counts as hung and is killed "
                             f"(the heartbeat needs no MPI call from your code; default {Config.hang_timeout:g}, "
                             "0 = off)")
    parser.add_argument("--progress-timeout", type=float,
                        help="seconds an active rank may go without progress (a step, a commit) before it is "
                             "killed: catches deadlocks and stuck reads (default 0 = off; set it above your "
                             "longest step)")
    parser.add_argument("--timeout", type=float, default=None, help="seconds before the whole job is killed "
                        "(exit 124; default: none)")
    parser.add_argument("--grace", type=float, default=10.0,
                        help="seconds the ranks get to leave after SIGTERM / SIGINT before they are killed")
    parser.add_argument("--run-dir", type=Path, help="events and outcome files (default elastic-run/<time>)")
    parser.add_argument("--detector", action="store_true",
                        help="Open MPI's heartbeat failure detector as well (declares a rank that is silent in "
                             "MPI for 2 s dead, so long computations between MPI calls are not allowed)")
    parser.add_argument("--oversubscribe", action="store_true", help="force --oversubscribe")
    parser.add_argument("--mca", nargs=2, action="append", default=[], metavar=("KEY", "VALUE"))
    parser.add_argument("--mpiexec", help="mpiexec to use (default: the one on PATH)")
    talk = parser.add_mutually_exclusive_group()
    talk.add_argument("--quiet", action="store_true",
                      help="no progress lines, no command echo: warnings, the deaths and the verdict only")
    talk.add_argument("--verbose", action="store_true", help="log every event of every process as it happens")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- program and its arguments")
    args = parser.parse_args(argv)
    if args.command and args.command[0] == "--":
        args.command = args.command[1:]
    if not args.command:
        parser.error("give the program after --, e.g. -- python examples/jacobi.py")
    if not shutil.which(args.command[0]):
        parser.error(f"the program {args.command[0]!r} is not an executable file here or on PATH: no process "
                     "could start it")
    if sum(map(bool, (args.slurm, args.host, args.hostfile, args.simulate_nodes))) > 1:
        parser.error("give one of --slurm (the allocation's hosts), --host, --hostfile and --simulate-nodes")
    args.hosts = slurm_allocation() if args.slurm else _hosts(args.host, parser) if args.host else \
        _hostfile(args.hostfile, parser) if args.hostfile else []
    if args.spare_nodes < 0 or (args.spare_nodes and not args.simulate_nodes and args.spare_nodes >= len(args.hosts)):
        parser.error(f"--spare-nodes {args.spare_nodes}: give fewer than the {len(args.hosts)} hosts (the last K of "
                     "them are held back), or use --simulate-nodes")
    args.spare_hosts = [h for h, _ in args.hosts[len(args.hosts) - args.spare_nodes:]] if args.spare_nodes and \
        not args.simulate_nodes else []
    args.hosts = args.hosts[:len(args.hosts) - len(args.spare_hosts)]
    if args.nprocs is None:
        if not args.slurm:
            parser.error("give -n (active ranks), or --slurm to size the job from the allocation")
        args.nprocs = sum(n for _, n in args.hosts) - args.spares
    if args.nprocs < 1 or args.spares < 0:
        parser.error("-n must be >= 1 and --spares >= 0")
    if args.simulate_nodes is not None:
        if args.simulate_nodes < 1:
            parser.error("--simulate-nodes must be >= 1")
        try:
            _nodes.check_can_simulate()
        except ConfigError as exc:
            parser.error(str(exc))
        args.hosts = _nodes.simulated_hosts(args.simulate_nodes, args.nprocs + args.spares)
        args.spare_hosts = [_nodes.node_name(args.simulate_nodes + i) for i in range(args.spare_nodes)]
    if args.relaunches is None:
        args.relaunches = 2 if len(args.hosts) > 1 else 0
    if args.relaunches < 0:
        parser.error("--relaunches must be >= 0")
    args.placement = _nodes.Placement.first(args.hosts or [(socket.gethostname(), args.nprocs + args.spares)],
                                            args.nprocs, args.spares)
    args.inject_text = args.inject
    try:
        args.inject = _nodes.node_injections(args.inject, args.placement.ranks_on(), args.spare_hosts) \
            if args.simulate_nodes else args.inject
    except ConfigError as exc:
        parser.error(str(exc))
    if args.grace < 0:
        parser.error("--grace must be >= 0 seconds")
    if args.timeout is not None and args.timeout <= 0:
        parser.error("--timeout must be > 0 seconds (leave it out for no timeout)")
    if args.run_dir is None:
        args.run_dir = Path("elastic-run") / time.strftime("%Y%m%d-%H%M%S")
    try:
        args.config = Config.from_env(spares=args.spares, rebuild=args.rebuild, min_size=args.min_size,
                                      inject=args.inject, hang_timeout=args.hang_timeout,
                                      progress_timeout=args.progress_timeout, term_grace=args.grace,
                                      run_dir=str(args.run_dir),
                                      log_level="WARNING" if args.quiet else "DEBUG" if args.verbose else None)
        _validate(args)
    except ConfigError as exc:
        parser.error(str(exc))
    args.job = f"elastic-{uuid.uuid4().hex[:12]}"  # names the node memory of this job, and only this job's
    if args.relaunches:
        args.config = args.config.replace(node_store=f"/dev/shm/{args.job}")
    return args


def _hosts(text: str, parser: argparse.ArgumentParser) -> list[tuple[str, int]]:
    hosts = []
    for item in text.split(","):
        name, _, slots = item.strip().partition(":")
        if not name or (slots and not slots.isdigit()):
            parser.error(f"--host {text!r}: write host:slots,host:slots (e.g. nodea:4,nodeb:4)")
        hosts.append((name, int(slots or 1)))
    return hosts


def _hostfile(path: Path, parser: argparse.ArgumentParser) -> list[tuple[str, int]]:
    try:
        lines = path.read_text().splitlines()
    except OSError as exc:
        parser.error(f"--hostfile {path}: {exc.strerror}")
    hosts = []
    for line in lines:
        words = line.split("#", 1)[0].split()
        if not words:
            continue
        name, _, slots = words[0].partition(":")
        for word in words[1:]:
            key, _, value = word.partition("=")
            if key == "slots":
                slots = value
        if not slots.isdigit() and slots:
            parser.error(f"--hostfile {path}: {line.strip()!r}: write 'host slots=N' or 'host:N'")
        hosts.append((name, int(slots or 1)))
    if not hosts:
        parser.error(f"--hostfile {path} names no host")
    return hosts


def _validate(args: argparse.Namespace) -> None:
    """Refuse, before anything starts, what the ranks would refuse or silently ignore."""
    from elastic.recovery import Policy
    config = args.config
    policy = Policy.from_config(config)
    for entry in config.inject:
        if entry.point == "park":
            if entry.rank >= config.spares:
                raise ConfigError(f"injection s{entry.rank}@park: there are {config.spares} spares (s0 is the first)")
        elif entry.rank >= args.nprocs:
            raise ConfigError(f"injection {entry.to_dict()}: logical rank {entry.rank} does not exist with "
                              f"-n {args.nprocs} (ranks 0..{args.nprocs - 1})")
        if entry.action == "node" and not args.simulate_nodes:
            raise ConfigError(f"injection {entry.to_dict()} kills a whole node: only simulated nodes "
                              "(--simulate-nodes N, then nodeK@STEP) are killed this way")
        if entry.action == "hang" and not config.hang_timeout and not args.detector:
            raise ConfigError(f"injection {entry.to_dict()} hangs a rank, but --hang-timeout 0 turned the "
                              "heartbeat off and --detector is not on: nothing would ever notice it")
        if entry.action == "stall" and not config.progress_timeout:
            raise ConfigError(f"injection {entry.to_dict()} stalls a rank (alive, no progress): only "
                              "--progress-timeout notices that; set it")
        if entry.point == "spawn" and "spawn" not in policy.modes:
            raise ConfigError(f"injection {entry.to_dict()} fires during a spawn, but --rebuild "
                              f"{','.join(policy.modes)} never spawns")


# ---------------------------------------------------------------------------- running
class _Output(threading.Thread):
    """Copies one of mpiexec's streams through, line by line, dropping Open MPI's failure noise."""

    def __init__(self, source: IO[bytes], sink: Any) -> None:
        super().__init__(daemon=True)
        self.source, self.sink, self.hidden = source, sink, 0
        self.lost_nodes: list[str] = []

    def run(self) -> None:
        after_noise = False
        for line in iter(self.source.readline, b""):
            if line.startswith(_NOISE) or (after_noise and not line.strip()):  # the notice ends in a blank line
                self.hidden += bool(line.strip())
                after_noise = True
                continue
            after_noise = False
            lost = _LOST_NODE.search(line)
            if lost:
                self.lost_nodes.append(lost.group(1).decode(errors="replace"))
            self.sink.buffer.write(line.replace(b"\0", b""))  # prterun's stream can carry a stray NUL
            self.sink.flush()


def _session_processes(sid: int, states: str = "") -> list[int]:
    """Pids of the live processes still in session ``sid`` (this host only; zombies are already dead);
    ``states``: only those in one of these states (``"Tt"``: stopped)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != sid:
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[3]) == sid and fields[0] != "Z" and (not states or fields[0] in states):
                pids.append(int(entry.name))  # state, then (after ppid, pgrp) the session
    return pids


def _is_sentinel(pid: int) -> bool:
    try:
        return b"elastic.comm._sentinel" in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False


class _Attempt:
    """One mpiexec run of the job, watched to its end (local)."""

    def __init__(self, args: argparse.Namespace, cmd: list[str], env: dict[str, str]) -> None:
        self.args = args
        self.stopping: list[float] = []  # when the job was told to stop (a signal, the timeout)
        self.leftovers: list[int] = []
        self.stopped_since: dict[int, float] = {}  # sentinels seen stopped (SIGSTOP), since when
        self.killed_stopped: list[int] = []
        self.swept = 0.0
        self.proc = subprocess.Popen(cmd, env={**os.environ, **env}, start_new_session=True,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        self.outputs = [_Output(self.proc.stdout, sys.stdout), _Output(self.proc.stderr, sys.stderr)]  # type: ignore
        for output in self.outputs:
            output.start()

    def stop(self, why: str) -> None:
        if not self.stopping:
            print(f"\n[launch] {why}: stopping the job ({self.args.grace:g} s grace)", file=sys.stderr, flush=True)
            self.stopping.append(time.monotonic())
            self.proc.send_signal(signal.SIGTERM)  # mpiexec passes it on to every rank's sentinel

    def wait(self, deadline: float | None) -> None:
        """Until mpiexec ends (or the grace after a stop runs out), then nothing it started lives on."""
        proc = self.proc
        while proc.poll() is None:
            now = time.monotonic()
            if deadline is not None and now > deadline:
                self.stop(f"TIMED OUT after {self.args.timeout:g} s")
            if self.stopping and now - self.stopping[0] > self.args.grace:
                break
            if now - self.swept > SWEEP_SECONDS:
                self.swept = now
                self._sweep_stopped_sentinels(now)
            time.sleep(0.1)
        # Nothing the job started outlives it: mpiexec, its daemons, the ranks, spawned ones, orphans.
        # Sentinels may still be writing down how their rank ended when mpiexec is gone: a moment for them.
        settle = time.monotonic() + LEFTOVER_SECONDS
        while _session_processes(proc.pid) and time.monotonic() < settle and proc.poll() is not None:
            time.sleep(0.05)
        self.leftovers = _session_processes(proc.pid) + ([proc.pid] if proc.poll() is None else [])
        for pid in self.leftovers:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        proc.wait()
        for output in self.outputs:
            output.join(timeout=5)

    def _sweep_stopped_sentinels(self, now: float) -> None:
        """Kill a sentinel stopped for twice the hang bound (this host). Its rank kills it after the
        bound while the rank lives; a sentinel stopped after its rank ended has nobody else to free
        mpiexec from it, and a job that finished would otherwise never end."""
        bound = 2 * (self.args.config.hang_timeout or STOPPED_SENTINEL_SECONDS)
        stopped = {pid for pid in _session_processes(self.proc.pid, "Tt") if _is_sentinel(pid)}
        self.stopped_since = {pid: self.stopped_since.get(pid, now) for pid in stopped}
        for pid, since in self.stopped_since.items():
            if now - since > bound:
                print(f"[launch] the sentinel pid {pid} has been stopped for {now - since:.0f} s: killed",
                      file=sys.stderr, flush=True)
                self.killed_stopped.append(pid)
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)

    @property
    def lost_nodes(self) -> set[str]:
        return {node for output in self.outputs for node in output.lost_nodes}

    @property
    def hidden(self) -> int:
        return sum(output.hidden for output in self.outputs)


def _next_placement(args: argparse.Namespace, previous: _nodes.Placement, live_on: dict[int, str], lost: set[str],
                    spare_hosts: list[str], config: Config, count: int, generation: int, committed: bool
                    ) -> tuple[_nodes.Placement, Relaunch, list[str], set[str]]:
    """The relaunch's placement (``_nodes.replan``) on hosts that answer a probe (real hosts; a
    simulated node's loss is known): a host that does not is lost too, and the plan made again.
    Returns the placement, the Relaunch, the spare nodes left and the hosts the probe found dead."""
    probed: set[str] = set()
    agent = next((shlex.split(v) for k, v in args.mca if k == "plm_rsh_agent"),
                 ["ssh", "-o", "BatchMode=yes", "-o", "ConnectTimeout=10"])
    while True:
        spares = [h for h in spare_hosts if h not in probed]
        placement, relaunch, left = _nodes.replan(previous, live_on, lost | probed, spares, config, count, generation,
                                                  args.nprocs, committed)
        if args.simulate_nodes or len(args.hosts) + len(args.spare_hosts) < 2:
            return placement, relaunch, left, probed
        dead = _nodes.unreachable([h for h, _ in placement.hosts], slurm=args.slurm, agent=agent)
        if not dead:
            return placement, relaunch, left, probed
        print(f"[launch] {', '.join(sorted(dead))} did not answer (the probe): counted as lost", flush=True)
        probed |= dead


def _pids(run_dir: Path) -> set[int]:
    """Every process that left a file in the run directory."""
    return {int(m.group(1)) for p in run_dir.glob("*-*") for m in [re.search(r"-(\d+)\.jsonl?$", p.name)] if m}


def main(argv: list[str] | None = None) -> int:
    keep_mpi_uninitialized()  # a tool: nothing it reads starts MPI here (importing this module changes nothing)
    args = parse_args(argv)
    args.run_dir.mkdir(parents=True, exist_ok=True)
    for stale in [p for pattern in ("outcome-*.json", "events-*.jsonl", "fate-*.json", "summary.json")
                  for p in args.run_dir.glob(pattern)]:
        stale.unlink()
    memory = Path("/dev/shm") / f"{args.job}-nodes"  # the simulated nodes' memory
    if args.simulate_nodes:
        args.agent = _nodes.write_agent(args.run_dir, memory)
    attempt: _Attempt | None = None
    got: list[int] = []

    def on_signal(sig: int, _frame: Any) -> None:
        got.append(sig)
        if attempt is not None:
            attempt.stop(f"got {signal.Signals(sig).name}")

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)}
    deadline = None if args.timeout is None else time.monotonic() + args.timeout
    placement, config, spare_hosts = args.placement, args.config, list(args.spare_hosts)
    notes: list[str] = []
    hidden, leftovers, relaunches, lost_all = 0, 0, 0, set()
    launches: list[dict[str, float]] = []  # wall-clock times of each mpiexec: started, gone
    try:
        while True:
            before = _pids(args.run_dir)
            hosts = placement.counts() if args.hosts else None
            cmd = build_command(args, len(placement.table), hosts if relaunches or args.simulate_nodes else None)
            if not args.quiet:
                print(f"[launch] {' '.join(cmd)}", flush=True)
            launches.append({"launched": time.time()})
            attempt = _Attempt(args, cmd, {**config.to_env(), "PYTHONUNBUFFERED": "1"})
            if got:
                attempt.stop(f"got {signal.Signals(got[0]).name}")
            attempt.wait(deadline)
            launches[-1]["ended"] = time.time()
            hidden += attempt.hidden
            leftovers += len(attempt.leftovers) if not attempt.stopping else 0
            mine = _pids(args.run_dir) - before
            this = summarize(args.run_dir, config.inject, mine)
            lost = attempt.lost_nodes | {o["host"] for o in this["outcomes"] if o["status"] == "injected-node"}
            lost_all |= lost
            if args.simulate_nodes:
                for node in lost:  # its memory goes with it
                    shutil.rmtree(memory / node, ignore_errors=True)
            if this["finished"] or attempt.stopping or this["stopped_by"] or not args.relaunches:
                break
            if relaunches >= args.relaunches:
                notes.append(f"the job ended unfinished and its {args.relaunches} relaunch(es) (--relaunches) are "
                             "used up")
                break
            relaunches += 1
            events = read_events(args.run_dir)
            generation, live_on, host_of = _nodes.where_ranks_live(args.run_dir, mine)
            try:
                placement, relaunch, spare_hosts, probed = _next_placement(
                    args, placement, live_on, lost, spare_hosts, config, relaunches, generation + 1,
                    any(e["event"] == "committed" for e in events))
                lost_all |= probed
                inject = _nodes.pending_injections(args.inject_text, [e for e in events if e["event"] == "inject"],
                                                   lost_all, host_of)
                if args.simulate_nodes:
                    inject = _nodes.node_injections(inject, placement.ranks_on(), spare_hosts)
                # What did not fire yet fires in the relaunch, its generations counted from the relaunch's start.
                pending = tuple(dataclasses.replace(e, gen=e.gen + relaunch.generation)
                                for e in (parse_schedule(inject) if inject else ()))
                config = config.replace(relaunch=relaunch, spares=placement.table.count(_nodes.SPARE), inject=pending)
            except (_nodes.GiveUp, ConfigError) as exc:
                notes.append(f"no relaunch: {exc}")
                break
            what = f"node(s) {', '.join(sorted(lost))} lost" if lost else "the runtime ended unfinished"
            moved = (f"; logical ranks {list(relaunch.replaced)} on spare node(s)" if relaunch.replaced else "") + \
                (f"; logical ranks {list(relaunch.removed)} removed (shrink)" if relaunch.removed else "")
            print(f"[launch] {what}: relaunch {relaunches} of {args.relaunches} on "
                  f"{', '.join(h for h, _ in placement.hosts)} from the nodes' memory{moved}", flush=True)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if args.simulate_nodes:
            shutil.rmtree(memory, ignore_errors=True)
        elif not args.hosts:  # this machine is the job's only node: its memory is this launcher's to free
            shutil.rmtree(Path("/dev/shm") / args.job, ignore_errors=True)
    assert attempt is not None
    timed_out = bool(attempt.stopping) and not got
    stopped = signal.Signals(got[0]).name if got else "timeout" if timed_out else None
    summary = summarize(args.run_dir, config.inject, stopped=stopped)  # what the last launch still owed
    if timed_out:
        rc = 124
        notes.append(f"TIMED OUT after {args.timeout:g} s")
    elif got:
        rc = 128 + got[0]
        notes.append(f"stopped by {signal.Signals(got[0]).name}")
    else:
        rc = 0 if summary["finished"] else 1
    if hidden:
        notes.append(f"({hidden} 'NBC_Progress' lines of Open MPI hidden: non-blocking collectives interrupted "
                     "by a failure, expected)")
    if lost_all and not relaunches:
        notes.append(f"node(s) {', '.join(sorted(lost_all))} lost with every process on them: Open MPI 5.0's runtime "
                     "ends the whole job when a node's daemon dies, and the state in memory goes with it "
                     + ("(--relaunches 0: no relaunch from the other nodes' memory)" if not args.relaunches else ""))
    if relaunches:
        notes.append(f"{relaunches} relaunch(es) from the nodes' memory (nodes lost: "
                     f"{', '.join(sorted(lost_all)) or 'none'})")
    if leftovers:
        notes.append(f"killed {leftovers} processes left behind by the job")
    if args.relaunches and rc and args.hosts and not args.simulate_nodes:
        notes.append(f"node memory of this job may be left in /dev/shm/{args.job} on the hosts: remove it there")
    _report(summary, args.run_dir, notes)
    summary.update({"ok": rc == 0, "rc": rc, "timed_out": timed_out, "mpiexec_rc": attempt.proc.returncode,
                    "signal": signal.Signals(got[0]).name if got else None, "relaunches": relaunches,
                    "launches": launches, "lost_nodes": sorted(lost_all), "job": args.job})
    (args.run_dir / "summary.json").write_text(json.dumps(summary, indent=1, default=str))
    return rc


if __name__ == "__main__":
    sys.exit(main())

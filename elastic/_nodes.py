"""Nodes for the launcher: several hosts, and a multi-node test bed on one machine.

``--simulate-nodes N`` starts N fake nodes on this machine through Open MPI's
ssh launcher: its agent (written into the run directory) runs each node's
daemon under ``unshare --uts --mount`` with the node's hostname and a fresh
tmpfs on ``/dev/shm``, so ranks on different fake nodes talk over TCP, see
different hostnames (the store's failure domains) and lose their shared
memory with the node. Ranks fill the nodes in order, ``slots`` per node.
``nodeK@WHERE`` injections become ``R@WHERE:node`` on the first active
logical rank R of node K, which kills the node: its daemon, every process
under it, its memory. Needs root (``unshare``, ``mount``).
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

from elastic.comm import ConfigError

# Across nodes Open MPI picks its hierarchical collectives (coll/han), which crash after a process
# failure; the flat ones survive it. Tier 1 (ULFM) across nodes needs this.
MULTI_NODE_MCA = (("coll", "^han"),)

AGENT = """#!/bin/sh
# Open MPI's ssh agent for simulated nodes (written by elastic.launch): AGENT [options] HOST COMMAND
while [ "${1#-}" != "$1" ]; do shift; done
host=$1; shift
exec unshare --uts --mount sh -c \\
  'hostname "$0" && mount -t tmpfs -o mode=1777 tmpfs /dev/shm && eval "$1"' "$host" "$*"
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


def write_agent(run_dir: Path) -> Path:
    path = run_dir / "node-agent.sh"
    path.write_text(AGENT)
    path.chmod(0o700)
    return path


def node_injections(text: str | None, hosts: list[tuple[str, int]], nprocs: int) -> str | None:
    """``nodeK@WHERE[/gG]`` entries of a compact schedule as ``R@WHERE:node[/gG]``, R the first
    active logical rank on node K; other entries unchanged.

    Raises:
        ConfigError: node K does not exist or holds no active rank.
    """
    if not text or text.strip().startswith("[") or "node" not in text:
        return text
    out = []
    for item in text.split(","):
        match = re.fullmatch(r"\s*node(\d+)@([^:/]+)(/g\d+)?\s*", item)
        if not match:
            out.append(item)
            continue
        index, where, gen = int(match.group(1)), match.group(2), match.group(3) or ""
        first = sum(slots for _, slots in hosts[:index])
        if index >= len(hosts) or first >= nprocs:
            raise ConfigError(f"injection {item.strip()!r}: there are {len(hosts)} nodes (node0..node{len(hosts) - 1})"
                              f" and node{index} holds no active rank")
        out.append(f"{first}@{where}:node{gen}")
    return ",".join(out)

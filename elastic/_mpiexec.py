"""The mpiexec command of a launch: Open MPI's options for this machine, the hosts and the plan (local).

Every rank runs under a sentinel (``elastic.comm._sentinel``), started with the
launcher's Python; the job's configuration travels in the environment.
"""
from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

from elastic.comm import Config

from . import _nodes
from ._plan import LaunchPlan
from ._settings import Training

DETECTOR_MCA = (("mpi_ft_detector", "true"), ("mpi_ft_detector_period", "0.5"), ("mpi_ft_detector_timeout", "2"))


def build_command(plan: LaunchPlan, nprocs: int, hosts: list[tuple[str, int]] | None = None,
                  agent: Path | None = None) -> list[str]:
    """The mpiexec command line for this machine (root, core count, Slurm allocation) and the plan;
    ``hosts``: (host, processes) of this launch, filled in order (default: the hosts' slots);
    ``agent``: what starts the simulated nodes' daemons."""
    mpiexec = plan.mpiexec or shutil.which("mpiexec") or "mpiexec"
    cmd = [mpiexec, "--with-ft", "ulfm", "-n", str(nprocs)]
    slots = os.cpu_count() or 1
    if hosts is not None:
        cmd += ["--host", ",".join(f"{h}:{n}" for h, n in hosts), "--map-by", "slot"]  # as the table says
        slots = nprocs
    elif plan.hosts:
        cmd += ["--host", ",".join(f"{h}:{n}" for h, n in plan.hosts)]
        slots = sum(n for _, n in plan.hosts)
    many = len(hosts if hosts is not None else plan.hosts) > 1
    if plan.simulate_nodes:
        cmd += ["--mca", "plm_rsh_agent", str(agent)]
    if os.geteuid() == 0:
        cmd.append("--allow-run-as-root")
    # PRRTE does not give a dead process's slot to a spawned one: with every slot taken, Spawn fails
    # (MPI_ERR_UNKNOWN). Across hosts the launcher fills every slot itself, so it lets a replacement
    # take the dead one's core; on one host given full, the rebuild falls through to the next mode.
    if plan.oversubscribe or nprocs > slots or ("spawn" in plan.config.rebuild and many):
        cmd.append("--oversubscribe")
    if nprocs > (os.cpu_count() or 1):
        cmd += ["--bind-to", "none"]  # more processes than cores (slots can exceed them under Slurm)
    for key, value in _mca(plan, many, _crowded(plan, nprocs, hosts)):
        cmd += ["--mca", key, value]
    for name in sorted(job_env(plan.config, plan.training, omp_threads(plan))):
        cmd += ["-x", name]
    # The sentinel runs with this launcher's Python; the program with whatever the command names.
    return cmd + [sys.executable, "-m", "elastic.comm._sentinel", "--"] + list(plan.command)


def _crowded(plan: LaunchPlan, nprocs: int, hosts: list[tuple[str, int]] | None) -> bool:
    """More processes on one machine than it has cores: simulated nodes (all on this machine, each
    claiming slots it does not have), or the busiest host (hosts assumed alike: this one's cores)."""
    counts = [n for _, n in (hosts if hosts is not None else plan.hosts)] or [nprocs]
    on_one = sum(counts) if plan.simulate_nodes else max(counts)
    return on_one > (os.cpu_count() or 1)


def _mca(plan: LaunchPlan, many_hosts: bool, crowded: bool = False) -> list[tuple[str, str]]:
    """The MCA parameters of a launch: the project's, then the user's (``--mca``, last: they win).
    ``crowded``: a rank waiting in MPI yields its core (``_crowded``): spinning, it took the core
    from the peer it waited for, and the TCP between simulated nodes moved a tier-2 fetch at a
    quarter of the rate (0.23 against 0.85 GB/s, 4 senders to 2 receivers, 6 ranks on 2 cores)."""
    params = list(_nodes.MULTI_NODE_MCA) if many_hosts else []
    if crowded:
        params.append(("mpi_yield_when_idle", "1"))
    if plan.detector:
        params += DETECTOR_MCA
    if (not plan.hosts or plan.simulate_nodes) and not any(k == "btl" for k, _ in plan.mca) \
            and "OMPI_MCA_btl" not in os.environ:
        # One machine: shared memory and TCP carry everything. The libfabric BTL only probes its
        # providers, most of every process's MPI_Init (a spawned replacement's too).
        params.append(("btl", "^ofi"))
    return params + list(plan.mca)


def job_env(config: Config, training: Training, threads: int | None = None) -> dict[str, str]:
    """What every process of the job gets in its environment: the whole configuration, comm's and
    the training layer's (to other hosts too, through ``-x``), and ``OMP_NUM_THREADS`` when the
    launcher chose it (``omp_threads``)."""
    return {**config.to_env(), **training.to_env(), "PYTHONUNBUFFERED": "1",
            **({"OMP_NUM_THREADS": str(threads)} if threads is not None else {})}


def omp_threads(plan: LaunchPlan) -> int | None:
    """Threads for each process's OpenMP and BLAS pools, as torchrun sets them: this host's cores
    over the processes on the busiest host (at least 1), unless ``OMP_NUM_THREADS`` is set. Pools
    sized for the whole machine in every process spin against each other: on 2 cores, 4 ranks'
    numpy dot products took 8 ms instead of 10 us, and a small FSDP2 step 0.5 s instead of 35 ms."""
    if "OMP_NUM_THREADS" in os.environ:
        return None
    hosts = max(1, len(plan.hosts))
    per_host = -(-(plan.nprocs + plan.spares) // hosts)
    return max(1, (os.cpu_count() or 1) // per_host)

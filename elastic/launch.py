"""Launch a job under ``mpiexec --with-ft ulfm`` and report what each process did.

    python -m elastic.launch -n 4 --spares 1 --inject 1@10 -- python examples/jacobi.py
    python -m elastic.launch --slurm --spares 1 -- python examples/train.py   # inside sbatch / salloc

ULFM's mpiexec exit status says nothing about which ranks died on purpose, so
every process writes an outcome file and this launcher decides from those:
exit 0 when the job finished and every death was an injected one, 1 when a
process died unexpectedly or none finished, 124 when the job timed out.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from elastic.comm import read_outcomes

_EXPECTED_END = ("finished", "spare-unused")
DETECTOR_MCA = (("mpi_ft_detector", "true"), ("mpi_ft_detector_period", "0.5"), ("mpi_ft_detector_timeout", "2"))


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


def build_command(args: argparse.Namespace, nprocs: int) -> list[str]:
    """The mpiexec command line for this machine (root, core count, Slurm allocation) and options."""
    mpiexec = args.mpiexec or shutil.which("mpiexec") or "mpiexec"
    cmd = [mpiexec, "--with-ft", "ulfm", "-n", str(nprocs)]
    slots = os.cpu_count() or 1
    if args.hosts:
        cmd += ["--host", ",".join(f"{h}:{n}" for h, n in args.hosts)]
        slots = sum(n for _, n in args.hosts)
    if os.geteuid() == 0:
        cmd.append("--allow-run-as-root")
    if args.oversubscribe or nprocs > slots:
        cmd.append("--oversubscribe")
    if nprocs > (os.cpu_count() or 1):
        cmd += ["--bind-to", "none"]  # more processes than cores (slots can exceed them under Slurm)
    if args.detector:
        for key, value in DETECTOR_MCA:
            cmd += ["--mca", key, value]
    for key, value in args.mca:
        cmd += ["--mca", key, value]
    for name in sorted(_job_env(args)):
        cmd += ["-x", name]
    return cmd + args.command


def _job_env(args: argparse.Namespace) -> dict[str, str]:
    # Every ELASTIC_* setting of the caller travels with the job (on other hosts too, through -x).
    env = {k: v for k, v in os.environ.items() if k.startswith("ELASTIC_")}
    env.update({"ELASTIC_RUN_DIR": str(args.run_dir), "ELASTIC_SPARES": str(args.spares), "PYTHONUNBUFFERED": "1"})
    if args.rebuild:
        env["ELASTIC_REBUILD"] = args.rebuild
    if args.inject:
        env["ELASTIC_INJECT"] = args.inject
    if args.min_size:
        env["ELASTIC_MIN_SIZE"] = str(args.min_size)
    return env


def summarize(run_dir: Path) -> tuple[bool, list[dict], list[str]]:
    """(job ok, outcomes, pids that died without a word) from a run directory."""
    outcomes = read_outcomes(run_dir)
    spoke = {str(o["pid"]) for o in outcomes}
    silent = sorted(p.stem.rsplit("-", 1)[-1] for p in run_dir.glob("events-*.jsonl")
                    if p.stem.rsplit("-", 1)[-1] not in spoke)
    unexpected = [o for o in outcomes if o["status"] not in _EXPECTED_END and not o["status"].startswith("injected")]
    finished = [o for o in outcomes if o["status"] == "finished"]
    return bool(finished) and not silent and not unexpected, outcomes, silent


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m elastic.launch", description=__doc__.splitlines()[0])
    parser.add_argument("-n", "--nprocs", type=int, help="active ranks (with --slurm: the allocation's "
                        "tasks minus --spares)")
    parser.add_argument("--slurm", action="store_true",
                        help="run on the Slurm allocation around this launcher: its nodes and task slots "
                             "(each node is a failure domain for the replicated store)")
    parser.add_argument("--spares", type=int, default=0, help="hot spare ranks launched on top of -n")
    parser.add_argument("--rebuild", help="rebuild modes in order, e.g. spare,shrink or spawn")
    parser.add_argument("--min-size", type=int, help="fewest active ranks to continue with")
    parser.add_argument("--inject", help="fault schedule, e.g. 1@10 or 1@5,2@10/g1 (see elastic.comm)")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds before the whole job is killed")
    parser.add_argument("--run-dir", type=Path, help="events and outcome files (default elastic-run/<time>)")
    parser.add_argument("--detector", action="store_true",
                        help="heartbeat failure detector: finds hung ranks and ranks that exit non-zero (~2 s)")
    parser.add_argument("--oversubscribe", action="store_true", help="force --oversubscribe")
    parser.add_argument("--mca", nargs=2, action="append", default=[], metavar=("KEY", "VALUE"))
    parser.add_argument("--mpiexec", help="mpiexec to use (default: the one on PATH)")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- program and its arguments")
    args = parser.parse_args(argv)
    if args.command and args.command[0] == "--":
        args.command = args.command[1:]
    if not args.command:
        parser.error("give the program after --, e.g. -- python examples/jacobi.py")
    args.hosts = slurm_allocation() if args.slurm else []
    if args.nprocs is None:
        if not args.slurm:
            parser.error("give -n (active ranks), or --slurm to size the job from the allocation")
        args.nprocs = sum(n for _, n in args.hosts) - args.spares
    if args.nprocs < 1 or args.spares < 0:
        parser.error("-n must be >= 1 and --spares >= 0")
    if args.run_dir is None:
        args.run_dir = Path("elastic-run") / time.strftime("%Y%m%d-%H%M%S")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.run_dir.mkdir(parents=True, exist_ok=True)
    for stale in list(args.run_dir.glob("outcome-*.json")) + list(args.run_dir.glob("events-*.jsonl")):
        stale.unlink()
    cmd = build_command(args, args.nprocs + args.spares)
    print(f"[launch] {' '.join(cmd)}", flush=True)
    proc = subprocess.Popen(cmd, env={**os.environ, **_job_env(args)}, start_new_session=True)
    timed_out = False
    try:
        proc.wait(timeout=args.timeout)
    except subprocess.TimeoutExpired:
        timed_out = True
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    except KeyboardInterrupt:
        os.killpg(proc.pid, signal.SIGKILL)
        raise
    ok, outcomes, silent = summarize(args.run_dir)
    counts: dict[str, int] = {}
    for o in outcomes:
        counts[o["status"]] = counts.get(o["status"], 0) + 1
    summary = {"ok": ok and not timed_out, "timed_out": timed_out, "mpiexec_rc": proc.returncode,
               "counts": counts, "silent_pids": silent, "outcomes": outcomes}
    (args.run_dir / "summary.json").write_text(json.dumps(summary, indent=1))
    told = ", ".join(f"{v} {k}" for k, v in sorted(counts.items()))
    print(f"[launch] {len(outcomes) + len(silent)} processes: {told}"
          + (f", {len(silent)} died unexpectedly (pids {', '.join(silent)})" if silent else "")
          + (f"; TIMED OUT after {args.timeout:.0f} s" if timed_out else "")
          + f"; events in {args.run_dir}", flush=True)
    if timed_out:
        return 124
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

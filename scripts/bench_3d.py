"""The torchtitan-shaped job (``examples/llama3d.py``, pp=2 x dp=2, torch's 1F1B schedule, FSDP2 as
HSDP): what the ``ulfm`` process group costs per step against torchrun + Gloo without fault
tolerance, its floor, and kill -> next step for a spare, in one run.

    python scripts/bench_3d.py [--reps 3] [--steps 24] [--json]

Rows (each mode alternated with the others, ``--reps`` times; median, mean and max):

* ``steps/s ulfm``: the example under ``python -m elastic.launch`` (no failure), steps 3.. per second;
* ``steps/s gloo``: the same program under ``torchrun`` with ``--plain`` (Gloo, no fault tolerance);
* ``p2p ulfm`` / ``p2p gloo`` (the floor): one step's pipeline transfers alone, two ranks, the
  example's activation shape, ``--microbatches`` sends one way and as many back (forward and
  backward), ms per step, on each group;
* ``down spare``: kill -> the next step done (``elastic.report``), logical rank 1 killed at step
  ``steps // 2``, a parked spare takes its slices from its twin;
* ``down dp spare``: the same for ``examples/ddp.py`` (torch DDP on the ``ulfm`` group, a spare);
* ``restart`` (a floor for a torchrun restart from a DCP checkpoint every 5 steps): the plain
  program's launch -> its first step, plus the steps since the checkpoint at its step time; no
  teardown, no checkpoint I/O counted.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
CHECKPOINT_EVERY = 5
SHAPE = (2, 16, 32)  # the example's micro-batch activation: batch 16 / 2 replicas / 4 micro-batches, seq, dim


def run(cmd: list[str], env: dict[str, str] | None = None) -> tuple[float, str]:
    """(the wall time it was started at, its output); a failure stops the benchmark, saying why."""
    started = time.time()
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})})
    if proc.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return started, proc.stdout + proc.stderr


def elastic(run_dir: Path, n: int, launcher: list[str], program: list[str]) -> tuple[float, str]:
    return run([sys.executable, "-m", "elastic.launch", "-n", str(n), "--timeout", "300", "--run-dir", str(run_dir),
                *launcher, "--", sys.executable, *program])


def torchrun(n: int, program: list[str]) -> tuple[float, str]:
    return run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(n), "--master-port",
                str(29500 + os.getpid() % 1000), *program])


def rate(output: str) -> float:
    return float(re.search(r"^rate ([0-9.]+) steps/s", output, re.M).group(1))  # type: ignore[union-attr]


def down(run_dir: Path) -> tuple[float, int]:
    from elastic.comm.events import read_events
    from elastic.report import timeline

    row = timeline(read_events(run_dir))[0]
    return row["down"] / 1e3, row["redone"]


def p2p_child(backend: str, transfers: int, reps: int) -> int:
    """Two ranks: ``transfers`` activations 0 -> 1, then as many gradients 1 -> 0, per step (the
    pipeline's transfers alone); rank 0 prints ms per step."""
    import torch
    import torch.distributed as dist

    if backend == "ulfm":
        import elastic
        import elastic.distributed

        world = elastic.init()
        elastic.distributed.ProcessGroup(world).group  # noqa: B018
    else:
        dist.init_process_group("gloo")
    rank, peer = dist.get_rank(), 1 - dist.get_rank()
    out, back = torch.randn(*SHAPE), torch.empty(*SHAPE)
    times = []
    for _ in range(reps + 2):
        start = time.perf_counter()
        for direction in (0, 1):
            works = [dist.isend(out, peer) if rank == direction else dist.irecv(back, peer) for _ in range(transfers)]
            for w in works:
                w.wait()
        times.append(time.perf_counter() - start)
    if rank == 0:
        print(f"p2p_ms {1e3 * statistics.median(times[2:]):.4f}", flush=True)
    if backend == "ulfm":
        world.finish()
    else:
        dist.destroy_process_group()
    return 0


def summary(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "mean": statistics.fmean(values), "max": max(values),
            "runs": len(values)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--p2p-child", choices=("ulfm", "gloo"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.p2p_child:
        return p2p_child(args.p2p_child, 4, 50)
    kill = args.steps // 2
    program = ["examples/llama3d.py", "--pp", "2", "--dp", "2", "--schedule", "1f1b", "--steps", str(args.steps)]
    me = ["scripts/bench_3d.py"]
    got: dict[str, list[float]] = {name: [] for name in ("steps/s ulfm", "steps/s gloo", "p2p ulfm", "p2p gloo",
                                                          "down spare", "down dp spare", "restart")}
    with tempfile.TemporaryDirectory(prefix="bench-3d-") as tmp:
        for rep in range(args.reps):  # the modes alternate: a slow spell of the machine hits each alike
            got["steps/s ulfm"].append(rate(elastic(Path(tmp) / f"rate-{rep}", 4, [], program)[1]))
            started, output = torchrun(4, program + ["--plain"])
            got["steps/s gloo"].append(rate(output))
            first = float(re.search(r"^first_step_at ([0-9.]+)$", output, re.M).group(1))  # type: ignore[union-attr]
            step_s = 1 / got["steps/s gloo"][-1]
            got["restart"].append(first - started + (kill % CHECKPOINT_EVERY) * step_s)
            for backend in ("ulfm", "gloo"):
                output = elastic(Path(tmp) / f"p2p-{rep}", 2, [], me + ["--p2p-child", "ulfm"])[1] \
                    if backend == "ulfm" else torchrun(2, me + ["--p2p-child", "gloo"])[1]
                got[f"p2p {backend}"].append(float(re.search(r"^p2p_ms ([0-9.]+)", output, re.M).group(1)))  # type: ignore[union-attr]
            elastic(Path(tmp) / f"spare-{rep}", 4, ["--spares", "1", "--inject", f"1@{kill}"], program)
            got["down spare"].append(down(Path(tmp) / f"spare-{rep}")[0])
            elastic(Path(tmp) / f"ddp-{rep}", 4, ["--spares", "1", "--inject", f"1@{kill}"],
                    ["examples/ddp.py", "--steps", str(args.steps)])
            got["down dp spare"].append(down(Path(tmp) / f"ddp-{rep}")[0])
    rows = [{"case": name, "unit": "steps/s" if name.startswith("steps") else "ms" if name.startswith("p2p") else "s",
             **summary(values)} for name, values in got.items()]
    ratio = statistics.median(got["steps/s ulfm"]) / statistics.median(got["steps/s gloo"])
    floor = statistics.median(got["p2p ulfm"]) / statistics.median(got["p2p gloo"])
    spare = statistics.median(got["down spare"])
    rows.append({"case": "ratio", "ulfm_over_gloo_steps": ratio, "p2p_ulfm_over_gloo": floor,
                 "spare_over_dp_spare": spare / statistics.median(got["down dp spare"]),
                 "spare_over_restart": spare / statistics.median(got["restart"])})
    if args.json:
        for row in rows:
            print(json.dumps(row))
        return 0
    print(f"examples/llama3d.py pp=2 x dp=2, 1f1b, {args.steps} steps, kill at step {kill}; {args.reps} runs each, "
          "alternated")
    print(f"{'case':<14} {'median':>9} {'mean':>9} {'max':>9}  unit")
    for row in rows[:-1]:
        print(f"{row['case']:<14} {row['median']:>9.3f} {row['mean']:>9.3f} {row['max']:>9.3f}  {row['unit']}")
    print(f"steps/s ulfm / gloo {ratio:.2f}x; its floor, the transfers alone, ulfm / gloo time {floor:.2f}x; "
          f"spare down / dp spare {rows[-1]['spare_over_dp_spare']:.2f}x, / restart floor "
          f"{rows[-1]['spare_over_restart']:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())

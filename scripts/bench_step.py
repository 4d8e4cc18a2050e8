"""What a recovery point costs per training step: none, a commit every 1 or 10 steps, or the per-step point.

    python scripts/bench_step.py [--sizes 128] [--step-ms 200] [--ranks 4] [--steps 24] [--repeat 3] [--json]
    python scripts/bench_step.py --sizes 16 128 512 --step-ms 50 200 --layouts replicated,sharded

A data-parallel loop on numpy (no torch: the state's bytes are the whole story)
under mpiexec --with-ft ulfm, ``--ranks`` ranks and one spare. Each step: a
compute step of ``--step-ms`` (256x256 float32 matmuls, the count calibrated
once on rank 0 and used by every rank, so a slower step is a slower rank, not a
shorter loop), a 1 MB gradient all-reduce, and an update that changes the state.
The state per rank is ``--sizes`` MB, laid out (``layout``):

* ``replicated``: all of it a model every rank holds alike (data parallel), plus
  a rank's own random stream;
* ``sharded`` (ZeRO-1): a shared model of 2/3 of it and this rank's optimizer
  shard (two moments of the model / ranks), which only this rank has.

``mode``: ``none`` (no State: the loop alone), ``commit1`` / ``commit10``
(``state.commit()`` after every / every 10th step), ``step`` (``State(per_step=True)``:
``step_point()`` between the update of what is rank-unique, the shard, and the
update of what every rank holds, the model; its replication is synchronous).
Per row, from the median of ``--repeat`` failure-free runs alternated over
the modes (a slow spell of this shared machine lands on every mode alike):
steps/s (the median step of the last two thirds), ``blocked_fraction`` (the median time the loop spends
in the State's calls per step, over the median step, on the rank that gets
there last: the others' time there includes waiting for it), memory over the state
(RSS above what the process held before its state, steady after the run and at
its high-water mark; the state itself counts 1), and in a second run with a
SIGKILL of logical rank 1 at step ``steps // 2``, a spare taking over: kill ->
next step (s) and the steps done again (``lost``). ``vs none``: the row's
steps/s over the same size, step and layout without a State.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from elastic.comm.events import read_events  # noqa: E402  (no MPI here: the workers start it)
from elastic.report import timeline  # noqa: E402

MODES = ("none", "commit1", "commit10", "step")
LAYOUTS = ("replicated", "sharded")
MATMUL = 256


# ---------------------------------------------------------------------------- the worker (one rank)
def _rss() -> tuple[int, int]:
    """(resident, high-water mark) of this process, bytes."""
    fields = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines() if ":" in line)
    return int(fields["VmRSS"].split()[0]) << 10, int(fields["VmHWM"].split()[0]) << 10


def _calibrate(world: Any, a: np.ndarray, step_ms: float) -> int:
    """Matrix products for a step of ``step_ms``, timed on every rank at once (the contention of the
    steps), the slowest rank's count (collective)."""
    t, done = time.perf_counter(), 0
    while time.perf_counter() - t < 0.5:
        a @ a
        done += 1
    return max(1, round(min(world.allgather(done)) * step_ms / 1e3 / 0.5))


def _values(me: int, total: int, layout: str) -> dict[str, np.ndarray]:
    """A state of ``total`` bytes: a model every rank holds (all of it replicated; two thirds sharded,
    the rest this rank's optimizer shard: two float32 moments), and this rank's RNG."""
    model_bytes = total if layout == "replicated" else total * 2 // 3
    values: dict[str, np.ndarray] = {"w": np.full(model_bytes // 4, 0.5, np.float32),  # resident, not lazy zeros
                                     "rng": np.array([me + 1], np.int64)}
    if layout == "sharded":
        shard = (total - model_bytes) // 8
        values.update({f"opt.{me}.{k}": np.full(shard, 0.5, np.float32) for k in "mv"})
    return values


def worker(args: argparse.Namespace) -> int:
    import elastic

    world = elastic.init()
    me = int(world.logical_rank)
    a = np.random.default_rng(0).standard_normal((MATMUL, MATMUL), dtype=np.float32)
    # A replacement joins the survivors' recovery, not this: it gets the count with the shared values.
    matmuls = 0 if world.role is elastic.Role.RECOVERED else _calibrate(world, a, args.step_ms)
    base_rss = _rss()[0]
    values = _values(me, args.mb << 20, args.layout)
    state_bytes = sum(v.nbytes for v in values.values())
    grad = np.zeros(1 << 18, np.float32)  # 1 MB
    state = None
    if args.mode != "none":
        state = elastic.State(world, per_step=args.mode == "step", local=("rng", "opt"), step=0, matmuls=matmuls,
                              **values)
    every = {"commit1": 1, "commit10": 10}.get(args.mode, 0)
    blocked: list[float] = []
    seconds: list[float] = []

    def loop(world: elastic.World, state: elastic.State | None) -> None:
        v: Any = state if state is not None else argparse.Namespace(step=0, matmuls=matmuls, **values)
        value = values.__getitem__ if state is None else state.__getitem__
        while v.step < args.steps:
            t0 = time.perf_counter()
            world.fault_point(v.step)
            for _ in range(v.matmuls):
                a @ a
            v.rng = (v.rng * 1103515245 + 12345) % (1 << 31)  # this rank's draws
            grad[:] = float(v.rng[0] % 7)
            world.allreduce([grad], step=v.step)
            for name in [k for k in values if k.startswith("opt.")]:
                value(name)[:grad.size] += 1e-6  # the update of this rank's optimizer shard: before the point
            wait = 0.0
            if args.mode == "step":
                t = time.perf_counter()
                state.step_point()
                wait += time.perf_counter() - t
            v.w[:grad.size] += 1e-6 * grad  # the update of the model every rank holds: after it
            v.step += 1
            if state is not None:
                state.record_step(v.step)
                if every and v.step % every == 0:
                    t = time.perf_counter()
                    state.commit()
                    wait += time.perf_counter() - t
            blocked.append(wait)
            seconds.append(time.perf_counter() - t0)

    if state is None:
        loop(world, None)
        world.finish()
    else:
        elastic.run(loop)(world, state)
    rss, peak = _rss()
    keep = len(seconds) // 3
    step = statistics.median(seconds[keep:])
    world.events.emit("result", step_s=step, blocked_s=statistics.median(blocked[keep:]),
                      memory=(rss - base_rss) / state_bytes, peak=(peak - base_rss) / state_bytes,
                      state_bytes=state_bytes)
    return 0


# ---------------------------------------------------------------------------- the driver
def launch(run_dir: Path, ranks: int, inject: str, worker_args: list[str]) -> list[dict]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"}  # one core's worth per rank
    cmd = [sys.executable, "-m", "elastic.launch", "-n", str(ranks), "--spares", "1", "--quiet", "--timeout",
           "600", "--run-dir", str(run_dir), *(["--inject", inject] if inject else []), "--",
           sys.executable, str(Path(__file__).resolve()), "--worker", *worker_args]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=660)
    if proc.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return read_events(run_dir)


def clean_run(layout: str, mb: int, step_ms: float, mode: str, args: argparse.Namespace, run_dir: Path) -> dict:
    """One failure-free run: steps/s, blocking, memory."""
    worker_args = ["--layout", layout, "--mb", str(mb), "--step-ms", str(step_ms), "--mode", mode,
                   "--steps", str(args.steps)]
    results = [e for e in launch(run_dir, args.ranks, "", worker_args) if e["event"] == "result"]
    return {"steps_per_s": 1 / max(e["step_s"] for e in results),  # the slowest rank sets the pace
            # The rank that reaches the State's calls last waits for no peer there: its time in them is
            # what the protocol itself blocks a step for (the others' includes waiting for the last).
            "blocked_fraction": min(e["blocked_s"] / e["step_s"] for e in results),
            "memory_over_state": max(e["memory"] for e in results),
            "peak_over_state": max(e["peak"] for e in results)}


def group_rows(layout: str, mb: int, step_ms: float, modes: list[str], args: argparse.Namespace,
               tmp: Path) -> list[dict]:
    """The modes of one (layout, size, step): their failure-free runs alternated ``--repeat``
    times (the median run of each counts: a slow spell of this shared machine lands on every
    mode alike), then one run with a kill per mode."""
    runs: dict[str, list[dict]] = {mode: [] for mode in modes}
    for i in range(args.repeat):
        for mode in modes:
            runs[mode].append(clean_run(layout, mb, step_ms, mode, args, tmp / f"{layout}-{mb}-{step_ms}-{mode}-{i}"))
    rows = []
    for mode in modes:
        median = sorted(runs[mode], key=lambda r: r["steps_per_s"])[len(runs[mode]) // 2]
        row = {"layout": layout, "mb": mb, "step_ms": step_ms, "mode": mode, "ranks": args.ranks, **median,
               "down_s": None, "lost": None}
        if mode != "none":
            worker_args = ["--layout", layout, "--mb", str(mb), "--step-ms", str(step_ms), "--mode", mode,
                           "--steps", str(args.steps)]
            events = launch(tmp / f"{layout}-{mb}-{step_ms}-{mode}-kill", args.ranks, f"1@{args.steps // 2}",
                            worker_args)
            rebuild = timeline(events)[0]
            row.update(down_s=rebuild["down"] / 1e3, lost=rebuild["redone"])
        rows.append(row)
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--layout", choices=LAYOUTS, help=argparse.SUPPRESS)
    parser.add_argument("--mb", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--mode", choices=MODES, help=argparse.SUPPRESS)
    parser.add_argument("--sizes", type=int, nargs="+", default=[128], help="MB of state per rank")
    parser.add_argument("--step-ms", type=float, nargs="+", default=[200.0], help="compute per step")
    parser.add_argument("--layouts", default=",".join(LAYOUTS))
    parser.add_argument("--modes", default=",".join(MODES), help="none first: the base of the ratios")
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--repeat", type=int, default=3, help="failure-free runs per row, alternated (median)")
    parser.add_argument("--json", action="store_true", help="one JSON object per row")
    args = parser.parse_args()
    if args.worker:
        args.step_ms = args.step_ms[0]
        return worker(args)
    modes, layouts = args.modes.split(","), args.layouts.split(",")
    if modes[0] != "none" or not set(modes) <= set(MODES) or not set(layouts) <= set(LAYOUTS):
        parser.error(f"--modes: of {','.join(MODES)}, none first; --layouts: of {','.join(LAYOUTS)}")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for layout in layouts:
            for mb in args.sizes:
                for step_ms in args.step_ms:
                    for r in group_rows(layout, mb, step_ms, modes, args, Path(tmp)):
                        rows.append(r)
                        if args.json:
                            print(json.dumps(r), flush=True)
    if args.json:
        return 0
    print(f"{args.ranks} ranks + 1 spare, {args.steps} steps, the median of {args.repeat} alternated runs; "
          "memory: RSS above the process before its state, over the state (steady / peak); kill of logical "
          f"rank 1 at step {args.steps // 2}, the spare takes over")
    print(" | ".join(("layout", "MB", "step ms", "mode", "steps/s", "vs none", "blocked", "memory", "peak",
                      "down s", "lost")))
    base = {(r["layout"], r["mb"], r["step_ms"]): r["steps_per_s"] for r in rows if r["mode"] == "none"}
    for r in rows:
        ratio = r["steps_per_s"] / base[(r["layout"], r["mb"], r["step_ms"])] if base else float("nan")
        print(" | ".join([r["layout"], str(r["mb"]), f"{r['step_ms']:.0f}", r["mode"], f"{r['steps_per_s']:.2f}",
                          f"{ratio:.3f}", f"{100 * r['blocked_fraction']:.2f}%", f"{r['memory_over_state']:.2f}",
                          f"{r['peak_over_state']:.2f}",
                          "-" if r["down_s"] is None else f"{r['down_s']:.3f}",
                          "-" if r["lost"] is None else str(r["lost"])]))
    return 0


if __name__ == "__main__":
    sys.exit(main())

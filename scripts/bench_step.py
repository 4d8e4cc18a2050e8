"""What a recovery point costs per training step: none, a commit every 1 or 10 steps, the per-step point, twins.

    python scripts/bench_step.py [--sizes 128] [--step-ms 200] [--ranks 4] [--steps 24] [--repeat 3] [--json]
    python scripts/bench_step.py --sizes 16 128 512 --step-ms 50 200 --layouts replicated,sharded
    python scripts/bench_step.py --sizes 128 --step-ms 200 --layouts sharded --modes none,step,twin --json

A data-parallel loop on numpy (no torch: the state's bytes are the whole story)
under mpiexec --with-ft ulfm, ``--ranks`` ranks and one spare. Each step: a
compute step of ``--step-ms`` (256x256 float32 matmuls, the count fixed once per
run by a calibration job timing every rank at once, the slowest rank's rate, and
used by every mode and rank: the same work per step, so a slower step is a slower
rank or a costlier mode, never a shorter loop), a 1 MB gradient all-reduce, and
an update that changes the state.
The state per rank is ``--sizes`` MB, laid out (``layout``):

* ``replicated``: all of it a model every rank holds alike (data parallel), plus
  a rank's own random stream;
* ``sharded`` (ZeRO-1): a shared model of 2/3 of it and this rank's optimizer
  shard (two moments of the model / ranks), which only this rank has. The
  gradient stands for the model's, scaled down: each rank updates its shard's
  part of it and the updated parts are all-gathered (ZeRO-1's parameter
  all-gather), so every rank holds the model again.

``mode``: ``none`` (no State: the loop alone), ``commit1`` / ``commit10``
(``state.commit()`` after every / every 10th step), ``step`` (``State(per_step=True)``:
``step_point()`` between the update of what is rank-unique, the shard, and the
update of what every rank holds, the model; its replication is synchronous), ``twin``
(sharded only: ``State(per_step=True, twins=Mesh(2, ranks / 2))``: two instances, each shard
held by a rank of each, twice the moments a rank; the point replicates the random stream only,
the update of the shard follows it, and the next step begins by gathering the updated parts
from the rank's instance, point to point).
Per row, from the median of ``--repeat`` failure-free runs alternated over
the modes (a slow spell of this shared machine lands on every mode alike), over
the last whole tens of steps past a warm-up of 4 (each mode's commits land in
them in proportion): steps/s (from the mean step, commits included),
``blocked_fraction`` (the mean time the loop spends in the State's calls per
step over the mean step, on the rank that gets there last: the others' time
there includes waiting for it) and ``blocked_max`` (its largest single step's),
memory over the state (RSS above what the process held before its state, steady
after the run and at its high-water mark; the state itself counts 1), and in a
second run with a SIGKILL of logical rank 1 at step ``steps // 2``, a spare taking over: kill ->
next step (``down_s``), the steps done again (``lost``) and ``floor_s``, the part of
``down_s`` any spare substitution pays in that run (down less the state's own
recovery: the same job's spare path). ``bytes_sent_per_step``: what a rank hands
MPI per step (the most of any rank): its point-to-point sends, 2 (n-1)/n of an
all-reduced array and (n-1)/n of an all-gathered one (ring algorithms), and the
State's replication as its ``committed`` events count it. ``optimizer_ms``: the
median time of the shard's update (the sharded layout). ``vs none``: the row's
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

MODES = ("none", "commit1", "commit10", "step", "twin")
REPLICAS = 2  # the twin mode's instances
LAYOUTS = ("replicated", "sharded")
MATMUL = 256
WARMUP = 4  # steps not counted: the first commits touch fresh memory


# ---------------------------------------------------------------------------- the worker (one rank)
def _rss() -> tuple[int, int]:
    """(resident, high-water mark) of this process, bytes."""
    fields = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines() if ":" in line)
    return int(fields["VmRSS"].split()[0]) << 10, int(fields["VmHWM"].split()[0]) << 10


def _calibrate(seconds: float = 1.0) -> int:
    """Matrix products per second, timed on every rank at once (the contention of the steps): the
    slowest rank's rate, as an event (the driver's calibration job)."""
    import elastic

    world = elastic.init()
    a = np.random.default_rng(0).standard_normal((MATMUL, MATMUL), dtype=np.float32)
    world.allgather(None)  # every rank starts timing together
    t, done = time.perf_counter(), 0
    while time.perf_counter() - t < seconds:
        a @ a
        done += 1
    rate = min(world.allgather(done / (time.perf_counter() - t)))
    world.events.emit("calibrated", matmuls_per_s=rate)
    world.finish()
    return 0


def _values(me: int, shard: int, total: int, layout: str, replicas: int) -> dict[str, np.ndarray]:
    """A state of ``total`` bytes: a model every rank holds (all of it replicated; two thirds sharded,
    the rest this rank's optimizer shard ``shard``: two float32 moments, ``replicas`` times larger
    with twins), and this rank's RNG."""
    model_bytes = total if layout == "replicated" else total * 2 // 3
    values: dict[str, np.ndarray] = {"w": np.full(model_bytes // 4, 0.5, np.float32),  # resident, not lazy zeros
                                     "rng": np.array([me + 1], np.int64)}
    if layout == "sharded":
        size = replicas * (total - model_bytes) // 8
        values.update({f"opt.{shard}.{k}": np.full(size, 0.5, np.float32) for k in "mv"})
    return values


class _Worker:
    """One rank's loop: the layout's values, the step and, by mode, a State and its recovery point."""

    def __init__(self, args: argparse.Namespace) -> None:
        import elastic
        from elastic.mesh import Mesh

        self.args, self.world = args, elastic.init()
        me, n = int(self.world.logical_rank), self.world.job.initial_size
        self.twin, self.sharded = args.mode == "twin", args.layout == "sharded"
        self.mesh = Mesh(self.world, REPLICAS, n // REPLICAS) if self.twin else None
        self.shard, shards = (self.mesh.stage, self.mesh.pp) if self.mesh is not None else (me, n)
        self.a = np.random.default_rng(0).standard_normal((MATMUL, MATMUL), dtype=np.float32)
        matmuls = args.matmuls  # fixed once per run by the driver: every mode does the same work per step
        self.base_rss = _rss()[0]
        self.values = _values(me, self.shard, args.mb << 20, args.layout, REPLICAS if self.twin else 1)
        self.grad = np.zeros(1 << 18, np.float32)  # 1 MB: the model's gradient, scaled down
        self.parts = np.linspace(0, self.grad.size, shards + 1).astype(int)  # shard s: grad's [parts[s], parts[s+1])
        self.lo, self.hi = self.parts[self.shard], self.parts[self.shard + 1]
        # With twins the model is gathered from the shards each step, not kept: the shard's part is.
        self.w = self.values.pop("w") if self.twin else self.values["w"]
        if self.twin:
            self.values[f"opt.{self.shard}.p"] = self.w[self.lo:self.hi].copy()
        # What this rank hands MPI per step: the all-reduce, and the all-gather of the shards' parts.
        self.sent = 2 * (n - 1) / n * self.grad.nbytes
        if self.sharded:
            self.sent += (shards - 1) * (self.hi - self.lo) * 4 if self.twin else (n - 1) / n * self.grad.nbytes
        self.state = None
        if args.mode != "none":
            self.state = elastic.State(
                self.world, per_step=args.mode in ("step", "twin"), local=("rng",) if self.twin else ("rng", "opt"),
                twins=self.mesh, twinned=("opt",) if self.twin else (), step=0, matmuls=matmuls, **self.values)
        self.v: Any = self.state if self.state is not None else argparse.Namespace(step=0, matmuls=matmuls,
                                                                                  **self.values)
        self.gathered = np.empty(self.grad.size, np.float32)
        self.blocked: list[float] = []
        self.seconds: list[float] = []
        self.optimizer: list[float] = []

    def value(self, name: str) -> Any:
        return self.values[name] if self.state is None else self.state[name]

    def run(self) -> int:
        import elastic

        if self.state is None:
            self.loop(self.world, None)
            self.world.finish()
        else:
            elastic.run(self.loop)(self.world, self.state)
        rss, peak = _rss()
        # The last whole tens of steps, past a warm-up of WARMUP at least: every mode's commits land
        # in them in proportion (commit10's once in each ten), and the mean counts each one.
        counted = (len(self.seconds) - WARMUP) // 10 * 10
        seconds, blocked = self.seconds[-counted:], self.blocked[-counted:]
        state_bytes = self.args.mb << 20  # the layout's state without twins: their second copy of a shard shows
        self.world.events.emit(
            "result", step_s=statistics.fmean(seconds), blocked_s=statistics.fmean(blocked),
            blocked_max=max(b / t for b, t in zip(blocked, seconds)), counted=counted,
            memory=(rss - self.base_rss) / state_bytes, peak=(peak - self.base_rss) / state_bytes,
            state_bytes=state_bytes, sent_per_step=self.sent, steps=len(self.seconds),
            optimizer_s=statistics.median(self.optimizer[-counted:]) if self.optimizer else None)
        return 0

    def loop(self, world: Any, state: Any) -> None:
        every = {"commit1": 1, "commit10": 10}.get(self.args.mode, 0)
        v, grad = self.v, self.grad
        while v.step < self.args.steps:
            t0 = time.perf_counter()
            world.fault_point(v.step)
            if self.mesh is not None:
                self.gather(v.step)
            for _ in range(v.matmuls):
                self.a @ self.a
            v.rng = (v.rng * 1103515245 + 12345) % (1 << 31)  # this rank's draws
            grad[:] = float(v.rng[0] % 7) + self.w[:grad.size] * 1e-3
            world.allreduce([grad], step=v.step)
            wait = self.update()
            v.step += 1
            if state is not None:
                state.record_step(v.step)
                if every and v.step % every == 0:
                    t = time.perf_counter()
                    state.commit()
                    wait += time.perf_counter() - t
            self.blocked.append(wait)
            self.seconds.append(time.perf_counter() - t0)

    def gather(self, step: int) -> None:
        """Twins: the model's updated parts, from the shards of this rank's instance (point to point)."""
        assert self.mesh is not None
        hosts, p, parts, me = self.mesh.stage_hosts(), self.value(f"opt.{self.shard}.p"), self.parts, self.shard
        self.world.neighbors([(hosts[s], 0, p) for s in hosts if s != me],
                             [(hosts[s], 0, self.w[parts[s]:parts[s + 1]]) for s in hosts if s != me], step=step)
        self.w[self.lo:self.hi] = p

    def point(self) -> float:
        """The per-step point, where the layout puts it: its seconds."""
        t = time.perf_counter()
        if self.args.mode in ("step", "twin"):
            self.state.step_point()
        return time.perf_counter() - t

    def update(self) -> float:
        """The step after the gradient's all-reduce, by layout; the seconds blocked in the point."""
        from mpi4py import MPI

        grad, lo, hi = self.grad, self.lo, self.hi
        if not self.sharded:
            wait = self.point()
            self.w[:grad.size] += 1e-6 * grad  # the model every rank holds: after the point
            return wait
        wait = self.point() if self.twin else 0.0  # twins: before the shard's update
        t = time.perf_counter()
        m = self.value(f"opt.{self.shard}.m")[:hi - lo]  # the shard's moments, and its part of the model
        m *= 0.9
        m += grad[lo:hi]
        if self.twin:
            self.value(f"opt.{self.shard}.p")[:] -= 1e-6 * m
            self.optimizer.append(time.perf_counter() - t)
            return wait
        mine = self.w[lo:hi] - 1e-6 * m
        self.optimizer.append(time.perf_counter() - t)
        with self.world.mpi.guard():  # ZeRO-1's all-gather of the updated parts, before the model changes
            self.world.mpi.comm.Allgatherv(mine, [self.gathered, (np.diff(self.parts), self.parts[:-1]), MPI.FLOAT])
        wait = self.point()  # the shard is what the step makes it; the model not yet
        self.w[:grad.size] = self.gathered
        return wait


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


def calibrate(args: argparse.Namespace, tmp: Path) -> float:
    """Matrix products per second on every rank at once, the slowest rank's: one job, once per run."""
    events = launch(tmp / "calibrate", args.ranks, "", ["--calibrate"])
    return float(next(e["matmuls_per_s"] for e in events if e["event"] == "calibrated"))


def _worker_args(layout: str, mb: int, step_ms: float, mode: str, args: argparse.Namespace) -> list[str]:
    matmuls = max(1, round(args.matmuls_per_s * step_ms / 1e3))  # the same work per step in every mode
    return ["--layout", layout, "--mb", str(mb), "--step-ms", str(step_ms), "--mode", mode,
            "--steps", str(args.steps), "--matmuls", str(matmuls)]


def clean_run(layout: str, mb: int, step_ms: float, mode: str, args: argparse.Namespace, run_dir: Path) -> dict:
    """One failure-free run: steps/s, blocking, memory."""
    events = launch(run_dir, args.ranks, "", _worker_args(layout, mb, step_ms, mode, args))
    results = [e for e in events if e["event"] == "result"]
    last = min(results, key=lambda e: e["blocked_s"] / e["step_s"])  # the rank that reaches the State's calls last
    replicated = {}  # what each rank's State sent its peers, over the run
    for e in events:
        if e["event"] == "committed":
            replicated[e["logical"]] = replicated.get(e["logical"], 0) + e["bytes_out"]
    return {"steps_per_s": 1 / max(e["step_s"] for e in results),  # the slowest rank sets the pace
            # The rank that reaches the State's calls last waits for no peer there: its time in them is
            # what the protocol itself blocks a step for (the others' includes waiting for the last).
            "blocked_fraction": last["blocked_s"] / last["step_s"], "blocked_max": last["blocked_max"],
            "memory_over_state": max(e["memory"] for e in results),
            "peak_over_state": max(e["peak"] for e in results),
            "replicas": REPLICAS if mode == "twin" else 1,
            "bytes_sent_per_step": max(e["sent_per_step"] + replicated.get(e["logical"], 0) / e["steps"]
                                       for e in results),
            "optimizer_ms": 1e3 * max(e["optimizer_s"] for e in results) if layout == "sharded" else None}


def group_rows(layout: str, mb: int, step_ms: float, modes: list[str], args: argparse.Namespace,
               tmp: Path) -> list[dict]:
    """The modes of one (layout, size, step): their failure-free runs alternated ``--repeat``
    times (the median run of each counts: a slow spell of this shared machine lands on every
    mode alike), then one run with a kill per mode."""
    modes = [m for m in modes if m != "twin" or layout == "sharded"]  # replicated state: DDP is its own twin
    runs: dict[str, list[dict]] = {mode: [] for mode in modes}
    for i in range(args.repeat):
        for mode in modes:
            runs[mode].append(clean_run(layout, mb, step_ms, mode, args, tmp / f"{layout}-{mb}-{step_ms}-{mode}-{i}"))
    rows = []
    for mode in modes:
        median = sorted(runs[mode], key=lambda r: r["steps_per_s"])[len(runs[mode]) // 2]
        row = {"layout": layout, "mb": mb, "step_ms": step_ms, "mode": mode, "ranks": args.ranks, **median,
               "down_s": None, "lost": None, "floor_s": None}
        if mode != "none":
            events = launch(tmp / f"{layout}-{mb}-{step_ms}-{mode}-kill", args.ranks, f"1@{args.steps // 2}",
                            _worker_args(layout, mb, step_ms, mode, args))
            rebuild = timeline(events)[0]
            row.update(down_s=rebuild["down"] / 1e3, lost=rebuild["redone"],
                       floor_s=(rebuild["down"] - (rebuild["restore"] or 0.0)) / 1e3)
        rows.append(row)
    return rows


def _checked(parser: argparse.ArgumentParser, args: argparse.Namespace) -> tuple[list[str], list[str]]:
    """The modes and layouts asked for; a usage error for what cannot run."""
    modes, layouts = args.modes.split(","), args.layouts.split(",")
    if modes[0] != "none" or not set(modes) <= set(MODES) or not set(layouts) <= set(LAYOUTS):
        parser.error(f"--modes: of {','.join(MODES)}, none first; --layouts: of {','.join(LAYOUTS)}")
    if args.steps < WARMUP + 10:
        parser.error(f"--steps {args.steps}: at least {WARMUP + 10} (a warm-up of {WARMUP}, then whole tens counted)")
    if "twin" in modes and args.ranks % REPLICAS:
        parser.error(f"--modes twin: {REPLICAS} instances of --ranks / {REPLICAS}: give an even --ranks")
    return modes, layouts


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--layout", choices=LAYOUTS, help=argparse.SUPPRESS)
    parser.add_argument("--mb", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--mode", choices=MODES, help=argparse.SUPPRESS)
    parser.add_argument("--matmuls", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--calibrate", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--sizes", type=int, nargs="+", default=[128], help="MB of state per rank")
    parser.add_argument("--step-ms", type=float, nargs="+", default=[200.0], help="compute per step")
    parser.add_argument("--layouts", default=",".join(LAYOUTS))
    parser.add_argument("--modes", default=",".join(MODES), help="none first: the base of the ratios")
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--repeat", type=int, default=3, help="failure-free runs per row, alternated (median)")
    parser.add_argument("--json", action="store_true", help="one JSON object per row")
    args = parser.parse_args()
    if args.calibrate:
        return _calibrate()
    if args.worker:
        args.step_ms = args.step_ms[0]
        return _Worker(args).run()
    modes, layouts = _checked(parser, args)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        args.matmuls_per_s = calibrate(args, Path(tmp))
        for layout in layouts:
            for mb in args.sizes:
                for step_ms in args.step_ms:
                    for r in group_rows(layout, mb, step_ms, modes, args, Path(tmp)):
                        r["matmuls_per_s"] = args.matmuls_per_s
                        rows.append(r)
                        if args.json:
                            print(json.dumps(r), flush=True)
    if args.json:
        return 0
    print(f"{args.ranks} ranks + 1 spare, {args.steps} steps, the median of {args.repeat} alternated runs; "
          "memory: RSS above the process before its state, over the state (steady / peak); kill of logical "
          f"rank 1 at step {args.steps // 2}, the spare takes over")
    print(" | ".join(("layout", "MB", "step ms", "mode", "steps/s", "vs none", "blocked", "blocked max", "memory",
                      "peak", "sent MB/step", "opt ms", "down s", "floor s", "lost")))
    base = {(r["layout"], r["mb"], r["step_ms"]): r["steps_per_s"] for r in rows if r["mode"] == "none"}
    for r in rows:
        ratio = r["steps_per_s"] / base[(r["layout"], r["mb"], r["step_ms"])] if base else float("nan")
        print(" | ".join([r["layout"], str(r["mb"]), f"{r['step_ms']:.0f}", r["mode"], f"{r['steps_per_s']:.2f}",
                          f"{ratio:.3f}", f"{100 * r['blocked_fraction']:.2f}%", f"{100 * r['blocked_max']:.1f}%",
                          f"{r['memory_over_state']:.2f}",
                          f"{r['peak_over_state']:.2f}", f"{r['bytes_sent_per_step'] / 2**20:.2f}",
                          "-" if r["optimizer_ms"] is None else f"{r['optimizer_ms']:.2f}",
                          "-" if r["down_s"] is None else f"{r['down_s']:.3f}",
                          "-" if r["floor_s"] is None else f"{r['floor_s']:.3f}",
                          "-" if r["lost"] is None else str(r["lost"])]))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""In-memory recovery against checkpoint-restart, side by side in one run.

    python scripts/bench_recovery.py --ranks 4 8 --sizes 10 128 --reps 2

For each (ranks, MB of state per rank) the same training job (a small MLP with
Adam; a per-rank "ballast" array brings the committed state up to the size
asked) runs under mpiexec --with-ft ulfm and loses logical rank 1 after step
``interval + 7`` of each generation, ``reps`` times in a row:

  (a) shrink, (b) spare substitute, (c) spawn substitute: the elastic loop
      recovers in-process from the replicated store (commit every ``interval``);
      the spawned process forked from the launcher's warm process (the default), and (c')
      the same started cold (``--cold``: a new interpreter importing everything);
  (d) checkpoint-restart, what users do today: every rank writes its state
      with torch.save (+fsync) every ``interval`` steps; the kill ends the job;
      it is relaunched with mpiexec and every rank torch.loads the last
      checkpoint. Each relaunch kills again, so one job per repetition; every launch starts
      cold (``--cold``), as a new job does today.

Recovery time = the kill -> the first completed step past the one the job was
on when killed, so the steps lost since the last commit / checkpoint count in
every column. Phases: for (a-c) rebuild (kill -> world rebuilt and every rank
in the store's recovery), restore, redo (lost steps again); for (d) teardown
(kill -> mpiexec gone), relaunch (mpiexec -> every rank initialised), load,
redo. Medians over the repetitions; the ratio columns are (d) over each of (a-c).

Steady state, in the same run: step time with a commit every step and every
``interval`` steps over no fault tolerance at all (commit only at start and
end), and the commit bandwidth next to raw MPI point-to-point and memcpy
bandwidth of the same bytes.

Writes ``bench_recovery.json`` (for scripts/simulate_ettr.py) and, with
matplotlib, ``bench_recovery.png``.

Node loss (``--nodes N``, root: simulated nodes, see ``elastic.launch --simulate-nodes``):
node 1 is killed (its daemon, its ranks, its memory) ``interval + 7`` steps in;
Open MPI then ends the whole job. (e) tier 2: the launcher relaunches on the
other nodes plus a spare node and the ranks restore from the surviving nodes'
memory, forked from the launcher's warm process, and (e') the same started
cold; (f) checkpoint-restart of the same state from disk, relaunched by hand
(cold) on as many nodes. Phases of (e): detect (kill -> the runtime gone), relaunch
(-> every rank started), attach (-> the nodes' versions agreed), fetch,
resume (-> the loop resumed), redo.

    python scripts/bench_recovery.py --nodes 3 --ranks 6 --sizes 10 128
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
from typing import Iterator

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


# ---------------------------------------------------------------- the job
def worker(args: argparse.Namespace) -> int:
    import torch

    import elastic

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 256), torch.nn.ReLU(), torch.nn.Linear(256, 1))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    model(torch.zeros(2, 32)).sum().backward()
    optimizer.step()  # Adam's moments exist from the start: the state has its full size
    optimizer.zero_grad()
    x = torch.randn(1024, 32, generator=torch.Generator().manual_seed(1))
    y = x.sum(dim=1, keepdim=True).tanh()
    model_bytes = 3 * sum(p.numel() * 4 for p in model.parameters())
    ballast = np.zeros(max((args.state_mb << 20) - model_bytes, 0) // 8)
    world = elastic.init()
    ballast[:] = int(world.logical_rank)
    state = elastic.TorchState(world, model=model, optimizer=optimizer, local=("ballast",), step=0,
                               ballast=ballast)
    ckpt = Path(args.checkpoint_dir) if args.checkpoint_dir else None
    if ckpt is not None:
        path = ckpt / f"rank{int(world.logical_rank)}.pt"
        if path.exists():  # a relaunch: every rank reads its last checkpoint back
            t = time.perf_counter()
            saved = torch.load(path, weights_only=False)
            model.load_state_dict(saved["model"])
            optimizer.load_state_dict(saved["optimizer"])
            state.ballast[:] = saved["ballast"]
            state.step = saved["step"]
            world.events.emit("checkpoint_loaded", seconds=time.perf_counter() - t, step=state.step)
    batches = elastic.GlobalBatches(len(x), 64, seed=0)
    if args.measure_bandwidth:
        _bandwidth(world, ballast)

    def train(world, state):
        while state.step < args.steps:
            world.fault_point(state.step)
            optimizer.zero_grad()
            idx = torch.from_numpy(batches.shard(state.step, world))
            loss = torch.nn.functional.mse_loss(model(x[idx]), y[idx], reduction="sum") / 64
            loss.backward()
            elastic.allreduce_gradients(world, model)
            optimizer.step()
            state.step += 1
            state.record_step(state.step, float(loss), total=args.steps)
            if args.commit_every and state.step % args.commit_every == 0:
                state.commit()
            if ckpt is not None and state.step % args.checkpoint_every == 0:
                t = time.perf_counter()
                tmp = ckpt / f"rank{int(world.logical_rank)}.tmp"
                with open(tmp, "wb") as f:
                    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                                "ballast": state.ballast, "step": state.step}, f)
                    f.flush()
                    os.fsync(f.fileno())
                tmp.replace(ckpt / f"rank{int(world.logical_rank)}.pt")
                world.events.emit("checkpoint_saved", seconds=time.perf_counter() - t, step=state.step)
                with world.mpi.guard():  # a checkpoint counts once every rank has written its part
                    world.mpi.comm.Barrier()

    if ckpt is None:
        elastic.run(train)(world, state)
    else:  # the baseline has no fault tolerance at all: no commits, the first death ends the job
        train(world, state)
        world.finish()
    return 0


def _bandwidth(world, buf: np.ndarray) -> None:
    """Raw MPI and memcpy bandwidth of the state's bytes (collective), as an event on every rank."""
    from bench_store import raw_bandwidth
    world.events.emit("bandwidth", nbytes=int(buf.nbytes), **raw_bandwidth(world, buf))


# ---------------------------------------------------------------- the driver
def launch(n: int, run_dir: Path, launcher: list[str], worker_args: list[str], env: dict | None = None) -> float:
    """Run one job; returns the wall-clock time (time.time()) at which mpiexec was gone."""
    cmd = [sys.executable, "-m", "elastic.launch", "-n", str(n), "--timeout", "600", "--run-dir", str(run_dir),
           *launcher, "--", sys.executable, __file__, "--worker", *worker_args]
    subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=700,
                   env={**os.environ, "OPENBLAS_NUM_THREADS": "1", **(env or {})})
    return time.time()


def events_of(run_dir: Path) -> list[dict]:
    from elastic.comm.events import read_events
    return read_events(run_dir)


def in_memory(n: int, mb: int, mode: str, a: argparse.Namespace, tmp: Path) -> list[dict]:
    """One job with ``reps`` failures in sequence; the phases of each recovery."""
    from elastic.report import timeline
    kills = ",".join(f"1@{a.interval * (g + 1) + 7}/g{g}" for g in range(a.reps))
    launcher = {"shrink": ["--rebuild", "shrink"], "spare": ["--spares", str(a.reps), "--rebuild", "spare"],
                "spawn": ["--rebuild", "spawn"], "spawn-cold": ["--rebuild", "spawn", "--cold"]}[mode] + \
        ["--inject", kills]
    if mode == "shrink" and n - a.reps < 1:
        return []
    run_dir = tmp / f"{mode}-{n}-{mb}"
    steps = a.interval * (a.reps + 1) + 10
    launch(n, run_dir, launcher, ["--state-mb", str(mb), "--steps", str(steps), "--commit-every", str(a.interval)])
    events = events_of(run_dir)
    out = []
    for row in timeline(events):
        past = [e for e in events
                if e["event"] == "step" and e["gen"] >= row["gen"] and e["step"] > row["failed_at_step"]]
        if not past:
            continue
        restored = row["t_resumed"] - row["resume"] / 1e3
        restore = row["restore"] / 1e3
        out.append({"total": past[0]["t"] - row["t_failure"], "rebuild": restored - restore - row["t_failure"],
                    "restore": restore, "redo": past[0]["t"] - restored})
    return out


def node_loss(n: int, mb: int, a: argparse.Namespace, tmp: Path, cold: bool = False) -> list[dict]:
    """Tier 2: node 1 killed once; the launcher relaunches from the nodes' memory (phases, seconds)."""
    run_dir = tmp / f"node-{n}-{mb}{'-cold' if cold else ''}"
    failed_at = a.interval + 7
    launch(n, run_dir, ["--simulate-nodes", str(a.nodes), "--spare-nodes", "1", "--inject", f"node1@{failed_at}"]
           + (["--cold"] if cold else []),
           ["--state-mb", str(mb), "--steps", str(a.interval * 2 + 10), "--commit-every", str(a.interval)])
    events = events_of(run_dir)
    summary = json.loads((run_dir / "summary.json").read_text())
    if summary.get("relaunches") != 1:
        print(f"  node loss {n}x{mb}: no relaunch ({summary.get('rc')}); see {run_dir}", flush=True)
        return []
    gone, relaunched = summary["launches"][0]["ended"], summary["launches"][1]["launched"]
    t_kill = min(e["t"] for e in events if e["event"] == "inject")
    later = [e for e in events if e["t"] > relaunched]

    def last(name: str) -> float:
        return max(e["t"] for e in later if e["event"] == name)
    started, attached, recovered, resumed = last("started"), last("store_attached"), last("store_recovered"), \
        last("resumed")
    past = min(e["t"] for e in later if e["event"] == "step" and e["step"] > failed_at)
    return [{"total": past - t_kill, "detect": gone - t_kill, "relaunch": started - gone, "attach": attached - started,
             "fetch": recovered - attached, "resume": resumed - recovered, "redo": past - resumed}]


def restart(n: int, mb: int, a: argparse.Namespace, tmp: Path, nodes: int = 0) -> list[dict]:
    """Checkpoint-restart: each repetition is a job killed after a checkpoint, then relaunched
    (``nodes``: on simulated nodes, losing node 1 instead of rank 1)."""
    ckpt = tmp / f"ckpt-{n}-{mb}"
    ckpt.mkdir()
    steps = a.interval * (a.reps + 1) + 10
    common = ["--state-mb", str(mb), "--steps", str(steps), "--commit-every", "0",
              "--checkpoint-dir", str(ckpt), "--checkpoint-every", str(a.interval)]
    no_recovery = {"ELASTIC_REBUILD": "spare"}  # no spares: the first death ends the job, as without ULFM
    out = []
    previous = None
    for g in range(a.reps + 1):
        run_dir = tmp / f"restart-{n}-{mb}-{g}"
        where = f"node1@{a.interval * (g + 1) + 7}" if nodes else f"1@{a.interval * (g + 1) + 7}"
        kill = ["--inject", where] if g < a.reps else []
        on = ["--cold"] + (["--simulate-nodes", str(nodes), "--relaunches", "0"] if nodes else [])
        t_gone = launch(n, run_dir, on + kill, common, no_recovery)
        events = events_of(run_dir)
        if previous is not None:
            t_kill, failed_at, t_prev_gone = previous
            started = max(e["t"] for e in events if e["event"] == "started")
            loaded = [e for e in events if e["event"] == "checkpoint_loaded"]
            past = [e for e in events if e["event"] == "step" and e["step"] > failed_at]
            load = max(e["seconds"] for e in loaded)
            relaunch = started - t_prev_gone
            out.append({"total": past[0]["t"] - t_kill, "teardown": t_prev_gone - t_kill, "relaunch": relaunch,
                        "load": load, "redo": past[0]["t"] - started - load,
                        "save": statistics.median(e["seconds"] for e in events if e["event"] == "checkpoint_saved")})
        if kill:
            t_kill = min(e["t"] for e in events if e["event"] == "inject")
            failed_at = max(e["step"] for e in events if e["event"] == "step")
            previous = (t_kill, failed_at, t_gone)
    return out


def steady(n: int, mb: int, a: argparse.Namespace, tmp: Path) -> dict:
    """Median step time, commits included, at commit every step / every interval / never."""
    out = {}
    for every in (0, a.interval, 1):
        run_dir = tmp / f"steady-{n}-{mb}-{every}"
        extra = ["--measure-bandwidth"] if every == a.interval else []
        launch(n, run_dir, [], ["--state-mb", str(mb), "--steps", str(5 * a.interval), "--commit-every", str(every),
                                *extra])
        events = events_of(run_dir)
        steps = sorted((e for e in events if e["event"] == "step"), key=lambda e: e["step"])
        # Whole commit intervals from step 2k on: the first two commits touch fresh memory (page
        # faults); the store reuses buffers from the third on, as for the rest of a long run.
        first = 2 * a.interval
        out[every] = (steps[-1]["t"] - steps[first - 1]["t"]) / (len(steps) - first)
        if extra:
            bw = [e for e in events if e["event"] == "bandwidth"]
            commits = [sum(e["durations"].values()) for e in events if e["event"] == "committed" and e["version"] >= 2]
            out["p2p_MBps"] = mb / statistics.median(e["p2p_s"] for e in bw)
            out["memcpy_MBps"] = mb / statistics.median(e["memcpy_s"] for e in bw)
            out["commit_s"] = statistics.median(commits)
            out["commit_MBps"] = mb / out["commit_s"]
    return out


def _configurations(a: argparse.Namespace, width: int) -> Iterator[tuple[int, int]]:
    """The (ranks, MB per rank) pairs to run, in order; those over --max-total-mb are skipped, saying so."""
    for n in a.ranks:
        for mb in a.sizes:
            if n * mb > a.max_total_mb:
                print(f"{n:>{width}} {mb:>{width}}  skipped: {n * mb} MB in all exceeds --max-total-mb", flush=True)
                continue
            yield n, mb


def med(rows: list[dict], key: str) -> float:
    return statistics.median(r[key] for r in rows) if rows else float("nan")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[4, 8])
    parser.add_argument("--sizes", type=int, nargs="+", default=[10, 128], help="MB of state per rank")
    parser.add_argument("--reps", type=int, default=2, help="failures per mode and configuration")
    parser.add_argument("--interval", type=int, default=10, help="steps between commits / checkpoints")
    parser.add_argument("--max-total-mb", type=int, default=2048, help="skip ranks x MB above this (memory)")
    parser.add_argument("--out", type=Path, default=Path("elastic-run/bench"))
    parser.add_argument("--nodes", type=int, default=0,
                        help="node loss instead, on this many simulated nodes (+1 spare; root): tier 2 vs restart")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--state-mb", type=int, default=10, help=argparse.SUPPRESS)
    parser.add_argument("--steps", type=int, default=40, help=argparse.SUPPRESS)
    parser.add_argument("--commit-every", type=int, default=10, help=argparse.SUPPRESS)
    parser.add_argument("--checkpoint-dir", help=argparse.SUPPRESS)
    parser.add_argument("--checkpoint-every", type=int, default=10, help=argparse.SUPPRESS)
    parser.add_argument("--measure-bandwidth", action="store_true", help=argparse.SUPPRESS)
    a = parser.parse_args()
    if a.worker:
        return worker(a)
    a.out.mkdir(parents=True, exist_ok=True)
    if a.nodes:
        return node_main(a)
    print(f"kill -> first step past the one the job was on, seconds, median of {a.reps}; commit / checkpoint "
          f"every {a.interval} steps, kill {7} steps after one; restart = (d) over (a-c)", flush=True)
    head = ("ranks", "MB", "shrink", "spare", "spawn", "spawn cold", "restart", "d/shrink", "d/spare", "d/spawn",
            "spawn/spare", "cold/spare", "rebuild", "restore", "redo", "teardown", "relaunch", "load", "ckpt save")
    print(" ".join(f"{h:>9}" for h in head), flush=True)
    results = []
    for n, mb in _configurations(a, 9):
        with tempfile.TemporaryDirectory(dir=a.out) as tmp:
            rows = {m: in_memory(n, mb, m, a, Path(tmp)) for m in ("shrink", "spare", "spawn", "spawn-cold")}
            rows["restart"] = restart(n, mb, a, Path(tmp))
            flat = steady(n, mb, a, Path(tmp))
        r = {"ranks": n, "mb": mb, **{m: rows[m] for m in rows}, "steady": flat}
        results.append(r)
        d = med(rows["restart"], "total")
        spare = med(rows["spare"], "total")
        cells = (n, mb, *(med(rows[m], "total") for m in ("shrink", "spare", "spawn", "spawn-cold")), d,
                 *(d / med(rows[m], "total") for m in ("shrink", "spare", "spawn")),
                 med(rows["spawn"], "total") / spare, med(rows["spawn-cold"], "total") / spare,
                 med(rows["spare"], "rebuild"), med(rows["spare"], "restore"), med(rows["spare"], "redo"),
                 med(rows["restart"], "teardown"), med(rows["restart"], "relaunch"),
                 med(rows["restart"], "load"), med(rows["restart"], "save"))
        print(" ".join(f"{c:>9.3f}" if isinstance(c, float) else f"{c:>9}" for c in cells), flush=True)
    print("\nphases of (a-c): rebuild (kill -> recovery under way), restore, redo; shown for spare above.\n"
          "Steady state: seconds per step with commits amortised, and that over no fault tolerance ('x'). "
          "This job's steps are milliseconds; the cost of a commit ('commit s') is what carries to a real step.",
          flush=True)
    head = ("ranks", "MB", "no FT", f"every {a.interval}", "every 1", f"x every {a.interval}", "x every 1",
            "commit s", "commit MB/s", "p2p MB/s", "memcpy MB/s", "commit/p2p")
    print(" ".join(f"{h:>11}" for h in head), flush=True)
    for r in results:
        s = r["steady"]
        cells = (r["ranks"], r["mb"], s[0], s[a.interval], s[1], s[a.interval] / s[0], s[1] / s[0], s["commit_s"],
                 s["commit_MBps"], s["p2p_MBps"], s["memcpy_MBps"], s["commit_MBps"] / s["p2p_MBps"])
        print(" ".join(f"{c:>11.4f}" if isinstance(c, float) else f"{c:>11}" for c in cells), flush=True)
    (a.out / "bench_recovery.json").write_text(json.dumps({"interval": a.interval, "results": results}, indent=1))
    _plot(results, a.out / "bench_recovery.png")
    return 0


def node_main(a: argparse.Namespace) -> int:
    """The node-loss table: tier 2 against checkpoint-restart, one kill each, side by side."""
    a.reps = 1
    print(f"node 1 of {a.nodes} simulated nodes killed {a.interval + 7} steps in (commit / checkpoint every "
          f"{a.interval}); kill -> first step past the one the job was on, seconds", flush=True)
    head = ("ranks", "MB", "tier 2", "t2 cold", "restart", "restart/t2", "r/t2 cold", "detect", "relaunch",
            "attach", "fetch", "resume", "redo", "c:relaunch", "r:teardown", "r:relaunch", "r:load", "ckpt save")
    print(" ".join(f"{h:>10}" for h in head), flush=True)
    results = []
    for n, mb in _configurations(a, 10):
        with tempfile.TemporaryDirectory(dir=a.out) as tmp:
            tier2 = node_loss(n, mb, a, Path(tmp))
            cold = node_loss(n, mb, a, Path(tmp), cold=True)
            again = restart(n, mb, a, Path(tmp), nodes=a.nodes)
        results.append({"ranks": n, "mb": mb, "tier2": tier2, "tier2_cold": cold, "restart": again})
        t2, c2, d = med(tier2, "total"), med(cold, "total"), med(again, "total")
        cells = (n, mb, t2, c2, d, d / t2, d / c2, *(med(tier2, k) for k in ("detect", "relaunch", "attach", "fetch",
                                                                              "resume", "redo")),
                 med(cold, "relaunch"), *(med(again, k) for k in ("teardown", "relaunch", "load", "save")))
        print(" ".join(f"{c:>10.3f}" if isinstance(c, float) else f"{c:>10}" for c in cells), flush=True)
    (a.out / "bench_node_loss.json").write_text(json.dumps({"interval": a.interval, "nodes": a.nodes,
                                                            "results": results}, indent=1))
    return 0


def _plot(results: list[dict], out: Path) -> None:
    from elastic.report import pyplot
    plt = pyplot(required=False)
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(8, 4))
    labels = [f"{r['ranks']}x{r['mb']}MB" for r in results]
    width = 0.2
    for i, mode in enumerate(("shrink", "spare", "spawn", "restart")):
        ax.bar(np.arange(len(results)) + i * width, [med(r[mode], "total") for r in results], width, label=mode)
    ax.set_xticks(np.arange(len(results)) + 1.5 * width, labels)
    ax.set(ylabel="seconds, kill -> first new step", yscale="log", title="recovery time by mode")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    print(f"plot written to {out}")


if __name__ == "__main__":
    sys.exit(main())

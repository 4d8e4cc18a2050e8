"""In-memory recovery against its physical floor and against checkpoint-restart, side by side in one run.

    python scripts/bench_recovery.py --ranks 4 --sizes 10 128 [--reps 8] [--out DIR]

For each (ranks, MB of state per rank) the same training job (a small MLP with
Adam; a per-rank "ballast" array brings the committed state up to the size
asked) runs under mpiexec --with-ft ulfm and loses a rank seven steps after a
commit (every ``interval`` steps), ``reps`` times per mode (8: median, mean and
max), the modes' jobs interleaved over the run (a slow spell of this shared
machine lands on every mode alike):

  (a) shrink (a job loses at most n - 2 ranks, so it takes several jobs),
      (b) spare substitute, (b') the same with the rank-unique state kept by parity (``--parity
      xor:4``: the ballast decoded from its group), (c) spawn substitute: the elastic loop recovers
      in-process from the replicated store; the spawned process forked from the
      launcher's warm process (the default), and (c') the same started cold
      (``--cold``: a new interpreter importing everything);
  (d) checkpoint-restart, what users do today: every rank writes its state
      with torch.save (+fsync) every ``interval`` steps; the kill ends the job;
      it is relaunched with mpiexec and every rank torch.loads the last
      checkpoint (``--restart-reps`` kills, each a cold relaunch);
  the floor: a raw mpi4py job of the same ranks (no elastic, no sentinel) in which
      rank 1 SIGKILLs itself and the others revoke and shrink, plus the lost
      rank's bytes at the point-to-point rate measured between two of its ranks
      in the same job (the rate over every size run so far, so the floor grows
      with the bytes): what any in-memory recovery of that state must pay.

Recovery time = the kill -> the first completed step past the one the job was
on when killed, so the steps lost since the last commit / checkpoint count in
every column (not in the floor). Phases: for (a-c) detect (kill -> the first
survivor sees it), rebuilt (kill -> the world rebuilt), restore, transferred (the
bytes every rank sent for the lost state, and their rate over the longest fetch,
beside the floor's p2p rate), redo (lost steps again); for (d) teardown (kill ->
mpiexec gone), relaunch (mpiexec -> every rank initialised), load, redo. ``--out
DIR`` writes ``bench_recovery.json``: ``rows`` (one per mode and size: ``mode``,
``mb``, ``kills``, ``median_s``, ``mean_s``, ``max_s``, ``floor_s``,
``detect_ms``, ``detect_max_ms``, ``rebuilt_s``, ``transferred_mb``,
``transfer_s``, ``transfer_gbps``, ``p2p_gbps``, ``redone_s``) and every kill's
phases (``results``, for scripts/simulate_ettr.py).

Steady state, in the same run: step time with a commit every step and every
``interval`` steps over no fault tolerance at all (commit only at start and
end), and the commit bandwidth next to raw MPI point-to-point (a ring Sendrecv
of the same bytes between the same ranks) and memcpy, with the commit's phases
(prepare, exchange, checksum, vote, pack: the roll-back copy). With matplotlib,
``bench_recovery.png`` too.

Node loss (``--nodes N``, root: simulated nodes, see ``elastic.launch --simulate-nodes``):
node 1 is killed (its daemon, its ranks, its memory) ``interval + 7`` steps in;
Open MPI then ends the whole job. (e) tier 2: the launcher relaunches on the
other nodes plus a spare node and the ranks restore from the surviving nodes'
memory, forked from the launcher's warm process, (e') the same started
cold, and (e'') the same with the rank-unique state kept by parity (``xor:N``,
N the nodes: one member of each group per node, so the lost node costs each
group one; its fetch is the decode); (f) checkpoint-restart of the same state from disk, relaunched by hand
(cold) on as many nodes. Phases of (e): detect (kill -> the runtime gone), relaunch
(-> every rank started), attach (-> the nodes' versions agreed), fetch,
resume (-> the loop resumed), redo. Beside them, the fetch's rate (the lost
node's bytes over the store's fetch) and MPI point to point between simulated
nodes 0 and N-1 in the same run (TCP); tier 2 runs ``--node-reps`` times (3: median
and max), the others once; ``bench_node_loss.json`` gives per tier-2
run ``total``, ``fetch_gbps``, ``tcp_gbps`` and ``warm_hosts`` ([the host a
relaunched rank on a new host runs on, the host of the warm process that forked
it, or null when it started cold]).

    python scripts/bench_recovery.py --nodes 3 --ranks 6 --sizes 10 128
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import shutil
import tempfile
import time
from pathlib import Path
from typing import Callable, Iterator

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
    # Touched before init(), as a program builds its model before it: a spare parks with its memory
    # in place, and takes its values from the store (only a rank that starts the job sets its own).
    ballast = np.ones(max((args.state_mb << 20) - model_bytes, 0) // 8)
    world = elastic.init()
    if world.role is not elastic.Role.RECOVERED:
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


def pair_seconds(comm, buf: np.ndarray, source: int, dest: int) -> float:
    """Seconds for ``buf`` from rank ``source`` to rank ``dest`` (median of 3, each after a barrier;
    the receiver's time is the one that counts; collective)."""
    times = []
    for _ in range(3):
        comm.Barrier()
        t = time.perf_counter()
        if comm.rank == source:
            comm.Send(buf, dest=dest)
        elif comm.rank == dest:
            comm.Recv(buf, source=source)
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def floor_worker(a: argparse.Namespace) -> int:
    """The floor of one kill, raw mpi4py under ``mpiexec --with-ft ulfm`` (no elastic, no sentinel):
    the lost rank's bytes from rank 0 to rank 1 at the p2p rate (median of 3, touched buffers),
    then rank 1 SIGKILLs itself inside a barrier and the others revoke and shrink. Each rank prints
    one JSON line; the exit skips MPI_Finalize (it hangs after a failure, ompi #11404)."""
    import signal

    from mpi4py import MPI

    comm = MPI.COMM_WORLD.Dup()
    comm.Set_errhandler(MPI.ERRORS_RETURN)
    buf = np.ones((a.state_mb << 20) // 8)
    out: dict = {"rank": comm.rank, "p2p_s": pair_seconds(comm, buf, 0, 1)}
    comm.Barrier()
    if comm.rank == 1:
        print(json.dumps({**out, "kill": time.time()}), flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    try:
        comm.Barrier()
    except MPI.Exception:
        pass
    out["seen"] = time.time()
    comm.Revoke()
    comm.Shrink()
    out["done"] = time.time()
    print(json.dumps(out), flush=True)
    os._exit(0)


def floor(n: int, mb: int, kills: int) -> list[dict]:
    """``kills`` raw ULFM kills of rank 1 of ``n`` ranks (one job each, see ``floor_worker``): per kill,
    kill -> seen (the first survivor), kill -> shrunk (the last), and the p2p seconds of ``mb``."""
    mpiexec = shutil.which("mpiexec") or str(Path(sys.executable).parent / "mpiexec")
    cmd = [mpiexec, "--with-ft", "ulfm", "-n", str(n), "--mca", "btl", "^ofi", "--oversubscribe"]
    if os.geteuid() == 0:
        cmd.append("--allow-run-as-root")
    out = []
    for _ in range(kills):
        run = subprocess.run(cmd + [sys.executable, __file__, "--floor-worker", "--state-mb", str(mb)], cwd=ROOT,
                             capture_output=True, text=True, timeout=120,
                             env={**os.environ, "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1"})
        lines = [json.loads(x) for x in run.stdout.splitlines() if x.startswith("{")]
        kill = [x["kill"] for x in lines if "kill" in x]
        done = [x for x in lines if "done" in x]
        if not kill or len(done) != n - 1:
            print(f"  floor {n}x{mb}: {len(done)} of {n - 1} survivors shrank; {run.stderr[-500:]}", flush=True)
            continue
        out.append({"seen": min(x["seen"] for x in done) - kill[0], "shrunk": max(x["done"] for x in done) - kill[0],
                    "p2p": next(x["p2p_s"] for x in lines if x["rank"] == 1), "bytes": mb << 20})
    return out


def floor_seconds(runs: list[dict], nbytes: int) -> float:
    """The floor of one kill that loses ``nbytes``: the raw ULFM kill -> shrunk (the median of
    ``runs``, ``floor``'s jobs of the same ranks) plus ``nbytes`` moved once at their p2p rate
    (the median of the bytes each moved over its seconds). The rate, not a size's own p2p
    seconds: a floor that reads less at more bytes is a mismeasured one."""
    rate = statistics.median(r["bytes"] / r["p2p"] for r in runs)
    return statistics.median(r["shrunk"] for r in runs) + nbytes / rate


def tcp_worker(a: argparse.Namespace) -> int:
    """MPI point to point between the first and the last rank (simulated nodes 0 and N-1: TCP), the
    state's bytes, median of 3 (touched buffers); an event on the receiver."""
    import elastic

    world = elastic.init()
    comm, last = world.mpi.comm, world.size - 1
    buf = np.ones((a.state_mb << 20) // 8)
    seconds = pair_seconds(comm, buf, 0, last)
    if comm.rank == last:
        world.events.emit("tcp", nbytes=int(buf.nbytes), seconds=seconds)
    world.finish()
    return 0


def _bandwidth(world, buf: np.ndarray) -> None:
    """Raw MPI and memcpy bandwidth of the state's bytes (collective), as an event on every rank."""
    from bench_store import raw_bandwidth
    world.events.emit("bandwidth", nbytes=int(buf.nbytes), **raw_bandwidth(world, buf))


# ---------------------------------------------------------------- the driver
def launch(n: int, run_dir: Path, launcher: list[str], worker_args: list[str], env: dict | None = None,
           script_flag: str = "--worker") -> float:
    """Run one job; returns the wall-clock time (time.time()) at which mpiexec was gone."""
    cmd = [sys.executable, "-m", "elastic.launch", "-n", str(n), "--timeout", "600", "--run-dir", str(run_dir),
           *launcher, "--", sys.executable, __file__, script_flag, *worker_args]
    subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=700,
                   env={**os.environ, "OPENBLAS_NUM_THREADS": "1", **(env or {})})
    return time.time()


def events_of(run_dir: Path) -> list[dict]:
    from elastic.comm.events import read_events
    return read_events(run_dir)


def in_memory(n: int, mb: int, mode: str, kills: int, a: argparse.Namespace, run_dir: Path) -> list[dict]:
    """One job losing logical rank 1 ``kills`` times in a row; the phases of each recovery (seconds)."""
    from elastic.report import timeline
    # A shrink removes the logical rank it lost: the next kill takes the next one.
    where = ",".join(f"{g + 1 if mode == 'shrink' else 1}@{a.interval * (g + 1) + 7}/g{g}" for g in range(kills))
    spare = ["--spares", str(kills), "--rebuild", "spare"]
    launcher = {"shrink": ["--rebuild", "shrink"], "spare": spare, "spare-parity": spare + ["--redundancy", a.parity],
                "spawn": ["--rebuild", "spawn"], "spawn-cold": ["--rebuild", "spawn", "--cold"]}[mode] + \
        ["--inject", where]
    steps = a.interval * (kills + 1) + 10
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
        rebuilt = max(e["t"] for e in events if e["event"] == "rebuilt" and e["gen"] == row["gen"])
        # transferred: every rank's bytes sent for the lost state, over the longest fetch of the recovery
        fetched = [e for e in events if e["event"] == "store_recovered" and e["gen"] == row["gen"]]
        moved = sum(e["bytes_moved"] for e in fetched)
        fetch = max((e["durations"].get("fetch", 0.0) for e in fetched), default=0.0)
        out.append({"total": past[0]["t"] - row["t_failure"], "rebuild": restored - restore - row["t_failure"],
                    "restore": restore, "redo": past[0]["t"] - restored,
                    "detect": row["detect"] / 1e3, "rebuilt": rebuilt - row["t_failure"],
                    "moved": moved, "fetch": fetch})
    if len(out) < kills:
        print(f"  {mode} {n}x{mb}: {len(out)} of {kills} recoveries measured; see {run_dir}", flush=True)
    return out


def node_loss(n: int, mb: int, a: argparse.Namespace, tmp: Path, cold: bool = False, parity: str | None = None
              ) -> list[dict]:
    """Tier 2: node 1 killed once; the launcher relaunches from the nodes' memory (phases, seconds).
    ``parity``: the rank-unique state kept by that redundancy instead of copies."""
    run_dir = tmp / f"node-{n}-{mb}{'-cold' if cold else ''}{'-parity' if parity else ''}"
    failed_at = a.interval + 7
    launch(n, run_dir, ["--simulate-nodes", str(a.nodes), "--spare-nodes", "1", "--inject", f"node1@{failed_at}"]
           + (["--cold"] if cold else []) + (["--redundancy", parity] if parity else []),
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
    fetched = sum(e["bytes_in"] for e in later if e["event"] == "restored")
    fetch = max(e["durations"]["fetch"] for e in later if e["event"] == "store_recovered")
    return [{"total": past - t_kill, "detect": gone - t_kill, "relaunch": started - gone, "attach": attached - started,
             "fetch": recovered - attached, "resume": resumed - recovered, "redo": past - resumed,
             "fetch_gbps": fetched / fetch / 1e9, "fetched_bytes": fetched, "warm_hosts": warm_hosts(run_dir)}]


def warm_hosts(run_dir: Path) -> list[list[str | None]]:
    """For each rank the relaunch started on a host the first launch did not use: [its host, the host
    of the warm process that forked it (the ``started`` event's), or None where it started cold]."""
    first, new = set(), []
    for path in sorted(run_dir.glob("events-*.jsonl")):
        host = path.stem[len("events-"):].rsplit("-", 1)[0]  # events-<host>-<pid>.jsonl
        for line in path.read_text().splitlines():
            e = json.loads(line)
            if e["event"] != "started":
                continue
            if "relaunch" in e:
                new.append((host, e.get("warm_host")))
            else:
                first.add(host)
    return [[host, warm] for host, warm in new if host not in first]


def tcp_rate(n: int, mb: int, a: argparse.Namespace, tmp: Path) -> float:
    """GB/s of MPI point to point between simulated nodes 0 and N-1 (TCP), ``mb`` MB, in this run."""
    run_dir = tmp / f"tcp-{n}-{mb}"
    launch(n, run_dir, ["--simulate-nodes", str(a.nodes)], ["--state-mb", str(mb)], script_flag="--tcp-worker")
    e = next(e for e in events_of(run_dir) if e["event"] == "tcp")
    return float(e["nbytes"] / e["seconds"] / 1e9)


def restart(n: int, mb: int, kills: int, a: argparse.Namespace, root: Path, nodes: int = 0) -> list[dict]:
    """Checkpoint-restart: ``kills`` jobs in a row, each killed after a checkpoint, then relaunched
    (``nodes``: on simulated nodes, losing node 1 instead of rank 1)."""
    ckpt = root / "ckpt"
    ckpt.mkdir(parents=True)
    steps = a.interval * (kills + 1) + 10
    common = ["--state-mb", str(mb), "--steps", str(steps), "--commit-every", "0",
              "--checkpoint-dir", str(ckpt), "--checkpoint-every", str(a.interval)]
    no_recovery = {"ELASTIC_REBUILD": "spare"}  # no spares: the first death ends the job, as without ULFM
    out = []
    previous = None
    for g in range(kills + 1):
        run_dir = root / str(g)
        where = f"node1@{a.interval * (g + 1) + 7}" if nodes else f"1@{a.interval * (g + 1) + 7}"
        kill = ["--inject", where] if g < kills else []
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
            late = [e for e in events if e["event"] == "committed" and e["version"] >= 2]
            commits = [sum(e["durations"].values()) for e in late]
            for phase in ("prepare", "exchange", "checksum", "vote", "pack"):
                out[f"commit_{phase}_s"] = statistics.median(e["durations"][phase] for e in late)
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


def every_mode(n: int, mb: int, a: argparse.Namespace, root: Path) -> dict[str, list[dict]]:
    """The floor and every mode's kills at (n ranks, mb MB per rank), their jobs alternated."""
    def job(mode: str) -> Callable[[int, Path], list[dict]]:
        return lambda kills, run_dir: in_memory(n, mb, mode, kills, a, run_dir)
    jobs = {"floor": (1, lambda kills, _: floor(n, mb, kills)),
            "shrink": (max(1, n - 2), job("shrink")),  # two ranks left at least
            **{m: (a.reps, job(m)) for m in ("spare", "spare-parity", "spawn", "spawn-cold")},
            "restart": (a.reps, lambda kills, run_dir: restart(n, mb, kills, a, run_dir))}
    return alternated(jobs, {m: a.reps for m in jobs} | {"restart": a.restart_reps}, root)


def alternated(jobs: dict[str, tuple[int, Callable[[int, Path], list[dict]]]], kills: dict[str, int],
               root: Path) -> dict[str, list[dict]]:
    """Each mode's ``kills`` spread over jobs of at most its kills per job (two jobs at least), the
    modes' jobs interleaved evenly over the run: a machine that slows down for a while slows every
    mode alike. ``jobs``: mode -> (kills per job, run(kills, run_dir) -> rows)."""
    queue = []
    for mode, (per_job, _) in jobs.items():
        count = max(2, -(-kills[mode] // per_job)) if kills[mode] else 0
        shares = [kills[mode] // count + (i < kills[mode] % count) for i in range(count)]
        queue += [((i + 0.5) / count, mode, i, k) for i, k in enumerate(shares) if k]
    out: dict[str, list[dict]] = {mode: [] for mode in jobs}
    for _, mode, i, k in sorted(queue):
        out[mode] += jobs[mode][1](k, root / f"{mode}-{i}")
    return out


MB = 1 << 20


def _rate(rows: list[dict]) -> float:
    """GB/s of the recoveries' transfers, the median over those that moved bytes."""
    rates = [r["moved"] / r["fetch"] / 1e9 for r in rows if r["moved"] and r["fetch"] > 0]
    return statistics.median(rates) if rates else float("nan")


def med(rows: list[dict], key: str) -> float:
    return statistics.median(r[key] for r in rows) if rows else float("nan")


def mean(rows: list[dict], key: str) -> float:
    return statistics.fmean(r[key] for r in rows) if rows else float("nan")


def top(rows: list[dict], key: str) -> float:
    return max(r[key] for r in rows) if rows else float("nan")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[4, 8])
    parser.add_argument("--sizes", type=int, nargs="+", default=[10, 128], help="MB of state per rank")
    parser.add_argument("--reps", type=int, default=8, help="failures per mode and configuration")
    parser.add_argument("--parity", default="xor:4",
                        help="the spare-parity mode's --redundancy: (b) with the rank-unique state kept by parity")
    parser.add_argument("--restart-reps", type=int, default=4,
                        help="failures for checkpoint-restart (each a cold relaunch: seconds)")
    parser.add_argument("--interval", type=int, default=10, help="steps between commits / checkpoints")
    parser.add_argument("--max-total-mb", type=int, default=2048, help="skip ranks x MB above this (memory)")
    parser.add_argument("--out", type=Path, default=Path("elastic-run/bench"))
    parser.add_argument("--node-reps", type=int, default=3, help="--nodes: node losses for tier 2 (median, max)")
    parser.add_argument("--nodes", type=int, default=0,
                        help="node loss instead, on this many simulated nodes (+1 spare; root): tier 2 vs restart")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--floor-worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--tcp-worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--state-mb", type=int, default=10, help=argparse.SUPPRESS)
    parser.add_argument("--steps", type=int, default=40, help=argparse.SUPPRESS)
    parser.add_argument("--commit-every", type=int, default=10, help=argparse.SUPPRESS)
    parser.add_argument("--checkpoint-dir", help=argparse.SUPPRESS)
    parser.add_argument("--checkpoint-every", type=int, default=10, help=argparse.SUPPRESS)
    parser.add_argument("--measure-bandwidth", action="store_true", help=argparse.SUPPRESS)
    a = parser.parse_args()
    if a.worker:
        return worker(a)
    if a.floor_worker:
        return floor_worker(a)
    if a.tcp_worker:
        return tcp_worker(a)
    a.out.mkdir(parents=True, exist_ok=True)
    if a.nodes:
        return node_main(a)
    print(f"kill -> first step past the one the job was on, seconds, median of {a.reps} kills (restart: "
          f"{a.restart_reps}); commit / checkpoint every {a.interval} steps, kill 7 steps after one; the modes' jobs "
          "alternate; restart = (d) over (a-c)", flush=True)
    head = ("ranks", "MB", "floor", "shrink", "spare", "spawn", "spawn cold", "restart", "spare/flr", "d/shrink",
            "d/spare", "d/spawn", "spawn/spare", "cold/spare", "detect ms", "max ms", "flr det ms", "rebuilt",
            "restore", "redo", "teardown", "relaunch", "load", "ckpt save")
    print(" ".join(f"{h:>10}" for h in head), flush=True)
    results, table = [], []
    floors: dict[int, list[dict]] = {}
    for n, mb in _configurations(a, 10):
        with tempfile.TemporaryDirectory(dir=a.out) as tmp:
            rows = every_mode(n, mb, a, Path(tmp))
            flat = steady(n, mb, a, Path(tmp))
        # The floor: a raw revoke + shrink of the same ranks, and the lost rank's bytes at the p2p
        # rate between two of them (measured in the floor's jobs, between the same processes),
        # pooled over the sizes so far so that it grows with the bytes.
        floors.setdefault(n, []).extend(rows["floor"])  # the same ranks' floor jobs at every size so far
        floor_s = floor_seconds(floors[n], mb << 20) if floors[n] else float("nan")
        r = {"ranks": n, "mb": mb, **{m: rows[m] for m in rows}, "steady": flat, "floor_s": floor_s}
        results.append(r)
        p2p_gbps = statistics.median(f["bytes"] / f["p2p"] for f in floors[n]) / 1e9 if floors[n] else float("nan")
        for mode in ("shrink", "spare", "spare-parity", "spawn", "spawn-cold", "restart"):
            memory = mode != "restart"
            table.append({"mode": mode, "ranks": n, "mb": mb, "kills": len(rows[mode]),
                          "median_s": med(rows[mode], "total"), "mean_s": mean(rows[mode], "total"),
                          "max_s": top(rows[mode], "total"), "floor_s": floor_s,
                          "detect_ms": 1e3 * med(rows[mode], "detect") if memory else None,
                          "detect_max_ms": 1e3 * top(rows[mode], "detect") if memory else None,
                          # the phases: rebuilt (kill -> world rebuilt), transferred (bytes, GB/s), redone
                          "rebuilt_s": med(rows[mode], "rebuilt") if memory else None,
                          "transferred_mb": med(rows[mode], "moved") / MB if memory else None,
                          "transfer_s": med(rows[mode], "fetch") if memory else None,
                          "transfer_gbps": _rate(rows[mode]) if memory else None, "p2p_gbps": p2p_gbps,
                          "redone_s": med(rows[mode], "redo") if memory else None})
        d = med(rows["restart"], "total")
        spare = med(rows["spare"], "total")
        cells = (n, mb, floor_s, *(med(rows[m], "total") for m in ("shrink", "spare", "spawn", "spawn-cold")), d,
                 spare / floor_s, *(d / med(rows[m], "total") for m in ("shrink", "spare", "spawn")),
                 med(rows["spawn"], "total") / spare, med(rows["spawn-cold"], "total") / spare,
                 1e3 * med(rows["spare"], "detect"), 1e3 * top(rows["spare"], "detect"),
                 1e3 * med(rows["floor"], "seen"),
                 med(rows["spare"], "rebuilt"), med(rows["spare"], "restore"), med(rows["spare"], "redo"),
                 med(rows["restart"], "teardown"), med(rows["restart"], "relaunch"),
                 med(rows["restart"], "load"), med(rows["restart"], "save"))
        print(" ".join(f"{c:>10.3f}" if isinstance(c, float) else f"{c:>10}" for c in cells), flush=True)
    print("\nEvery mode, median / mean / max over its kills (s), and detection (kill -> a survivor sees it, ms):")
    print(" ".join(f"{h:>9}" for h in ("mode", "ranks", "MB", "kills", "median", "mean", "max", "floor", "x floor",
                                        "detect", "det max", "rebuilt", "moved MB", "moved s", "GB/s", "p2p GB/s",
                                        "redone")))

    def shown(value: float | None) -> float | str:
        return "-" if value is None else value

    for t in table:
        cells = (t["mode"], t["ranks"], t["mb"], t["kills"], t["median_s"], t["mean_s"], t["max_s"], t["floor_s"],
                 t["median_s"] / t["floor_s"], shown(t["detect_ms"]), shown(t["detect_max_ms"]),
                 shown(t["rebuilt_s"]), shown(t["transferred_mb"]), shown(t["transfer_s"]), shown(t["transfer_gbps"]),
                 t["p2p_gbps"], shown(t["redone_s"]))
        print(" ".join(f"{c:>9.3f}" if isinstance(c, float) else f"{c:>9}" for c in cells), flush=True)
    print("\nphases of (a-c): rebuild (kill -> recovery under way), restore, redo; shown for spare above.\n"
          "Steady state: seconds per step with commits amortised, and that over no fault tolerance ('x'). "
          "This job's steps are milliseconds; the cost of a commit ('commit s') is what carries to a real step. "
          "p2p: a ring Sendrecv of the same bytes between the same ranks (every rank sends and receives at once, "
          "as in a commit); the commit's phases (s, median): prepare, exchange (the copies to the holders), "
          "checksum, vote, pack (the roll-back copy of the rank's own state).",
          flush=True)
    head = ("ranks", "MB", "no FT", f"every {a.interval}", "every 1", f"x every {a.interval}", "x every 1",
            "commit s", "commit MB/s", "p2p MB/s", "memcpy MB/s", "commit/p2p", "prepare", "exchange", "checksum",
            "vote", "pack")
    print(" ".join(f"{h:>11}" for h in head), flush=True)
    for r in results:
        s = r["steady"]
        cells = (r["ranks"], r["mb"], s[0], s[a.interval], s[1], s[a.interval] / s[0], s[1] / s[0], s["commit_s"],
                 s["commit_MBps"], s["p2p_MBps"], s["memcpy_MBps"], s["commit_MBps"] / s["p2p_MBps"],
                 *(s[f"commit_{k}_s"] for k in ("prepare", "exchange", "checksum", "vote", "pack")))
        print(" ".join(f"{c:>11.4f}" if isinstance(c, float) else f"{c:>11}" for c in cells), flush=True)
    (a.out / "bench_recovery.json").write_text(json.dumps({"interval": a.interval, "rows": table, "results": results},
                                                          indent=1))
    _plot(results, a.out / "bench_recovery.png")
    return 0


def node_main(a: argparse.Namespace) -> int:
    """The node-loss table: tier 2 against checkpoint-restart side by side; tier 2 ``--node-reps``
    times (its median, and its max beside it), the others once (seconds). One tier-2 run says
    little here: this VM hands freed memory back to its host (virtio-balloon free page reporting)
    and faults it in again at ~2.5 ms a MB (0.12 once backed), so the fetch into the relaunched
    ranks' new buffers took 0.17-0.2 s or 0.6-1.4 s at 128 MB from run to run of the same code."""
    a.reps = 1
    print(f"node 1 of {a.nodes} simulated nodes killed {a.interval + 7} steps in (commit / checkpoint every "
          f"{a.interval}); kill -> first step past the one the job was on, seconds", flush=True)
    parity = f"xor:{a.nodes}"  # one member of each group per node
    head = ("ranks", "MB", "tier 2", "t2 max", "t2 cold", "t2 parity", "restart", "restart/t2", "r/t2 cold",
            "p:fetch", "p:GB/s", "detect", "relaunch",
            "attach", "fetch", "resume", "redo", "c:relaunch", "r:teardown", "r:relaunch", "r:load", "ckpt save",
            "fetch GB/s", "tcp GB/s", "fetch/tcp", "warm")
    print(" ".join(f"{h:>10}" for h in head), flush=True)
    results = []
    for n, mb in _configurations(a, 10):
        with tempfile.TemporaryDirectory(dir=a.out) as tmp:
            tcp = tcp_rate(n, mb, a, Path(tmp))
            tier2, cold, by_parity, again = [], [], [], []
            for rep in range(a.node_reps):  # the slow ones alternate with the first tier-2 runs
                tier2 += node_loss(n, mb, a, Path(tmp) / f"t2-{rep}")
                if rep == 0:
                    cold = node_loss(n, mb, a, Path(tmp), cold=True)
                    again = restart(n, mb, 1, a, Path(tmp) / "restart", nodes=a.nodes)
                if rep == 1 or a.node_reps == 1:
                    by_parity = node_loss(n, mb, a, Path(tmp), parity=parity)
        for row in tier2 + cold + by_parity:
            row["tcp_gbps"] = tcp
        results.append({"ranks": n, "mb": mb, "tcp_gbps": tcp, "tier2": tier2, "tier2_cold": cold,
                        "tier2_parity": by_parity, "parity": parity, "restart": again})
        t2, c2, d = med(tier2, "total"), med(cold, "total"), med(again, "total")
        warm = [w for row in tier2 for w in row["warm_hosts"]]
        phases = ("detect", "relaunch", "attach", "fetch", "resume", "redo")
        cells = (n, mb, t2, top(tier2, "total"), c2, med(by_parity, "total"), d, d / t2, d / c2,
                 med(by_parity, "fetch"), med(by_parity, "fetch_gbps"), *(med(tier2, k) for k in phases),
                 med(cold, "relaunch"), *(med(again, k) for k in ("teardown", "relaunch", "load", "save")),
                 med(tier2, "fetch_gbps"), tcp, med(tier2, "fetch_gbps") / tcp,
                 f"{sum(w[0] == w[1] for w in warm)}/{len(warm)}")
        print(" ".join(f"{c:>10.3f}" if isinstance(c, float) else f"{c:>10}" for c in cells), flush=True)
    print(f"t2 parity: tier 2 with --redundancy {parity} (p:fetch its decode, s; p:GB/s its rate); "
          "fetch GB/s: the lost node's bytes over the store's fetch; tcp GB/s: MPI point to point between simulated "
          "nodes 0 and N-1 in the same run; warm: relaunched ranks on new hosts forked by their own host's warm "
          "process / all of them", flush=True)
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

"""The project beside what its users would pick instead, on one job: torchft, and torchrun's restart from a checkpoint.

    pip install -c constraints.txt -e '.[peers]'   # torchft and its lighthouse (without it: its rows are skipped)
    python scripts/bench_peers.py [--workers 4] [--steps 200] [--repeat 3] [--kills 3] [--heartbeats MS,...] [--json]

Every way trains examples/train.py's job (its MLP, data, Adam, global batch 64 split over the
workers, ``--steps`` steps, ``--workers`` workers on this machine, one job at a time, the ways'
runs alternated so a slow spell of the shared machine does not land on one way only):

- ``elastic``: ``mpi`` (examples/train.py, ``allreduce_gradients``) and ``ddp`` (examples/ddp.py, torch DDP
  on the ``ulfm`` group), each with a spare (``spare``) or without (``shrink``), and ``ddp_gloo-spare``
  (examples/ddp.py over Gloo, torchrun's way, a 10 s group timeout), every
  step a recovery point (``--per-step``), and ``ddp_gloo-spare-every5`` committing every 5 steps instead
  (torchrun's checkpoint interval here): launched by ``python -m elastic.launch``.
- ``torchft`` (0.2.0) as its README runs it: a lighthouse (``--min_replicas 1 --join_timeout_ms 10000``),
  one replica group of one worker per worker, each under ``torchrun --max-restarts``, a ``Manager``
  (``min_replica_size=1``) with its ``DistributedDataParallel`` and ``Optimizer`` over
  ``ProcessGroupGloo`` (5 s timeout); one way per lighthouse ``--heartbeat_timeout_ms`` in
  ``--heartbeats`` (its default 5000 first).
- ``torchrun``: torch's DDP over Gloo under ``torchrun --max-restarts``, rank 0 saving model, optimizer and
  step every 5 steps (the project's commit interval), every rank loading it at start.

Per way: failure-free steps/s (the median step of worker 0's run, the median of ``--repeat`` runs);
``--kills`` runs where worker 1 SIGKILLs itself at the start of step ``steps // 2`` (``kill_to_next_s``)
and as many where this script SIGKILLs it at a random moment inside that step (``kill_inside_step_s``).
Both are the longest the job then went without finishing a new step (from the kill on, over the next
three new steps: a kill after the step's reduction lets that step end, and the recovery lands on the
next), the median over the runs. ``steps_lost``: steps finished before the kill and trained again
after it; ``samples_after_kill``: the fewest samples a step trained on after the kill (the global
batch is 64); ``bitwise``: the final weights are the way's failure-free run's in every kill run
(``repeatable``: its failure-free runs end on the same weights); ``survivors_restarted``: in how many
kill runs a worker that was not killed started again (torchrun's restart does it by design). Dropout
masks are seeded per step and worker in the peers' workers, so a restart from a checkpoint could be
exact. The job ends when worker 0 finishes. ``--json``: one JSON object per row (``kill_runs``, the
maxima and the medians' runs beside them); the docs' table: docs/measurements.md.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BOUND = 300  # seconds one run may take before it counts as hung
GLOBAL_BATCH = 64
CHECKPOINT_EVERY = 5


# ---------------------------------------------------------------------------- what a run gives
@dataclass
class Step:
    t: float
    step: int  # the step this end completes, counted from 1
    worker: int
    samples: int  # the global batch it trained on


@dataclass
class Run:
    steps: list[Step]
    kill_t: float | None = None
    digest: str | None = None
    survivors_restarted: bool = False  # a worker that was not killed started again


def steps_per_s(run: Run, total: int) -> float:
    """1 / the median time between worker 0's ends of consecutive steps on the whole global batch,
    over the last three quarters of the run (everyone starts cold; torchft's first worker up trains
    alone, faster, on its share, until the others join)."""
    full = {s.step: s.t for s in run.steps if s.worker == 0 and s.step > total // 4 and s.samples == GLOBAL_BATCH}
    gaps = [t - full[k - 1] for k, t in full.items() if k - 1 in full]
    if not gaps:
        raise ValueError("worker 0 finished no two consecutive steps on the whole global batch (a torchft worker up "
                         "first trains alone until the others join): run more --steps")
    return 1 / statistics.median(gaps)


def _progress(run: Run) -> list[tuple[float, int]]:
    """(time, step) each time the job finished a step it had not finished before."""
    out, best = [], 0
    for s in sorted(run.steps, key=lambda s: s.t):
        if s.step > best:
            best = s.step
            out.append((s.t, s.step))
    return out


def stall(run: Run, new_steps: int = 3) -> float:
    """The longest the job went without finishing a new step, from the kill on, over its next
    ``new_steps`` new steps."""
    assert run.kill_t is not None
    after = [t for t, _ in _progress(run) if t > run.kill_t][:new_steps]
    if len(after) < new_steps:
        raise ValueError(f"the job finished {len(after)} new steps after the kill, not {new_steps}")
    return max(b - a for a, b in zip([run.kill_t, *after], after))


def steps_lost(run: Run) -> int:
    """Steps the job had finished before the kill and trained again after it."""
    assert run.kill_t is not None
    done = max((s.step for s in run.steps if s.t <= run.kill_t), default=0)
    return len({s.step for s in run.steps if s.t > run.kill_t and s.step <= done})


def samples_after(run: Run) -> int:
    """The fewest samples a step finished after the kill trained on."""
    assert run.kill_t is not None
    return min(s.samples for s in run.steps if s.t > run.kill_t)


# ---------------------------------------------------------------------------- the ways
@dataclass(frozen=True)
class Way:
    tool: str
    way: str
    heartbeat_ms: int = 0  # torchft's lighthouse only

    @property
    def name(self) -> str:
        return f"{self.tool}/{self.way}"


# The project's programs: examples/train.py, and examples/ddp.py on the ulfm group or over Gloo
# (torchrun's own way).
PROGRAMS = {"mpi": ("examples/train.py",), "ddp": ("examples/ddp.py",),
            "ddp_gloo": ("examples/ddp.py", "--backend", "gloo", "--group-timeout", "10")}


def elastic_ways() -> list[Way]:
    """Every step a recovery point (as torchft's), and ddp_gloo also committing every 5 steps instead
    (``-every5``: torchrun's checkpoint interval here, its like for like)."""
    return [Way("elastic", f"{path}-{mode}") for path in ("mpi", "ddp") for mode in ("spare", "shrink")] + \
        [Way("elastic", "ddp_gloo-spare"), Way("elastic", f"ddp_gloo-spare-every{CHECKPOINT_EVERY}")]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait(procs: list[subprocess.Popen], done, bound: float) -> None:
    """Until ``done()`` or every process ended; past ``bound`` seconds the run is a failure."""
    end = time.monotonic() + bound
    while not done() and any(p.poll() is None for p in procs):
        if time.monotonic() > end:
            raise TimeoutError(f"no end after {bound:.0f} s")
        time.sleep(0.05)


def _stop(procs: list[subprocess.Popen]) -> None:
    """End every process of a run, their own children too (each leads its own process group)."""
    for p in procs:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p.pid, signal.SIGKILL)
        p.wait()


class Killer:
    """The outside kill: once the job reached step ``at``, SIGKILL worker 1 at a random moment of the next step."""

    def __init__(self, at: int, step_s: float, rng: random.Random) -> None:
        self.at, self.delay, self.kill_t = at, rng.uniform(0, step_s), None

    def poll(self, reached: int, pid_of_worker_1) -> None:
        if self.kill_t is None and reached >= self.at:
            time.sleep(self.delay)
            pid = pid_of_worker_1()
            self.kill_t = time.time()
            os.kill(pid, signal.SIGKILL)


# ---- the project
def run_elastic(way: Way, workers: int, steps: int, run_dir: Path, kill: str | None, killer: Killer | None) -> Run:
    from elastic.comm.events import read_events
    path, mode, *every = way.way.split("-")
    points = [f"--commit-every={every[0].removeprefix('every')}"] if every else ["--per-step"]
    launcher = ["--spares", "1"] if mode == "spare" else ["--rebuild", "shrink"]
    if kill == "boundary":
        launcher += ["--inject", f"1@{steps // 2}"]
    cmd = [sys.executable, "-m", "elastic.launch", "-n", str(workers), "--quiet", "--timeout", str(BOUND),
           "--run-dir", str(run_dir), *launcher, "--", sys.executable, *PROGRAMS[path], "--steps", str(steps),
           *points]
    with open(run_dir.with_suffix(".out"), "w") as out:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)

    def events() -> list[dict]:
        try:
            return read_events(run_dir) if run_dir.exists() else []
        except ValueError:  # a line being written
            return []

    def poll_killer() -> bool:
        if killer is not None:
            ev = events()
            killer.poll(max((e["step"] for e in ev if e["event"] == "step"), default=0),
                        lambda: next(e["pid"] for e in ev if e["event"] == "started" and e["logical"] == 1))
        return False

    try:
        _wait([proc], poll_killer, BOUND)
    finally:
        _stop([proc])
    if proc.returncode:
        raise RuntimeError(f"{' '.join(cmd)}: rc {proc.returncode}, see {run_dir.with_suffix('.out')}")
    ev = read_events(run_dir)
    run = Run([Step(e["t"], e["step"], e["logical"], int(e["samples"][0])) for e in ev if e["event"] == "step"])
    run.digest = next(e["model_sha256"] for e in ev if e["event"] == "result")
    injected = [e["t"] for e in ev if e["event"] == "inject"]
    run.kill_t = killer.kill_t if killer else injected[0] if injected else None
    starts = [e["logical"] for e in ev if e["event"] == "started" and e["role"] == "initial"]
    run.survivors_restarted = any(starts.count(w) > 1 for w in range(workers) if w != 1)
    return run


# ---- the peers: their workers write one JSON line per finished step into the run directory
def _read_logs(run_dir: Path) -> list[dict]:
    out = []
    for path in run_dir.glob("worker-*.jsonl"):
        for line in path.read_text().splitlines():
            with contextlib.suppress(ValueError):  # a line being written
                out.append(json.loads(line))
    return out


def _run_peer(cmds: list[tuple[list[str], dict]], run_dir: Path, workers: int, killer: Killer | None,
              extra: list[subprocess.Popen]) -> Run:
    """Start the workers' commands, wait until worker 0 finished (then the others, a while), stop everything."""
    procs = []
    logs = run_dir / "logs"
    logs.mkdir(parents=True)
    try:
        for i, (cmd, env) in enumerate(cmds):
            with open(logs / f"{i}.out", "w") as out:
                procs.append(subprocess.Popen(cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT,
                                              env={**os.environ, **env}, start_new_session=True))
        finals: set[int] = set()

        def done() -> bool:
            records = _read_logs(run_dir)
            finals.update(r["worker"] for r in records if "final" in r)
            if killer is not None:
                pids = [r["pid"] for r in records if "pid" in r and r["worker"] == 1]
                killer.poll(max((r["step"] for r in records if "step" in r), default=0), lambda: pids[-1])
            return len(finals) == workers

        _wait(procs, lambda: 0 in finals or done(), BOUND)
        with contextlib.suppress(TimeoutError):  # a restarted worker may still be catching up: its steps do not count
            _wait(procs, done, 10)
    finally:
        _stop(procs + extra)
    records = _read_logs(run_dir)
    if 0 not in finals:
        raise RuntimeError(f"worker 0 did not finish; see {logs}")
    final = next(r for r in records if r["worker"] == 0 and "final" in r)
    # The job ends with worker 0: a torchft replica restarted too late to rejoin its peers
    # trains alone after they left, from step 1 (its own quorum of one), and that is not the job.
    run = Run([Step(r["t"], r["step"], r["worker"], r["samples"]) for r in records
               if "step" in r and r["t"] <= final["t"]])
    run.digest = final["final"]
    kills = [r["kill"] for r in records if "kill" in r]
    run.kill_t = killer.kill_t if killer else kills[0] if kills else None
    starts = [r["worker"] for r in records if "pid" in r]
    run.survivors_restarted = any(starts.count(w) > 1 for w in range(workers) if w != 1)
    return run


def _worker_cmd(tool: str, workers: int, steps: int, run_dir: Path, kill: str | None) -> list[str]:
    cmd = [str(Path(__file__)), "--worker", tool, "--workers", str(workers), "--steps", str(steps),
           "--run-dir", str(run_dir)]
    return cmd + (["--kill-at", str(steps // 2)] if kill == "boundary" else [])


# torch 2.13's torchrun shares its rendezvous store with the workers by default, and a restarted
# group then reads the dead group's Gloo addresses from it (pytorch#135712): without this no restart
# gets past init_process_group.
RESTARTABLE = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}


def _torchrun(nproc: int) -> list[str]:
    # --standalone: its own rendezvous on a free port; restarts: a killed worker comes back
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes", "1",
            "--nproc-per-node", str(nproc), "--max-restarts", "3"]


def run_torchft(way: Way, workers: int, steps: int, run_dir: Path, kill: str | None, killer: Killer | None) -> Run:
    port = _free_port()
    lighthouse = subprocess.Popen(
        [shutil.which("torchft_lighthouse") or "torchft_lighthouse", "--min_replicas", "1", "--quorum_tick_ms",
         "100", "--join_timeout_ms", "10000", "--heartbeat_timeout_ms", str(way.heartbeat_ms),
         "--bind", f"[::]:{port}"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    env = {"TORCHFT_LIGHTHOUSE": f"http://localhost:{port}", "NUM_REPLICA_GROUPS": str(workers)}
    cmds = [(_torchrun(1) + _worker_cmd("torchft", workers, steps, run_dir, kill), {**env, "REPLICA_GROUP_ID": str(i)})
            for i in range(workers)]
    return _run_peer(cmds, run_dir, workers, killer, [lighthouse])


def run_torchrun(way: Way, workers: int, steps: int, run_dir: Path, kill: str | None, killer: Killer | None) -> Run:
    return _run_peer([(_torchrun(workers) + _worker_cmd("torchrun", workers, steps, run_dir, kill), RESTARTABLE)],
                     run_dir, workers, killer, [])


RUNNERS = {"elastic": run_elastic, "torchft": run_torchft, "torchrun": run_torchrun}


# ---------------------------------------------------------------------------- the peers' workers
def _job():
    """examples/train.py's options, data, model, global batches and digest."""
    from _train_job import train_and_defaults
    train, args = train_and_defaults()
    x, y, model = train.setup(args)
    import elastic
    return args, x, y, model, elastic.GlobalBatches(args.samples, GLOBAL_BATCH, args.seed), train.digest


class _Log:
    def __init__(self, run_dir: Path, worker: int) -> None:
        self.worker = worker
        self.file = open(run_dir / f"worker-{worker}.jsonl", "a", buffering=1)
        self.write(pid=os.getpid())

    def write(self, **record) -> None:
        self.file.write(json.dumps({"worker": self.worker, **record}) + "\n")


def _maybe_kill(args: argparse.Namespace, worker: int, step: int, log: _Log) -> None:
    """The boundary kill: worker 1 at the start of step ``--kill-at`` (or its first after it: a torchft
    replica that came up late joins at the step its peers reached), in its first life only."""
    if worker == 1 and 0 <= args.kill_at <= step and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0":
        log.write(kill=time.time())
        os.kill(os.getpid(), signal.SIGKILL)


def _shard(batches, step: int, worker: int, workers: int):
    import numpy as np
    import torch
    return torch.from_numpy(np.array_split(batches.batch(step), workers)[worker])


def _all_up(args: argparse.Namespace, worker: int, bound: float = 120.0) -> None:
    """Wait, in a first life, until every worker is up (its file in the run directory): the first
    torchft replica up forms a quorum alone and trains on its share until the others join, and on
    a loaded machine that was most of the run (no step on the whole global batch to time, or the
    run over before the kill). A restarted worker joins its peers' quorum at once."""
    if os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0":
        return
    (args.run_dir / f"up-{worker}").touch()
    deadline = time.monotonic() + bound
    while len(list(args.run_dir.glob("up-*"))) < args.workers:
        if time.monotonic() > deadline:
            raise SystemExit(f"bench_peers: {args.workers} torchft workers not all up after {bound:g} s")
        time.sleep(0.05)  # polling a condition: the others' files


def worker_torchft(args: argparse.Namespace) -> None:
    from datetime import timedelta

    import torch
    from torchft import DistributedDataParallel, Manager, Optimizer, ProcessGroupGloo
    replica = int(os.environ["REPLICA_GROUP_ID"])
    job, x, y, model, batches, digest = _job()
    log = _Log(args.run_dir, replica)
    optimizer = torch.optim.Adam(model.parameters(), lr=job.lr)

    def state_dict():
        return {"model": model.state_dict(), "optim": optimizer.state_dict()}

    def load_state_dict(sd) -> None:
        model.load_state_dict(sd["model"])
        optimizer.load_state_dict(sd["optim"])

    manager = Manager(pg=ProcessGroupGloo(timeout=timedelta(seconds=5)), min_replica_size=1,
                      load_state_dict=load_state_dict, state_dict=state_dict,
                      replica_id=f"bench_peers_{replica}", timeout=timedelta(seconds=30))
    ddp = DistributedDataParallel(manager, model)
    opt = Optimizer(manager, optimizer)
    _all_up(args, replica)
    while manager.current_step() < args.steps:
        step = manager.current_step()
        _maybe_kill(args, replica, step, log)
        torch.manual_seed(job.seed * 1_000_003 + step * 64 + replica)  # dropout: the same masks whoever trains
        opt.zero_grad()  # starts the quorum
        idx = _shard(batches, step, replica, args.workers)
        torch.nn.functional.mse_loss(ddp(x[idx]), y[idx]).backward()  # DDP averages over the participants
        opt.step()  # steps only if the quorum's all-reduce went through everywhere
        if manager.current_step() > step:
            log.write(step=manager.current_step(), t=time.time(),
                      samples=len(idx) * manager.num_participants())
    log.write(final=digest(model.state_dict()), t=time.time())


def worker_torchrun(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    dist.init_process_group("gloo")
    rank, size = dist.get_rank(), dist.get_world_size()
    job, x, y, model, batches, digest = _job()
    log = _Log(args.run_dir, rank)
    optimizer = torch.optim.Adam(model.parameters(), lr=job.lr)
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    checkpoint, step = args.run_dir / "checkpoint.pt", 0
    if checkpoint.exists():
        saved = torch.load(checkpoint)
        model.load_state_dict(saved["model"])
        optimizer.load_state_dict(saved["optim"])
        step = saved["step"]
    while step < args.steps:
        _maybe_kill(args, rank, step, log)
        torch.manual_seed(job.seed * 1_000_003 + step * 64 + rank)
        optimizer.zero_grad()
        idx = _shard(batches, step, rank, size)
        torch.nn.functional.mse_loss(ddp(x[idx]), y[idx]).backward()
        optimizer.step()
        step += 1
        log.write(step=step, t=time.time(), samples=GLOBAL_BATCH)
        if rank == 0 and step % CHECKPOINT_EVERY == 0:
            tmp = checkpoint.with_suffix(".tmp")
            torch.save({"model": model.state_dict(), "optim": optimizer.state_dict(), "step": step}, tmp)
            tmp.replace(checkpoint)  # a kill mid-save leaves the previous one
    log.write(final=digest(model.state_dict()), t=time.time())
    dist.destroy_process_group()


# ---------------------------------------------------------------------------- the table
def ways(heartbeats: list[int]) -> tuple[list[Way], list[str]]:
    """Every way that can run here, and a line for each peer that cannot."""
    out, skipped = elastic_ways(), []
    try:
        import torchft  # noqa: F401
        if not shutil.which("torchft_lighthouse"):
            raise ImportError("no torchft_lighthouse on PATH")
        out += [Way("torchft", f"heartbeat-{ms}ms", ms) for ms in heartbeats]
    except ImportError as e:
        skipped.append(f"torchft skipped ({e}): pip install -c constraints.txt -e '.[peers]'")
    out.append(Way("torchrun", "restart"))
    return out, skipped


def one(way: Way, args: argparse.Namespace, tmp: Path, label: str, kill: str | None, rng: random.Random,
        step_s: float) -> Run:
    run_dir = tmp / f"{way.tool}-{way.way}-{label}"
    killer = Killer(args.steps // 2, step_s, rng) if kill == "inside" else None
    return RUNNERS[way.tool](way, args.workers, args.steps, run_dir, kill, killer)


def measure(all_ways: list[Way], args: argparse.Namespace, tmp: Path) -> list[dict]:
    rng = random.Random(args.seed)
    clean: dict[Way, list[Run]] = {w: [] for w in all_ways}
    kills: dict[Way, dict[str, list[Run]]] = {w: {"boundary": [], "inside": []} for w in all_ways}
    total = len(all_ways) * (args.repeat + 2 * args.kills)
    done, began = 0, time.monotonic()
    for i in range(max(args.repeat, args.kills)):  # alternated: a slow spell spreads over every way
        for way in all_ways:
            if i < args.repeat:
                clean[way].append(one(way, args, tmp, f"clean-{i}", None, rng, 0))
            step_s = 1 / steps_per_s(clean[way][0], args.steps)
            for kind in ("boundary", "inside") if i < args.kills else ():
                kills[way][kind].append(one(way, args, tmp, f"{kind}-{i}", kind, rng, step_s))
            done += (i < args.repeat) + 2 * (i < args.kills)
            so_far = time.monotonic() - began  # on stderr: --json's stdout stays the rows
            print(f"[bench_peers] round {i + 1}: {way.name} done, {done}/{total} runs ({so_far:.0f} s so far, about "
                  f"{so_far / done * (total - done):.0f} s to go)", file=sys.stderr, flush=True)
    return [row(way, clean[way], kills[way], args.steps) for way in all_ways]


def row(way: Way, clean: list[Run], kills: dict[str, list[Run]], steps: int) -> dict:
    every = kills["boundary"] + kills["inside"]
    rates = [steps_per_s(r, steps) for r in clean]
    boundary, inside = [stall(r) for r in kills["boundary"]], [stall(r) for r in kills["inside"]]
    return {"tool": way.tool, "way": way.way,
            "steps_per_s": statistics.median(rates), "steps_per_s_runs": rates,
            "kill_to_next_s": statistics.median(boundary), "kill_to_next_max_s": max(boundary),
            "kill_to_next_runs": boundary,
            "kill_inside_step_s": statistics.median(inside), "kill_inside_step_max_s": max(inside),
            "kill_inside_step_runs": inside,
            "steps_lost": max(steps_lost(r) for r in every),
            "samples_after_kill": min(samples_after(r) for r in every),
            "bitwise": all(r.digest == clean[0].digest for r in every),
            "survivors_restarted": sum(r.survivors_restarted for r in every), "kill_runs": len(every),
            "repeatable": len({r.digest for r in clean}) == 1}


def print_table(table: list[dict], skipped: list[str], args: argparse.Namespace) -> None:
    print(f"{args.workers} workers, {args.steps} steps, global batch {GLOBAL_BATCH}; steps/s the median of "
          f"{args.repeat} runs; kills of worker 1 at step {args.steps // 2}, {args.kills} runs each: the median (max)")
    head = ("tool", "way", "steps/s", "vs elastic", "kill -> next s", "kill inside step s", "vs best torchft",
            "steps lost", "samples after", "bitwise", "repeatable", "survivors restarted")
    print(" | ".join(head))
    base = next((r["steps_per_s"] for r in table if r["way"] == "mpi-spare"), table[0]["steps_per_s"])
    torchft = [r for r in table if r["tool"] == "torchft"]
    best = min((r["kill_to_next_s"] for r in torchft), default=None)
    for r in table:
        print(" | ".join([r["tool"], r["way"], f"{r['steps_per_s']:.1f}", f"{r['steps_per_s'] / base:.2f}",
                          f"{r['kill_to_next_s']:.3f} ({r['kill_to_next_max_s']:.3f})",
                          f"{r['kill_inside_step_s']:.3f} ({r['kill_inside_step_max_s']:.3f})",
                          f"{r['kill_to_next_s'] / best:.2f}" if best else "-", str(r["steps_lost"]),
                          str(r["samples_after_kill"]), "yes" if r["bitwise"] else "no",
                          "yes" if r["repeatable"] else "no", f"{r['survivors_restarted']} of {r['kill_runs']}"]))
    for line in skipped:
        print(line)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     epilog="time: (--repeat + 2 x --kills) runs per way, one after the other: more "
                                            "than 15 minutes with the defaults on a loaded 2-core machine (the third "
                                            "round's torchft rows at 15 min, stop 42); progress on stderr")
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--repeat", type=int, default=3, help="failure-free runs per way, alternated (median)")
    parser.add_argument("--kills", type=int, default=3, help="runs per way and kind of kill, alternated (median, max)")
    parser.add_argument("--heartbeats", default="5000,1000,500",
                        help="torchft's lighthouse --heartbeat_timeout_ms, one way each (its default 5000 first)")
    parser.add_argument("--seed", type=int, default=0, help="draws the outside kills' moments")
    parser.add_argument("--ways", help="only these, comma-separated TOOL/WAY names (e.g. elastic/mpi-spare,"
                        "torchrun/restart; default every way); ratios are to elastic/mpi-spare where it runs")
    parser.add_argument("--json", action="store_true", help="one JSON object per row")
    parser.add_argument("--keep", action="store_true", help="keep every run's events and logs (says where)")
    parser.add_argument("--worker", choices=("torchft", "torchrun"), help=argparse.SUPPRESS)
    parser.add_argument("--run-dir", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--kill-at", type=int, default=-1, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        {"torchft": worker_torchft, "torchrun": worker_torchrun}[args.worker](args)
        return 0
    if GLOBAL_BATCH % args.workers or args.steps < 8:
        parser.error(f"--workers must divide the global batch ({GLOBAL_BATCH}); --steps at least 8")
    all_ways, skipped = ways([int(ms) for ms in args.heartbeats.split(",")])
    if args.ways:
        only = set(args.ways.split(","))
        known = {w.name for w in all_ways}
        unknown = {n for n in only - known if not (skipped and n.startswith("torchft/"))}  # skipped: said below
        if unknown:
            parser.error(f"--ways: no way named {', '.join(sorted(unknown))}; of {', '.join(sorted(known))}")
        all_ways = [w for w in all_ways if w.name in only]
    # A SIGTERM (timeout's, a batch system's) ends it through the finally blocks that stop each run's
    # processes: a lighthouse or torchrun left behind would outlive the benchmark.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    tmp = tempfile.mkdtemp(prefix="bench_peers-")
    try:
        table = measure(all_ways, args, Path(tmp))
    finally:
        if args.keep:
            print(f"[bench_peers] every run's events and logs kept in {tmp}", file=sys.stderr)
        else:
            shutil.rmtree(tmp, ignore_errors=True)
    if args.json:
        for r in table:
            print(json.dumps(r))
        for line in skipped:
            print(line, file=sys.stderr)
    else:
        print_table(table, skipped, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())

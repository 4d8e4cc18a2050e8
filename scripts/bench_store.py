"""Benchmark the replicated store: its planning at scale, and its bytes against raw MPI, side by side.

    python scripts/bench_store.py --plan --ranks 64 1024 4096 16384 --chunks 1024 [--json]
    python scripts/bench_store.py --sizes 16 128 512 --ranks 4 8 [--json]
    python scripts/bench_store.py --sizes 16 128 --ranks 8 --redundancy copies:2,xor:4,xor:8,rs:4+2 [--json]

``--plan`` (one process, no MPI): for ``n`` ranks on hosts of 8 and ``--chunks``
chunks per rank, the seconds one rank spends on placement for a commit (the
failure domains, built once per generation, and its own pieces) and on the
recovery plan for one dead rank and for one dead host of 8 ranks, and the
busiest sender over the fair share (the lost chunks over the live ranks of the
other hosts, rounded up: a chunk is not split).

``--sizes``: for each (ranks, MB per rank) one job under mpiexec --with-ft ulfm
with one spare. In it, side by side: a ring Sendrecv of the same bytes (raw
point-to-point), memcpy, 7 commits (replication 2, 8 MB chunks; cold = the
first, warm = the median of the last 5, their max beside it; with the store's roll-back copy, the
default, and without it: ``--copy``), the memory each rank holds (RSS, and
its high-water mark, over the state's size: the state itself counts as 1),
then logical rank 1 is SIGKILLed and the spare takes over: kill -> the
world rebuilt -> the state fetched from the peers -> rolled back in place on
every rank ('down'), against the floor of ULFM (kill -> seen -> world rebuilt)
plus the lost bytes at the measured point-to-point bandwidth.

``--redundancy``: each of these ways of keeping the state (``copies:R``, ``xor:K``, ``rs:K+M``), one
job each, in turn for every size; ``rs:K+M`` loses M ranks of one group at once (M spares) and must
come back bitwise. Encode = the state over the seconds the commit spends adding blocks into its
parity (XOR, GF(2^8): the arithmetic, its traffic is the exchange phase), decode = the state over
the fetch, both against the same job's memcpy and p2p rates.

``--interleaved N``: besides, one job per size holding a store of every way over the same state,
their commits in turn N times (the order rotating), so that the machine's drift between jobs and
each job's own memory layout are out of the comparison: each way's commit (the slowest rank's),
and its ratio to the first way's in the same turn: median, mean and max (the first two turns
left out: cold).

``--rounds R``: the ways in turn, R times over (a job each), and per way the ratios of its commit and
its memory to the first way's job of the same round (adjacent jobs: the machine's load drifts slower
than a round): median, mean and max over the rounds.
"""
from __future__ import annotations

import argparse
import collections
import json
import math
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from elastic.comm.events import read_events  # noqa: E402  (no MPI: the tool does not start it)
CHUNK = 8 << 20
COMMITS = 7  # per job: the first is cold, the first two are left out of the warm median
PHASES = ("prepare", "exchange", "encode", "checksum", "vote", "pack")


# ---------------------------------------------------------------------------- planning, one process
def plan_row(n: int, chunks: int, replication: int) -> dict:
    from elastic.recovery._placement import Layout, pieces, plan

    domain_of = {r: f"host{r // 8}" for r in range(n)}
    me = n // 2
    t = time.perf_counter()
    layout = Layout.of(domain_of)
    pieces(layout, me, chunks, replication)
    place = time.perf_counter() - t
    row = {"ranks": n, "chunks": chunks, "replication": replication, "place_seconds": place}
    worst = 0.0
    for label, dead in (("rank", {me}), ("host", set(range(8, 16)))):
        live = set(layout.ranks) - dead
        t = time.perf_counter()
        chosen = plan(layout, dead, {o: chunks for o in dead}, replication, live)
        row[f"plan_{label}_seconds"] = time.perf_counter() - t
        load: collections.Counter = collections.Counter()
        for p in chosen.values():
            load[p.holder] += p.count
        dead_hosts = {layout.place[d][0] for d in dead}
        senders = sum(1 for r in live if layout.place[r][0] not in dead_hosts)
        fair = math.ceil(sum(load.values()) / senders)
        row[f"busiest_{label}_over_fair"] = max(load.values()) / fair
        worst = max(worst, row[f"busiest_{label}_over_fair"])
    row["plan_seconds"] = max(row["plan_rank_seconds"], row["plan_host_seconds"])
    row["busiest_over_fair"] = worst
    row.update(parity_row(layout, me))
    return row


def parity_row(layout, me: int) -> dict:
    """xor:8: one rank's group, and the decode plan for a dead host of 8 (seconds, one process)."""
    from elastic.recovery import Redundancy
    from elastic.recovery._fetch import Fetch
    from elastic.recovery._parity import group_of
    from elastic.recovery._paritystore import plan_decodes

    t = time.perf_counter()
    group_of(layout, me, 8)
    group_s = time.perf_counter() - t
    dead = tuple(range(8, 16))
    fetch = Fetch(0, dead, frozenset(set(layout.ranks) - set(dead)), {d: d for d in dead})
    t = time.perf_counter()
    decodes, lost = plan_decodes(layout, fetch, Redundancy.parse("xor:8"), frozenset(dead))
    assert len(decodes) == 8 and not lost  # a host's 8 ranks: one member of 8 groups each
    return {"parity_group_seconds": group_s, "parity_plan_host_seconds": time.perf_counter() - t}


# ---------------------------------------------------------------------------- bytes, under mpiexec
def _memory() -> tuple[int, int]:
    """(resident bytes now, their high-water mark) of this process."""
    fields = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines() if ":" in line)
    return int(fields["VmRSS"].split()[0]) << 10, int(fields["VmHWM"].split()[0]) << 10


def raw_bandwidth(world, buf: np.ndarray) -> dict[str, float]:
    """Seconds for a ring Sendrecv of ``buf`` (median of 3) and for a memcpy of it (collective)."""
    comm = world.mpi.comm
    recv = np.empty_like(buf)
    recv[:] = 0  # touched: the bandwidth of the wire, not of page faults
    right, left = (world.rank + 1) % world.size, (world.rank - 1) % world.size
    times = []
    for _ in range(3):
        comm.Barrier()
        t = time.perf_counter()
        comm.Sendrecv(buf, dest=right, recvbuf=recv, source=left)
        comm.Barrier()
        times.append(time.perf_counter() - t)
    t = time.perf_counter()
    np.copyto(recv, buf)
    return {"p2p_s": statistics.median(times), "memcpy_s": time.perf_counter() - t}


def worker(mb: int, rollback_copy: bool, redundancy: str) -> int:
    import elastic
    from mpi4py import MPI
    from elastic.recovery import Redundancy

    nbytes = mb << 20
    base, _ = _memory()
    # Allocated, and touched, before a spare parks in init(): a program builds its model first.
    state = {"weights": np.zeros(nbytes // 8)}
    world = elastic.init()
    comm = world.mpi.comm
    run_dir = Path(os.environ["ELASTIC_RUN_DIR"])
    if world.role is not elastic.Role.RECOVERED:
        state["weights"][...] = np.random.default_rng(int(world.logical_rank)).random(nbytes // 8)
    kept = Redundancy.parse(redundancy)
    store = _store(world, kept, rollback_copy)
    killed = range(1, 1 + _losses(kept))
    out: dict[str, float] = {}
    if world.role is not elastic.Role.RECOVERED:
        times = []
        for v in range(COMMITS):
            comm.Barrier()
            t = time.perf_counter()
            store.commit(state, v + 1)
            times.append(time.perf_counter() - t)
        rss, peak = _memory()
        out["commit_cold_s"], out["commit_s"], out["commit_max_s"] = \
            times[0], statistics.median(times[2:]), max(times[2:])
        out["steady_over_state"], out["peak_over_state"] = (rss - base) / nbytes, (peak - base) / nbytes
        out.update(raw_bandwidth(world, state["weights"]))  # after: its receive buffer is no memory of the store's
        comm.Barrier()
        if world.logical_rank in killed:
            if world.logical_rank == 1:
                (run_dir / "killed_at").write_text(repr(time.time()))
            os.kill(os.getpid(), signal.SIGKILL)
        try:
            with world.mpi.guard():
                comm.Barrier()
            raise SystemExit("ranks were killed but the barrier completed")
        except elastic.ProcessFailure:
            pass
        rebuild = world.recover()
        out["rebuild_s"] = rebuild.durations["total"]
    comm = world.mpi.comm
    store.recover()
    mine = store.restore()["weights"]
    state["weights"][...] = mine  # the roll-back, in place, as State.restore does
    comm.Barrier()  # the next step can start
    done = time.time()
    ok = state["weights"].tobytes() == np.random.default_rng(int(world.logical_rank)).random(nbytes // 8).tobytes()
    all_ok = comm.allreduce(int(ok), op=MPI.MIN)
    fetch = comm.allreduce(store.last_recovery["fetch"], op=MPI.MAX)
    results = comm.gather(out, root=0)
    if world.rank == 0:
        merged = {k: statistics.median(r[k] for r in results if k in r) for k in results[0]}
        merged["commit_max_s"] = max(r["commit_max_s"] for r in results if "commit_max_s" in r)
        merged.update(fetch_s=fetch, restored_ok=bool(all_ok), mb=mb, ranks=world.size, lost=len(killed),
                      down_s=done - float((run_dir / "killed_at").read_text()))
        (run_dir / "bench.json").write_text(json.dumps(merged))
    world.finish()
    return 0


def interleaved_worker(mb: int, ways: list[str], turns: int) -> int:
    """Every way's store over one state, committed in turn; the slowest rank's seconds of each."""
    import elastic
    from elastic.recovery import Redundancy

    state = {"weights": np.zeros((mb << 20) // 8)}
    world = elastic.init()
    comm = world.mpi.comm
    state["weights"][...] = np.random.default_rng(int(world.logical_rank)).random(state["weights"].size)
    stores = {way: _store(world, Redundancy.parse(way)) for way in ways}
    times: dict[str, list[float]] = {way: [] for way in ways}
    for turn in range(turns):
        for way in ways[turn % len(ways):] + ways[:turn % len(ways)]:
            comm.Barrier()
            t = time.perf_counter()
            stores[way].commit(state, turn + 1)
            times[way].append(time.perf_counter() - t)
    slowest = {way: np.max(comm.allgather(times[way]), axis=0).tolist() for way in ways}
    if world.rank == 0:
        Path(os.environ["ELASTIC_RUN_DIR"], "bench.json").write_text(json.dumps(slowest))
    world.finish()
    return 0


def interleaved_row(n: int, mb: int, ways: list[str], turns: int) -> dict | str:
    with tempfile.TemporaryDirectory() as tmp:
        times = _job(tmp, n, 0, str(mb), "--redundancy", ",".join(ways), "--interleaved", str(turns))
    if isinstance(times, str):
        return times
    first = ways[0]
    row: dict = {"interleaved": True, "ranks": n, "mb": mb, "turns": turns, "over": first}
    for way in ways:
        warm = times[way][2:]
        row[way] = {"commit_s": _spread(warm), "over_first": _spread([t / f for t, f in zip(warm, times[first][2:])])}
    return row


def _store(world, kept, rollback_copy: bool = True):
    """The store that keeps the state the way ``kept`` says."""
    from elastic.recovery import ParityStore, ReplicatedStore
    if kept.parity:
        return ParityStore(world, kept, chunk_bytes=CHUNK, rollback_copy=rollback_copy)
    return ReplicatedStore(world, replication=kept.copies, chunk_bytes=CHUNK, rollback_copy=rollback_copy)


def _job(tmp: str, n: int, spares: int, *worker_args: str) -> dict | str:
    """This script's worker on ``n`` ranks (and ``spares``) under the launcher, run dir ``tmp``: what its
    rank 0 wrote, or why there is nothing."""
    cmd = [sys.executable, "-m", "elastic.launch", "-n", str(n), "--spares", str(spares), "--timeout", "900",
           "--run-dir", tmp, "--", sys.executable, __file__, "--worker", *worker_args]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=960)
    bench = Path(tmp, "bench.json")
    if not bench.exists():
        return f"failed:\n{proc.stdout[-2000:]}{proc.stderr[-2000:]}"
    return json.loads(bench.read_text())


def _spread(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "mean": statistics.mean(values), "max": max(values)}


def _losses(kept) -> int:
    """Ranks one job loses at once: as many as a parity group survives (one for copies)."""
    return kept.m if kept.parity else 1


def bytes_row(n: int, mb: int, rollback_copy: bool, redundancy: str = "copies:2") -> dict | str:
    from elastic.recovery import Redundancy
    with tempfile.TemporaryDirectory() as tmp:
        r = _job(tmp, n, _losses(Redundancy.parse(redundancy)), str(mb), "--redundancy", redundancy,
                 *([] if rollback_copy else ["--no-rollback-copy"]))
        if isinstance(r, str):
            return r
        phases = _phases(tmp)
        # ULFM's part: the kill seen by the survivors and the world rebuilt around it.
        rebuilt = max(e["t"] for e in read_events(tmp) if e["event"] == "rebuilt")
        r["rebuild_s"] = rebuilt - float(Path(tmp, "killed_at").read_text())
    p2p_bw = (mb << 20) / r["p2p_s"]
    floor = r["rebuild_s"] + (mb << 20) / p2p_bw
    return {"ranks": n, "mb": mb, "redundancy": redundancy, "lost": r["lost"], "rollback_copy": rollback_copy,
            "p2p_mb_s": mb / r["p2p_s"], "memcpy_mb_s": mb / r["memcpy_s"],
            "encode_mb_s": mb / phases["commit_encode_s"] if phases.get("commit_encode_s") else None,
            "decode_mb_s": mb / r["fetch_s"],
            "commit_cold_s": r["commit_cold_s"], "commit_s": r["commit_s"], "commit_max_s": r["commit_max_s"],
            "commit_over_p2p": r["p2p_s"] / r["commit_s"],
            "memory_over_state": r["steady_over_state"], "peak_over_state": r["peak_over_state"],
            "rebuild_s": r["rebuild_s"], "fetch_s": r["fetch_s"], "down_s": r["down_s"], "floor_s": floor,
            "down_over_floor": r["down_s"] / floor, "bitwise": r["restored_ok"], **phases}


def _phases(run_dir: str) -> dict[str, float]:
    """Median seconds of each phase of the warm commits (all but the first two), over the ranks."""
    by_rank: dict[int, list[dict]] = collections.defaultdict(list)
    for e in read_events(run_dir):
        if e["event"] == "committed":
            by_rank[e["logical"]].append(e["durations"])
    warm = [d for commits in by_rank.values() for d in commits[2:COMMITS]]
    return {f"commit_{k}_s": statistics.median(d[k] for d in warm) for k in (warm[0] if warm else {})}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--plan", action="store_true", help="time placement and planning at scale, one process")
    parser.add_argument("--sizes", type=int, nargs="+", default=[16, 128, 512], help="MB per rank")
    parser.add_argument("--ranks", type=int, nargs="+", default=None)
    parser.add_argument("--chunks", type=int, default=1024, help="--plan: chunks per rank")
    parser.add_argument("--replication", type=int, default=2, help="--plan: copies of each chunk")
    parser.add_argument("--max-total-mb", type=int, default=2048,
                        help="skip combinations whose ranks x MB exceed this (memory: ~4x per rank at a commit)")
    parser.add_argument("--json", action="store_true", help="one JSON object per row")
    parser.add_argument("--copy", choices=("both", "yes", "no"), default="both",
                        help="rows with the store's roll-back copy (the default store), without it, or both")
    parser.add_argument("--redundancy", default="copies:2",
                        help="comma-separated ways to keep the state, one job each in turn: copies:R, xor:K, rs:K+M")
    parser.add_argument("--rounds", type=int, default=1,
                        help="the ways in turn this many times over; then each way's commit and memory over the "
                             "first way's of the same round: median, mean, max")
    parser.add_argument("--interleaved", type=int, default=0, metavar="N",
                        help="also one job per size committing every way's store in turn N times: each way's "
                             "commit over the first way's in the same turn (median, mean, max)")
    parser.add_argument("--worker", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--no-rollback-copy", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker is not None and args.interleaved:
        return interleaved_worker(args.worker, args.redundancy.split(","), args.interleaved)
    if args.worker is not None:
        return worker(args.worker, not args.no_rollback_copy, args.redundancy)
    if args.plan:
        head = ("ranks", "chunks", "place s", "plan rank s", "plan host s", "busiest/fair rank", "busiest/fair host",
                "xor:8 group s", "xor:8 host s")
        if not args.json:
            print(f"replication {args.replication}, hosts of 8 ranks; seconds one rank spends; busiest sender over "
                  "the fair share (lost chunks / live ranks of the other hosts, rounded up)")
            print(" ".join(f"{h:>17}" for h in head), flush=True)
        for n in args.ranks or [64, 1024, 4096, 16384]:
            r = plan_row(n, args.chunks, args.replication)
            if args.json:
                print(json.dumps(r), flush=True)
            else:
                cells = (n, args.chunks, r["place_seconds"], r["plan_rank_seconds"], r["plan_host_seconds"],
                         r["busiest_rank_over_fair"], r["busiest_host_over_fair"], r["parity_group_seconds"],
                         r["parity_plan_host_seconds"])
                print(" ".join(f"{c:>17.4f}" if isinstance(c, float) else f"{c:>17}" for c in cells), flush=True)
        return 0
    keys = ("ranks", "mb", "redundancy", "lost", "rollback_copy", "p2p_mb_s", "memcpy_mb_s", "encode_mb_s",
            "decode_mb_s", "commit_cold_s", "commit_s", "commit_max_s", "commit_over_p2p", "memory_over_state",
            "peak_over_state", "rebuild_s", "fetch_s", "down_s", "floor_s", "down_over_floor", "bitwise")
    head = ("ranks", "MB", "redundancy", "lost", "copy", "p2p MB/s", "memcpy MB/s", "encode MB/s", "decode MB/s",
            "cold commit", "commit s", "commit max", "commit/p2p", "mem/state", "peak/state", "rebuild s", "fetch s",
            "down s", "floor s", "down/floor", "bitwise")
    if not args.json:
        print("8 MB chunks, a spare per rank lost; commit/p2p = raw ring Sendrecv time over commit time; "
              "mem = RSS over the state (the state counts 1); encode = MB over the commit's arithmetic (parity), "
              "decode = MB over the fetch; down = kill -> rebuilt, fetched, rolled back; "
              "floor = ULFM (kill -> seen -> world rebuilt) + lost MB at the p2p bandwidth")
        print(" ".join(f"{h:>11}" for h in head), flush=True)
    copies = {"both": (True, False), "yes": (True,), "no": (False,)}[args.copy]
    ways = [w.strip() for w in args.redundancy.split(",") if w.strip()]
    configs = [(n, mb, c) for n in args.ranks or [4, 8] for mb in args.sizes for c in copies]
    for n, mb, copy in configs:
        if n * mb > args.max_total_mb:
            print(f"{n:>11} {mb:>11}  skipped: {n * mb} MB in all exceeds --max-total-mb", flush=True)
            continue
        rounds = [{way: _print_row(bytes_row(n, mb, copy, way), n, mb, way, keys, args.json) for way in ways}
                  for _ in range(args.rounds)]  # the ways alternate within each round
        if len(ways) > 1:
            _print_ratios(rounds, ways, n, mb, args.json)
        if len(ways) > 1 and args.interleaved > 2:
            _print_interleaved(interleaved_row(n, mb, ways, args.interleaved), ways, args.json)
    return 0


def _print_row(r: dict | str, n: int, mb: int, way: str, keys: tuple[str, ...], as_json: bool) -> dict | None:
    """One job's row, printed; the row, or None when the job failed."""
    if isinstance(r, str):
        print(f"{n:>11} {mb:>11} {way:>11}  {r}", flush=True)
        return None
    if as_json:
        print(json.dumps(r), flush=True)
        return r
    print(" ".join(f"{r[k]:>11.3f}" if isinstance(r[k], float) else f"{r[k]!s:>11}" for k in keys), flush=True)
    print(f"{'':>23}commit phases (s): " + ", ".join(
        f"{k[7:-2]} {v:.3f}" for k, v in r.items() if k.startswith("commit_") and k[7:-2] in PHASES), flush=True)
    return r


def _print_interleaved(row: dict | str, ways: list[str], as_json: bool) -> None:
    if isinstance(row, str) or as_json:
        print(row if isinstance(row, str) else json.dumps(row), flush=True)
        return
    print(f"{'':>23}interleaved, one job, {row['turns']} turns (the first two left out): commit s and over "
          f"{ways[0]} in the same turn, median / mean / max", flush=True)
    for way in ways:
        c, o = row[way]["commit_s"], row[way]["over_first"]
        print(f"{'':>23}{way}: {c['median']:.3f} / {c['mean']:.3f} / {c['max']:.3f} s, "
              f"{o['median']:.3f} / {o['mean']:.3f} / {o['max']:.3f}", flush=True)


def _print_ratios(rounds: list[dict[str, dict | None]], ways: list[str], n: int, mb: int, as_json: bool) -> None:
    """Each way's commit and memory over the first way's, paired within a round (adjacent jobs)."""
    first = ways[0]
    if not as_json:
        print(f"{'':>23}over {first}, paired by round ({len(rounds)}): median / mean / max", flush=True)
    for way in ways[1:]:
        row: dict = {"ratios": True, "ranks": n, "mb": mb, "redundancy": way, "over": first}
        for key, name in (("commit_s", "commit"), ("memory_over_state", "memory")):
            ratios = [r[way][key] / r[first][key] for r in rounds if r[way] and r[first]]
            row[name] = {**_spread(ratios), "rounds": ratios} if ratios else None
        if as_json:
            print(json.dumps(row), flush=True)
            continue
        cells = ", ".join(f"{name} {row[name]['median']:.3f} / {row[name]['mean']:.3f} / {row[name]['max']:.3f}"
                          if row[name] else f"{name} -" for name in ("commit", "memory"))
        print(f"{'':>23}{way}: {cells}", flush=True)


if __name__ == "__main__":
    sys.exit(main())

"""Benchmark the replicated store against raw MPI and against the local disk, in the same run.

    python scripts/bench_store.py --sizes 16 128 512 --ranks 4 8

For each (ranks, MB per rank) one job runs under mpiexec --with-ft ulfm with one
spare. In it: a ring Sendrecv of the same bytes (raw MPI point-to-point
bandwidth), memcpy bandwidth, 5 commits (replication 2: the first, cold, and the
median of the last 3, warm), then
logical rank 1 is SIGKILLed, the spare takes over and `store.recover` brings
its state back from the peers ('fetch': the dead rank's bytes arrive and are
verified; 'restore': fetch plus re-replication over the new world); rank 0 meanwhile also times numpy save (fsync)
and load (page cache dropped for the file with posix_fadvise) of its own bytes.
"""
from __future__ import annotations

import argparse
import json
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


def raw_bandwidth(world, buf: np.ndarray) -> dict[str, float]:
    """Seconds for a ring Sendrecv of ``buf`` (median of 3) and for a memcpy of it (collective)."""
    comm = world.comm
    recv = np.empty_like(buf)
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


def worker(mb: int) -> int:
    import elastic
    from mpi4py import MPI
    from elastic.recovery import ReplicatedStore

    world = elastic.init()
    comm = world.comm
    nbytes = mb << 20
    state = {"weights": np.random.default_rng(int(world.logical_rank)).random(nbytes // 8)}
    store = ReplicatedStore(world, replication=2, chunk_bytes=8 << 20)
    out: dict[str, float] = {}
    if world.role is not elastic.Role.RECOVERED:
        out.update(raw_bandwidth(world, state["weights"]))
        times = []
        for v in range(5):
            comm.Barrier()
            t = time.perf_counter()
            store.commit(state, v + 1)
            times.append(time.perf_counter() - t)
        # The first two commits touch fresh memory (page faults); from the third on the store
        # reuses the retired version's buffers, as it does for the rest of a training run.
        out["commit_cold_s"] = times[0]
        out["commit_s"] = statistics.median(times[2:])
        if world.logical_rank == 1:
            os.kill(os.getpid(), signal.SIGKILL)
        if world.rank == 0:
            with tempfile.TemporaryDirectory(dir=os.environ.get("BENCH_DISK_DIR", ".")) as tmp:
                path = os.path.join(tmp, "state.npy")
                t = time.perf_counter()
                with open(path, "wb") as f:
                    np.save(f, state["weights"])
                    f.flush()
                    os.fsync(f.fileno())
                out["disk_save_s"] = time.perf_counter() - t
                fd = os.open(path, os.O_RDONLY)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                os.close(fd)
                t = time.perf_counter()
                np.load(path)
                out["disk_load_s"] = time.perf_counter() - t
        try:
            with world.guard():
                comm.Barrier()
            raise SystemExit("rank 1 was killed but the barrier completed")
        except elastic.ProcessFailure:
            pass
        world.recover()
    comm = world.comm
    comm.Barrier()
    t = time.perf_counter()
    store.recover()
    restore_s = time.perf_counter() - t
    restore_max = comm.allreduce(restore_s, op=MPI.MAX)
    fetch_max = comm.allreduce(store.last_recovery["fetch"], op=MPI.MAX)
    expected = np.random.default_rng(int(world.logical_rank)).random(nbytes // 8)
    ok = store.restore()["weights"].tobytes() == expected.tobytes()
    all_ok = comm.allreduce(int(ok), op=MPI.MIN)
    results = comm.gather(out, root=0)
    if world.rank == 0:
        merged = {k: statistics.median(r[k] for r in results if k in r) for k in results[0]}
        merged.update(restore_s=restore_max, fetch_s=fetch_max, restored_ok=bool(all_ok), mb=mb, ranks=world.size,
                      recover_bytes=store.bytes_moved)
        Path(os.environ["ELASTIC_RUN_DIR"], "bench.json").write_text(json.dumps(merged))
    world.finish()
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[16, 128, 512], help="MB per rank")
    parser.add_argument("--ranks", type=int, nargs="+", default=[4, 8])
    parser.add_argument("--max-total-mb", type=int, default=2048,
                        help="skip combinations whose ranks x MB exceed this (memory: ~5x per rank here)")
    parser.add_argument("--worker", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker is not None:
        return worker(args.worker)
    print("replication 2, one spare; MB/s = MB per rank / seconds; 'commit/p2p' = commit bandwidth over "
          "raw ring Sendrecv bandwidth; 'disk/restore' = numpy load from disk over in-memory restore time")
    head = ("ranks", "MB/rank", "p2p MB/s", "memcpy MB/s", "cold commit", "commit s", "commit MB/s", "commit/p2p",
            "fetch s", "restore s", "disk save s", "disk load s", "disk/fetch", "disk/restore", "bitwise")
    print(" ".join(f"{h:>12}" for h in head), flush=True)
    for n in args.ranks:
        for mb in args.sizes:
            if n * mb > args.max_total_mb:
                print(f"{n:>12} {mb:>12}  skipped: {n * mb} MB in all exceeds --max-total-mb", flush=True)
                continue
            with tempfile.TemporaryDirectory() as tmp:
                cmd = [sys.executable, "-m", "elastic.launch", "-n", str(n), "--spares", "1", "--timeout", "900",
                       "--run-dir", tmp, "--", sys.executable, __file__, "--worker", str(mb)]
                proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=960)
                bench = Path(tmp, "bench.json")
                if not bench.exists():
                    print(f"{n:>12} {mb:>12}  failed:\n{proc.stdout[-2000:]}{proc.stderr[-2000:]}", flush=True)
                    continue
                r = json.loads(bench.read_text())
            row = (n, mb, mb / r["p2p_s"], mb / r["memcpy_s"], r["commit_cold_s"], r["commit_s"], mb / r["commit_s"],
                   r["p2p_s"] / r["commit_s"], r["fetch_s"], r["restore_s"], r["disk_save_s"], r["disk_load_s"],
                   r["disk_load_s"] / r["fetch_s"], r["disk_load_s"] / r["restore_s"], r["restored_ok"])
            print(" ".join(f"{v:>12.3f}" if isinstance(v, float) else f"{v!s:>12}" for v in row), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

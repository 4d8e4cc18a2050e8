"""What a vote costs when nothing fails: ULFM's blocking Agree against the library's agreement,
which is posted non-blocking and polled so that a revoke can end it (``_collectives.agree``).

    mpiexec --with-ft ulfm -n 4 --oversubscribe python scripts/bench_agree.py [--count 2000] [--json]

A commit runs about five agreements (the shared-values vote, three for the version, the commit
vote); ``finish()`` one.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mpi4py import MPI  # noqa: E402

from elastic.comm import _collectives  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--count", type=int, default=2000, help="agreements per measurement")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    comm = MPI.COMM_WORLD.Dup()
    comm.Set_errhandler(MPI.ERRORS_RETURN)
    ways = {"Agree (blocking)": lambda: comm.Agree(1),
            "agree (polled, revoke-aware)": lambda: _collectives.agree(comm, 1)}
    best: dict[str, float] = {}
    for _ in range(3):  # side by side, best of three: the machine is shared
        for name, call in ways.items():
            comm.Barrier()
            t = time.perf_counter()
            for _ in range(args.count):
                call()
            best[name] = min(best.get(name, float("inf")), (time.perf_counter() - t) / args.count * 1e6)
    if comm.Get_rank() == 0:
        rows = [{"way": name, "us_per_agreement": round(us, 1)} for name, us in best.items()]
        ratio = best["agree (polled, revoke-aware)"] / best["Agree (blocking)"]
        if args.json:
            print(json.dumps({"ranks": comm.Get_size(), "rows": rows, "ratio": round(ratio, 2)}))
        else:
            print(f"{'way':32s} {'us per agreement':>18s}   ({comm.Get_size()} ranks, best of 3 x {args.count})")
            for row in rows:
                print(f"{row['way']:32s} {row['us_per_agreement']:18.1f}")
            print(f"{'ratio polled / blocking':32s} {ratio:18.2f}")


if __name__ == "__main__":
    main()

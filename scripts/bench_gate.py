"""What the integrity gate costs per step: its parts, timed in one process, as ratios to a step.

    python scripts/bench_gate.py [--sizes 16 128 512] [--step-ms 200] [--commit-every 1 5] [--ranks 1024 16384] [--json]

The gate runs inside every commit (``State._gate``). Per rank, for a state of MB megabytes of
float32 arrays (64 tensors, a model and its Adam moments): the non-finite scan of the committed
arrays (``nonfinite_values``: a BLAS dot per array), the fingerprints of the values every rank
holds alike (XXH3; they were compared at every commit before the gate, and are shown for the
whole), and per step the loss / gradient-norm checks (``record_step``). Then the verdict over
every rank's document (each rank reads all of them: a digest of its fingerprints each, O(ranks);
the fingerprints themselves are gathered only when two digests differ) at ``--ranks``. The
ratio is the gate's time per step (its commit part over ``--commit-every`` steps) over a step of
``--step-ms`` (issue 29's target: <= 1% of a 200 ms step at 128 MB per rank). Medians of 5.

With ``State(per_step=True)`` there is no ``commit()``: the gate runs at the step point of every
``--gate-every`` steps (``ELASTIC_GATE_EVERY``), and its fingerprints of the shared values are
its own cost there (the step point replicates only the rank-unique values): the ``per-step``
rows count the scan and the fingerprints over the interval.
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from elastic._integrity import digest, my_share, nonfinite_values, verdict  # noqa: E402
from elastic.recovery import checksum  # noqa: E402

TENSORS = 64


def timed(fn, reps: int = 5) -> float:
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def state_of(mb: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    per = (mb << 20) // 4 // TENSORS
    return {f"model.{i}": rng.standard_normal(per, dtype=np.float32) for i in range(TENSORS)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[16, 128, 512], help="MB of state per rank")
    parser.add_argument("--step-ms", type=float, default=200.0)
    parser.add_argument("--commit-every", type=int, nargs="+", default=[1, 5])
    parser.add_argument("--gate-every", type=int, nargs="+", default=[10, 100],
                        help="per-step points: steps between the gate's checks (ELASTIC_GATE_EVERY)")
    parser.add_argument("--ranks", type=int, nargs="+", default=[1024, 16384])
    parser.add_argument("--share", type=int, default=4,
                        help="ranks that hold the values alike (data parallel): each scans 1/share of them")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    rows = []
    for mb in args.sizes:
        arrays = state_of(mb)
        mine = my_share(arrays, list(arrays), 0, args.share)  # rank 0's part: the largest values first
        scan = timed(lambda arrays=arrays: nonfinite_values(arrays))
        scan_mine = timed(lambda mine=mine: nonfinite_values(mine))
        sums = timed(lambda arrays=arrays: [checksum(a.view(np.uint8)) for a in arrays.values()])
        scalars = timed(lambda: [math.isfinite(x) for x in (0.5, 1.5)], reps=101)
        common = {"mb": mb, "scan_ms": scan * 1e3, "fingerprints_ms": sums * 1e3, "scan_gb_s": mb / 1024 / scan,
                  "share": args.share, "my_scan_ms": scan_mine * 1e3}
        for every in args.commit_every:
            per_step = scan_mine / every + scalars
            rows.append({**common, "mode": "commit", "commit_every": every, "gate_ms_per_step": per_step * 1e3,
                         "ratio": per_step / (args.step_ms / 1e3),
                         "ratio_with_fingerprints": (per_step + sums / every) / (args.step_ms / 1e3)})
        for every in args.gate_every:  # the fingerprints are the gate's own here: counted in "ratio"
            per_step = (scan_mine + sums) / every + scalars
            rows.append({**common, "mode": "per-step", "commit_every": every, "gate_ms_per_step": per_step * 1e3,
                         "ratio": per_step / (args.step_ms / 1e3), "ratio_with_fingerprints": per_step /
                         (args.step_ms / 1e3)})
    sums = {f"model.{i}": f"<f4:[1]:{i}" for i in range(TENSORS)}
    documents = {n: [{"digest": digest(dict(sums)), "seen": None, "values": []} for _ in range(n)] for n in args.ranks}
    verdicts = [{"ranks": n, "verdict_ms": timed(lambda docs=docs: verdict(docs, list(range(len(docs))))) * 1e3}
                for n, docs in documents.items()]
    if args.json:
        for row in rows + verdicts:
            print(json.dumps(row))
        return 0
    print(f"{'MB/rank':>8} {'gate at':>9} {'every':>6} {'scan ms':>8} {'scan GB/s':>9} "
          f"{'1/' + str(args.share) + ' ms':>8} {'XXH3 ms':>8} {'gate ms/step':>12} {'of a step':>9} {'+ XXH3':>8}   "
          f"(step {args.step_ms:g} ms; "
          f"a rank scans 1/{args.share} of the values the ranks hold alike)")
    for r in rows:
        print(f"{r['mb']:>8} {r['mode']:>9} {r['commit_every']:>6} {r['scan_ms']:>8.2f} {r['scan_gb_s']:>9.1f} "
              f"{r['my_scan_ms']:>8.2f} {r['fingerprints_ms']:>8.2f} {r['gate_ms_per_step']:>12.3f} "
              f"{r['ratio']:>8.2%} {r['ratio_with_fingerprints']:>8.2%}")
    for v in verdicts:
        print(f"verdict over {v['ranks']} ranks' documents (a digest of {TENSORS} fingerprints each, all equal): "
              f"{v['verdict_ms']:.2f} ms per commit")
    return 0


if __name__ == "__main__":
    sys.exit(main())

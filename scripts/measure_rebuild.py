"""Measure how long a rebuild takes after a real SIGKILL, per mode and job size.

    python scripts/measure_rebuild.py --sizes 4 8 --reps 5

Each repetition launches examples/jacobi.py under mpiexec --with-ft ulfm, kills
logical rank 1 at step 10, and reads the per-rank events: the kill time (the
victim's `inject` event), when survivors first saw the failure, when the last
survivor had the agreed failed set, and when the last process had the rebuilt
communicator. Prints medians (ms after the kill) and the median phase durations.
"""
from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from elastic.comm.events import read_events  # noqa: E402

MODES = {"shrink": [], "spare": ["--spares", "1"], "spawn": []}


def one_run(n: int, mode: str, run_dir: Path, timeout: float) -> dict[str, float]:
    cmd = [sys.executable, "-m", "elastic.launch", "-n", str(n), "--rebuild", mode, *MODES[mode],
           "--inject", "1@10", "--timeout", str(timeout), "--run-dir", str(run_dir),
           "--", sys.executable, "examples/jacobi.py", "--steps", "20"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout + 30)
    if proc.returncode != 0:
        raise RuntimeError(f"{mode} n={n} failed:\n{proc.stdout}{proc.stderr}")
    events = read_events(run_dir)
    kill = next(e["t"] for e in events if e["event"] == "inject")
    of = lambda name: [e for e in events if e["event"] == name]  # noqa: E731
    rebuilt = of("rebuilt")
    row = {"seen": min(e["t"] for e in of("failure_seen")) - kill,
           "agreed": max(e["t"] for e in of("agreed")) - kill,
           "rebuilt": max(e["t"] for e in rebuilt) - kill}
    for phase in ("agree", "shrink", "substitute", "install"):
        row[phase] = statistics.median(e["durations"].get(phase, 0.0) for e in rebuilt)
    return row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[4, 8])
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--timeout", type=float, default=120)
    args = parser.parse_args()
    cols = ("seen", "agreed", "rebuilt", "agree", "shrink", "substitute", "install")
    print(f"median over {args.reps} runs, ms; seen/agreed/rebuilt: from the SIGKILL to the first survivor "
          "seeing it / the last survivor holding the agreed failed set / the last process on the rebuilt "
          "communicator; the rest: per-process phase durations")
    print(f"{'mode':>7} {'ranks':>5} " + " ".join(f"{c:>10}" for c in cols))
    with tempfile.TemporaryDirectory() as tmp:
        for n in args.sizes:
            for mode in args.modes:
                rows = [one_run(n, mode, Path(tmp) / f"{mode}-{n}-{i}", args.timeout) for i in range(args.reps)]
                med = {c: statistics.median(r[c] for r in rows) * 1e3 for c in cols}
                print(f"{mode:>7} {n:>5} " + " ".join(f"{med[c]:>10.1f}" for c in cols), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

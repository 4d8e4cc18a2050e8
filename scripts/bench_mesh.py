"""A data x pipeline mesh losing ranks: kill -> next step for each way back, beside the data-parallel
spare path and a checkpoint-restart of the same mesh, in one run.

    python scripts/bench_mesh.py [--reps 3] [--steps 24] [--json]

Rows (each the median of ``--reps`` jobs under mpiexec --with-ft ulfm; the kill is a SIGKILL at
step ``steps // 2``):

* ``twin``: ``examples/hybrid.py`` on a 2 x 2 mesh, logical rank 1 (stage 1 of replica 0) killed,
  a parked spare takes its place and gets the stage from its twin (logical 3);
* ``store``: the 2 x 2 mesh (a commit to the store every 5 steps, the example's default), both
  replicas of stage 1 killed at once: every rank rolls back to the last commit, two spares get
  the stage from the store's copies;
* ``checkfree``: a 2 x 3 mesh without store copies, both replicas of stage 1 killed at once, two
  spares rebuilt by CheckFree from stages 0 and 2;
* ``dp spare``: ``examples/train.py`` (data parallel, ``elastic.run``, a commit every 5 steps)
  on 4 ranks, logical rank 1 killed, a spare restores it from the replicated store;
* ``restart`` (a floor for checkpoint-restart of the 2 x 2 mesh): a fresh launch (the launcher
  started) -> its first step, plus the steps a checkpoint every 5 steps would redo at the kill's step, at the
  mesh's step time; no teardown of the failed job, no checkpoint write or read counted.

``down`` = kill -> the first step completed after the recovery (``elastic.report``), seconds;
``vs dp spare`` = down over the dp spare row's.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from elastic.comm.events import read_events  # noqa: E402  (no MPI here)
from elastic.report import final_steps, timeline  # noqa: E402

CHECKPOINT_EVERY = 5


def launch(run_dir: Path, n: int, launcher: list[str], program: list[str]) -> tuple[float, list[dict]]:
    """(the wall time the launcher was started at, the job's events)."""
    cmd = [sys.executable, "-m", "elastic.launch", "-n", str(n), "--quiet", "--timeout", "300",
           "--run-dir", str(run_dir), *launcher, "--", sys.executable, *program]
    started = time.time()
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=360)
    if proc.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return started, read_events(run_dir)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    kill = args.steps // 2
    steps = ["--steps", str(args.steps)]
    mesh = ["examples/hybrid.py", "--dp", "2", "--pp", "2", *steps]
    cases = {
        "twin": (4, ["--spares", "1", "--inject", f"1@{kill}"], mesh),
        "store": (4, ["--spares", "2", "--inject", f"1@{kill},3@{kill}"], mesh),
        "checkfree": (6, ["--spares", "2", "--inject", f"1@{kill},4@{kill}"],
                      ["examples/hybrid.py", "--dp", "2", "--pp", "3", *steps, "--commit-every", "0"]),
        "dp spare": (4, ["--spares", "1", "--inject", f"1@{kill}"],
                     ["examples/train.py", *steps, "--commit-every", str(CHECKPOINT_EVERY)]),
        "restart": (4, [], mesh),
    }
    downs: dict[str, list[float]] = {name: [] for name in cases}
    detail: dict[str, str] = {}
    with tempfile.TemporaryDirectory(prefix="bench-mesh-") as tmp:
        for rep in range(args.reps):  # the cases alternate: a slow spell of the machine hits each alike
            for name, (n, launcher, program) in cases.items():
                start, events = launch(Path(tmp) / f"{name}-{rep}".replace(" ", "-"), n, launcher, program)
                if name == "restart":
                    first = min(e["t"] for e in events if e["event"] == "step")
                    done = final_steps(events)
                    step_s = statistics.median(done[s]["seconds"] for s in done if s > 1)
                    downs[name].append(first - start + (kill % CHECKPOINT_EVERY) * step_s)
                    detail[name] = f"launch -> first step + {kill % CHECKPOINT_EVERY} steps redone"
                else:
                    row = timeline(events)[0]
                    downs[name].append(row["down"] / 1e3)
                    methods = ", ".join(sorted({e["method"] for e in events if e["event"] == "stage_rebuilt"}))
                    detail[name] = f"{methods or 'restored from the store'}, {row['redone']} steps redone"
    base = statistics.median(downs["dp spare"])
    rows = [{"case": name, "down_s": statistics.median(v), "vs_dp_spare": statistics.median(v) / base,
             "runs": len(v), "how": detail[name]} for name, v in downs.items()]
    if args.json:
        for row in rows:
            print(json.dumps(row))
    else:
        print(f"kill at step {kill} of {args.steps}; median of {args.reps} runs each")
        print(f"{'case':<10} {'down s':>8} {'vs dp spare':>12}  how")
        for row in rows:
            print(f"{row['case']:<10} {row['down_s']:>8.2f} {row['vs_dp_spare']:>11.2f}x  {row['how']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

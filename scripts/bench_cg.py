"""A long CG solve with a failure every N seconds (Fenix / ESR style): what recovery costs a solver.

    python scripts/bench_cg.py [--ranks 4] [--n 512] [--every 1.0] [--repeat 3] [--json]

``examples/cg.py`` (a 2-D Poisson solve to ``--tol``, strips of rows per rank, halo exchanges,
dot products summed in strip order) under mpiexec --with-ft ulfm. ``mode``: ``floor``, no
recovery point after the start (what the solver costs alone, and what the job could only
restart from); ``point``, every iteration a recovery point (the strips replicated at each
iteration's step point); ``commit50``, a commit every 50 iterations. The work is fixed once
(the grid, the tolerance, the iterations it takes); each mode's failure-free run and its run
with failures alternate over the modes ``--repeat`` times, so a slow spell of this shared machine
lands on every mode alike. The failures: logical rank 1 SIGKILLed every ``--every`` seconds of
the failure-free solve (its iteration rate converts the seconds to iterations), a spare taking
over each time. Per mode: the solve's wall time failure-free (median of the runs, mean, max),
iterations per second against the floor, and with failures: how many, the solve's wall time,
the down time summed over the recoveries (kill -> next iteration, ``elastic.report``) as a
fraction of that solve, the iterations done again, the iteration count against the
failure-free one, and whether the solution is bitwise the failure-free one.
``--json``: one JSON object per row.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from elastic.comm.events import read_events
from elastic.report import timeline

ROOT = Path(__file__).resolve().parents[1]
MODES = {"floor": ("--commit-every", "1000000000"), "point": (), "commit50": ("--commit-every", "50")}


def run(mode: str, ranks: int, n: int, run_dir: Path, launcher_args: list[str]) -> list[dict]:
    cmd = [sys.executable, "-m", "elastic.launch", "-n", str(ranks), "--quiet", "--timeout", "900",
           "--run-dir", str(run_dir), *launcher_args, "--", sys.executable, "examples/cg.py", "--n", str(n),
           "--max-iterations", "100000", *MODES[mode]]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=960)
    if proc.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{proc.stdout}\n{proc.stderr}")
    return read_events(run_dir)


def solve(events: list[dict]) -> dict:
    """The solve's wall time (its first iteration's start to its last's end, rank 0's clock),
    its iterations and its solution's hash."""
    steps = [e for e in events if e["event"] == "step" and e.get("logical") == 0]
    (result,) = [e for e in events if e["event"] == "result"]
    return {"seconds": steps[-1]["t"] - steps[0]["t"] + steps[0]["seconds"], "iterations": result["steps"],
            "x_sha256": result["x_sha256"]}


def kills(iterations: int, seconds: float, every: float) -> list[int]:
    """The iterations at which ``every`` seconds of a solve of ``seconds`` have passed."""
    rate = iterations / seconds
    return [round(k * every * rate) for k in range(1, int(seconds / every) + 1) if k * every * rate < iterations - 1]


def rows(modes: list[str], ranks: int, n: int, every: float, repeat: int, tmp: Path) -> list[dict]:
    clean: dict[str, list[dict]] = {m: [] for m in modes}
    faulty: dict[str, list[dict]] = {m: [] for m in modes}
    for i in range(repeat):  # alternated: the machine's slow spells spread over every mode
        for mode in modes:
            ref = solve(run(mode, ranks, n, tmp / f"{mode}-clean-{i}", []))
            clean[mode].append(ref)
            at = kills(ref["iterations"], ref["seconds"], every)
            schedule = ",".join(f"1@{step}/g{k}" for k, step in enumerate(at))
            events = run(mode, ranks, n, tmp / f"{mode}-kills-{i}", ["--spares", str(len(at)), "--inject", schedule])
            recovered = timeline(events)
            faulty[mode].append({**solve(events), "failures": len(recovered),
                                 "down_s": sum(r["down"] for r in recovered if r["down"] is not None) / 1e3,
                                 "redone": sum(r["redone"] or 0 for r in recovered), "same": ref["x_sha256"]})
    floor = statistics.median(r["iterations"] / r["seconds"] for r in clean[modes[0]])
    table = []
    for mode in modes:
        seconds = [r["seconds"] for r in clean[mode]]
        with_failures = sorted(faulty[mode], key=lambda r: r["seconds"])[len(faulty[mode]) // 2]  # the median run
        rate = statistics.median(r["iterations"] / r["seconds"] for r in clean[mode])
        table.append({
            "mode": mode, "ranks": ranks, "n": n, "iterations": clean[mode][0]["iterations"],
            "solve_s": statistics.median(seconds), "solve_mean_s": statistics.fmean(seconds),
            "solve_max_s": max(seconds), "iterations_per_s": rate, "vs_floor": rate / floor,
            "failures": with_failures["failures"], "solve_with_failures_s": with_failures["seconds"],
            "down_s": with_failures["down_s"], "down_fraction": with_failures["down_s"] / with_failures["seconds"],
            "redone": with_failures["redone"], "iterations_with_failures": with_failures["iterations"],
            "bitwise": all(r["x_sha256"] == r["same"] for r in faulty[mode])})
    return table


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--n", type=int, default=512, help="grid points per side")
    parser.add_argument("--every", type=float, default=1.0, help="seconds of the solve between failures")
    parser.add_argument("--modes", default=",".join(MODES), help=f"which rows, of {','.join(MODES)} (floor first)")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--json", action="store_true", help="one JSON object per row")
    args = parser.parse_args()
    modes = args.modes.split(",")
    if modes[0] != "floor" or not set(modes) <= set(MODES):
        parser.error(f"--modes: names of {', '.join(MODES)}, floor first (the ratios are to it)")
    with tempfile.TemporaryDirectory() as tmp:
        table = rows(modes, args.ranks, args.n, args.every, args.repeat, Path(tmp))
    if args.json:
        for r in table:
            print(json.dumps(r))
        return 0
    print(f"{args.ranks} ranks, {args.n} x {args.n} grid, {table[0]['iterations']} iterations to 1e-8; "
          f"logical rank 1 killed every {args.every:g} s of the solve, a spare each time; solve s: the median of "
          f"{args.repeat} failure-free runs (mean, max), with failures the median run")
    head = ("mode", "iter/s", "vs floor", "solve s", "mean", "max", "failures", "with failures s", "down s",
            "down / solve", "redone", "iterations", "bitwise")
    print(" | ".join(head))
    for r in table:
        print(" | ".join([r["mode"], f"{r['iterations_per_s']:.0f}", f"{r['vs_floor']:.2f}", f"{r['solve_s']:.2f}",
                          f"{r['solve_mean_s']:.2f}", f"{r['solve_max_s']:.2f}", str(r["failures"]),
                          f"{r['solve_with_failures_s']:.2f}", f"{r['down_s']:.3f}", f"{r['down_fraction']:.1%}",
                          str(r["redone"]), f"{r['iterations_with_failures']} / {r['iterations']}",
                          "yes" if r["bitwise"] else "NO"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())

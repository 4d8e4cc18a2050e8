"""DDP over Gloo against allreduce_gradients over MPI, side by side in one run.

    python scripts/bench_ddp.py [--ranks 4] [--steps 200] [--json]

The same model, data and optimizer (examples/train.py's MLP) trained two ways:
``examples/train.py`` (gradients summed by ``elastic.allreduce_gradients`` over
MPI after the backward pass) and ``examples/ddp.py`` (torch's DDP over the
World's Gloo group, all-reducing during the backward pass, one parameter per
bucket). For each: steps per second without failures (the median step over
the run, commits included), and with a spare, kill -> next step after logical
rank 1 is SIGKILLed at step ``steps // 2``, with its phases (from
``elastic.report.timeline``). ``--json``: one JSON object per row.
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
PROGRAMS = {"MPI allreduce_gradients": "examples/train.py", "DDP over Gloo": "examples/ddp.py"}


def run(program: str, ranks: int, steps: int, run_dir: Path, launcher_args: list[str]) -> list[dict]:
    cmd = [sys.executable, "-m", "elastic.launch", "-n", str(ranks), "--quiet", "--timeout", "600",
           "--run-dir", str(run_dir), *launcher_args, "--", sys.executable, program, "--steps", str(steps)]
    if program.endswith("ddp.py"):
        cmd += ["--group-timeout", "10"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=660)
    if proc.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{proc.stdout}\n{proc.stderr}")
    return read_events(run_dir)


def row(name: str, program: str, ranks: int, steps: int, tmp: Path) -> dict:
    clean = run(program, ranks, steps, tmp / f"{Path(program).stem}-clean", [])
    seconds = [e["seconds"] for e in clean if e["event"] == "step" and e["step"] > 1]
    killed = run(program, ranks, steps, tmp / f"{Path(program).stem}-kill",
                 ["--spares", "1", "--inject", f"1@{steps // 2}"])
    rebuild = timeline(killed)[0]
    return {"way": name, "ranks": ranks, "steps_per_s": 1 / statistics.median(seconds),
            "down_s": rebuild["down"] / 1e3, "detect_ms": rebuild["detect"], "agree_ms": rebuild["agree"],
            "rebuild_ms": rebuild["rebuild"], "restore_ms": rebuild["restore"], "resume_ms": rebuild["resume"],
            "redone": rebuild["redone"]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--json", action="store_true", help="one JSON object per row")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        rows = [row(name, program, args.ranks, args.steps, Path(tmp)) for name, program in PROGRAMS.items()]
    if args.json:
        for r in rows:
            print(json.dumps(r))
        return 0
    base = rows[0]["steps_per_s"]
    print(f"{args.ranks} ranks, {args.steps} steps, commit every 5; kill of logical rank 1 at step {args.steps // 2}, "
          "a spare takes over; ms unless said")
    head = ("way", "steps/s", "vs MPI", "down s", "detect", "agree", "rebuild", "restore", "resume", "redone")
    print(" | ".join(head))
    for r in rows:
        print(" | ".join([r["way"], f"{r['steps_per_s']:.1f}", f"{r['steps_per_s'] / base:.2f}", f"{r['down_s']:.3f}"]
                         + [f"{r[k]:.1f}" if r[k] is not None else "-" for k in
                            ("detect_ms", "agree_ms", "rebuild_ms", "restore_ms", "resume_ms")] + [str(r["redone"])]))
    return 0


if __name__ == "__main__":
    sys.exit(main())

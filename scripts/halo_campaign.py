"""A campaign against halo exchanges written with ``Sendrecv``: a neighbour killed at random steps.

Each run kills one random logical rank of ``tests/programs/sendrecv_halo.py`` (4 ranks, a spare):
at a random step (an injection), or with ``--outside`` by a SIGKILL from this script at a random
moment of the training, most likely while its neighbours are inside ``world.mpi.comm.Sendrecv``
with it. Every run must finish (exit 0) with the rod bitwise the failure-free run's and no death but
the victim's: a survivor crashing inside Open MPI, or a hang (the job's bound), is a failure. Prints
one line a run and the totals; exits 1 on any crash, hang or wrong rod. ``--blocking`` runs the
control: Open MPI's own blocking ``Sendrecv``.

    python scripts/halo_campaign.py --runs 20 --seed 4201 [--outside] [--blocking]
"""
from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from elastic.comm.events import read_events  # noqa: E402
from elastic.testing import Job, launch  # noqa: E402

PROGRAM = ("tests/programs/sendrecv_halo.py", "--steps", "40")
RANKS = 4


def kill_from_outside(program: tuple[str, ...], run_dir: Path, rank: int, delay: float, bound: float) -> Job:
    """Launch the job, SIGKILL logical rank ``rank``'s program ``delay`` s after the first step."""
    cmd = [sys.executable, "-m", "elastic.launch", "-n", str(RANKS), "--spares", "1", "--timeout", str(bound),
           "--run-dir", str(run_dir), "--", sys.executable, *program]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + bound
    while time.monotonic() < deadline and proc.poll() is None:
        if run_dir.exists() and any(e["event"] == "step" for e in read_events(run_dir)):
            break
        time.sleep(0.01)
    time.sleep(delay)
    victims = [e["pid"] for e in read_events(run_dir) if e["event"] == "started" and e.get("logical") == rank]
    for pid in victims[:1]:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    output, _ = proc.communicate(timeout=bound + 30)
    return Job(proc.returncode, output, run_dir)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--bound", type=float, default=90.0, help="seconds one job may take before it is a hang")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--outside", action="store_true", help="kill by SIGKILL from outside, at a random moment")
    parser.add_argument("--blocking", action="store_true",
                        help="the control: Open MPI's blocking Sendrecv, as programs had it before HaloComm")
    args = parser.parse_args()
    program = PROGRAM + (("--blocking",) if args.blocking else ())
    rng = random.Random(args.seed)
    totals = {"correct": 0, "crash": 0, "hang": 0, "wrong": 0}
    with tempfile.TemporaryDirectory(prefix="elastic-halo-") as tmp:
        reference = launch(program, RANKS, Path(tmp) / "reference", timeout=args.bound, cwd=ROOT)
        if reference.rc != 0:
            print(reference.output[-3000:])
            return 1
        expected = reference.result["rod_sha256"]
        steps = [e["t"] for e in reference.events if e["event"] == "step"]
        training = max(steps) - min(steps)
        for run in range(args.runs):
            rank, step = rng.randrange(RANKS), rng.randrange(2, 36)
            delay = rng.uniform(0, 0.8 * training) if args.outside else 0.0
            run_dir = Path(tmp) / f"run-{run}"
            if args.outside:
                job = kill_from_outside(program, run_dir, rank, delay, args.bound)
                victim = {e["pid"] for e in job.events if e["event"] == "started" and e.get("logical") == rank}
            else:
                job = launch(program, RANKS, run_dir, ("--spares", "1", "--inject", f"{rank}@{step}"),
                             timeout=args.bound, cwd=ROOT)
                victim = {o["pid"] for o in job.outcomes if o["status"].startswith("injected-")}
            deaths = [o for o in job.outcomes if o["status"] == "failed"] + \
                [f for f in job.fates if f["end"] not in ("exited",) and f["pid"] not in victim]
            verdict = "hang" if job.rc == 124 else "crash" if job.rc != 0 or deaths else \
                "correct" if job.has_result and job.result["rod_sha256"] == expected else "wrong"
            totals[verdict] += 1
            kill = f"{rank} after {delay:.3f} s" if args.outside else f"{rank}@{step}"
            line = {"run": run, "kill": kill, "verdict": verdict, "rc": job.rc}
            print(json.dumps(line) if args.json else f"run {run:3d}  kill {kill:<16} {verdict}", flush=True)
            if verdict != "correct":
                print(job.output[-2000:], flush=True)
    print(json.dumps(totals) if args.json else
          f"{args.runs} runs: {totals['correct']} correct, {totals['crash']} crashes, {totals['hang']} hangs, "
          f"{totals['wrong']} wrong", flush=True)
    return 0 if totals["correct"] == args.runs else 1


if __name__ == "__main__":
    sys.exit(main())

"""A campaign against halo exchanges written with ``Sendrecv``: a neighbour killed at random steps.

Each run kills one random logical rank at a random step of ``tests/programs/sendrecv_halo.py`` (4
ranks, a spare): its neighbours are then inside ``world.mpi.comm.Sendrecv`` with a dead peer. Every
run must finish (exit 0) with the rod bitwise the failure-free run's and no death but the injected
one: a survivor crashing inside Open MPI, or a hang (the job's bound), is a failure. Prints one line
a run and the totals; exits 1 on any crash, hang or wrong rod.

    python scripts/halo_campaign.py --runs 20 --seed 4201
"""
from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from elastic.testing import launch  # noqa: E402

PROGRAM = ("tests/programs/sendrecv_halo.py", "--steps", "40")
RANKS = 4


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--bound", type=float, default=90.0, help="seconds one job may take before it is a hang")
    parser.add_argument("--json", action="store_true")
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
        for run in range(args.runs):
            rank, step = rng.randrange(RANKS), rng.randrange(2, 36)
            job = launch(program, RANKS, Path(tmp) / f"run-{run}", ("--spares", "1", "--inject", f"{rank}@{step}"),
                         timeout=args.bound, cwd=ROOT)
            deaths = [o for o in job.outcomes if o["status"] == "failed"] + \
                [f for f in job.fates if f["end"] not in ("exited",) and f["pid"] not in
                 {o["pid"] for o in job.outcomes if o["status"].startswith("injected-")}]
            verdict = "hang" if job.rc == 124 else "crash" if job.rc != 0 or deaths else \
                "correct" if job.has_result and job.result["rod_sha256"] == expected else "wrong"
            totals[verdict] += 1
            line = {"run": run, "kill": f"{rank}@{step}", "verdict": verdict, "rc": job.rc}
            print(json.dumps(line) if args.json else f"run {run:3d}  kill {rank}@{step:<3d} {verdict}", flush=True)
            if verdict != "correct":
                print(job.output[-2000:], flush=True)
    print(json.dumps(totals) if args.json else
          f"{args.runs} runs: {totals['correct']} correct, {totals['crash']} crashes, {totals['hang']} hangs, "
          f"{totals['wrong']} wrong", flush=True)
    return 0 if totals["correct"] == args.runs else 1


if __name__ == "__main__":
    sys.exit(main())

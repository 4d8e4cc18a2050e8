"""DDP and FSDP2 over the World's communicator, DDP over Gloo, and allreduce_gradients over MPI, side by side.

    python scripts/bench_ddp.py [--ranks 4] [--steps 200] [--repeat 3] [--json]

The same model, data and optimizer (examples/train.py's MLP) trained four ways
(``way`` in the rows): ``mpi``, ``examples/train.py`` (gradients summed by
``elastic.allreduce_gradients`` over MPI after the backward pass); ``ddp``,
``examples/ddp.py`` on the ``ulfm`` process group (torch's DDP over the World's
communicator, one all-reduce per backward); ``ddp-gloo``, the same over Gloo
(one parameter per bucket, a 10 s group timeout: the bound a rank waits in an
all-reduce its peer left); ``fsdp``, ``examples/fsdp.py`` (FSDP2's
``fully_shard`` on the ``ulfm`` group, its shards in the store). For each:
steps per second without failures (the median step of a run, commits
included; the failure-free runs of all ways alternate ``--repeat`` times and
the median run counts, so a slow spell of this shared machine does not land on
one way only), and with a spare, kill -> next step after logical rank 1 is
SIGKILLed at step ``steps // 2``, with its phases (from
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
WAYS = {"mpi": ("examples/train.py",), "ddp": ("examples/ddp.py", "--backend", "ulfm"),
        "ddp-gloo": ("examples/ddp.py", "--backend", "gloo", "--group-timeout", "10"),
        "fsdp": ("examples/fsdp.py",)}


def run(program: tuple[str, ...], ranks: int, steps: int, run_dir: Path, launcher_args: list[str]) -> list[dict]:
    cmd = [sys.executable, "-m", "elastic.launch", "-n", str(ranks), "--quiet", "--timeout", "600",
           "--run-dir", str(run_dir), *launcher_args, "--", sys.executable, *program, "--steps", str(steps)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=660)
    if proc.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{proc.stdout}\n{proc.stderr}")
    return read_events(run_dir)


def steps_per_s(program: tuple[str, ...], ranks: int, steps: int, run_dir: Path) -> float:
    seconds = [e["seconds"] for e in run(program, ranks, steps, run_dir, []) if e["event"] == "step" and e["step"] > 1]
    return 1 / statistics.median(seconds)


def kill_row(name: str, program: tuple[str, ...], ranks: int, steps: int, tmp: Path) -> dict:
    killed = run(program, ranks, steps, tmp / f"{name}-kill", ["--spares", "1", "--inject", f"1@{steps // 2}"])
    rebuild = timeline(killed)[0]
    return {"way": name, "ranks": ranks, "down_s": rebuild["down"] / 1e3, "detect_ms": rebuild["detect"],
            "agree_ms": rebuild["agree"], "rebuild_ms": rebuild["rebuild"], "restore_ms": rebuild["restore"],
            "resume_ms": rebuild["resume"], "redone": rebuild["redone"]}


def rows(ways: list[str], ranks: int, steps: int, repeat: int, tmp: Path) -> list[dict]:
    rates: dict[str, list[float]] = {name: [] for name in ways}
    for i in range(repeat):  # alternated: the machine's slow spells spread over every way
        for name in ways:
            rates[name].append(steps_per_s(WAYS[name], ranks, steps, tmp / f"{name}-clean-{i}"))
    return [{**kill_row(name, WAYS[name], ranks, steps, tmp), "steps_per_s": statistics.median(rates[name]),
             "steps_per_s_runs": rates[name]} for name in ways]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--ways", default=",".join(WAYS), help=f"which rows, of {','.join(WAYS)} (mpi first: the base)")
    parser.add_argument("--repeat", type=int, default=3, help="failure-free runs per way, alternated (median)")
    parser.add_argument("--json", action="store_true", help="one JSON object per row")
    args = parser.parse_args()
    ways = args.ways.split(",")
    if ways[0] != "mpi" or not set(ways) <= set(WAYS):
        parser.error(f"--ways: names of {', '.join(WAYS)}, mpi first (the ratios are to it)")
    with tempfile.TemporaryDirectory() as tmp:
        table = rows(ways, args.ranks, args.steps, args.repeat, Path(tmp))
    if args.json:
        for r in table:
            print(json.dumps(r))
        return 0
    base, base_down = table[0]["steps_per_s"], table[0]["down_s"]
    print(f"{args.ranks} ranks, {args.steps} steps, commit every 5, steps/s the median of {args.repeat} runs; "
          f"kill of logical rank 1 at step {args.steps // 2}, a spare takes over; ms unless said")
    head = ("way", "steps/s", "vs mpi", "down s", "vs mpi", "detect", "agree", "rebuild", "restore", "resume", "redone")
    print(" | ".join(head))
    for r in table:
        print(" | ".join([r["way"], f"{r['steps_per_s']:.1f}", f"{r['steps_per_s'] / base:.2f}", f"{r['down_s']:.3f}",
                          f"{r['down_s'] / base_down:.2f}"]
                         + [f"{r[k]:.1f}" if r[k] is not None else "-" for k in
                            ("detect_ms", "agree_ms", "rebuild_ms", "restore_ms", "resume_ms")] + [str(r["redone"])]))
    return 0


if __name__ == "__main__":
    sys.exit(main())

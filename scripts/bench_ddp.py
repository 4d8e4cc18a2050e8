"""DDP and FSDP2 over the World's communicator, DDP over Gloo, and allreduce_gradients over MPI, side by side.

    python scripts/bench_ddp.py [--ranks 4] [--steps 200] [--repeat 3] [--kills 3] [--json]

The same model, data and optimizer (examples/train.py's MLP) trained four ways
(``way`` in the rows), and a transformer two ways: ``mpi``, ``examples/train.py`` (gradients summed by
``elastic.allreduce_gradients`` over MPI after the backward pass); ``ddp``,
``examples/ddp.py`` on the ``ulfm`` process group (torch's DDP over the World's
communicator, one all-reduce per backward); ``ddp-gloo``, the same over Gloo
(the same one all-reduce, a 10 s group timeout); ``fsdp``, ``examples/fsdp.py`` (FSDP2's
``fully_shard`` on the ``ulfm`` group, its shards in the store);
``transformer-fsdp``, ``examples/fsdp_transformer.py`` (the official FSDP2
example's transformer, DCP into peer memory, a spare that rehearsed),
``transformer-fsdp-port``, ``examples/fsdp_port.py`` (the same model and loop as a port of the
official example is written: made on the meta device after ``init()``, no rehearsal),
``transformer-fsdp-port-rehearsed``, the same with ``elastic.init(rehearse=True)`` and
``transformer-ddp``, the same model and loop under DDP. For each:
steps per second without failures (the median step of a run, commits
included; the failure-free runs of all ways alternate ``--repeat`` times and
the median run counts, so a slow spell of this shared machine does not land on
one way only), and with a spare, kill -> next step after logical rank 1 is
SIGKILLed at step ``steps // 2`` in ``--kills`` runs per way (alternated too):
the median, mean and max, the phases' medians (from ``elastic.report.timeline``),
and the ratio to ``ddp``'s. With ``ddp-gloo``, its floor from the same run: Gloo's all-reduce of
the MLP's gradients alone (the same ranks under torchrun, the median of 300), and the most
``ddp-gloo`` could reach against ``mpi`` were its step the MPI path's plus that all-reduce.
``--json``: one JSON object per row.

Time: one launch per run, ``len(--ways) x (--repeat + --kills)`` of them (48 with the defaults),
5-10 s each for the MLP's ways and 8-30 s for the transformer's: 686 s with the defaults on this
loaded 2-core machine (stop 40), each run's end and an estimate of the rest printed on stderr.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from elastic.comm.events import read_events
from elastic.report import timeline

ROOT = Path(__file__).resolve().parents[1]
WAYS = {"mpi": ("examples/train.py",), "ddp": ("examples/ddp.py", "--backend", "ulfm"),
        "ddp-gloo": ("examples/ddp.py", "--backend", "gloo", "--group-timeout", "10"),
        "fsdp": ("examples/fsdp.py",),
        # the official FSDP2 example's transformer, and the same model and loop under DDP
        "transformer-ddp": ("examples/fsdp_transformer.py", "--ddp"),
        "transformer-fsdp": ("examples/fsdp_transformer.py",),
        # the same model as a port of the official example is written: built after init, no rehearsal
        "transformer-fsdp-port": ("examples/fsdp_port.py",),
        "transformer-fsdp-port-rehearsed": ("examples/fsdp_port.py", "--rehearse")}  # init(rehearse=True)
PHASES = ("detect", "agree", "rebuild", "restore", "resume")


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


def kill_run(program: tuple[str, ...], ranks: int, steps: int, run_dir: Path) -> dict:
    rebuild = timeline(run(program, ranks, steps, run_dir, ["--spares", "1", "--inject", f"1@{steps // 2}"]))[0]
    return {"down_s": rebuild["down"] / 1e3, "redone": rebuild["redone"],
            **{f"{phase}_ms": rebuild[phase] for phase in PHASES}}


def gradient_numel() -> int:
    """How many numbers examples/train.py's MLP all-reduces per step."""
    from _train_job import train_and_defaults
    train, args = train_and_defaults()
    return sum(p.numel() for p in train.make_model(args).parameters())


def gloo_allreduce_ms(ranks: int, numel: int) -> float:
    """Gloo's all-reduce of ``numel`` floats alone, ``ranks`` processes under torchrun: the median ms."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks),
           __file__, "--gloo-floor", str(numel)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("gloo_allreduce_ms ")]
    if proc.returncode or not lines:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{proc.stdout}\n{proc.stderr}")
    return float(lines[0].split()[1])


def _gloo_floor_worker(numel: int, reps: int = 300) -> None:
    import torch
    import torch.distributed as dist
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    buf = torch.ones(numel)
    seconds = []
    for i in range(reps + 20):  # the first 20 warm the connections up
        t = time.perf_counter()
        dist.all_reduce(buf)
        if i >= 20:
            seconds.append(time.perf_counter() - t)
    if dist.get_rank() == 0:
        print(f"gloo_allreduce_ms {1e3 * statistics.median(seconds):.4f}", flush=True)
    dist.destroy_process_group()


def rows(ways: list[str], ranks: int, steps: int, repeat: int, kills: int, tmp: Path) -> list[dict]:
    rates: dict[str, list[float]] = {name: [] for name in ways}
    downs: dict[str, list[dict]] = {name: [] for name in ways}
    total, done, began = len(ways) * (repeat + kills), 0, time.monotonic()

    def progress(name: str, kind: str, started: float) -> None:  # on stderr: --json's stdout stays the rows
        nonlocal done
        done += 1
        now = time.monotonic()
        print(f"[bench_ddp] {done}/{total} {name} {kind}: {now - started:.1f} s ({now - began:.0f} s so far, about "
              f"{(now - began) / done * (total - done):.0f} s to go)", file=sys.stderr, flush=True)

    for i in range(max(repeat, kills)):  # alternated: the machine's slow spells spread over every way
        for name in ways:
            if i < repeat:
                started = time.monotonic()
                rates[name].append(steps_per_s(WAYS[name], ranks, steps, tmp / f"{name}-clean-{i}"))
                progress(name, "failure-free", started)
            if i < kills:
                started = time.monotonic()
                downs[name].append(kill_run(WAYS[name], ranks, steps, tmp / f"{name}-kill-{i}"))
                progress(name, "kill", started)
    table = []
    for name in ways:
        down = [d["down_s"] for d in downs[name]]
        phases = {f"{p}_ms": statistics.median(d[f"{p}_ms"] for d in downs[name]) for p in PHASES}
        table.append({"way": name, "ranks": ranks, "steps_per_s": statistics.median(rates[name]),
                      "steps_per_s_runs": rates[name], "down_s": statistics.median(down),
                      "down_mean_s": statistics.fmean(down), "down_max_s": max(down), "down_runs": down,
                      "redone": max(d["redone"] for d in downs[name]), **phases})
    gloo = next((r for r in table if r["way"] == "ddp-gloo"), None)
    if gloo is not None:  # its floor: were its step the MPI path's plus Gloo's all-reduce alone
        gloo["gloo_allreduce_ms"] = gloo_allreduce_ms(ranks, gradient_numel())
        gloo["ceiling_vs_mpi"] = 1 / (1 + gloo["gloo_allreduce_ms"] / 1e3 * table[0]["steps_per_s"])
    return table


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     epilog="time: len(--ways) x (--repeat + --kills) launches, about 11 minutes with "
                                            "the defaults on a loaded 2-core machine; progress on stderr")
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--ways", default=",".join(WAYS), help=f"which rows, of {','.join(WAYS)} (mpi first: the base)")
    parser.add_argument("--repeat", type=int, default=3, help="failure-free runs per way, alternated (median)")
    parser.add_argument("--kills", type=int, default=3, help="runs with a kill per way, alternated (median, mean, max)")
    parser.add_argument("--json", action="store_true", help="one JSON object per row")
    parser.add_argument("--gloo-floor", type=int, help=argparse.SUPPRESS)  # a torchrun worker of gloo_allreduce_ms
    args = parser.parse_args()
    if args.gloo_floor:
        _gloo_floor_worker(args.gloo_floor)
        return 0
    ways = args.ways.split(",")
    if ways[0] != "mpi" or not set(ways) <= set(WAYS):
        parser.error(f"--ways: names of {', '.join(WAYS)}, mpi first (the ratios are to it)")
    with tempfile.TemporaryDirectory() as tmp:
        table = rows(ways, args.ranks, args.steps, args.repeat, args.kills, Path(tmp))
    if args.json:
        for r in table:
            print(json.dumps(r))
        return 0
    by_way = {r["way"]: r for r in table}
    base, base_down = table[0]["steps_per_s"], table[0]["down_s"]
    ddp_down = by_way["ddp"]["down_s"] if "ddp" in by_way else None
    print(f"{args.ranks} ranks, {args.steps} steps, commit every 5, steps/s the median of {args.repeat} runs; "
          f"kill of logical rank 1 at step {args.steps // 2}, a spare takes over, {args.kills} runs: down the median "
          "(mean, max), phases the medians in ms")
    head = ("way", "steps/s", "vs mpi", "down s", "mean", "max", "vs mpi", "vs ddp") + PHASES + ("redone",)
    print(" | ".join(head))
    for r in table:
        print(" | ".join([r["way"], f"{r['steps_per_s']:.1f}", f"{r['steps_per_s'] / base:.2f}", f"{r['down_s']:.3f}",
                          f"{r['down_mean_s']:.3f}", f"{r['down_max_s']:.3f}", f"{r['down_s'] / base_down:.2f}",
                          f"{r['down_s'] / ddp_down:.2f}" if ddp_down else "-"]
                         + [f"{r[f'{p}_ms']:.1f}" for p in PHASES] + [str(r["redone"])]))
    if "ddp-gloo" in by_way:
        gloo = by_way["ddp-gloo"]
        print(f"Gloo's all-reduce of the same gradients alone: {gloo['gloo_allreduce_ms']:.2f} ms a step (the MPI "
              f"path's whole step: {1e3 / base:.2f} ms); at most {gloo['ceiling_vs_mpi']:.2f}x mpi for ddp-gloo")
    if {"transformer-ddp", "transformer-fsdp"} <= set(by_way):
        same = by_way["transformer-fsdp"]["down_s"] / by_way["transformer-ddp"]["down_s"]
        print(f"FSDP2 against DDP on the same transformer: down {same:.2f}x")
    if {"transformer-ddp", "transformer-fsdp-port"} <= set(by_way):
        port = by_way["transformer-fsdp-port"]["down_s"] / by_way["transformer-ddp"]["down_s"]
        print(f"FSDP2 as the official example's port is written (no rehearsal) against DDP: down {port:.2f}x")
    if {"transformer-ddp", "transformer-fsdp-port-rehearsed"} <= set(by_way):
        port = by_way["transformer-fsdp-port-rehearsed"]["down_s"] / by_way["transformer-ddp"]["down_s"]
        print(f"FSDP2, that port with elastic.init(rehearse=True), against DDP: down {port:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())

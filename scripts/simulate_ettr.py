"""Effective training time ratio at cluster scale: in-memory recovery vs checkpoint-restart.

    python scripts/simulate_ettr.py [--measured elastic-run/bench/bench_recovery.json] [--plot ettr.png]
    python scripts/bench_step.py --json > elastic-run/bench/bench_step.json
    python scripts/simulate_ettr.py --per-step elastic-run/bench/bench_step.json

A first-order model (Young 1974, Daly 2006), checked by a discrete-event
simulation of a 30-day job with exponential failures. For each job size and
method it prints the optimal commit / checkpoint interval and the ETTR there
and at fixed intervals. The assumptions are printed with the table.
"""
from __future__ import annotations

import argparse
import json
import math
import random
import statistics
from dataclasses import dataclass
from pathlib import Path

HOUR = 3600.0
# Published failure statistics, as the mean time between failures of ONE rank (GPU), in hours:
# Meta (HPCA 2025): a 1,024-GPU job fails every 7.9 h on average;
# Llama 3 (2024): 466 job interruptions in 54 days on 16,384 GPUs (78% of them hardware).
RANK_MTBF_H = {"Meta 1k-GPU MTTF 7.9 h": 7.9 * 1024, "Llama 3 466 in 54 d": 54 * 24 / 466 * 16384}


@dataclass(frozen=True)
class Method:
    name: str
    cost: float      # seconds training stops for one commit / checkpoint
    recover: float   # seconds from a failure to training again (lost work not included)


def ettr(interval: float, method: Method, mttf: float) -> float:
    """First-order ETTR: each segment of `interval` useful seconds costs the commit, and with
    probability (segment / MTTF) a failure, the recovery and on average half the segment again."""
    segment = interval + method.cost
    return interval / (segment + segment / mttf * (method.recover + segment / 2))


def optimal_interval(method: Method, mttf: float) -> float:
    """Daly's higher-order optimum (Young's sqrt(2CM) when the commit is cheap)."""
    c = method.cost
    if c >= 2 * mttf:
        return mttf
    return math.sqrt(2 * c * mttf) * (1 + math.sqrt(c / (2 * mttf)) / 3 + c / (18 * mttf)) - c


def simulate(interval: float, method: Method, mttf: float, days: float = 30, seed: int = 0) -> float:
    """Discrete events: train `interval`, commit; failures arrive as a Poisson process and cost
    the recovery plus the work since the last commit (a failure during recovery restarts it).
    The whole segments between two failures are counted at once: O(failures), so a per-step point
    (a segment of one step, a fraction of a second) simulates as fast as an hourly checkpoint."""
    rng = random.Random(seed)
    horizon, now, useful = days * 24 * HOUR, 0.0, 0.0
    segment = interval + method.cost
    next_failure = rng.expovariate(1 / mttf)
    while now < horizon:
        to_horizon = math.ceil((horizon - now) / segment)
        before_failure = math.floor((next_failure - now) / segment)
        if before_failure >= to_horizon:
            now, useful = now + to_horizon * segment, useful + to_horizon * interval
            break
        useful += before_failure * interval
        now = next_failure  # the segment in flight is lost; recover (again if a failure hits the recovery)
        while True:
            next_failure = now + rng.expovariate(1 / mttf)
            if next_failure >= now + method.recover:
                now += method.recover
                break
            now = next_failure
    return useful / now


def per_step_methods(path: Path, layout: str, state_gb: float, unique: float) -> list[tuple[Method, float, str]]:
    """(method, its fixed interval: one step, where the figures come from) for each per-step mode of
    ``layout`` in ``bench_step.py --json`` output (one row per line). A step point costs what it
    blocked a measured step for, grown with the rank-unique bytes it replicates (``unique`` of a
    state of ``state_gb`` at scale, against the bench's own: a third of it sharded, the random
    stream alone replicated); twins replicate the random stream only, at any size. A failure costs
    the run's kill -> next step, its restore part grown with the state the replacement receives."""
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.startswith("{")]
    rows = [r for r in rows if r["layout"] == layout]
    if not rows:
        raise SystemExit(f"{path}: no {layout} rows; run scripts/bench_step.py --layouts {layout} --json > {path}")
    base = next(r for r in rows if r["mode"] == "none")
    step_s = 1 / base["steps_per_s"]
    out = []
    for r in rows:
        if r["mode"] not in ("step", "twin"):
            continue
        bench_gb = r["mb"] / 1024
        bench_unique = bench_gb / 3 if layout == "sharded" else 0.0
        grow = max(1.0, state_gb * unique / bench_unique) if r["mode"] == "step" and bench_unique else 1.0
        cost = r["blocked_fraction"] / r["steps_per_s"] * grow  # the point's own time in a step, not noise
        restore_gbps = bench_gb / max(r["down_s"] - r["floor_s"], 1e-6)
        recover = r["floor_s"] + state_gb / restore_gbps + step_s * (r["lost"] or 0)
        grown = f", x{grow:.1f} for {unique:.2f} of {state_gb:g} GB rank-unique" if grow != 1.0 else ""
        out.append((Method(f"per-step, {r['mode']}", cost, recover), step_s,
                    f"{path} ({r['ranks']} ranks x {r['mb']} MB {layout}, {1e3 * step_s:.0f} ms steps{grown})"))
    return out


def measured_constants(path: Path | None) -> dict[str, float]:
    """Per-failure and per-GB costs of in-memory recovery, from bench_recovery.json or this machine's figures."""
    const = {"rebuild_s": 0.05, "restore_gbps": 1.0, "commit_gbps": 0.5, "spawn_s": 4.3, "source": "defaults"}
    if path and path.exists():
        data = json.loads(path.read_text())
        big = max(data["results"], key=lambda r: r["mb"])
        spare = big["spare"]
        const.update(rebuild_s=statistics.median(r["rebuild"] for r in spare),
                     restore_gbps=big["mb"] / 1024 / statistics.median(r["restore"] for r in spare),
                     commit_gbps=big["steady"]["commit_MBps"] / 1024,
                     spawn_s=statistics.median(r["rebuild"] for r in big["spawn"]),
                     source=f"{path} ({big['ranks']} ranks x {big['mb']} MB)")
    return const


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[1024, 4096, 16384, 131072])
    parser.add_argument("--state-gb", type=float, default=1.0, help="checkpointed state per rank, GB")
    parser.add_argument("--storage-gbps", type=float, nargs="+", default=[100.0, 1000.0],
                        help="parallel file system bandwidth shared by the job, GB/s")
    parser.add_argument("--restart-s", type=float, default=600.0,
                        help="requeue + relaunch + initialisation of the whole job at scale, seconds")
    parser.add_argument("--measured", type=Path, default=Path("elastic-run/bench/bench_recovery.json"))
    parser.add_argument("--per-step", type=Path, nargs="?", const=Path("elastic-run/bench/bench_step.json"),
                        help="add the per-step points measured by scripts/bench_step.py --json > FILE")
    parser.add_argument("--layout", choices=("sharded", "replicated"), default="sharded",
                        help="the bench_step layout the per-step figures come from")
    parser.add_argument("--unique", type=float, default=1 / 3,
                        help="the share of the state that is rank-unique (a ZeRO-1 shard: a third), the rest "
                             "replicated: what a per-step point replicates every step")
    parser.add_argument("--plot", type=Path, help="PNG of ETTR against job size (needs matplotlib)")
    a = parser.parse_args()
    k = measured_constants(a.measured)
    print("Assumptions:")
    print("- failures: Poisson; one rank's MTBF from published data: "
          + "; ".join(f"{name}: {h:,.0f} h" for name, h in RANK_MTBF_H.items()) + "; job MTTF = rank MTBF / ranks")
    print(f"- state per rank {a.state_gb} GB. In-memory (measured, {k['source']}): commit at "
          f"{k['commit_gbps']:.2f} GB/s per rank, in parallel on all ranks; recovery = {k['rebuild_s']:.3f} s "
          f"(detect + agree + rebuild with a spare) + state / {k['restore_gbps']:.2f} GB/s; spawn instead of a spare "
          f"{k['spawn_s']:.1f} s. Training stops for the commit (no overlap assumed).")
    print(f"- checkpoint-restart: every rank writes to / reads from a file system of "
          f"{' or '.join(f'{g:g}' for g in a.storage_gbps)} GB/s shared by the job (ranks x state / bandwidth); "
          f"a failure costs a restart of {a.restart_s:.0f} s (requeue, relaunch, init) plus the load.")
    print("- lost work: half an interval on average; intervals are Daly's optimum unless stated; "
          "'sim' = a 30-day discrete-event simulation at that interval (seed 0), which also counts failures "
          "during recovery: where recovery is not small against the MTTF the formula is optimistic, trust 'sim'.")
    fixed = per_step_methods(a.per_step, a.layout, a.state_gb, a.unique) if a.per_step else []
    for m, _, source in fixed:
        print(f"- {m.name} (measured, {source}): every step a recovery point, {1e3 * m.cost:.1f} ms a step, "
              f"recovery {m.recover:.3f} s, half a step lost; its interval is the step, not a choice")
    methods = lambda n: [  # noqa: E731
        Method("in-memory, spare", a.state_gb / k["commit_gbps"], k["rebuild_s"] + a.state_gb / k["restore_gbps"]),
        Method("in-memory, spawn", a.state_gb / k["commit_gbps"], k["spawn_s"] + a.state_gb / k["restore_gbps"]),
        *(Method(f"checkpoint {g:g} GB/s", n * a.state_gb / g, a.restart_s + n * a.state_gb / g)
          for g in a.storage_gbps)]
    rows = []
    for source, rank_mtbf in RANK_MTBF_H.items():
        print(f"\nfailure data: {source}")
        head = ("ranks", "job MTTF h", "method", "cost s", "recover s", "interval*", "ETTR*", "sim", "@10 min",
                "@60 min")
        print(f"{head[0]:>6} {head[1]:>10}  {head[2]:<22}" + "".join(f"{h:>10}" for h in head[3:]))
        for n in a.ranks:
            mttf = rank_mtbf * HOUR / n
            chosen = [(m, optimal_interval(m, mttf), True) for m in methods(n)] + [(m, t, False) for m, t, _ in fixed]
            for m, tau, free in chosen:  # free: the interval is a choice (else it is the step)
                best, sim = ettr(tau, m, mttf), simulate(tau, m, mttf)
                rows.append({"source": source, "ranks": n, "method": m.name, "ettr": best})
                at = f"{ettr(600, m, mttf):>10.3f}{ettr(3600, m, mttf):>10.3f}" if free else f"{'-':>10}{'-':>10}"
                print(f"{n:>6} {mttf / HOUR:>10.2f}  {m.name:<22}{m.cost:>10.3g}{m.recover:>10.3g}"
                      f"{_duration(tau):>10}{best:>10.3f}{sim:>10.3f}{at}")
    if a.plot:
        _plot(rows, a.ranks, a.plot)
    return 0


def _duration(seconds: float) -> str:
    if seconds < 60:
        return f"{seconds:.2f} s"
    return f"{seconds / 60:.1f} min" if seconds < 2 * HOUR else f"{seconds / HOUR:.1f} h"


def _plot(rows: list[dict], ranks: list[int], out: Path) -> None:
    from elastic.report import pyplot
    plt = pyplot()
    sources = list(RANK_MTBF_H)
    fig, axes = plt.subplots(1, len(sources), figsize=(11, 4), sharey=True)
    for ax, source in zip(axes, sources):
        for method in dict.fromkeys(r["method"] for r in rows):
            ys = [r["ettr"] for r in rows if r["source"] == source and r["method"] == method]
            ax.plot(ranks, ys, marker="o", label=method)
        ax.set(xscale="log", xlabel="ranks", title=source, ylim=(0, 1.02))
        ax.set_xticks(ranks, [str(r) for r in ranks])
    axes[0].set_ylabel("ETTR at the optimal interval")
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    print(f"plot written to {out}")


if __name__ == "__main__":
    raise SystemExit(main())

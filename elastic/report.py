"""Turn a run's JSON-line events into a recovery timeline, the ETTR, and a loss plot.

    python -m elastic.report RUN_DIR [--baseline FAILURE_FREE_RUN_DIR] [--plot loss.png] [--trace trace.json]

Per failure (one row per rebuild generation), in milliseconds:

* detect: the injected kill -> the first survivor sees the failure
* agree: the slowest process's agreement on the failed set
* rebuild: substitute (spare / spawn) + installing the new communicators (the shrink is in agree)
* restore: the slowest rank's state recovery from peers' memory and roll-back
* resume: restored -> the first training step completed again
* down: the kill -> that first step (everything above, and waits between them)

plus the steps redone (lost since the last commit) and the bytes moved; below
the table, per failure: the policy's reason, what died, and how each lost pipeline
stage came back (``stage_rebuilt``: from a twin, the store, by CheckFree(+), a replica).
Then the integrity gate's verdicts and the stragglers, in the order they came: a version kept
from becoming current by a NaN / Inf (and the roll-back, with the step dropped or run again), a
rank fenced for values that differ from the majority's, no majority (the job stopped), a rank
evicted (or not) for being slow, by how much.
ETTR (effective training time ratio) = time spent in training steps that
count toward the final model / wall time from start to finish.

``--trace`` writes the run as a Chrome-trace JSON file (open it in
https://ui.perfetto.dev or chrome://tracing): one track per process, spans for
its steps, its commits (with their phases) and each recovery's detect /
agree / rebuild / restore / resume, and instants for injections and deaths.
"""
from __future__ import annotations

import argparse
import functools
import json
import sys
from pathlib import Path
from typing import Any, Callable

from elastic.comm.events import REBUILD_PHASES, read_events
from elastic.comm.runtime import keep_mpi_uninitialized


def final_steps(events: list[dict]) -> dict[int, dict]:
    """Each step's last recorded execution (steps redone after a roll-back replace the lost ones)."""
    steps: dict[int, dict] = {}
    for e in events:
        if e["event"] == "step":
            steps[e["step"]] = e
    return steps


def finished(events: list[dict]) -> bool:
    return any(e["event"] == "finished" for e in events)


def ettr(events: list[dict]) -> float | None:
    """Time in steps that count / wall time between the first start and the last finish.

    For a run that did not finish, up to its last event (None without steps or a start).
    """
    started = [e["t"] for e in events if e["event"] == "started"]
    ends = [e["t"] for e in events if e["event"] == "finished"] or [e["t"] for e in events]
    steps = final_steps(events)
    if not started or not steps or max(ends) <= min(started):
        return None
    useful = sum(e["seconds"] for e in steps.values())
    return useful / (max(ends) - min(started))


def timeline(events: list[dict]) -> list[dict[str, Any]]:
    """One row per rebuild, phases in milliseconds (see the module docstring)."""
    rows = []
    generations = sorted({e["gen"] for e in events if e["event"] == "rebuilt"})
    steps = [e for e in events if e["event"] == "step"]
    for gen in generations:
        of = [e for e in events if e.get("gen") == gen]
        before = [e for e in events if e.get("gen") == gen - 1]
        rebuilt = [e for e in of if e["event"] == "rebuilt"]
        kills = [e["t"] for e in before if e["event"] == "inject"]  # every injected action ends a process now
        seen = [e["t"] for e in before if e["event"] == "failure_seen"]
        start = min(kills) if kills else min(seen, default=min(e["t"] for e in rebuilt))
        restored = [e for e in of if e["event"] == "state_restored"]
        restored_t = max((e["t"] for e in restored), default=max(e["t"] for e in rebuilt))
        # Generations order the steps without trusting clocks: a failure during this recovery
        # puts the first step after it in a later generation.
        after = [e for e in steps if e["gen"] >= gen]
        last_before = max((e["step"] for e in steps if e["gen"] < gen), default=0)
        first_after = after[0] if after else None
        decisions = [e for e in before if e["event"] == "decision"]
        rows.append({
            "gen": gen,
            "failed": rebuilt[0]["failed"],
            "mode": rebuilt[0]["mode"],
            "reason": _relaunch_reason(rebuilt[0]) if rebuilt[0]["mode"] == "relaunch" else
            decisions[-1]["reason"] if decisions else "",
            "detect": 1e3 * (min(seen) - start) if seen and kills else None,
            "agree": 1e3 * max(e["durations"].get("agree", 0.0) for e in rebuilt),
            "rebuild": 1e3 * max(sum(e["durations"].get(k, 0.0) for k in REBUILD_PHASES if k != "agree")
                                 for e in rebuilt),
            # None: another failure interrupted this recovery (the next row's recovery finished it).
            "restore": 1e3 * max(e["seconds"] for e in restored) if restored else None,
            "resume": 1e3 * (first_after["t"] - restored_t) if first_after else None,
            "down": 1e3 * (first_after["t"] - start) if first_after else None,
            "redone": max(last_before - (first_after["step"] - 1), 0) if first_after else None,
            # The store's bytes (each rank's), the shared values copied to replacements (told
            # alike by every rank: once), and the shards replacements took from their twins (each
            # replacement's).
            "bytes": sum(e["bytes_moved"] for e in restored) + max(
                (e["bytes"] for e in of if e["event"] == "shared_copied"), default=0) + sum(
                e["bytes"] for e in of if e["event"] == "twin_copied") if restored else None,
            "causes": rebuilt[0].get("causes", []),
            "size": rebuilt[0]["size"],
            "t_failure": start,
            "t_resumed": first_after["t"] if first_after else None,
            "failed_at_step": last_before,
            # By replica and stage: the ranks bringing them back write their events in any order.
            "stages": sorted(({k: e.get(k) for k in ("stage", "replica", "method", "sources", "step")}
                              for e in of if e["event"] == "stage_rebuilt"),
                             key=lambda x: (x["replica"] or 0, x["stage"])),
            "interrupted": gen < generations[-1] and not any(e["gen"] == gen for e in steps),
            # Sharded state kept by twins (State(twins=...)): who took its slices from which twins,
            # and the commits gone back to where every twin of some slice died.
            "twins": sorted((e["logical"], e["senders"]) for e in of if e["event"] == "twin_copied"),
            "twins_lost": sorted({(tuple(sorted(e["ranks"])), e["version"]) for e in of if e["event"] == "twins_lost"}),
        })
    return rows


def integrity(events: list[dict]) -> list[str]:
    """The gate's verdicts and the stragglers found, one line each, in time order (every rank
    writes the same verdict: the first rank's is told)."""
    seen: set[tuple] = set()
    lines = []
    for e in sorted((e for e in events if e["event"] in ("integrity", "rolled_back", "straggler")),
                    key=lambda e: e["t"]):
        key = (e["event"], e.get("gen"), e.get("version"), e.get("step"), e.get("rank"))
        if key in seen:
            continue
        seen.add(key)
        if e["event"] == "rolled_back":
            lines.append(f"  rolled back to version {e['version']}" +
                         (" (one further back: the last one did not help)" if e.get("fallback") else "") +
                         (f", step {e['step']} dropped" if e["dropped"] else
                          f", step {e['step']} to run again" if e["step"] is not None else ""))
        elif e["event"] == "straggler":
            lines.append(f"  step {e['step']}: logical rank {e['rank']} a straggler, {e['ratio']:.1f}x the median "
                         f"step ({e['median_seconds'] * 1e3:.1f} ms) for {e['steps']} steps: " +
                         ("evicted" if e["evicted"] else "not evicted (no spare, no replacement allowed)"))
        elif e["verdict"] == "nonfinite":
            what = f"a non-finite {e['what']} at step {e['step']}" if e["step"] is not None else "non-finite values"
            values = f" ({', '.join(e['values'][:3])})" if e["values"] else ""
            lines.append(f"  version {e['version']} not committed: {what}{values}")
        elif e["verdict"] == "fenced":
            differ = "; ".join(f"logical rank {r}: {', '.join(v[:3])}" for r, v in e["values"].items())
            lines.append(f"  version {e['version']} not committed: fenced, differing from the majority ({differ})")
        elif e["verdict"] == "structure":
            lines.append(f"  version {e['version']} refused: {', '.join(list(e['values'])[:3])} differ in name, dtype "
                         "or shape across ranks (a program error): the job stops")
        else:
            lines.append(f"  version {e['version']} refused: {', '.join(e['values'][:3])} differ and no majority "
                         "agrees: the job stops")
    return lines


def start_up(events: list[dict], gen: int, t_failure: float, run_dir: Path | None = None) -> dict[str, float]:
    """A relaunch's way back by phase, in seconds (issue 30): teardown (the kill -> the lost launch's
    mpiexec gone, from ``summary.json``), runtime (-> its processes began: the relaunch planned, the
    daemons started; without ``summary.json`` the two are one, ``down``), process (-> MPI_Init
    began: an interpreter and its imports, or a fork from the warm process), mpi_init, join (-> the
    world built), attach (-> the nodes' versions agreed), fetch (-> the state recovered), resume (->
    the loop goes on). The slowest rank's time at each boundary."""
    mine = [e for e in events if e.get("gen") == gen]
    started = [e for e in mine if e["event"] == "started" and "began" in e]
    if not started:
        return {}
    began = max(e["began"] for e in started)
    mpi_start = max(e["mpi_start"] for e in started)
    mpi_done = max(e["mpi_start"] + e["mpi_init"] for e in started)
    joined = max(e["t"] for e in started)

    def last(name: str) -> float | None:
        times = [e["t"] for e in mine if e["event"] == name]
        return max(times) if times else None
    phases: dict[str, float] = {}
    gone = None
    if run_dir is not None and (run_dir / "summary.json").exists():
        launches = json.loads((run_dir / "summary.json").read_text()).get("launches", [])
        gone = next((launch["ended"] for launch in launches if "ended" in launch and launch["ended"] >= t_failure),
                    None)
    if gone is not None:
        phases["teardown"], phases["runtime"] = gone - t_failure, min(e["began"] for e in started) - gone
    else:
        phases["down"] = min(e["began"] for e in started) - t_failure
    phases.update({"process": mpi_start - began, "mpi_init": mpi_done - mpi_start, "join": joined - mpi_done})
    previous = joined
    for phase, name in (("attach", "store_attached"), ("fetch", "store_recovered"), ("resume", "resumed")):
        at = last(name)
        if at is not None:
            phases[phase], previous = at - previous, at
    return phases


def _relaunch_reason(rebuilt: dict) -> str:
    lost = ", ".join(rebuilt.get("lost_nodes") or []) or "none named"
    moved = [f"{what} {ranks}" for what, ranks in (("on spare nodes:", rebuilt["replaced"]),
                                                   ("removed:", rebuilt["removed"])) if ranks]
    return f"the runtime ended (nodes lost: {lost}); relaunch {rebuilt['attempts']} from the nodes' memory" + \
        (f", logical ranks {'; '.join(moved)}" if moved else "")


# The recovery's spans: an event -> (the event that opens its span on the same process, the span's
# name, the event's fields the span shows)
_RECOVERY_SPANS = {"agreed": ("failure_seen", "agree", ("failed",)), "rebuilt": ("agreed", "rebuild", ("mode", "size")),
                   "state_restored": ("rebuilt", "restore", ("bytes_moved",)),
                   "resumed": ("state_restored", "resume", ())}
_INSTANTS = ("inject", "failure_seen", "started", "finished", "promoted", "spawned", "data_lost", "released")


def trace(events: list[dict]) -> dict[str, Any]:
    """The run as Chrome-trace JSON (the Trace Event Format: complete 'X' spans and 'i' instants,
    microseconds from the first event), one process track per OS process."""
    if not events:
        return {"traceEvents": [], "displayTimeUnit": "ms"}
    t0 = min(e["t"] for e in events)
    out: list[dict[str, Any]] = []
    names: dict[int, str] = {}
    last: dict[tuple[int, str], float] = {}  # (pid, event) -> its last time, to open the next span
    span = functools.partial(_span, out, t0)
    for e in events:
        pid, kind, t = e.get("pid", 0), e["event"], e["t"]
        if e.get("logical") is not None:
            names.setdefault(pid, f"logical rank {e['logical']} (pid {pid})")
        if kind == "step":
            span(e, f"step {e['step']}", t - e.get("seconds", 0.0), t, "step", loss=e.get("loss"), gen=e.get("gen"))
        elif kind == "committed":
            _commit_spans(span, e)
        elif kind in _RECOVERY_SPANS:
            opener, name, shown = _RECOVERY_SPANS[kind]
            if (pid, opener) in last or kind == "rebuilt":
                span(e, name, last.get((pid, opener), t), t, "recovery", **{k: e.get(k) for k in shown})
        elif kind == "failure_seen":
            kills = [x["t"] for x in events if x["event"] == "inject" and x.get("gen") == e.get("gen") and x["t"] <= t]
            span(e, "detect", max(kills) if kills else t, t, "recovery")
        if kind in _INSTANTS:
            out.append({"name": kind, "cat": "event", "ph": "i", "s": "p", "ts": round((t - t0) * 1e6, 1),
                        "pid": pid, "tid": 0, "args": {k: v for k, v in e.items() if k not in ("t", "event", "pid")}})
        last[(pid, kind)] = t
    meta = [{"name": "process_name", "ph": "M", "pid": pid, "tid": 0, "args": {"name": name}}
            for pid, name in sorted(names.items())]
    return {"traceEvents": meta + out, "displayTimeUnit": "ms"}


def _span(out: list[dict[str, Any]], t0: float, e: dict, name: str, start: float, end: float, cat: str,
          **args: Any) -> None:
    """A complete span on ``e``'s process track (none when it would end before it starts)."""
    if end >= start:
        out.append({"name": name, "cat": cat, "ph": "X", "ts": round((start - t0) * 1e6, 1),
                    "dur": round((end - start) * 1e6, 1), "pid": e.get("pid", 0), "tid": 0, "args": args})


def _commit_spans(span: Callable[..., None], e: dict) -> None:
    """A commit's span, and one per phase inside it, back to back."""
    phases = e.get("durations", {})
    start = e["t"] - sum(phases.values())
    span(e, f"commit v{e.get('version')}", start, e["t"], "commit", bytes_out=e.get("bytes_out"))
    for phase, seconds in phases.items():
        span(e, phase, start, start + seconds, "commit")
        start += seconds


def format_report(run_dir: Path, baseline: Path | None = None) -> str:
    events = read_events(run_dir)
    rows = timeline(events)
    lines = [f"run {run_dir}: {len(rows)} failure(s), ETTR {_ratio(ettr(events))}"
             + ("" if finished(events) else " (did not finish: up to its last event)")]
    if baseline is not None:
        lines[0] += f" (failure-free run: ETTR {_ratio(ettr(read_events(baseline)))})"
    head = ("gen", "failed", "mode", "size", "detect", "agree", "rebuild", "restore", "resume", "down", "redone",
            "MB moved")
    lines.append(" ".join(f"{h:>9}" for h in head) + "   (ms; redone = steps lost since the last commit)")
    for r in rows:
        cells = (r["gen"], ",".join(map(str, r["failed"])), r["mode"], r["size"], r["detect"], r["agree"],
                 r["rebuild"], r["restore"], r["resume"], r["down"], r["redone"],
                 None if r["bytes"] is None else r["bytes"] / 1e6)
        lines.append(" ".join(f"{c:>9.1f}" if isinstance(c, float) else f"{'-' if c is None else c!s:>9}"
                              for c in cells))
    for r in rows:
        causes = "; ".join(c["what"] if c.get("logical") is None else f"logical rank {c['logical']}: {c['what']}"
                           for c in r["causes"])
        phases = start_up(events, r["gen"], r["t_failure"], run_dir) if r["mode"] == "relaunch" else {}
        slowest = max(phases, key=lambda k: phases[k]) if phases else ""
        way = ("; the relaunch by phase (s): " + ", ".join(f"{k.replace('_', ' ')} {v:.2f}" for k, v in phases.items())
               + f"; slowest: {slowest.replace('_', ' ')}") if phases else ""
        interrupted = "; recovery interrupted by the next failure" if r["interrupted"] else ""
        stages = "; ".join(f"stage {x['stage']}" + (f" of replica {x['replica']}" if x["replica"] is not None else "")
                           + f" by {x['method']}" + (f" from logical {x['sources']}" if x["sources"] else "")
                           + (f" from the commit of step {x['step']}" if x["step"] is not None else "")
                           for x in r["stages"])
        twins = "".join(f"; logical rank {k}'s slices from its twin(s) logical {senders}" for k, senders in r["twins"])
        twins += "".join(f"; every twin of logical {list(ranks)} lost: every rank back to the commit of version "
                         f"{version}" for ranks, version in r["twins_lost"])
        lines.append(f"  gen {r['gen']}: {r['reason'] or 'no decision needed'}"
                     + (f"; died: {causes}" if causes else "") + (f"; rebuilt {stages}" if stages else "")
                     + twins + way + interrupted)
    checks = integrity(events)
    if checks:
        lines += ["integrity and stragglers:"] + checks
    steps = final_steps(events)
    if steps:
        last = steps[max(steps)]
        loss = "-" if last.get("loss") is None else f"{last['loss']:.6f}"
        lines.append(f"{'final' if finished(events) else 'last'} step {last['step']}, loss {loss}")
    return "\n".join(lines)


def _ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def pyplot(required: bool = True):
    """matplotlib.pyplot without a display; None (with a note) or SystemExit when it is not installed."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        if required:
            raise SystemExit("the plot needs matplotlib: pip install 'ulfm-elastic[plot]'") from exc
        print("(no plot: pip install 'ulfm-elastic[plot]')")
        return None
    return plt


def plot(run_dir: Path, out: Path, baseline: Path | None = None) -> None:
    """Loss against step and against wall time, failures marked, the failure-free run beside it."""
    plt = pyplot()
    events = read_events(run_dir)
    t0 = min(e["t"] for e in events if e["event"] == "started")
    fig, (by_step, by_time) = plt.subplots(1, 2, figsize=(11, 4))
    if baseline is not None:
        base = read_events(baseline)
        b0 = min(e["t"] for e in base if e["event"] == "started")
        bsteps = sorted(final_steps(base).values(), key=lambda e: e["step"])
        by_step.plot([e["step"] for e in bsteps], [e["loss"] for e in bsteps], "--", color="gray", label="no failure")
        by_time.plot([e["t"] - b0 for e in bsteps], [e["loss"] for e in bsteps], "--", color="gray",
                     label="no failure")
    every = [e for e in events if e["event"] == "step"]
    by_time.plot([e["t"] - t0 for e in every], [e["loss"] for e in every], color="C0", label="with failures")
    steps = sorted(final_steps(events).values(), key=lambda e: e["step"])
    by_step.plot([e["step"] for e in steps], [e["loss"] for e in steps], color="C0", label="with failures")
    for row in timeline(events):
        by_time.axvspan(row["t_failure"] - t0, (row["t_resumed"] or row["t_failure"]) - t0, color="C3", alpha=0.3)
        by_step.axvline(row["failed_at_step"], color="C3", alpha=0.6)
        by_step.annotate(f"lost {row['failed']} ({row['mode']})", (row["failed_at_step"], by_step.get_ylim()[1]),
                         rotation=90, va="top", ha="right", fontsize=8, color="C3")
    by_step.set(xlabel="step", ylabel="loss", yscale="log", title="loss by step (failures marked)")
    by_time.set(xlabel="seconds since start", ylabel="loss", yscale="log", title="loss by time (recovery shaded)")
    by_step.legend()
    by_time.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def main(argv: list[str] | None = None) -> int:
    keep_mpi_uninitialized()  # a tool: nothing it reads starts MPI here (importing this module changes nothing)
    parser = argparse.ArgumentParser(prog="python -m elastic.report", description=__doc__.splitlines()[0])
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("--baseline", type=Path, help="a failure-free run of the same job, for comparison")
    parser.add_argument("--plot", type=Path, help="write a PNG of the loss curves here (needs matplotlib)")
    parser.add_argument("--json", action="store_true", help="print the timeline rows as JSON instead")
    parser.add_argument("--trace", type=Path, help="write a Chrome-trace / Perfetto timeline (JSON) here")
    args = parser.parse_args(argv)
    if not any(args.run_dir.glob("events-*.jsonl")):
        parser.error(f"{args.run_dir} holds no events-*.jsonl: give the --run-dir of a launched job")
    if args.json:
        events = read_events(args.run_dir)
        print(json.dumps({"ettr": ettr(events), "timeline": timeline(events)}, indent=1))
    else:
        print(format_report(args.run_dir, args.baseline))
    if args.plot:
        plot(args.run_dir, args.plot, args.baseline)
        print(f"plot written to {args.plot}")
    if args.trace:
        args.trace.write_text(json.dumps(trace(read_events(args.run_dir))))
        print(f"trace written to {args.trace}: open it in https://ui.perfetto.dev")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""How fast training gets back after losing a pipeline stage, by way of recovery.

    python scripts/pipeline_experiment.py [--steps 120] [--plot elastic-run/pipeline/loss.png]

examples/pipeline.py (4 stages of one transformer block, synthetic text) runs
once without failure and once per way back: (a) the store's copies (a commit
every 10 steps; every rank rolls back to it: exact), (b) without copies,
CheckFree (interior stage) / CheckFree+ (end stages), (b') the same with
Adam's moments rebuilt by the same weighted average. Scenario 1 loses interior stage 1;
scenario 2 loses stage 1 and then the last stage. Printed per run: steps run
twice (roll-backs), how many steps behind the failure-free run it ends (when
that run first had this run's final loss, against when it first had its own;
5-step moving averages), the final loss, wall seconds.
"""
from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from elastic.report import final_steps  # noqa: E402
from elastic.comm.events import read_events  # noqa: E402

WAYS = {"none": (), "store": (), "checkfree": ("--commit-every", "0"),
        "checkfree+moments": ("--commit-every", "0", "--average-moments")}
PAPER = ("The paper (500M LLaMa, 5%/h stage failures, to validation loss 2.85): checkpointing 558 h, "
         "CheckFree 368 h, CheckFree+ 355 h (about 1.6x faster); 1.5B perplexity 16.07 without failures, "
         "17.59 with CheckFree, 17.07 with CheckFree+. This toy (4 stages of one block, synthetic text, "
         "minutes on a CPU) can show the ordering of the ways back, not those magnitudes.")


def run(tmp: Path, name: str, way: str, kills: str, spares: int, steps: int) -> dict:
    run_dir = tmp / f"{name}-{way}"
    launcher = ["--spares", str(spares), "--inject", kills] if way != "none" else []
    args = ["--commit-every", "10", *WAYS[way], "--checkfree-plus", "--steps", str(steps)]
    started = time.time()
    subprocess.run([sys.executable, "-m", "elastic.launch", "-n", "4", "--timeout", "600", "--run-dir",
                    str(run_dir), *launcher, "--", sys.executable, "examples/pipeline.py", *args],
                   cwd=ROOT, capture_output=True, text=True, timeout=700)
    events = read_events(run_dir)
    losses = {s: e["loss"] for s, e in final_steps(events).items()}
    executed = sum(1 for e in events if e["event"] == "step")
    return {"losses": losses, "seconds": time.time() - started, "redone": executed - len(losses),
            "methods": sorted({e["method"] for e in events if e["event"] == "stage_rebuilt"})}


def smooth(losses: dict[int, float], step: int, width: int = 5) -> float:
    window = [losses[s] for s in range(step - width + 1, step + 1) if s in losses]
    return sum(window) / len(window)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--plot", type=Path, default=Path("elastic-run/pipeline/loss.png"))
    a = parser.parse_args()
    first = a.steps * 2 // 5
    scenarios = {"stage 1 lost": (f"1@{first}", 1), "stage 1, then the last": (f"1@{first},3@{first * 3 // 2}/g1", 2)}
    print(PAPER, flush=True)
    results: dict[str, dict[str, dict]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for scenario, (kills, spares) in scenarios.items():
            print(f"\n{scenario} (kills {kills}); loss = 5-step moving average", flush=True)
            head = ("way back", "rebuilt by", "steps redone", "steps behind", "final loss", "seconds")
            print(f"{head[0]:<18} {head[1]:<22}" + "".join(f"{h:>13}" for h in head[2:]), flush=True)
            results[scenario] = runs = {}
            for way in WAYS:
                r = runs[way] = run(Path(tmp), f"{len(results)}", way, kills, spares, a.steps)
                losses = r["losses"]
                if len(losses) < a.steps:
                    print(f"{way:<18} did not finish", flush=True)
                    continue
                final = smooth(losses, a.steps)
                ref = runs["none"]["losses"]
                # When the failure-free run first had this final loss, against when it had its own
                # final loss: the steps of progress the failures cost (the curve is noisy, so its own
                # final loss is reached before the end too).
                reached = next((s for s in sorted(ref) if smooth(ref, s) <= final), None)
                own = next(s for s in sorted(ref) if smooth(ref, s) <= smooth(ref, a.steps))
                behind = "ahead" if reached is None else own - reached
                print(f"{way:<18} {','.join(r['methods']) or '-':<22}{r['redone']:>13}{behind:>13}"
                      f"{final:>13.4f}{r['seconds']:>13.1f}", flush=True)
    _plot(results, a.plot)
    return 0


def _plot(results: dict[str, dict[str, dict]], out: Path) -> None:
    from elastic.report import pyplot
    plt = pyplot(required=False)
    if plt is None:
        return
    out.parent.mkdir(parents=True, exist_ok=True)
    fig, axes = plt.subplots(1, len(results), figsize=(12, 4), sharey=True)
    for ax, (scenario, runs) in zip(axes, results.items()):
        for way, r in runs.items():
            steps = sorted(r["losses"])
            ax.plot(steps, [smooth(r["losses"], s) for s in steps], label=way,
                    linestyle="--" if way == "none" else "-")
        ax.set(title=scenario, xlabel="step")
    axes[0].set_ylabel("training loss (5-step moving average)")
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    print(f"plot written to {out}")


if __name__ == "__main__":
    sys.exit(main())

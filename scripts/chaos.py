"""A chaos campaign: randomized real failures, each job checked against a failure-free run.

    python scripts/chaos.py --runs 200 --seed 7            # prints a table; exit 1 on any hang or mismatch
    python scripts/chaos.py --runs 10 --seed 3 --json      # one JSON object per run, then the totals

Each run draws, from the seed, a rebuild mode (spare / spawn / shrink / mixed), a
replication level (2 or 3) and one or two victims: where they fail (a step, the
middle of a gradient all-reduce, the middle of a commit, inside the rebuild or
the spawn, while sending recovery data, inside ``finish()``, or a parked spare)
and how (SIGKILL, ``os._exit(3)``, an exception, SIGSTOP, a stall). It runs
``examples/train.py`` (dropout off; ``--program ddp`` / ``fsdp``: the same
training with torch's DDP, or FSDP2 with DCP into peer memory, on the ``ulfm``
process group; ``--per-step``: every optimizer step a recovery point, so a
``commit`` kill lands inside a step point) on 4 ranks under the launcher with a bound, and checks the
outcome. ``--program hybrid``: ``examples/hybrid.py`` on a 2 x 2 data x pipeline mesh
(no store: a lost stage comes back from its live twin, bitwise, or after a shrink
the other replica carries the batch, loss within 1e-4; when both replicas in use
of a stage die together the job must stop on every rank with ``Unrecoverable``, as
``plan_mesh_recovery`` says for the victims of one rebuild). ``--program zero1``:
``examples/zero1.py``, ZeRO-1 with each shard kept by a twin (two instances of two
shards, every step a recovery point, no commits), and ``--program llama3d``, the
torchtitan-shaped job on a pp=2 x dp=2 mesh (torch's 1F1B, FSDP2 as HSDP: twins k and k + 2, a
first victim failing inside a pipeline transfer or the update as often as at a step): bitwise with a replacement, the
loss within 1e-5 after a shrink, and ``DataLost`` on every process exactly when
both twins of a shard died before the first's replacement took the shard from
the second, or, as for every program, a rank and every holder of its per-step
copy (its random streams) died together. ``--collective-kills``:
every run instead SIGKILLs one random rank at a random step inside that step's
first reduction (DDP's gradient all-reduce, FSDP2's reduce-scatter), a spare takes over, and the result must be bitwise.
``--redundancy xor:4`` (or ``rs:K+M``): the rank-unique state kept by parity instead of copies
(``--redundancy`` to the launcher, no ``--replication``): the 4 ranks are one group, so a loss
is expected when more of its members die in one exposure window (between a failure and the next
commit of a later generation: a replacement or an adopter holds no parity before it) than the
group survives. ``--data-faults``: more than half of the runs also get, before the kills, a data fault on a third
rank: a NaN in its gradients (``nan``: the gate keeps the version from becoming current, every rank
rolls back and runs the step again), a flipped bit in its model (``bitflip``: fenced at the next
commit, replaced like a dead rank) or an 8x slowdown (``slow=8``, with ``--straggler 3:3``: evicted
after 3 steps). The expected outcome is the same as for the kills (a fenced or evicted rank is one
more victim; a spare more is parked for it):

* finished, with a spare or a spawned process: model and optimizer bitwise the
  failure-free run's; after a shrink: the loss within 1e-5 (relative);
* ``DataLost`` on every process, when every holder of some chunk was among the
  victims that died before the copies lost with the first of them were made
  again by a commit (computed from the store's own placement);
* anything else is a *mismatch*, and the launcher's timeout a *hang*.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from elastic.comm.events import read_events, read_outcomes, read_result  # noqa: E402
from elastic.recovery import Redundancy, place_replicas  # noqa: E402

RANKS, STEPS, COMMIT_EVERY, CHUNK = 4, 30, 5, 1 << 20
PROGRAMS = {"train": "examples/train.py", "ddp": "examples/ddp.py", "fsdp": "examples/fsdp.py",
            "hybrid": "examples/hybrid.py", "zero1": "examples/zero1.py", "llama3d": "examples/llama3d.py"}
HASHES = {"zero1": ("model_sha256", "moments_sha256"), "llama3d": ("digests",)}  # what a bitwise run matches; else:
DEFAULT_HASHES = ("model_sha256", "optimizer_sha256")
MESH = (2, 2)  # --program hybrid: data x pipeline, RANKS in all
ARGS = ("--steps", str(STEPS), "--dropout", "0", "--commit-every", str(COMMIT_EVERY))
HANG_TIMEOUT, PROGRESS_TIMEOUT = 5, 5
ACTIONS = ("kill", "kill", "exit", "raise", "hang")  # SIGKILL is what clusters meet most


@dataclasses.dataclass
class Scenario:
    mode: str
    rebuild: str
    spares: int
    replication: int
    inject: str
    stall: bool = False
    straggler: bool = False
    redundancy: str | None = None  # parity instead of ``replication`` copies

    def args(self) -> list[str]:
        out = ["--rebuild", self.rebuild, "--spares", str(self.spares), "--inject", self.inject,
               "--hang-timeout", str(HANG_TIMEOUT)]
        out += ["--redundancy", self.redundancy] if self.redundancy else []
        out += ["--straggler", "3:3"] if self.straggler else []
        return out + (["--progress-timeout", str(PROGRESS_TIMEOUT)] if self.stall else [])


def with_data_fault(rng: random.Random, scenario: Scenario) -> Scenario:
    """The scenario with, more often than not, a data fault first, on a rank no kill names."""
    if rng.random() >= 0.6:
        return scenario
    named = {int(e.split("@")[0]) for e in scenario.inject.split(",") if not e.startswith("s")}
    rank = rng.choice([r for r in range(RANKS) if r not in named])
    kind = rng.choice(("nan", "bitflip", "slow=8"))
    entry = f"{rank}@{rng.randrange(2, 5)}:{kind}"
    victim = kind != "nan"  # fenced or evicted: a rank to replace, like a dead one
    spares = scenario.spares + (1 if victim and scenario.mode in ("spare", "mixed") else 0)
    return dataclasses.replace(scenario, inject=f"{entry},{scenario.inject}", spares=spares,
                               straggler=kind.startswith("slow"))


def draw(rng: random.Random) -> Scenario:
    """One random scenario the launcher accepts."""
    mode = rng.choice(("spare", "spawn", "shrink", "mixed"))
    rebuild = {"spare": "spare", "spawn": "spawn", "shrink": "shrink",
               "mixed": rng.choice(("spare,spawn,shrink", "spare,shrink", "spare,spawn"))}[mode]
    ranks = rng.sample(range(RANKS), 2)
    step = rng.randrange(6, STEPS - 3)
    first_point = rng.choice(("step", "step", "collective", "commit", "finish", "park")
                             if "spare" in rebuild else ("step", "step", "collective", "commit", "finish"))
    action = rng.choice(ACTIONS + (("stall",) if first_point == "step" else ()))
    entries, spare_victims, stall = [], 0, action == "stall"
    if first_point == "park":
        entries.append(f"s0@park:{action}")
        spare_victims = 1
    elif first_point == "commit":
        entries.append(f"{ranks[0]}@commit{rng.randrange(1, STEPS // COMMIT_EVERY)}:{action}")
    elif first_point == "finish":
        entries.append(f"{ranks[0]}@finish:{action}")
    else:
        entries.append(f"{ranks[0]}@{'c' if first_point == 'collective' else ''}{step}:{action}")
    actives = 0 if first_point == "park" else 1
    if first_point in ("step", "collective") and rng.random() < 0.6:  # a second victim
        timing = rng.choice(("same", "later", "during"))
        second = rng.choice(("kill", "kill", "exit", "raise", "hang"))
        if timing == "same":
            entries.append(f"{ranks[1]}@{step}:{second}")
        elif timing == "later":
            entries.append(f"{ranks[1]}@{min(step + rng.randrange(3, 8), STEPS - 1)}:{second}/g1")
        else:
            points = ["agree", "rebuild", "restore"] + (["spawn"] if rebuild == "spawn" else [])
            point = rng.choice(points)
            entries.append(f"{ranks[1]}@{point}:{second}" + ("/g1" if point == "restore" else ""))
        actives += 1
    spares = {"spare": actives + spare_victims, "mixed": 1 + spare_victims}.get(mode, 0)
    return Scenario(mode, rebuild, spares, rng.choice((2, 3)), ",".join(entries), stall)


def draw_llama3d(rng: random.Random) -> Scenario:
    """``draw``'s scenario, its first victim, where it fails at a step or in its first reduction, more
    often than not failing elsewhere inside that step instead: one of its pipeline transfers
    (``pS.M``, the M-th of the step on that rank, activations and gradients) or its update (``uS``)."""
    scenario = draw(rng)
    first, *rest = scenario.inject.split(",")
    rank, where = first.split("@", 1)
    step, _, action = where.partition(":")
    step = step.removeprefix("c")  # at a step, or inside its first reduction: a place in the step either way
    if step.isdigit() and rng.random() < 0.7:
        point = rng.choice(("p", "p", "p", "u"))  # (no gS: with one shard per replica FSDP2 gathers nothing)
        first = f"{rank}@{point}{step}{f'.{rng.randrange(8)}' if point == 'p' else ''}:{action}"
    return dataclasses.replace(scenario, inject=",".join([first, *rest]))


def draw_collective_kill(rng: random.Random) -> Scenario:
    """A SIGKILL inside a random step's first reduction, a spare to take over."""
    return Scenario("spare", "spare", 1, rng.choice((2, 3)),
                    f"{rng.randrange(RANKS)}@c{rng.randrange(1, STEPS - 1)}:kill")


def draw_hybrid(rng: random.Random) -> Scenario:
    """One or two victims on the mesh: killed at a step, inside the twins' gradient all-reduce, or
    while a lost stage is being copied from its twin (``restore``); a spare or a spawn each."""
    rebuild = rng.choice(("spare", "spawn", "spare,spawn", "shrink", "spare,shrink"))
    ranks = rng.sample(range(RANKS), 2)
    step = rng.randrange(3, STEPS - 3)
    entries = [f"{ranks[0]}@{rng.choice(('', 'c'))}{step}:{rng.choice(ACTIONS)}"]
    if rng.random() < 0.6:
        timing = rng.choice(("same", "later", "during"))
        second = rng.choice(ACTIONS)
        entries.append({"same": f"{ranks[1]}@{step}:{second}",
                        "later": f"{ranks[1]}@{min(step + rng.randrange(3, 8), STEPS - 1)}:{second}/g1",
                        "during": f"{ranks[1]}@restore:{second}/g1"}[timing])
    spares = len(entries) if "spare" in rebuild else 0
    return Scenario("hybrid", rebuild, spares, 1, ",".join(entries))


def hybrid_loss_expected(run_dir: Path, scenario: Scenario) -> bool:
    """Whether the job had to stop: a rebuild whose lost ranks (with those of a rebuild a failure
    interrupted) took every replica in use of a stage, on a 2-stage mesh where CheckFree cannot
    help, and that no shrink could answer (the mesh shrinks only where a whole replica is left).
    A shrink takes its victims' replicas out of use."""
    from elastic.recovery import plan_mesh_recovery
    events = read_events(run_dir)
    dp, pp = MESH
    failed: dict[int, set[int]] = {}  # the generation a failure was seen in -> the dead
    for e in (e for e in events if e["event"] == "agreed"):
        failed.setdefault(e["gen"], set()).update(int(r) for r in e["failed"])
    modes = {e["gen"] - 1: e["mode"] for e in events if e["event"] == "rebuilt"}
    lost: set[int] = set()
    dropped: set[int] = set()
    for gen in sorted(failed):
        interrupted = gen > 0 and not any(e["event"] == "step" and e["gen"] == gen for e in events)
        lost = (lost if interrupted else set()) | failed[gen]
        if "shrink" in modes.get(gen, ""):
            dropped |= {r // pp for r in failed[gen]}
            continue
        try:
            plan_mesh_recovery(dp, pp, lost, dropped=dropped)
        except Exception:
            whole = any(d not in dropped and all(d * pp + s not in lost for s in range(pp)) for d in range(dp))
            return not ("shrink" in scenario.rebuild and whole)
    return False


# ---------------------------------------------------------------------------- running and checking
def launch(args: list[str], program: tuple[str, ...], run_dir: Path, bound: float) -> tuple[int, str, float]:
    cmd = [sys.executable, "-m", "elastic.launch", "-n", str(RANKS), "--timeout", str(bound),
           "--run-dir", str(run_dir), *args, "--", sys.executable, *program]
    t0 = time.monotonic()
    try:
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=bound + 60)
        return proc.returncode, proc.stdout + proc.stderr, time.monotonic() - t0
    except subprocess.TimeoutExpired as exc:  # the launcher itself hung: the worst outcome there is
        return 124, str(exc.stdout or "") + str(exc.stderr or ""), time.monotonic() - t0


def reference(program: tuple[str, ...], replication: int, work: Path, cache: dict[int, dict]) -> dict:
    if replication not in cache:
        run_dir = work / f"reference-r{replication}"
        rc, out, _ = launch([], program + _replication(program, replication), run_dir, 300)
        if rc != 0:
            raise SystemExit(f"the failure-free reference run failed (rc {rc}):\n{out[-3000:]}")
        chunks = max((-(-e["replicated_bytes"] // CHUNK) for e in read_events(run_dir) if e["event"] == "committed"),
                     default=0)
        cache[replication] = {**(read_result(run_dir) or {}), "chunks": chunks}
    return cache[replication]


def _replication(program: tuple[str, ...], replication: int) -> tuple[str, ...]:
    return () if program[0] == PROGRAMS["hybrid"] else ("--replication", str(replication))


def loss_expected(run_dir: Path, scenario: Scenario, chunks: int) -> bool:
    """Whether some state had every copy die. A recovery moves a dead rank's state once, to its
    replacement or adopter; the copies it held for others come back only with the next commit
    after it (the store's exposure window). So victims form one group until a commit completes in
    a later generation than theirs, and a chunk is lost when its owner died without its state
    having been recovered since, or recovered by an adopter (a shrink) that died after it, and
    every holder of a copy is in the owner's group."""
    events = read_events(run_dir)
    fired = sorted((e for e in events if e["event"] == "inject" and e["point"] != "park" and e["action"] != "nan"),
                   key=lambda e: e["t"])  # a NaN kills nobody: every rank rolls back
    commits = [(e["t"], e["gen"]) for e in events if e["event"] == "committed"]
    recovered = [(e["t"], {int(o): r for o, r in e.get("receivers", {}).items()}) for e in events
                 if e["event"] == "store_recovered"]  # (when, dead owner -> the logical rank that took it)
    groups: list[list[dict]] = []
    for e in fired:
        last = groups[-1][-1] if groups else None
        if last is not None and not any(gen > last["gen"] and last["t"] < t < e["t"] for t, gen in commits):
            groups[-1].append(e)  # no commit re-made the copies in between: still exposed
        else:
            groups.append([e])
    if scenario.redundancy:  # one parity group of every rank: more victims in a window than it survives
        survives = Redundancy.parse(scenario.redundancy).m
        return any(len({e["rank"] for e in group}) > survives for group in groups)
    placement = place_replicas(list(range(RANKS)), {r: "host" for r in range(RANKS)}, scenario.replication,
                               {r: chunks for r in range(RANKS)})
    for group in groups:
        ranks = {e["rank"] for e in group}
        unrecovered = {e["rank"] for e in group if not _recovered(e, group, recovered)}
        if any(holders[0] in unrecovered and set(holders[1:]) <= ranks for holders in placement.values()):
            return True
    return False


def _recovered(victim: dict, group: list[dict], recovered: list[tuple[float, dict[int, int]]]) -> bool:
    """The victim's state was recovered before its group ended, by its replacement or by an adopter
    (a shrink) that did not die after taking it."""
    return any(victim["t"] < t <= group[-1]["t"] and victim["rank"] in took and not any(
        other["rank"] == took[victim["rank"]] != victim["rank"] and other["t"] > t for other in group)
        for t, took in recovered)


def twins_lost(run_dir: Path) -> bool:
    """Whether both twins of a shard (logical ranks r and r + 2 of 4) died, the second before the
    first's replacement took the shard from it (``twin_copied``)."""
    events = read_events(run_dir)
    fired = sorted((e for e in events if e["event"] == "inject" and e["point"] != "park"), key=lambda e: e["t"])
    copied = [(e["t"], e["logical"]) for e in events if e["event"] == "twin_copied"]
    for i, first in enumerate(fired):
        for second in fired[i + 1:]:
            if second["rank"] == (first["rank"] + RANKS // 2) % RANKS and \
                    not any(first["t"] < t < second["t"] and r == first["rank"] for t, r in copied):
                return True
    return False


def check(scenario: Scenario, rc: int, run_dir: Path, ref: dict, program: str) -> tuple[str, str]:
    """(verdict, detail): correct / clear error / hang / mismatch."""
    if rc == 124:
        return "hang", "the job ran into its bound"
    outcomes = read_outcomes(run_dir)
    if scenario.mode == "hybrid":
        return check_hybrid(scenario, rc, run_dir, outcomes, ref)
    expect_loss = loss_expected(run_dir, scenario, ref["chunks"]) or \
        (program in ("zero1", "llama3d") and twins_lost(run_dir))
    if rc == 0:
        if expect_loss:
            return "mismatch", "finished although every holder of some chunk died"
        result = read_result(run_dir) or {}
        shrunk = any("shrink" in e["mode"] for e in read_events(run_dir) if e["event"] == "rebuilt")
        if result["steps"] != ref["steps"]:
            return "mismatch", f"{result['steps']} steps, not {ref['steps']}"
        if shrunk:
            ok = abs(result["final_loss"] - ref["final_loss"]) <= 1e-5 * ref["final_loss"]
            return ("correct", "shrink: loss within 1e-5") if ok else \
                ("mismatch", f"loss {result['final_loss']} vs {ref['final_loss']}")
        same = all(result[k] == ref[k] for k in HASHES.get(program, DEFAULT_HASHES))
        return ("correct", "bitwise") if same else ("mismatch", "model or optimizer differs from the reference")
    errors = [o for o in outcomes if o["status"] == "error"]
    if rc == 1 and errors and {o["kind"] for o in errors} == {"DataLost"} and len({o["message"] for o in errors}) == 1 \
            and not any(o["status"] == "finished" for o in outcomes):
        return ("clear error", "DataLost on every process") if expect_loss else \
            ("mismatch", "DataLost although a holder of every chunk survived")
    told = "; ".join(sorted({f"{o['kind']}: {o['message']}"[:160] for o in errors})) or "no agreed error"
    return "mismatch", f"rc {rc}: {told}"


def check_hybrid(scenario: Scenario, rc: int, run_dir: Path, outcomes: list[dict], ref: dict) -> tuple[str, str]:
    """A mesh run: bitwise the reference where every lost stage had a live twin; else Unrecoverable
    on every process."""
    expect_loss = hybrid_loss_expected(run_dir, scenario)
    if rc == 0:
        result = read_result(run_dir) or {}
        if expect_loss:
            return "mismatch", "finished although every replica of a stage died in one rebuild"
        if result.get("steps") != ref["steps"] or not result.get("replicas_equal"):
            return "mismatch", f"{result.get('steps')} steps, replicas equal: {result.get('replicas_equal')}"
        if any("shrink" in e["mode"] for e in read_events(run_dir) if e["event"] == "rebuilt"):
            ok = abs(result["final_loss"] - ref["final_loss"]) <= 1e-4 * ref["final_loss"]
            return ("correct", f"shrink to replicas {result['in_use']}: loss within 1e-4") if ok else \
                ("mismatch", f"loss {result['final_loss']} vs {ref['final_loss']}")
        return ("correct", "bitwise") if result["sha256"] == ref["sha256"] else \
            ("mismatch", "the model differs from the reference")
    errors = [o for o in outcomes if o["status"] == "error"]
    if rc == 1 and errors and {o["kind"] for o in errors} == {"Unrecoverable"} \
            and all("every data-parallel replica" in o["message"] for o in errors) \
            and not any(o["status"] == "finished" for o in outcomes):
        return ("clear error", "Unrecoverable on every process") if expect_loss else \
            ("mismatch", "Unrecoverable although a twin of every lost stage lived")
    told = "; ".join(sorted({f"{o['kind']}: {o['message']}"[:160] for o in errors})) or "no agreed error"
    return "mismatch", f"rc {rc}: {told}"


def program_of(args: argparse.Namespace, parser: argparse.ArgumentParser) -> tuple[str, ...]:
    """The jobs' program and its arguments; combinations that make no sense are refused."""
    if args.data_faults and (args.program != "train" or args.collective_kills):
        parser.error("--data-faults: with --program train (the example that reports its gradients' norm)")
    if args.per_step and args.program == "fsdp":
        parser.error("--per-step: train or ddp (fsdp.py recovers through DCP checkpoints, committed every few steps)")
    if args.program == "hybrid" and (args.per_step or args.collective_kills):
        parser.error("--program hybrid draws its own victims on the mesh (no store, no per-step points)")
    if args.program == "zero1" and (args.per_step or args.data_faults):
        parser.error("--program zero1: its twins make every step a recovery point already (no --per-step)")
    program = (PROGRAMS[args.program], *ARGS) + (("--per-step",) if args.per_step else ())
    if args.program == "zero1":  # twins, per step, no commits: losing both twins is DataLost
        program = (PROGRAMS["zero1"], *ARGS[:-2], "--commit-every", "0")
    if args.program == "llama3d":  # pp=2 x dp=2: twins k and k + 2 as zero1's, per step, no commits
        program = (PROGRAMS["llama3d"], "--pp", "2", "--dp", "2", *ARGS[:-2], "--commit-every", "0")
    if args.program == "hybrid":
        # Without store copies: the expected outcome then follows from the victims alone (twins, CheckFree).
        program = (PROGRAMS["hybrid"], "--dp", str(MESH[0]), "--pp", str(MESH[1]), "--steps", str(STEPS),
                   "--commit-every", "0")
    return program


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--bound", type=float, default=150.0, help="seconds one job may take before it is a hang")
    parser.add_argument("--keep", type=Path, help="keep every run's directory here (default: only failures)")
    parser.add_argument("--json", action="store_true", help="one JSON object per run, then the totals")
    parser.add_argument("--program", choices=PROGRAMS, default="train", help="which training program the jobs run")
    parser.add_argument("--per-step", action="store_true",
                        help="train / ddp with every optimizer step a recovery point (TorchState(per_step=True))")
    parser.add_argument("--collective-kills", action="store_true",
                        help="every run: a SIGKILL inside a random step's first reduction, a spare, bitwise")
    parser.add_argument("--data-faults", action="store_true",
                        help="most runs also get a NaN, a bit flip or a slow rank before the kills (train only)")
    parser.add_argument("--redundancy", help="xor:K or rs:K+M: the rank-unique state kept by parity (train, ddp)")
    args = parser.parse_args(argv)
    if args.redundancy:
        Redundancy.parse(args.redundancy)
        if args.program not in ("train", "ddp"):
            parser.error("--redundancy: with --program train or ddp (whose State keeps rank-unique values)")
    program = program_of(args, parser)
    rng = random.Random(args.seed)
    work = Path(tempfile.mkdtemp(prefix="elastic-chaos-"))
    keep = args.keep or ROOT / "elastic-run" / f"chaos-{args.seed}"
    refs: dict[int, dict] = {}
    rows = []
    for i in range(args.runs):
        scenario = draw_hybrid(rng) if args.program == "hybrid" else draw_llama3d(rng) if args.program == "llama3d" \
            else draw_collective_kill(rng) if args.collective_kills else draw(rng)
        if args.data_faults:
            scenario = with_data_fault(rng, scenario)
        if args.redundancy:
            scenario = dataclasses.replace(scenario, redundancy=args.redundancy, replication=2)
        ref = reference(program, scenario.replication, work, refs)
        run_dir = work / f"run-{i}"
        copies = () if scenario.redundancy else _replication(program, scenario.replication)
        rc, out, seconds = launch(scenario.args(), program + copies, run_dir, args.bound)
        verdict, detail = check(scenario, rc, run_dir, ref, args.program)
        row = {"run": i, **dataclasses.asdict(scenario), "rc": rc, "verdict": verdict, "detail": detail,
               "seconds": round(seconds, 1)}
        rows.append(row)
        if verdict in ("hang", "mismatch") or args.keep:
            keep.mkdir(parents=True, exist_ok=True)
            shutil.copytree(run_dir, keep / f"run-{i}", dirs_exist_ok=True)
            (keep / f"run-{i}" / "launcher.txt").write_text(out)
        if args.json:
            print(json.dumps(row), flush=True)
        else:
            kept = scenario.redundancy or f"r{scenario.replication}"
            print(f"{i:>4} {scenario.mode:>6} {kept:>6} {scenario.inject:<44} rc {rc:>3} "
                  f"{seconds:6.1f} s  {verdict}: {detail}", flush=True)
    shutil.rmtree(work, ignore_errors=True)
    counts = {v: sum(r["verdict"] == v for r in rows) for v in ("correct", "clear error", "hang", "mismatch")}
    totals = {"runs": len(rows), "finished correct": counts["correct"], "clear error": counts["clear error"],
              "hang": counts["hang"], "mismatch": counts["mismatch"],
              "median wall s": round(statistics.median(r["seconds"] for r in rows), 1) if rows else None,
              "seed": args.seed, "program": args.program}
    if args.json:
        print(json.dumps(totals))
    else:
        print("\n" + " | ".join(f"{k}" for k in totals) + "\n" + " | ".join(str(v) for v in totals.values()))
        if counts["hang"] or counts["mismatch"]:
            print(f"failed runs kept in {keep}")
    return 1 if counts["hang"] or counts["mismatch"] else 0


if __name__ == "__main__":
    sys.exit(main())

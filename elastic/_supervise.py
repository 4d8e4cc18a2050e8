"""Supervising a launch: one mpiexec run watched to its end, and what became of every process (local).

ULFM's mpiexec exit status says nothing about which ranks died or why, so
every process writes an outcome file, every sentinel a fate file, and the
verdict comes from those (``summarize``), as mpirun and torchrun users expect.
A stop (a signal to the launcher, the timeout) is passed on as SIGTERM with a
grace; nothing the job started outlives it; a sentinel stopped (SIGSTOP) after
its rank ended is killed so that a finished job ends, and so is an mpiexec that
outlives every process of its job (PRRTE, now and then, after a spawn).
"""
from __future__ import annotations

import dataclasses
import contextlib
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import IO, Any, Callable, Mapping

from elastic.comm.runtime import STOPPED_SENTINEL_SECONDS, WARM_ANSWER_SECONDS
from elastic.comm.events import SIGNAL_ERRORS, describe_end, read_events, read_fates, read_outcomes
from elastic.comm.faults import LOOP_POINTS, Injection

from ._plan import LaunchPlan

_EXPECTED_END = ("finished", "spare-unused")
LEFTOVER_SECONDS = 3.0  # after mpiexec ends, how long the job's last processes get to end on their own
SWEEP_SECONDS = 1.0     # how often the launcher looks for stopped sentinels
# How long mpiexec may outlive the last process of its job (it ends within a second once the last
# sentinel has): then the runtime hung at the job's end, and the launcher ends it.
OUTLIVE_SECONDS = 10.0
# Open MPI prints these for every non-blocking collective a failure interrupted (in flight, or
# started on a revoked communicator); they read like a crash.
_NOISE = (b"NBC_Progress: an error", b"Error in NBC_Start_round()")
# PRRTE's words when a node's daemon is gone (it then ends every rank of the job).
_LOST_NODE = re.compile(rb"Remote daemon: \S+ on node (\S+)")
# The runtime's words when it failed to come up, before any process of the job began: seen now and then
# on a busy machine (a daemon of a simulated node that never reported; PMIx's listener thread, more
# rarely). Nothing of the job ran, so the launcher starts it once more.
_START_FAILURE = re.compile(rb"The PMIx server's listener thread failed to start|A daemon failed to report back")


class _Output(threading.Thread):
    """Copies one of mpiexec's streams through, line by line, dropping Open MPI's failure noise."""

    def __init__(self, source: IO[bytes], sink: Any) -> None:
        super().__init__(daemon=True)
        self.source, self.sink, self.hidden = source, sink, 0
        self.lost_nodes: list[str] = []
        self.start_failure: str | None = None

    def run(self) -> None:
        after_noise = False
        for line in iter(self.source.readline, b""):
            if line.startswith(_NOISE) or (after_noise and not line.strip()):  # the notice ends in a blank line
                self.hidden += bool(line.strip())
                after_noise = True
                continue
            after_noise = False
            lost = _LOST_NODE.search(line)
            if lost:
                self.lost_nodes.append(lost.group(1).decode(errors="replace"))
            failed = _START_FAILURE.search(line)
            if failed and self.start_failure is None:
                self.start_failure = failed.group(0).decode()
            self.sink.buffer.write(line.replace(b"\0", b""))  # prterun's stream can carry a stray NUL
            self.sink.flush()


def _processes(match: Callable[[int, list[str]], bool]) -> list[int]:
    """Pids of the live processes on this host (zombies are already dead) that ``match(pid, fields)``,
    the fields of /proc/PID/stat after the name: state, ppid, pgrp, session, ..."""
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if fields[0] != "Z" and match(int(entry.name), fields):
                pids.append(int(entry.name))
    return pids


def _in_session(sid: int, pid: int, fields: list[str]) -> bool:
    """Process ``pid`` is in session ``sid`` (its leader aside)."""
    return pid != sid and int(fields[3]) == sid


def _session_processes(sid: int, states: str = "") -> list[int]:
    """Pids of the live processes still in session ``sid``; ``states``: only those in one of these
    states (``"Tt"``: stopped)."""
    return _processes(lambda pid, fields: _in_session(sid, pid, fields) and (not states or fields[0] in states))


def _is_sentinel(pid: int) -> bool:
    try:
        return b"elastic.comm._sentinel" in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False


class Attempt:
    """One mpiexec run of the job, watched to its end (local)."""

    def __init__(self, plan: LaunchPlan, cmd: list[str], env: dict[str, str],
                 warm: Mapping[str, int] | None = None) -> None:
        self.plan = plan
        self.warm = dict(warm or {})  # host -> its warm process's pid: the ranks they forked are this launch's too
        self.stopping: list[float] = []  # when the job was told to stop (a signal, the timeout)
        self.stopped_at: float | None = None  # the same, wall time (the fates' clock)
        self.leftovers: list[int] = []
        self.stopped_since: dict[int, float] = {}  # sentinels seen stopped (SIGSTOP), since when
        self.killed_stopped: list[int] = []
        self.warm_stopped_since: dict[int, float] = {}  # warm processes seen stopped, since when
        self.warm_killed: set[int] = set()
        self.swept = 0.0
        self.before = run_pids(plan.run_dir)  # the processes of earlier launches into this run directory
        self.all_ended_at: float | None = None  # when every process of this launch was seen to have ended
        self.outlived: float | None = None  # mpiexec outlived them all by this long: the launcher ended it
        self.proc = subprocess.Popen(cmd, env={**os.environ, **env}, start_new_session=True,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        self.outputs = [_Output(self.proc.stdout, sys.stdout), _Output(self.proc.stderr, sys.stderr)]  # type: ignore
        for output in self.outputs:
            output.start()

    def stop(self, why: str) -> None:
        if not self.stopping:
            print(f"\n[launch] {why}: stopping the job ({self.plan.grace:g} s grace)", file=sys.stderr, flush=True)
            self.stopping.append(time.monotonic())
            self.stopped_at = time.time()  # what ended after this was the stop's doing
            self.proc.send_signal(signal.SIGTERM)  # mpiexec passes it on to every rank's sentinel

    def wait(self, deadline: float | None) -> None:
        """Until mpiexec ends (or the grace after a stop runs out), then nothing it started lives on."""
        proc = self.proc
        while proc.poll() is None:
            now = time.monotonic()
            if deadline is not None and now > deadline:
                self.stop(f"TIMED OUT after {self.plan.timeout:g} s")
            if self.stopping and now - self.stopping[0] > self.plan.grace:
                break
            if now - self.swept > SWEEP_SECONDS:
                self.swept = now
                self._sweep_stopped_sentinels(now)
                self._end_a_stopped_warm_process(now)
                if self._outlives_its_job(now):
                    break
            time.sleep(0.1)
        # Nothing the job started outlives it: mpiexec, its daemons, the ranks, spawned ones, orphans, and
        # the ranks the warm processes forked (outside mpiexec's session; a stopped one cannot act on its
        # sentinel's death). Sentinels may still be writing down how their rank ended: a moment for them.
        def left() -> list[int]:  # one pass over /proc: mpiexec's session, the warm processes' children
            return _processes(lambda pid, fields: _in_session(proc.pid, pid, fields) or
                              int(fields[1]) in self.warm.values())
        settle = time.monotonic() + LEFTOVER_SECONDS
        while left() and time.monotonic() < settle and proc.poll() is not None:
            time.sleep(0.05)
        self.leftovers = left() + ([proc.pid] if proc.poll() is None else [])
        for pid in self.leftovers:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        proc.wait()
        for output in self.outputs:
            output.join(timeout=5)

    def _outlives_its_job(self, now: float) -> bool:
        """Every process of this launch has ended (its sentinel wrote how) and mpiexec has not, for
        ``OUTLIVE_SECONDS``: it will not (seen after a spawn, ranks and sentinels all gone). True
        then: the caller ends what is left, and the job's result is what its processes wrote.
        A process whose sentinel died unrecorded keeps this from ever holding: the timeout stays."""
        if self.stopping:
            return False
        if self.all_ended_at is None:
            if all_processes_ended(self.plan.run_dir, self.before):
                self.all_ended_at = now
            return False
        if now - self.all_ended_at < OUTLIVE_SECONDS:
            return False
        self.outlived = now - self.all_ended_at
        print(f"[launch] mpiexec had not ended {self.outlived:.0f} s after the last process of the job: the runtime "
              "hung at the job's end; ended by the launcher (the job's result is what its processes wrote)",
              file=sys.stderr, flush=True)
        return True

    def _sweep_stopped_sentinels(self, now: float) -> None:
        """Kill a sentinel stopped for twice the hang bound (this host), or at once when its rank has
        ended (said so in its outcome). Its rank kills it after the bound while the rank lives; a
        sentinel stopped after its rank ended has nobody else to free mpiexec from it, and a job
        that finished would otherwise wait for the bound, or never end."""
        bound = 2 * (self.plan.config.hang_timeout or STOPPED_SENTINEL_SECONDS)
        stopped = {pid for pid in _session_processes(self.proc.pid, "Tt") if _is_sentinel(pid)}
        self.stopped_since = {pid: self.stopped_since.get(pid, now) for pid in stopped}
        done = sentinels_of_ended_ranks(self.plan.run_dir) if stopped else set()
        for pid, since in self.stopped_since.items():
            if now - since > bound or pid in done:  # a rank that has ended cannot free its sentinel
                print(f"[launch] the sentinel pid {pid} has been stopped for {now - since:.0f} s: killed",
                      file=sys.stderr, flush=True)
                self.killed_stopped.append(pid)
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)

    def _end_a_stopped_warm_process(self, now: float) -> None:
        """Kill a warm process once it has been stopped for as long as a sentinel waits for it
        (``WARM_ANSWER_SECONDS``): the ranks started on its host from then on start cold, and a
        request it holds unread (a sentinel's streams, passed with it) no longer keeps mpiexec from
        ending."""
        watched = set(self.warm.values()) - self.warm_killed
        if not watched:
            return
        stopped = set(_processes(lambda pid, fields: pid in watched and fields[0] in "Tt"))
        self.warm_stopped_since = {pid: self.warm_stopped_since.get(pid, now) for pid in stopped}
        host_of = {pid: host for host, pid in self.warm.items()}
        for pid, since in self.warm_stopped_since.items():
            if now - since >= WARM_ANSWER_SECONDS:
                print(f"[launch] the warm process pid {pid} has been stopped for {now - since:.0f} s: killed; "
                      f"ranks started on {host_of[pid]} from now on start cold", file=sys.stderr, flush=True)
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
                self.warm_killed.add(pid)

    @property
    def lost_nodes(self) -> set[str]:
        return {node for output in self.outputs for node in output.lost_nodes}

    @property
    def hidden(self) -> int:
        return sum(output.hidden for output in self.outputs)

    @property
    def start_failure(self) -> str | None:
        """The runtime's words when it could not come up (only meaningful when no process began)."""
        return next((o.start_failure for o in self.outputs if o.start_failure), None)


def sentinels_of_ended_ranks(run_dir: Path) -> set[int]:
    """The sentinels (pids) whose rank has written its outcome: it ended, its sentinel has nothing
    left to watch (local; reads the run directory)."""
    ended = {o["pid"] for o in read_outcomes(run_dir)}
    return {e["sentinel_pid"] for e in read_events(run_dir)
            if e["event"] in ("started", "spawned") and e.get("sentinel_pid") and e["pid"] in ended}


def all_processes_ended(run_dir: Path, before: set[int]) -> bool:
    """Some process began since ``before`` and every one of them has its end recorded (a fate file,
    its sentinel's last act). File names only: cheap each second (local)."""
    began: set[int] = set()
    ended: set[int] = set()
    for p in run_dir.glob("*-*.json*"):
        m = re.match(r"(events|fate)-.*-(\d+)\.jsonl?$", p.name)
        if m and int(m.group(2)) not in before:
            (began if m.group(1) == "events" else ended).add(int(m.group(2)))
    return bool(began) and began <= ended


def run_pids(run_dir: Path) -> set[int]:
    """Every process that left a file in the run directory."""
    return {int(m.group(1)) for p in run_dir.glob("*-*") for m in [re.search(r"-(\d+)\.jsonl?$", p.name)] if m}


# ---------------------------------------------------------------------------- the outcome
@dataclasses.dataclass(frozen=True)
class Summary:
    """What became of a job and of each process (``summarize``); ``summary.json`` holds it as a
    document, with the launcher's verdict beside it."""

    finished: bool                           # the training finished
    processes: int                           # processes that left a word (events, outcome, sentinel record)
    counts: dict[str, int]                   # how many ended each way
    deaths: list[dict[str, Any]]             # those that did not leave together with the others, and how
    stopped_by: dict[str, str] | None        # the job's agreed error (kind, message), if one stopped it
    never_fired: list[dict[str, object]]     # schedule entries no process announced
    reached: list[dict[str, object]]         # ... of them, those whose rank was there when the loop passed their step
    outcomes: list[dict[str, Any]]
    fates: list[dict[str, Any]]

    def document(self, **verdict: Any) -> dict[str, Any]:
        """As ``summary.json`` holds it: these fields, then the launcher's ``verdict``."""
        return {**dataclasses.asdict(self), **verdict}


def summarize(run_dir: Path, schedule: tuple[Injection, ...] = (), only: set[int] | None = None,
              stopped: str | None = None, since: float | None = None) -> Summary:
    """What became of the job and of each process, from the files they wrote (local).

    ``finished``: the training finished (some process finished, none stopped the
    job with an error, none failed after finishing). ``deaths``: every process
    that did not leave together with the others, with how it ended. ``never_fired``: schedule
    entries that no process announced. ``only``: these processes (one launch of several).
    ``stopped``: why this launcher stopped the job (a signal's name, a timeout), ``since`` when
    (wall time): a process that said nothing of its own end, or ended by a termination signal (a
    SIGKILL: after ``since``), ended by that request; a death before the stop keeps its own cause.
    """
    outcomes = {o["pid"]: o for o in read_outcomes(run_dir) if only is None or o["pid"] in only}
    fates = {f["pid"]: f for f in read_fates(run_dir) if only is None or f["pid"] in only}
    events = [e for e in read_events(run_dir) if only is None or e["pid"] in only]
    last_seen: dict[int, dict] = {}
    for e in events:
        last_seen[e["pid"]] = e
    pids = sorted(set(outcomes) | set(fates) | set(last_seen))
    deaths = []
    for pid in pids:
        outcome, fate = outcomes.get(pid), fates.get(pid)
        info = outcome if outcome is not None else last_seen.get(pid, {})
        status = outcome["status"] if outcome else None
        left_together = status in _EXPECTED_END + ("error",) and not info.get("after_finish") and \
            (fate is None or fate["end"] == "exited")
        if left_together:  # finished, released, or stopped with the job's agreed error (told once, below)
            continue
        how = f"stopped on request ({stopped})" if stopped and _ended_by_a_stop(outcome, fate, since) else \
            _how(outcome, fate)
        deaths.append({"pid": pid, "logical": info.get("logical"), "gen": info.get("gen"),
                       "role": info.get("role"), "status": status, "how": how,
                       "injected": bool(status and status.startswith("injected-"))})
    statuses = [o["status"] for o in outcomes.values()]
    stop = next((o for o in outcomes.values() if o["status"] == "error"), None)
    after_finish = [o for o in outcomes.values() if o.get("after_finish")]
    finished = "finished" in statuses and stop is None and not after_finish
    fired = {(e["rank"], e["step"], e["point"], e["action"], e["gen"], e.get("micro")) for e in events
             if e["event"] == "inject"}
    never = [i for i in schedule if (i.rank, i.step, i.point, i.action, i.gen, i.micro) not in fired]
    counts: dict[str, int] = {}
    for pid in pids:  # by what the process said, else by what its sentinel saw
        key = "stopped on request" if stopped and _ended_by_a_stop(outcomes.get(pid), fates.get(pid), since) else \
            outcomes[pid]["status"] if pid in outcomes else fates[pid]["end"] if pid in fates else \
            "died with its sentinel, without a word"
        counts[key] = counts.get(key, 0) + 1
    return Summary(finished=finished, processes=len(pids), counts=counts, deaths=deaths,
                   stopped_by={"kind": stop["kind"], "message": stop["message"]} if stop else None,
                   never_fired=[i.to_dict() for i in never], reached=[i.to_dict() for i in unfired_but_reached(
                       never, events)], outcomes=list(outcomes.values()), fates=list(fates.values()))


def unfired_but_reached(entries: list[Injection], events: list[dict]) -> list[Injection]:
    """The step and collective injections that did not fire although the loop passed their step in
    their generation while their logical rank was active in it: the program's step points do not
    reach them (a micro-step count, a collective that is not the library's), never a timing of the
    job's. Local; O(events)."""
    steps: dict[int, tuple[int, int]] = {}  # generation -> (the first, the last) steps done in it
    present = set()                         # (generation, logical rank) that wrote anything
    for e in events:
        present.add((e.get("gen"), e.get("logical")))
        if e["event"] == "step" and isinstance(e.get("step"), int):
            lo, hi = steps.get(e["gen"], (e["step"], e["step"]))
            steps[e["gen"]] = (min(lo, e["step"]), max(hi, e["step"]))

    def passed(step: int, gen: int) -> bool:
        # Point S is marked at step S's record or at the top of the step after it, and a collective
        # of step S inside that step: the generation recorded step S and step S + 1. (A rank evicted
        # at step S's record, or a generation that resumed past S, never passed it.)
        lo, hi = steps.get(gen, (0, -1))
        return lo <= step and step + 1 <= hi
    return [i for i in entries if i.point in LOOP_POINTS and i.step is not None
            and (i.gen, i.rank) in present and passed(i.step, i.gen)]


def _ended_by_a_stop(outcome: dict | None, fate: dict | None, since: float | None) -> bool:
    """A process that left no word of its own end, or was ended by a termination signal: what a
    stop of the whole job (the launcher's SIGTERM, passed on to everyone, then SIGKILL after the
    grace) leaves behind. A SIGKILL before the stop began (``since``) was someone else's: its own."""
    if outcome is not None:
        return outcome["status"] == "failed" and outcome.get("kind") in SIGNAL_ERRORS
    if fate is None or fate["end"] == "terminated" or fate.get("signal") in ("SIGTERM", "SIGINT", "SIGHUP"):
        return True
    return fate.get("signal") == "SIGKILL" and (since is None or fate.get("t", since) >= since)


def _how(outcome: dict | None, fate: dict | None) -> str:
    """One line on how a process ended."""
    end = describe_end(outcome, fate)
    if end is None:
        return ("died with its sentinel, without a word (no outcome, no sentinel record: a SIGKILL to the "
                "sentinel, or its host lost)")
    if outcome is not None and outcome["status"] in ("failed", "error"):
        scope = "stopped the job" if outcome["status"] == "error" else "failed"
        scope += " after finishing" if outcome.get("after_finish") else ""
    else:
        scope = ""
    step = f" at step {end['step']}" if end["step"] is not None and not end["injected"] else ""
    return f"{scope}{step}: {end['what']}" if scope else f"{end['what']}{step}"


# What to do about the failures users meet first, by what the failed rank's error says.
_HINTS = (
    ("No backend type associated with device type",
     "an operation the process group does not implement for this device: on the ulfm group, use the "
     "torch.distributed calls DDP, FSDP2, DCP and torch's pipelining make, or give that part a Gloo group "
     "(elastic.distributed.ProcessGroup(world, backend='gloo'))"),
    ("import of torch halted",
     "torch could not be imported in the ranks: install it in the environment they run in "
     "(pip install -c constraints.txt -e '.[torch]')"),
    ("No module named 'torch'",
     "torch is not installed in the environment the ranks run in: pip install -c constraints.txt -e '.[torch]'"),
)


def why_failed(summary: Summary) -> list[str]:
    """The first failed rank's traceback, once, and whether every rank failed the same way; a hint
    where the error is one users meet first (local)."""
    failed = sorted((o for o in summary.outcomes if o["status"] == "failed" and o.get("traceback")),
                    key=lambda o: o.get("t", 0.0))
    if not failed:
        return []
    first = failed[0]
    lines = [f"the first failure's traceback (logical rank {first.get('logical')}, generation {first.get('gen')}):"]
    lines += [f"    {line}" for line in first["traceback"]]
    same = {(o["kind"], o["message"]) for o in failed}
    if len(failed) > 1 and len(same) == 1:
        lines.append(f"every one of the {len(failed)} failed ranks failed the same way: a program error, which "
                     "a recovery would only repeat")
    text = f"{first['kind']}: {first['message']} " + " ".join(first["traceback"])
    lines += [hint for words, hint in _HINTS if words in text]
    return lines


def report(summary: Summary, run_dir: Path, notes: list[str]) -> None:
    told = ", ".join(f"{v} {k}" for k, v in sorted(summary.counts.items()))
    if summary.processes:
        print(f"[launch] {summary.processes} processes: {told}; events in {run_dir}", flush=True)
    else:
        print(f"[launch] no process of the job left a word (events, outcome, sentinel record) in {run_dir}: "
              "none started, or mpiexec failed before them (see its output above)", flush=True)
    for d in summary.deaths:
        who = "parked spare" if d["role"] == "spare" else f"logical rank {d['logical']}"
        print(f"[launch]   pid {d['pid']} ({who}, generation {d['gen']}): {d['how']}", flush=True)
    for line in why_failed(summary):
        print(f"[launch] {line}", flush=True)
    for entry in summary.never_fired:
        if entry in summary.reached:
            print(f"[launch] error: injection {entry} never fired although the loop passed that step with that rank: "
                  "its step points do not reach it (mark steps with state.record_step or world.fault_point at "
                  "the optimizer step; --allow-unfired to accept it)", flush=True)
        else:
            print(f"[launch] warning: injection {entry} never fired (that rank, step or point was not reached)",
                  flush=True)
    for note in notes:
        print(f"[launch] {note}", flush=True)
    if summary.finished:
        print("[launch] training finished", flush=True)
    elif summary.stopped_by:
        print(f"[launch] training did not finish: {summary.stopped_by['kind']}: "
              f"{summary.stopped_by['message']}", flush=True)
    else:
        print("[launch] training did not finish: no process finished it (see the deaths above)", flush=True)

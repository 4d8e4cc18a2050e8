"""Per-process JSON-line events: what happened, when, and on which rank.

One file per process (``events-<host>-<pid>.jsonl``) under the run directory,
so that a dead rank's last line survives it. Timestamps are wall-clock
seconds (``time.time()``) so that events of different processes on one host
compare directly. Every event carries ``"v"``, the schema version
(``SCHEMA``): 1 = the fields ``event``, ``t``, ``pid``, ``logical``, ``rank``,
``gen``, ``role``, then the event's own.

Public for tools (the launcher, the report, scripts, tests): the ``read_*``
functions, and ``describe_end``, which says how a process ended from what it
and its sentinel wrote.
"""
from __future__ import annotations

import json
import logging
import os
import socket
import time
from pathlib import Path
from typing import Any, Callable

SCHEMA = 1
_LOG = logging.getLogger("elastic.events")  # at DEBUG (the launcher's --verbose) every event, as it happens
_CONTEXT = ("event", "t", "v", "pid", "logical", "rank", "gen", "role")  # fields every event carries

# Every event the library writes, and what it means: emitters, the report, the launcher and the tests
# use these names (tests/test_unit.py holds each of them to this table). Programs may add their own.
EVENTS: dict[str, str] = {
    # a process's life
    "started": "joined the job at launch (size, spares, modes, sentinel; relaunch: its count)",
    "spawned": "a spawned replacement started and is about to join its parents' rebuild",
    "rehearsed": "a spare ran the program's rehearsal before it parked (ok, seconds; error)",
    "parked": "a spare began waiting", "promoted": "a spare took over a lost logical rank",
    "released": "a spare was let go at the end of the job", "finished": "the job finished on this rank",
    "error": "an error ends this rank (scope rank) or the whole job alike (scope job)",
    "inject": "an injected fault fires here (the schedule entry's fields)",
    "result": "the program's result (its final loss, a model's hash)",
    # a recovery
    "failure_seen": "this rank saw a failure and revoked", "agreed": "the survivors agreed who died (the shrink)",
    "fenced": "a process declared dead was killed on this host", "decision": "the policy's modes for the lost ranks",
    "host_processes_lost": "every process of a host died: waited for the runtime's verdict",
    "spawn_failed": "spawning did not work; the policy is asked again", "install_failed": "a round's install failed",
    "rebuild_retry": "a failure during the rebuild: one more round", "rebuilt": "a new generation, how it was made",
    "resumed": "the loop goes on from a restored version",
    # the state
    "committed": "a version became current on every rank", "replication_reduced": "fewer ranks than copies asked for",
    "store_recovered": "the lost payloads came back from copies", "restored": "this rank's part of a recovery",
    "store_attached": "versions found again in the nodes' memory after a relaunch",
    "state_restored": "the program's values were put back from a version", "data_lost": "no copy of some state is left",
    "corrupt_copy": "a copy failed its checksum and was not used",
    "shared_copied": "the values every rank holds alike went to replacements, from the survivors",
    "twin_copied": "a replacement got its shard from its live twins (State(twins=...)), senders named",
    "twins_colocated": "a rank's twins share its failure domain in a job that spans several (a warning)",
    "twins_lost": "every twin of some shards died at once: every rank went back to the program's last commit",
    # the layers above
    "step": "one training step (loss, seconds, samples)", "process_group": "torch.distributed was (re)built",
    "stage_rebuilt": "a pipeline stage came back (replica, CheckFree, CheckFree+)",
    # integrity and stragglers
    "integrity": "the gate kept a version from becoming current: nonfinite, fenced ranks, or no_majority",
    "rolled_back": "every rank went back to the last good version after a non-finite value (step dropped or not)",
    "straggler": "a rank slower than the median for steps in a row: by how much, evicted or not",
    "bitflip": "an injected corruption flipped a bit of this rank's value",
    "local_loss": "record_step got losses that differ across ranks (each rank's own, not the job's): said once",
}

# The phases a rebuild times (``rebuilt``'s ``durations``, and ``total``): the report sums them by these names.
REBUILD_PHASES = ("agree", "substitute", "install")

__all__ = ["EVENTS", "REBUILD_PHASES", "EventLog", "read_events", "read_outcomes", "read_result", "read_fates",
           "describe_end", "SIGNAL_ERRORS", "PROGRAMMING_ERRORS"]


class EventLog:
    """Appends one JSON object per event; a no-op when no run directory is set."""

    def __init__(self, run_dir: str | os.PathLike[str] | None, context: Callable[[], dict[str, Any]]) -> None:
        self._context = context
        self._file = None
        self.run_dir = Path(run_dir) if run_dir else None
        if self.run_dir is not None:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            name = f"events-{socket.gethostname()}-{os.getpid()}.jsonl"
            # Line-buffered: an event is on disk before the next statement runs,
            # which matters for a rank that is about to be killed.
            self._file = open(self.run_dir / name, "a", buffering=1, encoding="utf-8")

    def emit(self, event: str, **fields: Any) -> None:
        """Record one event (local, never communicates)."""
        debug = _LOG.isEnabledFor(logging.DEBUG)
        if self._file is None and not debug:
            return
        record = {"event": event, "t": time.time(), "v": SCHEMA, "pid": os.getpid(), **self._context(), **fields}
        line = json.dumps(record, default=_jsonable)
        if self._file is not None:
            self._file.write(line + "\n")
        if debug:
            _LOG.debug("[event] %s", line)

    def write_outcome(self, status: str, **fields: Any) -> None:
        """Write this process's final word (``outcome-<host>-<pid>.json``), read by the launcher."""
        if self.run_dir is None:
            return
        record = {"status": status, "t": time.time(), "pid": os.getpid(),
                  "host": socket.gethostname(), **self._context(), **fields}
        path = outcome_path(self.run_dir, socket.gethostname(), os.getpid())
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(record, default=_jsonable))
        tmp.replace(path)


def _jsonable(value: Any) -> Any:
    if isinstance(value, (set, frozenset, tuple)):
        return sorted(value) if isinstance(value, (set, frozenset)) else list(value)
    if hasattr(value, "value"):
        return value.value
    return str(value)


def read_events(run_dir: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """All events of a run, every process's, sorted by time."""
    events = []
    for path in Path(run_dir).glob("events-*.jsonl"):
        for line in path.read_text(encoding="utf-8").splitlines():
            if line.strip():
                events.append(json.loads(line))
    return sorted(events, key=lambda e: e["t"])


def read_outcomes(run_dir: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """Every process's outcome record: what the program said of its own end (a process that
    died unexpectedly has none)."""
    return [json.loads(p.read_text()) for p in sorted(Path(run_dir).glob("outcome-*.json"))]


def read_result(run_dir: str | os.PathLike[str]) -> dict[str, Any] | None:
    """The program's last recorded result (``world.events.emit("result", ...)``), without the event's context."""
    results = [e for e in read_events(run_dir) if e["event"] == "result"]
    if not results:
        return None
    return {k: v for k, v in results[-1].items() if k not in _CONTEXT}


def read_fates(run_dir: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """How each process ended, as its sentinel saw it (``elastic.comm._sentinel``)."""
    return [json.loads(p.read_text()) for p in sorted(Path(run_dir).glob("fate-*.json"))]


def outcome_path(run_dir: str | os.PathLike[str], host: str, pid: int) -> Path:
    return Path(run_dir) / f"outcome-{host}-{pid}.json"


def write_fate(run_dir: str | os.PathLike[str], pid: int, end: str, **fields: Any) -> bool:
    """Record how the program ``pid`` on this host ended (``fate-<host>-<pid>.json``), unless a
    record is there already: the first word on an end stands (its sentinel's, or the program's
    own on its sentinel's behalf). False when one was there; ``OSError`` when it cannot be written."""
    host = socket.gethostname()
    path = Path(run_dir) / f"fate-{host}-{pid}.json"
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(json.dumps({"end": end, "pid": pid, "host": host, "t": time.time(), **fields}))
    try:
        os.link(tmp, path)  # atomic, and never over another's record
    except FileExistsError:
        return False
    finally:
        tmp.unlink()
    return True


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        doc: dict[str, Any] = json.loads(path.read_text())
        return doc
    except (OSError, ValueError):
        return None


# Errors a signal raises in a Python program: not the program's own, so never "the same error again".
SIGNAL_ERRORS = ("KeyboardInterrupt",)
# Errors that say the program itself is wrong (a setting, a value the library refuses): one rank
# raising it stops the job with it (rc 1) instead of being recovered from as a crash.
PROGRAMMING_ERRORS = ("ConfigError", "CommitRejected", "NothingCommitted", "ProtocolError")  # and its kinds


def describe_end(outcome: dict[str, Any] | None, fate: dict[str, Any] | None) -> dict[str, Any] | None:
    """How a process ended, from what it wrote (its outcome) and what its sentinel saw (its fate).

    Returns ``{"what", "step", "injected", "software"}`` (and ``programming``
    for an exception) or None when neither says anything. ``software``: an
    error of the program (an exception, a non-zero exit), which a recovery
    replays at the same step, as opposed to a signal or a hang, which come from
    outside. ``programming``: the library refused what the program did.
    """
    if outcome is not None and outcome["status"].startswith("injected-"):
        injection = outcome.get("injection", {})
        where = f"step {injection['step']}" if injection.get("step") is not None else injection.get("point")
        then = describe_end(None, fate) if fate is not None and fate["end"] != "died" else None
        action = injection.get("action")
        what = f"killed its node ({outcome.get('host')}) by injection" if action == "node" else f"injected {action}"
        return {"what": f"{what} at {where}" + (f", then {then['what']}" if then else ""),
                "step": outcome.get("step"), "injected": True, "software": False}
    if outcome is not None and outcome["status"] == "spawn-abandoned":
        return {"what": "a spawned replacement given up by its parents (a failure during the spawn)",
                "step": None, "injected": False, "software": False}
    if outcome is not None and outcome["status"] in ("failed", "error"):
        # A signal that Python turns into an exception (SIGINT) came from outside, like a kill.
        return {"what": f"{outcome['kind']}: {outcome['message']}", "step": outcome.get("step"),
                "injected": False, "software": outcome["kind"] not in SIGNAL_ERRORS,
                "programming": outcome["kind"] in PROGRAMMING_ERRORS}
    if fate is None:
        return None
    end = fate["end"]
    if end == "died":
        what = f"exited with code {fate['code']}" if "code" in fate else f"killed by {fate['signal']}"
    elif end == "sentinel-signalled":
        sender = f" from pid {fate['sender']}" if fate.get("sender") else ""
        what = f"ended with its sentinel, which got {fate.get('signal')}{sender}"
    elif end == "sentinel-stopped":
        what = f"its sentinel was stopped for {fate.get('seconds')} s: killed it, and ended with it"
    else:
        what = {"hung": f"hung (no heartbeat for {fate.get('seconds')} s), killed by its sentinel",
                "no-progress": f"made no progress for {fate.get('seconds')} s, killed by its sentinel",
                "deadline": "missed a deadline (a spawned process's join, or the merge with it, never "
                            "completed), killed by its sentinel",
                "stuck-exiting": "hung while leaving (MPI_Finalize), killed by its sentinel",
                "terminated": f"terminated by {fate.get('signal')}",
                "exited": f"left with code {fate.get('code')}"}.get(end, end)
    return {"what": what, "step": fate.get("step"), "injected": False, "software": end == "died" and "code" in fate}


def read_cause(run_dir: str | os.PathLike[str], host: str, pid: int) -> dict[str, Any] | None:
    """``describe_end`` of the process ``pid`` on ``host``, from its files in ``run_dir`` (local)."""
    return describe_end(_read_json(outcome_path(run_dir, host, pid)),
                        _read_json(Path(run_dir) / f"fate-{host}-{pid}.json"))

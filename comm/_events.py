"""Per-process JSON-line events: what happened, when, and on which rank.

One file per process (``events-<host>-<pid>.jsonl``) under the run directory,
so that a dead rank's last line survives it. Timestamps are wall-clock
seconds (``time.time()``) so that events of different processes on one host
compare directly.
"""
from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path
from typing import Any, Callable

RUN_DIR_ENV = "ELASTIC_RUN_DIR"


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
        if self._file is None:
            return
        record = {"event": event, "t": time.time(), "pid": os.getpid(), **self._context(), **fields}
        self._file.write(json.dumps(record, default=_jsonable) + "\n")

    def write_outcome(self, status: str, **fields: Any) -> None:
        """Write this process's final word (``outcome-<host>-<pid>.json``), read by the launcher."""
        if self.run_dir is None:
            return
        record = {"status": status, "t": time.time(), "pid": os.getpid(),
                  "host": socket.gethostname(), **self._context(), **fields}
        path = self.run_dir / f"outcome-{socket.gethostname()}-{os.getpid()}.json"
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
    """Every process's outcome record (a process that died unexpectedly has none)."""
    return [json.loads(p.read_text()) for p in sorted(Path(run_dir).glob("outcome-*.json"))]

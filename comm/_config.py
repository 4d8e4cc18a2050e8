"""comm's configuration: its ``ELASTIC_*`` settings, one row each (``_table``), read and checked here.

The launcher builds a ``Config`` from its options and hands it to every
process as environment variables (``Config.to_env``); each process reads it
back once (``Config.from_env``). A wrong value is refused here, naming the
variable and what to give. The training layer's settings (roll-backs,
stragglers, progress lines) are the training layer's table, not this one.
Imports no MPI.
"""
from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Callable, Mapping

from ._table import Setting, check, fields_match, read, write
from .faults import INJECT_ENV, Injection, parse_schedule
from .wire import message

MODES = ("spare", "spawn", "shrink")


def _modes(text: str) -> tuple[str, ...]:
    return tuple(m.strip() for m in text.split(",") if m.strip())


def _flag(text: str) -> bool:
    if text.lower() in ("1", "true", "yes", "on"):
        return True
    if text.lower() in ("", "0", "false", "no", "off"):
        return False
    raise ValueError("give 1 or 0")


@message
@dataclasses.dataclass(frozen=True)
class Relaunch:
    """What a relaunch of the job (tier 2: the runtime was lost, a node with it) starts from, set by the
    launcher: the membership table (universe rank -> logical rank, -1 a parked spare) and how the
    logical ranks were filled. Every process of the relaunch starts as a replacement and gets the
    state back from the nodes' memory (the store's node copies)."""

    count: int                       # relaunches so far, this one included
    generation: int                  # the first generation of this launch (after the lost one's last)
    table: tuple[int, ...]
    initial_size: int                # the job's first size (what the programs shard by)
    failed: tuple[int, ...] = ()     # logical ranks whose processes were lost with their nodes
    replaced: tuple[int, ...] = ()   # those now on spare nodes
    removed: tuple[int, ...] = ()    # those dropped (no spare node): survivors adopt their state
    lost_nodes: tuple[str, ...] = ()
    committed: bool = False          # a version was agreed before: the nodes' memory must give it back


def _relaunch(text: str) -> Relaunch | None:
    if not text:
        return None
    fields: dict[str, Any] = {k: tuple(v) if isinstance(v, list) else v for k, v in json.loads(text).items()}
    return Relaunch(**fields)


@message
@dataclasses.dataclass(frozen=True)
class Config:
    """Every setting of comm's side of a job; ``ROWS`` names the variable behind each field, how it
    is read and checked, and the launcher's option (the training layer's settings are its own).

    Args:
        spares: processes of the job that park as hot spares (the last ones).
        rebuild: rebuild modes allowed, in order of preference: spare, spawn, shrink.
        min_size: fewest active ranks the job may shrink to.
        multiple_of: after a shrink the active size must be a multiple of this.
        cost_model: choose between spawn and shrink by cost (``elastic.recovery.Policy``).
        spawn_seconds: what a spawn costs, for the cost model.
        run_dir: where events, outcome and fate files go (None: nowhere).
        inject: the fault schedule (``elastic.comm`` fault injection).
        domains: failure domain of each logical rank (round robin), instead of the hosts.
        hang_timeout: seconds without a heartbeat before the sentinel kills a rank (0: never).
        progress_timeout: seconds without progress before the sentinel kills a rank (0: never;
            None, the default: derived from the job's own steps, ``_sentinel.auto_bound``).
        term_grace: seconds a rank gets to leave after SIGTERM before its sentinel kills it.
        require_ulfm: refuse to start without ULFM (0: skip the check; the job then cannot
            survive a failure; None, the default: required, except in a single process started
            without mpiexec, which runs as a world of 1 with a warning, for debugging).
        log_level: the ``elastic`` loggers' level (DEBUG also logs every event as it happens).
        node_store: a directory in node memory (``/dev/shm/elastic-<job>``) where the store keeps
            each rank's committed version as files that outlive the processes (tier 2; None: off).
        relaunch: set by the launcher on a relaunch (``Relaunch``).
        warm_socket: where this host's warm process listens (``_warm``; set by the launcher, None:
            every rank starts cold).
    """

    spares: int = 0
    rebuild: tuple[str, ...] = ("spare", "shrink")
    min_size: int = 1
    multiple_of: int = 1
    cost_model: bool = False
    spawn_seconds: float = 1.3
    run_dir: str | None = None
    inject: tuple[Injection, ...] = ()
    domains: tuple[str, ...] = ()
    hang_timeout: float = 10.0
    progress_timeout: float | None = None
    term_grace: float = 5.0
    require_ulfm: bool | None = None
    log_level: str = "INFO"
    node_store: str | None = None
    relaunch: Relaunch | None = None
    warm_socket: str | None = None

    def __post_init__(self) -> None:
        check(ROWS, self)

    @property
    def faults_scheduled(self) -> bool:
        """A fault schedule is set: fault points inside torch's collectives too."""
        return bool(self.inject)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **overrides: Any) -> "Config":
        """The configuration the environment gives, then ``overrides`` (None values ignored)."""
        values = read(ROWS, os.environ if environ is None else environ, overrides)
        if isinstance(values.get("rebuild"), str):
            values["rebuild"] = _modes(values["rebuild"])
        if isinstance(values.get("inject"), str):
            values["inject"] = parse_schedule(values["inject"])
        return cls(**values)

    def replace(self, **changes: Any) -> "Config":
        return dataclasses.replace(self, **changes)

    def to_env(self) -> dict[str, str]:
        """Every variable, so that ``from_env`` gives this configuration back whatever else is set."""
        return write(ROWS, self)


def _rebuild_ok(modes: tuple[str, ...]) -> bool:
    return bool(modes) and all(m in MODES for m in modes) and len(set(modes)) == len(modes)


def _none_or(parse: Callable[[str], Any]) -> Callable[[str], Any]:
    return lambda t: parse(t) if t else None


def _at_least(low: float) -> Callable[[Any], bool]:
    return lambda v: v >= low


LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")
ROWS = (
    Setting("spares", "ELASTIC_SPARES", int, "takes integers >= 0", _at_least(0)),
    Setting("rebuild", "ELASTIC_REBUILD", _modes,
            f"give an ordered list drawn from {', '.join(MODES)} without repeats, e.g. 'spare,shrink' or 'spawn'",
            _rebuild_ok, "--rebuild", "rebuild modes in order, e.g. spare,shrink or spawn"),
    Setting("min_size", "ELASTIC_MIN_SIZE", int, "takes integers >= 1", _at_least(1), "--min-size",
            "fewest active ranks to continue with"),
    Setting("multiple_of", "ELASTIC_MULTIPLE_OF", int, "takes integers >= 1", _at_least(1)),
    Setting("cost_model", "ELASTIC_COST_MODEL", _flag, "give 1 or 0"),
    Setting("spawn_seconds", "ELASTIC_SPAWN_SECONDS", float, "takes seconds >= 0", _at_least(0)),
    Setting("run_dir", "ELASTIC_RUN_DIR", lambda t: t or None, "a directory"),
    Setting("inject", INJECT_ENV, parse_schedule, "a fault schedule"),
    Setting("domains", "ELASTIC_DOMAINS", lambda t: tuple(d.strip() for d in t.split(",") if d.strip()),
            "a comma-separated list of domain names"),
    Setting("hang_timeout", "ELASTIC_HANG_TIMEOUT", float, "takes seconds >= 0 (0 turns it off)", _at_least(0),
            "--hang-timeout", "seconds without a heartbeat before a rank counts as hung and is killed (the "
            "heartbeat needs no MPI call from your code; 0 = off)"),
    Setting("progress_timeout", "ELASTIC_PROGRESS_TIMEOUT", _none_or(float),
            "takes seconds >= 0 (0 turns it off; unset: from the job's own steps)", lambda v: v is None or v >= 0,
            "--progress-timeout", "seconds an active rank may go without progress (a step, a commit) before it is "
            "killed: catches deadlocks and stuck reads (0 = off; unset: 20 x the slowest step seen, at least "
            "120 s, once 3 steps were seen)"),
    Setting("term_grace", "ELASTIC_TERM_GRACE", float, "takes seconds >= 0", _at_least(0)),
    Setting("require_ulfm", "ELASTIC_REQUIRE_ULFM", _none_or(_flag), "give 1 or 0"),
    Setting("log_level", "ELASTIC_LOG_LEVEL", lambda t: t.strip().upper(), f"give one of {', '.join(LOG_LEVELS)}",
            lambda v: v in LOG_LEVELS),
    Setting("node_store", "ELASTIC_NODE_STORE", lambda t: t or None, "a directory in node memory"),
    Setting("relaunch", "ELASTIC_RELAUNCH", _relaunch, "set by the launcher"),
    Setting("warm_socket", "ELASTIC_WARM_SOCKET", lambda t: t or None, "set by the launcher"),
)
fields_match(ROWS, Config)

"""One configuration: every ``ELASTIC_*`` setting, read and checked in one place.

The launcher builds a ``Config`` from its options and hands it to every
process as environment variables (``Config.to_env``); each process reads it
back once (``Config.from_env``). Nothing else reads ``ELASTIC_*`` variables.
A wrong value is refused here, naming the variable and what to give.
Imports no MPI.
"""
from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Callable, Mapping

from ._errors import ConfigError
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


def _text(value: Any) -> str:
    if isinstance(value, Relaunch):
        return json.dumps(dataclasses.asdict(value))
    if isinstance(value, bool):
        return "1" if value else "0"
    if isinstance(value, tuple) and value and isinstance(value[0], Injection):
        return json.dumps([i.to_dict() for i in value])
    if isinstance(value, tuple):
        return ",".join(map(str, value))
    return f"{value:g}" if isinstance(value, float) else str(value)


@message
@dataclasses.dataclass(frozen=True)
class Config:
    """Every setting of a job; see ``ENV`` for the variable behind each field.

    Args:
        spares: processes of the job that park as hot spares (the last ones).
        rebuild: rebuild modes allowed, in order of preference: spare, spawn, shrink.
        min_size: fewest active ranks the job may shrink to.
        multiple_of: after a shrink the active size must be a multiple of this.
        cost_model: choose between spawn and shrink by cost (``elastic.recovery.Policy``).
        spawn_seconds: what a spawn costs, for the cost model.
        max_failures: failures in a row without a successful commit before the job stops.
        run_dir: where events, outcome and fate files go (None: nowhere).
        inject: the fault schedule (``elastic.comm`` fault injection).
        domains: failure domain of each logical rank (round robin), instead of the hosts.
        hang_timeout: seconds without a heartbeat before the sentinel kills a rank (0: never).
        progress_timeout: seconds without progress before the sentinel kills a rank (0: never).
        term_grace: seconds a rank gets to leave after SIGTERM before its sentinel kills it.
        require_ulfm: refuse to start without ULFM (0: skip the check; the job then cannot
            survive a failure; None, the default: required, except in a single process started
            without mpiexec, which runs as a world of 1 with a warning, for debugging).
        log_level: the ``elastic`` loggers' level (DEBUG also logs every event as it happens).
        progress_every / progress_seconds: a progress line on rank 0 every that many steps
            and/or seconds (0: not by that measure).
        node_store: a directory in node memory (``/dev/shm/elastic-<job>``) where the store keeps
            each rank's committed version as files that outlive the processes (tier 2; None: off).
        relaunch: set by the launcher on a relaunch (``Relaunch``).
        on_nonfinite: a NaN or Inf in the loss, the gradients' norm or the committed values at a
            recovery point: ``rollback`` (to the last good version, then the step again), ``skip``
            (roll back, and drop the offending step) or ``stop`` (an agreed error); default rollback.
        straggler_factor: a rank whose own work per step is this many times the median's ...
        straggler_steps: ... for this many steps in a row is evicted like a failed rank (0: off).
        warm_socket: where this host's warm process listens (``_warm``; set by the launcher, None:
            every rank starts cold).
        keep_versions: committed versions a ``State`` keeps, the current one included: a step not
            finite again after its roll-back goes back one more (``ReplicatedStore.fall_back``).
    """

    spares: int = 0
    rebuild: tuple[str, ...] = ("spare", "shrink")
    min_size: int = 1
    multiple_of: int = 1
    cost_model: bool = False
    spawn_seconds: float = 1.3
    max_failures: int = 3
    run_dir: str | None = None
    inject: tuple[Injection, ...] = ()
    domains: tuple[str, ...] = ()
    hang_timeout: float = 10.0
    progress_timeout: float = 0.0
    term_grace: float = 5.0
    require_ulfm: bool | None = None
    log_level: str = "INFO"
    progress_every: int = 10
    progress_seconds: float = 0.0
    node_store: str | None = None
    relaunch: Relaunch | None = None
    on_nonfinite: str = "rollback"
    straggler_factor: float = 0.0
    straggler_steps: int = 5
    keep_versions: int = 1
    warm_socket: str | None = None

    def __post_init__(self) -> None:
        bad = [m for m in self.rebuild if m not in MODES]
        if not self.rebuild or bad or len(set(self.rebuild)) != len(self.rebuild):
            self._refuse("rebuild", f"give an ordered list drawn from {', '.join(MODES)} without repeats, "
                                    "e.g. 'spare,shrink' or 'spawn'")
        if self.on_nonfinite not in NONFINITE:
            self._refuse("on_nonfinite", f"give one of {', '.join(NONFINITE)}")
        if self.straggler_factor and self.straggler_factor <= 1:
            self._refuse("straggler_factor", "give a factor > 1 (3: three times the median step), or 0 for off")
        if self.keep_versions < 1:
            self._refuse("keep_versions", "give versions >= 1 (the current one counts)")
        if self.straggler_steps < 1:
            self._refuse("straggler_steps", "give steps >= 1 (a rank must be slow that many steps in a row)")
        if self.log_level not in LOG_LEVELS:
            self._refuse("log_level", f"give one of {', '.join(LOG_LEVELS)}")
        for name in ("spares", "min_size", "multiple_of", "max_failures", "spawn_seconds", "hang_timeout",
                     "progress_timeout", "term_grace", "progress_every", "progress_seconds"):
            low = 1 if name in ("min_size", "multiple_of") else 0
            if getattr(self, name) < low:
                self._refuse(name, _WHAT[name])

    def _refuse(self, name: str, what: str) -> None:
        raise ConfigError(f"{ENV[name]}={_text(getattr(self, name))!r} ({name}): {what}")

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **overrides: Any) -> "Config":
        """The configuration the environment gives, then ``overrides`` (None values ignored)."""
        env = os.environ if environ is None else environ
        values: dict[str, Any] = {}
        for name, variable in ENV.items():
            text = env.get(variable)
            if text is None:
                continue
            try:
                values[name] = _PARSE[name](text)
            except ConfigError:
                raise
            except (TypeError, ValueError) as exc:
                raise ConfigError(f"{variable}={text!r} ({name}): {_WHAT.get(name, exc)}") from exc
        values.update({k: v for k, v in overrides.items() if v is not None})
        if isinstance(values.get("rebuild"), str):
            values["rebuild"] = _modes(values["rebuild"])
        if isinstance(values.get("inject"), str):
            values["inject"] = parse_schedule(values["inject"])
        return cls(**values)

    def replace(self, **changes: Any) -> "Config":
        return dataclasses.replace(self, **changes)

    def to_env(self) -> dict[str, str]:
        """Every variable, so that ``from_env`` gives this configuration back whatever else is set."""
        return {ENV[f.name]: _text(getattr(self, f.name)) if getattr(self, f.name) is not None else ""
                for f in dataclasses.fields(self)}


ENV = {
    "spares": "ELASTIC_SPARES", "rebuild": "ELASTIC_REBUILD", "min_size": "ELASTIC_MIN_SIZE",
    "multiple_of": "ELASTIC_MULTIPLE_OF", "cost_model": "ELASTIC_COST_MODEL",
    "spawn_seconds": "ELASTIC_SPAWN_SECONDS", "max_failures": "ELASTIC_MAX_FAILURES",
    "run_dir": "ELASTIC_RUN_DIR", "inject": INJECT_ENV, "domains": "ELASTIC_DOMAINS",
    "hang_timeout": "ELASTIC_HANG_TIMEOUT", "progress_timeout": "ELASTIC_PROGRESS_TIMEOUT",
    "term_grace": "ELASTIC_TERM_GRACE", "require_ulfm": "ELASTIC_REQUIRE_ULFM", "log_level": "ELASTIC_LOG_LEVEL",
    "progress_every": "ELASTIC_PROGRESS_EVERY", "progress_seconds": "ELASTIC_PROGRESS_SECONDS",
    "node_store": "ELASTIC_NODE_STORE", "relaunch": "ELASTIC_RELAUNCH", "on_nonfinite": "ELASTIC_ON_NONFINITE",
    "straggler_factor": "ELASTIC_STRAGGLER_FACTOR", "straggler_steps": "ELASTIC_STRAGGLER_STEPS",
    "keep_versions": "ELASTIC_KEEP_VERSIONS", "warm_socket": "ELASTIC_WARM_SOCKET",
}
NONFINITE = ("rollback", "skip", "stop")
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")
_PARSE: dict[str, Callable[[str], Any]] = {
    "spares": int, "rebuild": _modes, "min_size": int, "multiple_of": int, "cost_model": _flag,
    "spawn_seconds": float, "max_failures": int, "run_dir": lambda t: t or None, "inject": parse_schedule,
    "domains": lambda t: tuple(d.strip() for d in t.split(",") if d.strip()), "hang_timeout": float,
    "progress_timeout": float, "term_grace": float, "require_ulfm": lambda t: _flag(t) if t else None,
    "log_level": lambda t: t.strip().upper(), "progress_every": int, "progress_seconds": float,
    "node_store": lambda t: t or None, "relaunch": _relaunch, "on_nonfinite": lambda t: t.strip().lower(),
    "straggler_factor": float, "straggler_steps": int, "keep_versions": int, "warm_socket": lambda t: t or None,
}
_WHAT = {
    "spares": "takes integers >= 0", "min_size": "takes integers >= 1", "multiple_of": "takes integers >= 1",
    "max_failures": "takes integers >= 0", "cost_model": "give 1 or 0", "require_ulfm": "give 1 or 0",
    "spawn_seconds": "takes seconds >= 0", "hang_timeout": "takes seconds >= 0 (0 turns it off)",
    "progress_timeout": "takes seconds >= 0 (0 turns it off)", "term_grace": "takes seconds >= 0",
    "progress_every": "takes steps >= 0 (0: not by steps)", "straggler_factor": "takes a factor > 1, or 0 for off",
    "straggler_steps": "takes steps >= 1",
    "keep_versions": "takes versions >= 1", "progress_seconds": "takes seconds >= 0 (0: not by time)",
}

"""Shrink or substitute: how the lost logical ranks of one rebuild are filled (pure, no MPI).

A ``Policy`` is handed to ``elastic.comm.init(decide=...)``; at every rebuild
the first process of the shrunk world calls it and broadcasts the answer, so
every process executes the same decision. It answers with the rebuild modes to
apply, in order, and a sentence saying why; an empty answer stops the job with
that sentence.
"""
from __future__ import annotations

import dataclasses
import os
from typing import Mapping

from elastic.comm import ConfigError
from elastic.comm._settings import MIN_SIZE_ENV, MODES, REBUILD_ENV

MULTIPLE_OF_ENV = "ELASTIC_MULTIPLE_OF"
COST_MODEL_ENV = "ELASTIC_COST_MODEL"
SPAWN_SECONDS_ENV = "ELASTIC_SPAWN_SECONDS"


@dataclasses.dataclass(frozen=True)
class Policy:
    """Prefer a parked spare, then spawn or shrink, under the job's size constraints.

    Args:
        modes: the rebuild modes allowed, in order of preference.
        min_size: fewest active ranks the job may shrink to.
        multiple_of: after a shrink the active size must be a multiple of this
            (pipeline depth, tensor-parallel width); 1 means any size.
        cost_model: choose between spawn and shrink by cost instead of by order:
            spawning costs ``spawn_seconds`` once; shrinking from n to m ranks
            with the global batch kept makes each of the remaining steps
            n/m times slower. Needs the loop's outlook (``step_seconds``,
            ``remaining_steps``); without it the order decides.
        spawn_seconds: measured cost of a spawn + merge (about 1.3 s here).
    """

    modes: tuple[str, ...] = ("spare", "shrink")
    min_size: int = 1
    multiple_of: int = 1
    cost_model: bool = False
    spawn_seconds: float = 1.3

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> "Policy":
        """The policy the launcher's options ask for: ``ELASTIC_REBUILD`` (modes, default spare,shrink),
        ``ELASTIC_MIN_SIZE``, ``ELASTIC_MULTIPLE_OF``, ``ELASTIC_COST_MODEL`` (1 = on), ``ELASTIC_SPAWN_SECONDS``."""
        env = os.environ if environ is None else environ
        try:
            return cls(modes=env.get(REBUILD_ENV, "spare,shrink"), min_size=int(env.get(MIN_SIZE_ENV, "1")),
                       multiple_of=int(env.get(MULTIPLE_OF_ENV, "1")),
                       cost_model=env.get(COST_MODEL_ENV, "0") not in ("", "0", "false", "no"),
                       spawn_seconds=float(env.get(SPAWN_SECONDS_ENV, "1.3")))
        except ValueError as exc:
            if isinstance(exc, ConfigError):
                raise
            raise ConfigError(f"rebuild policy from the environment: {exc}; {MIN_SIZE_ENV} and {MULTIPLE_OF_ENV} "
                              f"take integers, {SPAWN_SECONDS_ENV} seconds") from exc

    def __post_init__(self) -> None:
        modes = tuple(self.modes.split(",")) if isinstance(self.modes, str) else tuple(self.modes)
        object.__setattr__(self, "modes", tuple(m.strip() for m in modes if m.strip()))
        bad = [m for m in self.modes if m not in MODES]
        if not self.modes or bad or len(set(self.modes)) != len(self.modes):
            raise ConfigError(f"policy modes {self.modes!r}: give an ordered list drawn from {MODES} "
                              "without repeats, e.g. ('spare', 'shrink')")
        if self.min_size < 1 or self.multiple_of < 1:
            raise ConfigError(f"min_size={self.min_size}, multiple_of={self.multiple_of}: both must be >= 1")
        if self.spawn_seconds < 0:
            raise ConfigError(f"spawn_seconds={self.spawn_seconds}: a cost cannot be negative")

    def __call__(self, lost: int, spares: int, active: int, outlook: Mapping[str, float] | None = None,
                 unavailable: frozenset[str] = frozenset()) -> tuple[tuple[str, ...], str]:
        """Decide how to fill ``lost`` logical ranks (local, deterministic).

        Args:
            lost: active logical ranks that died in this rebuild.
            spares: parked spares still alive.
            active: active ranks still alive (spares not counted).
            outlook: ``step_seconds`` and ``remaining_steps`` of the training loop, if known.
            unavailable: modes that failed in this rebuild (a spawn that cannot work here).

        Returns:
            (modes to apply in order, reason). No modes: the job cannot continue; the reason says why.
        """
        if unavailable:
            allowed = tuple(m for m in self.modes if m not in unavailable)
            if not allowed:
                return (), (f"{', '.join(sorted(unavailable))} failed and no other mode is allowed; "
                            "add spares (--spares) or allow 'shrink'")
            modes, reason = dataclasses.replace(self, modes=allowed)(lost, spares, active, outlook)
            return modes, f"{reason}; {', '.join(sorted(unavailable))} failed"
        from_spares = min(lost, spares) if "spare" in self.modes else 0
        rest = lost - from_spares
        used = ("spare",) if from_spares else ()
        spare_note = f"{from_spares} of {lost} lost rank(s) from parked spares" if from_spares else \
            f"no parked spare for {lost} lost rank(s)" if "spare" in self.modes else "spares not among the modes"
        if rest == 0:
            return used, spare_note
        after = active + from_spares
        shrink_ok, shrink_why = self._shrink_allowed(after)
        options = [m for m in self.modes if m == "spawn" or (m == "shrink" and shrink_ok)]
        if not options:
            why = shrink_why if "shrink" in self.modes else "shrink not allowed"
            return (), (f"{spare_note}; cannot fill the other {rest}: {why}, and spawn is not allowed; "
                        "add spares (--spares), allow 'spawn', or lower min_size / multiple_of")
        choice, why = options[0], "first allowed mode"
        if self.cost_model and len(options) == 2 and outlook and outlook.get("step_seconds") \
                and outlook.get("remaining_steps") is not None:
            slower = outlook["step_seconds"] * outlook["remaining_steps"] * ((after + rest) / after - 1)
            choice = "spawn" if slower > self.spawn_seconds else "shrink"
            why = (f"shrinking to {after} ranks would cost {slower:.2f} s over {outlook['remaining_steps']:.0f} "
                   f"remaining steps, spawning {self.spawn_seconds:.2f} s")
        elif "shrink" in self.modes and not shrink_ok:
            why = shrink_why
        return used + (choice,), f"{spare_note}; {choice} for {rest} ({why})"

    def _shrink_allowed(self, size: int) -> tuple[bool, str]:
        if size < self.min_size:
            return False, f"shrinking would leave {size} active ranks, below min_size={self.min_size}"
        if size % self.multiple_of:
            return False, f"shrinking would leave {size} active ranks, not a multiple of {self.multiple_of}"
        return True, ""

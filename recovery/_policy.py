"""Shrink or substitute: spares first, then spawn or shrink by order or by cost (pure, no MPI).

``Policy`` implements ``elastic.comm``'s rebuild-policy protocol: at every
rebuild the first process of the shrunk world asks it with a frozen
``RebuildContext`` and broadcasts the ``Decision``, so every process executes
the same one: the rebuild modes to apply, in order, and a sentence saying why;
an empty answer stops the job with that sentence.
"""
from __future__ import annotations

import dataclasses
from typing import Mapping

from elastic.comm import Config, ConfigError, Decision, RebuildContext
from elastic.comm.runtime import MODES


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
        spawn_seconds: measured cost of a spawn + merge (``bench_recovery.py`` measures it).
    """

    modes: tuple[str, ...] = ("spare", "shrink")
    min_size: int = 1
    multiple_of: int = 1
    cost_model: bool = False
    spawn_seconds: float = 1.3

    @classmethod
    def from_config(cls, config: Config) -> "Policy":
        """The policy a job's configuration asks for (the launcher's --rebuild, --min-size, ...)."""
        return cls(modes=config.rebuild, min_size=config.min_size, multiple_of=config.multiple_of,
                   cost_model=config.cost_model, spawn_seconds=config.spawn_seconds)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> "Policy":
        """``from_config(Config.from_env(environ))``."""
        return cls.from_config(Config.from_env(environ))

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

    def decide(self, context: RebuildContext) -> Decision:
        """How to fill ``context.lost`` logical ranks (local, deterministic); see the class docstring."""
        if context.unavailable:
            allowed = tuple(m for m in self.modes if m not in context.unavailable)
            failed = ", ".join(sorted(context.unavailable))
            if not allowed:
                return Decision((), f"{failed} failed and no other mode is allowed; add spares (--spares) "
                                    "or allow 'shrink'")
            decision = dataclasses.replace(self, modes=allowed).decide(
                dataclasses.replace(context, unavailable=frozenset()))
            return Decision(decision.modes, f"{decision.reason}; {failed} failed")
        lost, spares, active, outlook = context.lost, context.spares, context.active, context.outlook
        from_spares = min(lost, spares) if "spare" in self.modes else 0
        rest = lost - from_spares
        used = ("spare",) if from_spares else ()
        spare_note = f"{from_spares} of {lost} lost rank(s) from parked spares" if from_spares else \
            f"no parked spare for {lost} lost rank(s)" if "spare" in self.modes else "spares not among the modes"
        if rest == 0:
            return Decision(used, spare_note)
        after = active + from_spares
        shrink_ok, shrink_why = self._shrink_allowed(after)
        options = [m for m in self.modes if m == "spawn" or (m == "shrink" and shrink_ok)]
        if not options:
            why = shrink_why if "shrink" in self.modes else "shrink not allowed"
            return Decision((), f"{spare_note}; cannot fill the other {rest}: {why}, and spawn is not allowed; "
                                "add spares (--spares), allow 'spawn', or lower min_size / multiple_of")
        choice, why = options[0], "first allowed mode"
        if self.cost_model and len(options) == 2 and outlook.step_seconds and outlook.remaining_steps is not None:
            slower = outlook.step_seconds * outlook.remaining_steps * ((after + rest) / after - 1)
            choice = "spawn" if slower > self.spawn_seconds else "shrink"
            why = (f"shrinking to {after} ranks would cost {slower:.2f} s over {outlook.remaining_steps:.0f} "
                   f"remaining steps, spawning {self.spawn_seconds:.2f} s")
        elif "shrink" in self.modes and not shrink_ok:
            why = shrink_why
        return Decision(used + (choice,), f"{spare_note}; {choice} for {rest} ({why})")

    def _shrink_allowed(self, size: int) -> tuple[bool, str]:
        if size < self.min_size:
            return False, f"shrinking would leave {size} active ranks, below min_size={self.min_size}"
        if size % self.multiple_of:
            return False, f"shrinking would leave {size} active ranks, not a multiple of {self.multiple_of}"
        return True, ""

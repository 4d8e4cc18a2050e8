"""How the lost ranks of one rebuild are filled: the policy protocol and its default, the fixed order.

At every rebuild the first process of the shrunk universe asks the job's
policy and broadcasts its ``Decision``, so every process executes the same
one. A policy sees a frozen ``RebuildContext`` and nothing else: what was lost,
what is left, and the training loop's ``Outlook`` as the loop passed it to
``World.recover``. An empty decision stops the job with its reason.
``elastic.recovery.Policy`` (spares first, then spawn or shrink by cost) is
the other implementation. Pure: no MPI.
"""
from __future__ import annotations

import dataclasses
from typing import Protocol, Sequence

from ._config import MODES
from .wire import message


@dataclasses.dataclass(frozen=True)
class Outlook:
    """What the training loop expects ahead: seconds per step and steps left (None: unknown)."""

    step_seconds: float | None = None
    remaining_steps: int | None = None


@dataclasses.dataclass(frozen=True)
class RebuildContext:
    """What a policy decides from (identical on every process)."""

    lost: int                                   # active logical ranks to fill
    spares: int                                 # parked spares still alive
    active: int                                 # active ranks still alive
    outlook: Outlook = Outlook()
    unavailable: frozenset[str] = frozenset()   # modes that failed in this rebuild (a spawn)
    lost_ranks: tuple[int, ...] = ()            # which: their logical ranks, sorted
    active_ranks: tuple[int, ...] = ()          # the live active ranks' logical ranks, sorted
    initial_size: int = 0                       # the job's logical ranks at the start (0: not told)

    @classmethod
    def of(cls, lost: Sequence[int], active: Sequence[int], spares: int, outlook: Outlook = Outlook(),
           initial_size: int = 0, unavailable: frozenset[str] = frozenset()) -> RebuildContext:
        """The context of losing the logical ranks ``lost`` while ``active`` live on (the one way the
        real rebuild, a straggler's eviction and the simulated job all build it)."""
        return cls(len(lost), spares, len(active), outlook, unavailable, tuple(sorted(int(r) for r in lost)),
                   tuple(sorted(int(r) for r in active)), initial_size)


@message
@dataclasses.dataclass(frozen=True)
class Decision:
    """The modes to apply in order, and why; no modes: the job stops with ``reason``."""

    modes: tuple[str, ...]
    reason: str


class RebuildPolicy(Protocol):
    """Anything with ``decide`` (asked on the lowest live process; a spawned replacement uses the
    policy its own ``init`` gets, so the program must pass the same one everywhere)."""

    def decide(self, context: RebuildContext) -> Decision: ...


@dataclasses.dataclass(frozen=True)
class FixedOrder:
    """The configured modes in their order: each fills what it can; a shrink may not go below ``min_size``."""

    modes: tuple[str, ...] = ("spare", "shrink")
    min_size: int = 1

    def decide(self, context: RebuildContext) -> Decision:
        rest, used, notes = context.lost, [], []
        for mode in (m for m in self.modes if m in MODES and m not in context.unavailable):
            if not rest:
                break
            if mode == "spare" and context.spares:
                rest -= min(rest, context.spares)
            elif mode == "spawn":
                rest = 0
            elif mode == "shrink":
                left = context.active + context.lost - rest
                if left < self.min_size:
                    notes.append(f"shrinking would leave {left} active ranks, below min_size={self.min_size}")
                    continue
                rest = 0
            else:
                continue
            used.append(mode)
        failed = f" ({', '.join(sorted(context.unavailable))} failed)" if context.unavailable else ""
        if rest:
            why = "; ".join(notes) or f"no mode of {self.modes} can fill them"
            return Decision((), f"{rest} of {context.lost} lost rank(s) cannot be filled: {why}{failed}; "
                                "add spares (--spares), allow 'spawn', or lower min_size")
        return Decision(tuple(used), f"configured order {','.join(self.modes)}{failed}")


def asked(policy: RebuildPolicy, context: RebuildContext) -> Decision:
    """``policy``'s decision for ``context`` whatever the policy does (local): one that raises is a
    decision to stop, naming why."""
    try:
        got = policy.decide(context)
        return Decision(tuple(str(m) for m in got.modes), str(got.reason))
    except Exception as exc:
        return Decision((), f"the rebuild policy failed: {exc!r}")


def would_fill(policy: RebuildPolicy, context: RebuildContext) -> Decision:
    """What a rebuild would do about ``context``'s loss (local): ``policy``'s decision when its
    modes place every lost rank by the fill rule, else a decision with no modes and the policy's
    reason. Asked before evicting a live rank (a straggler): only a place the rebuild can fill is
    emptied."""
    decision = asked(policy, context)
    placed = {r for _, take in fill(decision.modes, context.lost_ranks, context.spares) for r in take}
    if not decision.modes or set(context.lost_ranks) - placed:
        return Decision((), decision.reason)
    return decision


def fill(modes: Sequence[str], pending: Sequence[int], spares: int) -> list[tuple[str, list[int]]]:
    """The fill rule: which lost logical ranks each decided mode takes, in the modes' order (pure,
    the same on every process; the real rebuild and the simulated one both follow it). A spare
    takes as many as are parked, lowest logical rank first; a spawn or a shrink takes the rest;
    a mode with nothing left to take, or none of ``MODES``, is skipped. What no mode takes is
    ``pending`` less the returned ranks (the job cannot fill it)."""
    plan, left = [], sorted(pending)
    for mode in modes:
        take = left[:spares] if mode == "spare" else list(left) if mode in MODES else []
        if take:
            plan.append((mode, take))
            left = left[len(take):]
    return plan

"""Straggler eviction, a stage of the step's end: present only when a bound is set.

Every rank's own work in the step (its time less what it waited for its peers) is gathered at
``record_step`` (one small all-gather) and read by ``_integrity.Stragglers`` alike on every rank;
a rank that many times slower than the median for that many steps in a row is evicted like a
failed rank, when the job can fill its place: the job's own rebuild policy says so, asked as the
rebuild will ask it (``job.rebuild_decision``), so an eviction never leaves a place the rebuild
cannot fill. Without a bound ``record_step`` stays local.
"""
from __future__ import annotations

import logging
from typing import Callable

from elastic.comm import Decision, Outlook, ProcessFailure, Recoverable

from ._capture import StepEnd
from ._integrity import Stragglers

_LOG = logging.getLogger("elastic")


class StragglerWatch:
    def __init__(self, world: Recoverable, factor: float, steps: int, outlook: Callable[[], Outlook]) -> None:
        self._world = world
        self._detector = Stragglers(factor, steps)
        self._outlook = outlook  # the loop's view ahead, as the rebuild will be given it
        self._said = False       # that a straggler could not be evicted: once, on rank 0

    def step_ended(self, end: StepEnd) -> None:
        """Gather every rank's own work of this step; evict a straggler when the detector says so
        and the job can fill its place (collective; the same decision on every rank)."""
        world, detector = self._world, self._detector
        ranks = [int(r) for r in world.logical_ranks]
        found = detector.observe(world.generation, ranks, world.allgather(float(end.own_work)))
        if found is None:
            return
        rank, ratio, median = found
        # The policy is asked on one rank and its answer broadcast, as the rebuild does: every rank
        # takes the same decision whatever the policy is.
        decision: Decision = world.bcast(world.job.rebuild_decision([rank], self._outlook()) if world.rank == 0
                                         else None, root=0)
        evicted = bool(decision.modes)
        why = (f"logical rank {rank} is a straggler: its own work per step was {ratio:.1f}x the median "
               f"({median * 1e3:.1f} ms) for {detector.steps} steps in a row (factor {detector.factor:g})")
        world.events.emit("straggler", rank=rank, ratio=ratio, median_seconds=median, steps=detector.steps,
                          step=end.step, evicted=evicted)
        if not evicted:  # the streak starts again; the job goes on with it, which is said once
            detector.reset()
            if not self._said and world.rank == 0:
                self._said = True
                _LOG.warning("[integrity] %s; not evicted, its place could not be filled: %s", why, decision.reason)
            return
        if rank == int(world.logical_rank):
            world.fail("straggler", why + ": evicted")
        raise ProcessFailure(why + ": evicted")

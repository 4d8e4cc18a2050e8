"""Straggler eviction, a stage of the step's end: present only when a bound is set.

Every rank's own work in the step (its time less what it waited for its peers) is gathered at
``record_step`` (one small all-gather) and read by ``_integrity.Stragglers`` alike on every rank;
a rank that many times slower than the median for that many steps in a row is evicted like a
failed rank, when the job can fill its place. Without a bound ``record_step`` stays local.
"""
from __future__ import annotations

import logging

from elastic.comm import ProcessFailure, Recoverable

from ._integrity import Stragglers
from ._settings import Training

_LOG = logging.getLogger("elastic")


class StragglerWatch:
    def __init__(self, world: Recoverable, factor: float, steps: int) -> None:
        self._world = world
        self._detector = Stragglers(factor, steps)

    def step_ended(self, step: int, own: float) -> None:
        """Gather every rank's own work of this step; evict a straggler when the detector says so
        and the job can fill its place (collective; the same decision on every rank)."""
        world, detector = self._world, self._detector
        ranks = [int(r) for r in world.logical_ranks]
        found = detector.observe(world.generation, ranks, world.allgather(float(own)))
        if found is None:
            return
        rank, ratio, median = found
        settings = world.job.settings
        fill = world.job.spares > 0 or "spawn" in settings.rebuild or \
            ("shrink" in settings.rebuild and world.size - 1 >= settings.min_size)
        why = (f"logical rank {rank} is a straggler: its own work per step was {ratio:.1f}x the median "
               f"({median * 1e3:.1f} ms) for {detector.steps} steps in a row (factor {detector.factor:g})")
        world.events.emit("straggler", rank=rank, ratio=ratio, median_seconds=median, steps=detector.steps,
                          step=step, evicted=fill)
        if not fill:  # said once per streak: the streak starts again
            detector.reset()
            _LOG.warning("[integrity] %s; not evicted: no spare is parked and the rebuild modes %s allow no "
                         "replacement", why, "/".join(settings.rebuild))
            return
        if rank == int(world.logical_rank):
            world.fail("straggler", why + ": evicted")
        raise ProcessFailure(why + ": evicted")


def straggler_watch(world: Recoverable, settings: Training) -> StragglerWatch | None:
    """The stage for the job's settings, or None when no bound is set."""
    return StragglerWatch(world, settings.straggler_factor, settings.straggler_steps) \
        if settings.straggler_factor else None

"""The step clock: each training step timed, an event per step, a progress line, the policy's outlook."""
from __future__ import annotations

import logging
import time
from typing import Any

from elastic.comm import Group, Outlook

from ._capture import StepEnd
from ._settings import Training

_LOG = logging.getLogger("elastic")


class StepClock:
    """Times training steps: an event per step on rank 0, a progress line, the outlook for the policy.

    Local. A step's duration counts from the previous step or from the last
    ``restart()`` (the end of a recovery), so recovery time is never taken for
    training time. ``outlook`` (seconds per step, smoothed; steps left) is what
    ``elastic.run`` hands to ``World.recover`` for the rebuild policy. The
    progress line (logger ``elastic``, INFO) comes every ``progress_every``
    steps and/or ``progress_seconds`` seconds (the training settings'), and at
    the last step.
    """

    def __init__(self, world: Group, settings: Training | None = None) -> None:
        self._world = world
        settings = Training.of(world) if settings is None else settings  # (a State passes the ones it read)
        self._every, self._seconds = settings.progress_every, settings.progress_seconds
        self._last: float | None = None
        self._waited = 0.0  # the world's waiting at the last step's end
        self._shown = time.monotonic()
        self.outlook = Outlook()

    def restart(self) -> None:
        self._last, self._waited = time.perf_counter(), self._world.job.waited

    def own_work(self) -> float:
        """Seconds of this step so far that this rank did not spend waiting for its peers (local)."""
        if self._last is None:
            return 0.0
        return max(time.perf_counter() - self._last - (self._world.job.waited - self._waited), 0.0)

    def step_ended(self, end: StepEnd) -> None:
        """The clock as a stage of a State's step end (``_stages``)."""
        self.step_done(end.step, end.loss, end.total, **end.metrics)

    def step_done(self, step: int, loss: float | None = None, total: int | None = None, **metrics: Any) -> float:
        """A step ended (local): its event on rank 0, the progress line when due, the outlook.
        Returns the step's own work (``own_work``)."""
        own = self.own_work()
        now = time.perf_counter()
        seconds = now - self._last if self._last is not None else 0.0
        self._last, self._waited = now, self._world.job.waited
        before = self.outlook.step_seconds
        self.outlook = Outlook(seconds if before is None else 0.8 * before + 0.2 * seconds,
                               max(total - step, 0) if total is not None else self.outlook.remaining_steps)
        world = self._world
        if world.rank == 0:
            world.events.emit("step", step=step, loss=loss, seconds=seconds, size=world.size, **metrics)
            if self._due(step, total) and _LOG.isEnabledFor(logging.INFO):
                of = f"/{total}" if total else ""
                shown = f" loss {loss:.5f}" if loss is not None else ""
                rate = 1 / max(self.outlook.step_seconds or 0.0, 1e-9)
                _LOG.info("[train] step %s%s%s  %.1f steps/s  %d ranks  generation %d", step, of, shown, rate,
                          world.size, world.generation)
        return own

    def _due(self, step: int, total: int | None) -> bool:
        now = time.monotonic()
        due = step == total or bool(self._every and step % self._every == 0) or \
            bool(self._seconds and now - self._shown >= self._seconds)
        if due:
            self._shown = now
        return due

"""The stages of a step's end, in order: one factory, one tuple, one frozen record each step.

``State.record_step`` makes a ``StepEnd`` (``_capture``: the step, its loss and gradient norm,
this rank's own work in it, the State's values captured only when a stage reads them) and hands
it to each stage in turn. ``stages`` builds them from the settings and the State's arguments,
only those that apply:

1. the per-step recovery point (``_points.EveryStep``): no collective since the step point;
2. the twins' comparison of their shards (``_gate.TwinCheck``), every ``twin_check_every`` steps;
3. the integrity gate's note of the loss and the gradient norm (``_gate.Gate``);
4. the fault schedule's step point (``FaultPoint``: the ``R@S`` entries fire here);
5. injected data faults (``_datafaults``), under a fault schedule: a flipped bit, a slow step;
6. the step clock (``_clock``): an event per step, the progress line, the policy's outlook;
7. straggler eviction (``_stragglers``), with a bound set: one small all-gather.

A stage does one thing and returns None, or the record as it changed the step (a data fault's:
the values it changed, which the State takes into its live ones, a longer own work); the stages
after it see that record. Each is tested alone in a simulated rank (``tests/test_stages.py``).
"""
from __future__ import annotations

from elastic.comm import Group, Recoverable

from ._capture import StepEnd, StepStage
from ._clock import StepClock
from ._datafaults import DataFaults
from ._gate import Gate, TwinCheck
from ._points import RecoveryPoint, Twins
from ._settings import Training
from ._stragglers import StragglerWatch


class FaultPoint:
    """The step's end as the fault schedule's step point: ``R@S`` entries fire here, unless the
    program marks its steps itself (``world.fault_point``)."""

    def __init__(self, world: Group) -> None:
        self._world = world

    def step_ended(self, end: StepEnd) -> None:
        self._world.fault_point(end.step, implied=True)


def stages(world: Recoverable, settings: Training, point: RecoveryPoint, gate: Gate, clock: StepClock,
           twins: Twins | None) -> tuple[StepStage, ...]:
    """A State's stages of the step's end, in their order, only those that apply (local): its
    recovery point where that is a stage too (every step's), the twins' check where there are
    twins and a period, data faults under a fault schedule, stragglers with a bound."""
    found: list[StepStage | None] = [
        point if isinstance(point, StepStage) else None,
        TwinCheck(world, twins.holders, settings.twin_check_every)
        if twins is not None and settings.twin_check_every else None,
        gate,
        FaultPoint(world),
        DataFaults(world) if world.job.settings.faults_scheduled else None,
        clock,
        StragglerWatch(world, settings.straggler_factor, settings.straggler_steps, lambda: clock.outlook)
        if settings.straggler_factor else None,
    ]
    return tuple(stage for stage in found if stage is not None)

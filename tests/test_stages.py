"""The stages of a step's end, each alone in a simulated rank (no MPI): the factory that builds
them, and what each one does with the frozen record ``record_step`` hands it."""
from __future__ import annotations

import logging

import numpy as np
import pytest

from elastic._capture import Capture, StepEnd
from elastic._clock import StepClock
from elastic._datafaults import DataFaults
from elastic._gate import Gate, TwinCheck
from elastic._points import EveryCommit, EveryStep
from elastic._settings import Training
from elastic._stages import FaultPoint, stages
from elastic._stragglers import StragglerWatch
from elastic.comm import ConfigError, Outlook, ProcessFailure, Role
from elastic.comm.faults import InjectedFault
from elastic.testing import SimJob


def _kinds(world, per_step: bool = False, twins=None, **settings) -> list[str]:
    training = Training(**settings)
    point = EveryStep(world) if per_step else EveryCommit()
    clock = StepClock(world, training)
    return [type(s).__name__ for s in stages(world, training, point, Gate(world, 3), clock, twins)]


class _AllTwins:
    def __init__(self, n: int) -> None:
        self.n = n

    def holders(self, logical: int) -> list[int]:
        return list(range(self.n))


def test_the_factory_builds_only_the_stages_that_apply_in_their_order():
    plain = SimJob(2).rank(0)
    assert _kinds(plain) == ["Gate", "FaultPoint", "StepClock"]  # what every State has: nothing collective
    assert _kinds(plain, per_step=True) == ["EveryStep", "Gate", "FaultPoint", "StepClock"]
    assert _kinds(plain, twins=_AllTwins(2)) == ["TwinCheck", "Gate", "FaultPoint", "StepClock"]
    assert _kinds(plain, twins=_AllTwins(2), twin_check_every=0) == ["Gate", "FaultPoint", "StepClock"]
    assert _kinds(plain, straggler_factor=3.0) == ["Gate", "FaultPoint", "StepClock", "StragglerWatch"]
    scheduled = SimJob(2, inject="1@5").rank(0)
    assert _kinds(scheduled, per_step=True, twins=_AllTwins(2), straggler_factor=3.0) == [
        "EveryStep", "TwinCheck", "Gate", "FaultPoint", "DataFaults", "StepClock", "StragglerWatch"]


def test_the_fault_point_stage_fires_the_schedules_step_entries():
    world = SimJob(1, inject="0@3:raise").rank(0)
    FaultPoint(world).step_ended(StepEnd(2))
    with pytest.raises(InjectedFault, match="step=3"):
        FaultPoint(world).step_ended(StepEnd(3))


def test_the_gate_stage_keeps_the_first_non_finite_value_for_the_next_commit():
    from elastic._integrity import NonFinite

    world = SimJob(1).rank(0)
    gate = Gate(world, 3)
    values = Capture({"w": np.ones(2)}, frozenset())
    gate.step_ended(StepEnd(4, loss=1.0, grad_norm=2.0))
    gate.check(values, 1)  # finite: passes
    gate.step_ended(StepEnd(5, loss=1.0, grad_norm=float("inf")))
    gate.step_ended(StepEnd(6, loss=float("nan")))
    with pytest.raises(NonFinite, match="non-finite grad_norm at step 5"):
        gate.check(values, 2)
    gate.forget()  # a restore undid the steps it saw
    gate.check(values, 2)


def test_the_clock_stage_records_the_step_with_its_metrics_on_rank_0():
    job = SimJob(2)
    clock = StepClock(job.rank(0))
    clock.restart()
    clock.step_ended(StepEnd(7, loss=0.25, total=10, metrics={"grad_norm": 1.5}))
    (step,) = job.of("step")
    assert (step["step"], step["loss"], step["grad_norm"], step["size"]) == (7, 0.25, 1.5, 2)
    assert clock.outlook.remaining_steps == 3 and clock.outlook.step_seconds is not None


def test_a_bitflip_comes_back_as_a_changed_value_and_the_live_one_is_untouched():
    world = SimJob(1, inject="0@2:bitflip").rank(0)
    w = np.linspace(1.0, 2.0, 4)
    live = Capture({"a.rng": np.zeros(3), "w": w, "z": np.arange(3)}, frozenset({"a"}))
    FaultPoint(world).step_ended(StepEnd(2))
    end = StepEnd(2, take=lambda: live)
    changed = DataFaults(world).step_ended(end)
    assert changed is not None and list(changed.changed) == ["w"]  # the first shared floating array
    flipped = changed.changed["w"]
    differ = np.flatnonzero(flipped.view(np.uint8) != w.view(np.uint8))
    assert differ.tolist() == [1] and np.isfinite(flipped).all()  # one byte, one bit, finite
    assert bin(int(flipped.view(np.uint8)[1] ^ w.view(np.uint8)[1])).count("1") == 1
    assert np.array_equal(w, np.linspace(1.0, 2.0, 4))  # the State takes it, not the stage
    assert DataFaults(world).step_ended(StepEnd(2, take=lambda: live)) is None  # once only


def test_a_slow_step_comes_back_with_its_own_work_that_many_times_longer():
    world = SimJob(1, inject="0@2:slow=3").rank(0)
    FaultPoint(world).step_ended(StepEnd(1))
    assert DataFaults(world).step_ended(StepEnd(1, own_work=0.01)) is None
    FaultPoint(world).step_ended(StepEnd(2))
    changed = DataFaults(world).step_ended(StepEnd(2, own_work=0.01))
    assert changed is not None and changed.own_work == pytest.approx(0.03) and not changed.changed


def test_the_per_step_point_stage_refuses_a_collective_after_the_step_point():
    def main(world):
        point = EveryStep(world)
        point.step_point(Capture({}, frozenset()), lambda arrays: None)
        point.step_ended(StepEnd(1))  # nothing in between: fine
        point.step_point(Capture({}, frozenset()), lambda arrays: None)
        world.allgather(0)
        point.step_ended(StepEnd(2))

    with pytest.raises(ConfigError, match="a collective ran between the step point"):
        SimJob(2).run(main)


def _twins_told(corrupt: int | None, n: int = 3):
    def main(world):
        if world.role is Role.RECOVERED:
            return "replacement"
        me = int(world.logical_rank)
        shard = np.full(4, 1.0 + (me == corrupt))
        capture = Capture({"opt.m": shard}, frozenset({"opt"}), frozenset({"opt"}))
        check = TwinCheck(world, _AllTwins(n).holders, every=2)
        check.step_ended(StepEnd(1, take=lambda: pytest.fail("read off the check's steps")))
        try:
            check.step_ended(StepEnd(2, take=lambda: capture))
        except ProcessFailure:
            world.recover()
            return "recovered"
        return "kept"
    return main


def test_the_twin_check_stage_fences_the_twin_that_differs_from_its_majority():
    assert SimJob(3).run(_twins_told(None)) == {0: "kept", 1: "kept", 2: "kept"}
    job = SimJob(3, spares=1)
    assert job.run(_twins_told(1)) == {0: "recovered", 1: "replacement", 2: "recovered"}  # the odd one failed
    assert {tuple(e["ranks"]) for e in job.of("integrity")} == {(1,)}
    assert [(e["mode"], e["failed"]) for e in job.of("rebuilt")] == [("spare", [1])]


def _stragglers(slow: int, steps: int = 6):
    def main(world):
        if world.role is Role.RECOVERED:
            return ("replacement", 0)
        watch = StragglerWatch(world, factor=3.0, steps=3, outlook=lambda: Outlook(0.01, 100))
        for step in range(1, steps + 1):
            own = 0.05 if int(world.logical_rank) == slow else 0.01
            try:
                watch.step_ended(StepEnd(step, own_work=own))
            except ProcessFailure:
                world.recover()
                return ("recovered", step)
        return ("kept", steps)
    return main


def test_a_straggler_is_evicted_only_where_the_jobs_policy_fills_its_place(caplog):
    job = SimJob(4, spares=1)
    got = job.run(_stragglers(slow=2))
    assert got == {0: ("recovered", 3), 1: ("recovered", 3), 2: ("replacement", 0), 3: ("recovered", 3)}
    assert {(e["rank"], e["evicted"]) for e in job.of("straggler")} == {(2, True)}
    assert [(e["mode"], e["failed"]) for e in job.of("rebuilt")] == [("spare", [2])]
    # A shrink to 3 ranks is not allowed (multiple_of=2) and there is no spare: the rank is kept,
    # and it is said once though the streak comes again.
    with caplog.at_level(logging.WARNING, logger="elastic"):
        kept = SimJob(4, rebuild=("shrink",), multiple_of=2)
        assert kept.run(_stragglers(slow=2, steps=9)) == {r: ("kept", 9) for r in range(4)}
    assert [e["evicted"] for e in kept.of("straggler") if e["logical"] == 0] == [False, False, False]
    (said,) = [r.getMessage() for r in caplog.records if "not evicted" in r.getMessage()]  # once, by rank 0
    assert "logical rank 2 is a straggler" in said and "not a multiple of 2" in said

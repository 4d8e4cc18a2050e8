"""What scripts/bench_peers.py reads from a run: the stall after a kill, the steps lost, the samples after it.

Fixed step logs, no tool run: the measures must say the same of a spare, of a peer whose step
in flight still ends after the kill, and of a restart from a checkpoint."""
from __future__ import annotations

import importlib.util
import sys

import pytest

from conftest import ROOT

spec = importlib.util.spec_from_file_location("bench_peers", ROOT / "scripts" / "bench_peers.py")
bench = importlib.util.module_from_spec(spec)
sys.modules[spec.name] = bench  # dataclasses look their module up there
spec.loader.exec_module(bench)


def job(ends: dict[int, list[tuple[float, int]]], kill_t: float | None = None, samples: int = 64) -> object:
    """A run from each worker's (time, step) ends."""
    return bench.Run([bench.Step(t, s, w, samples) for w, steps in ends.items() for t, s in steps], kill_t)


def test_the_stall_runs_from_the_kill_to_the_next_new_step():
    # steps every 10 ms; a kill at 0.035 s, after step 3; the job's step 4 ends at 0.535 s
    steps = [(0.01 * s, s) for s in range(1, 4)] + [(0.535 + 0.01 * k, 4 + k) for k in range(3)]
    run = job({0: steps, 2: steps}, kill_t=0.035)
    assert bench.stall(run) == pytest.approx(0.5)
    assert bench.steps_lost(run) == 0
    assert bench.steps_per_s(job({0: [(0.01 * s, s) for s in range(1, 41)]}), 40) == pytest.approx(100)


def test_a_step_in_flight_that_still_ends_does_not_hide_the_recovery_after_it():
    # killed inside step 4 after its reduction: step 4 ends 5 ms after the kill, step 5 half a second later
    steps = [(0.01 * s, s) for s in range(1, 4)] + [(0.04, 4), (0.54, 5), (0.55, 6), (0.56, 7)]
    assert bench.stall(job({0: steps}, kill_t=0.035)) == pytest.approx(0.5)


def test_a_restart_from_a_checkpoint_loses_the_steps_since_it_and_stalls_until_a_new_one():
    before = [(0.01 * s, s) for s in range(1, 8)]  # killed after step 7; the checkpoint holds step 5
    again = [(2.0 + 0.01 * k, s) for k, s in enumerate(range(6, 12))]  # steps 6 and 7 trained again
    run = job({0: before + again}, kill_t=0.075)
    assert bench.steps_lost(run) == 2
    assert bench.stall(run) == pytest.approx(2.02 - 0.075)  # step 8, the first new one, ends at 2.02 s


def test_the_samples_after_a_kill_are_the_fewest_a_step_trained_on():
    run = job({0: [(0.01, 1), (0.02, 2)]}, kill_t=0.015)
    run.steps.append(bench.Step(0.5, 3, 0, 48))  # a peer that drops the dead worker's share
    run.steps.append(bench.Step(0.6, 4, 0, 64))
    assert bench.samples_after(run) == 48


def test_too_few_steps_after_the_kill_is_an_error_not_a_number():
    with pytest.raises(ValueError, match="new steps after the kill"):
        bench.stall(job({0: [(0.01, 1), (0.02, 2), (0.5, 3)]}, kill_t=0.015))


def test_steps_per_s_counts_only_steps_on_the_whole_global_batch():
    # a worker alone on its 16 samples steps every 2 ms; the whole job, 64 samples, every 10 ms
    alone = [bench.Step(0.002 * s, s, 0, 16) for s in range(1, 31)]  # most of the run's last three quarters
    whole = [bench.Step(0.07 + 0.01 * k, s, 0, 64) for k, s in enumerate(range(31, 41))]
    assert bench.steps_per_s(bench.Run(alone + whole), 40) == pytest.approx(100)

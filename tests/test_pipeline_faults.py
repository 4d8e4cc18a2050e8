"""Pipeline stages lost to real kills: an exact replica, or CheckFree(+) from the neighbours.

The replica path must end bitwise where a failure-free run ends (every stage's
weights hashed), on a spare, a spawned process, or (shrink) a neighbour that
then hosts two stages. CheckFree cannot be exact; its rebuilt weights must be finite
and of the right shapes, and after the failure its training loss must stay
below that of re-initialising the lost stage at random (same seed, same kill):
the mean loss over the steps after the kill is compared, run against run.
"""
from __future__ import annotations

import pytest

from conftest import launch
from elastic.report import final_steps

pytestmark = pytest.mark.fault
PIPE = ("examples/pipeline.py",)
SHORT = ("--steps", "30")
LONG = ("--steps", "90")


def hashes(job) -> list[str]:
    assert job.rc == 0, job.output
    return [s["sha256"] for s in job.result["stages"]]


def loss_after(job, step: int) -> float:
    steps = final_steps(job.events)
    return sum(steps[s]["loss"] for s in steps if s > step) / len([s for s in steps if s > step])


@pytest.fixture(scope="module")
def failure_free(tmp_path_factory) -> list[str]:
    return hashes(launch(tmp_path_factory.mktemp("pipe"), 4, program=PIPE + SHORT))


@pytest.mark.parametrize("stage, how, neighbour", [
    (1, ("--spares", "1"), None), (0, ("--spares", "1"), None), (3, ("--rebuild", "spawn"), None),
    (2, ("--rebuild", "shrink"), 1), (0, ("--rebuild", "shrink"), 1)])
def test_replica_brings_the_stage_back_bitwise(tmp_path, failure_free, stage, how, neighbour):
    job = launch(tmp_path, 4, *how, "--inject", f"{stage}@17", program=PIPE + SHORT)
    assert hashes(job) == failure_free
    assert {e["version"] for e in job.of("state_restored")} == {3}  # committed at step 15
    # Which way it came back is in the events; after a shrink the stage lives on with its
    # neighbour, which then hosts two stages.
    rebuilt = [(e["stage"], e["method"], e["logical"], e.get("adopted", False)) for e in job.of("stage_rebuilt")]
    assert rebuilt == [(stage, "replica", stage if neighbour is None else neighbour, neighbour is not None)]


@pytest.mark.parametrize("stage, method", [(2, "checkfree"), (0, "checkfree+"), (3, "checkfree+")])
def test_checkfree_rebuilds_the_stage_better_than_random(tmp_path, stage, method):
    runs = {}
    for recovery in ("checkfree", "random"):
        job = launch(tmp_path / recovery, 4, "--spares", "1", "--inject", f"{stage}@50",
                     program=PIPE + LONG + ("--recovery", recovery, "--checkfree-plus"))
        assert job.rc == 0, job.output
        rebuilt = job.of("stage_rebuilt")
        expected = method if recovery == "checkfree" else "random"
        assert [(e["stage"], e["method"]) for e in rebuilt] == [(stage, expected)]
        assert all(s["finite"] and s["shapes_ok"] for s in job.result["stages"])
        assert not job.of("state_restored")  # nothing came from a copy: there is none
        runs[recovery] = loss_after(job, 50)
    assert runs["checkfree"] < runs["random"], runs


def test_checkfree_cannot_rebuild_two_neighbouring_stages_and_says_so(tmp_path):
    job = launch(tmp_path, 4, "--spares", "2", "--inject", "1@10,2@10",
                 program=PIPE + SHORT + ("--recovery", "checkfree"))
    assert job.rc == 1, job.output
    errors = [o for o in job.outcomes if o["status"] == "error"]
    assert len(errors) == 4 and {o["kind"] for o in errors} == {"Unrecoverable"}
    assert all("stage 1: a neighbouring stage was lost too" in o["message"] for o in errors)

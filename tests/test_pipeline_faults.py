"""Pipeline stages lost to real kills: back from the store's copies (exact), from the neighbours
(CheckFree, CheckFree+) where no copy is left, or a stop naming the stages.

The store path must end bitwise where a failure-free run ends (every stage's weights hashed), on a
spare (a spawned process: ``tests/test_hybrid_faults.py``), and (``tests/programs/pipeline_rebalance.py``,
on ``elastic.run``) after a shrink on the neighbour, which then hosts two stages. CheckFree cannot be exact; its rebuilt
weights must be finite, and after the failure its training loss must stay closer to the failure-free
run's than re-initialising the stage would (the mean over the steps after the kill, run against run).
"""
from __future__ import annotations

import pytest

from conftest import launch
from elastic.report import final_steps

pytestmark = pytest.mark.fault
PIPE = ("examples/pipeline.py",)
REBALANCE = ("tests/programs/pipeline_rebalance.py",)
# CheckFree's mean loss after the kill, at most this times the failure-free run's: measured 1.020-1.022 for
# stages 2, 0, 3; a random re-initialisation of the same stage instead gave 1.038, 1.061, 1.118.
CLOSE = 1.03
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


@pytest.fixture(scope="module")
def long_run(tmp_path_factory):
    job = launch(tmp_path_factory.mktemp("pipe"), 4, program=PIPE + LONG + ("--commit-every", "0", "--checkfree-plus"))
    assert job.rc == 0, job.output
    return job


def test_a_lost_stage_comes_back_bitwise_from_the_store(tmp_path, failure_free):
    stage = 1
    job = launch(tmp_path, 4, "--spares", "1", "--inject", f"{stage}@17", program=PIPE + SHORT)
    assert hashes(job) == failure_free
    # Every rank rolled back to the commit of step 15 and ran steps 16 and 17 again.
    assert [(e["stage"], e["method"], e["logical"], e["step"]) for e in job.of("stage_rebuilt")] == \
        [(stage, "store", stage, 15)]
    assert {e["version"] for e in job.of("store_recovered")} == {15}
    assert sorted(e["step"] for e in job.of("step") if e["logical"] == 0).count(16) == 2


@pytest.mark.parametrize("stage", [2, 0])
def test_after_a_shrink_a_neighbour_hosts_the_lost_stage_bitwise(tmp_path, failure_free, stage):
    job = launch(tmp_path, 4, "--rebuild", "shrink", "--inject", f"{stage}@17", program=REBALANCE)
    assert hashes(job) == failure_free
    assert {e["version"] for e in job.of("state_restored")} == {3}  # committed at step 15
    rebuilt = [(e["stage"], e["method"], e["logical"], e.get("adopted", False)) for e in job.of("stage_rebuilt")]
    assert rebuilt == [(stage, "replica", 1, True)]


@pytest.mark.parametrize("stage, method", [(2, "checkfree"), (0, "checkfree+"), (3, "checkfree+")])
def test_without_copies_checkfree_rebuilds_the_stage_and_training_stays_close(tmp_path, long_run, stage, method):
    job = launch(tmp_path, 4, "--spares", "1", "--inject", f"{stage}@50",
                 program=PIPE + LONG + ("--commit-every", "0", "--checkfree-plus"))
    assert job.rc == 0, job.output
    assert [(e["stage"], e["method"]) for e in job.of("stage_rebuilt")] == [(stage, method)]
    assert all(s["finite"] for s in job.result["stages"])
    assert not job.of("store_recovered")  # nothing came from a copy: there is none
    after, reference = loss_after(job, 50), loss_after(long_run, 50)
    assert after < reference * CLOSE, (after, reference)


def test_two_neighbouring_stages_with_no_copy_stop_every_rank_naming_them(tmp_path):
    # 1, 2 and 3 die: stage 3's copy (on 0) brings it back, but stage 1's lived on 2 and stage 2's on 3,
    # and CheckFree cannot rebuild two neighbouring stages.
    job = launch(tmp_path, 4, "--rebuild", "spawn", "--inject", "1@10,2@10,3@10", program=PIPE + SHORT)
    assert job.rc == 1, job.output
    errors = [o for o in job.outcomes if o["status"] == "error"]
    assert len(errors) == 4 and {o["kind"] for o in errors} == {"Unrecoverable"}
    assert all("stage 1: a neighbouring stage was lost too" in o["message"] and "no copy of them was left in the "
               "store" in o["message"] for o in errors)
    assert [e["given_up"] for e in job.of("store_recovered") if e["logical"] == 0][-1:] == [[1, 2]]

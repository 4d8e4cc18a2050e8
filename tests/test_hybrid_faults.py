"""A data x pipeline mesh losing ranks to real kills: the library brings each lost stage back from a
live data-parallel twin (exact: the run ends bitwise where a failure-free run ends), from the store's
copies when every replica of the stage died (every rank rolls back: exact), by CheckFree when its
copies died too, and stops every rank naming the stages when not even that can.

``examples/hybrid.py``: logical rank = replica * pp + stage; ``model sha256`` hashes replica 0's stages,
``replicas_equal`` says every replica of every stage ended bitwise equal.
"""
from __future__ import annotations

import pytest

from conftest import launch
from elastic.report import final_steps, format_report

pytestmark = pytest.mark.fault
MESH_2X2 = ("examples/hybrid.py", "--dp", "2", "--pp", "2", "--steps", "16")
MESH_2X3 = ("examples/hybrid.py", "--dp", "2", "--pp", "3", "--steps", "16")
NO_COPIES = ("--commit-every", "0")  # no stage in the store: twins and CheckFree only


def finished(job) -> dict:
    assert job.rc == 0, job.output
    assert job.result["steps"] == 16 and job.result["replicas_equal"], job.result
    assert all(s["finite"] for s in job.result["stages"])
    return job.result


def rebuilt(job) -> list[tuple]:
    return sorted((e["gen"], e["logical"], e["stage"], e["method"], tuple(e["sources"]))
                  for e in job.of("stage_rebuilt"))


def last_rebuilt(job) -> list[tuple]:
    """The stages the last rebuild brought back: ranks killed together may be seen over two rebuilds,
    the first cut short by the deaths it had not seen yet, and the second then brings back all."""
    done = rebuilt(job)
    return [r[1:] for r in done if r[0] == done[-1][0]] if done else []


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict:
    return finished(launch(tmp_path_factory.mktemp("mesh"), 4, program=MESH_2X2))


@pytest.fixture
def failure_free(reference) -> str:
    return reference["sha256"]


def test_a_lost_rank_comes_back_bitwise_from_its_twin(tmp_path, failure_free):
    job = launch(tmp_path, 4, "--spares", "1", "--inject", "1@6", program=MESH_2X2)
    assert finished(job)["sha256"] == failure_free
    assert rebuilt(job) == [(1, 1, 1, "twin", (3,))]  # stage 1 of replica 0, from stage 1 of replica 1
    assert "rebuilt stage 1 of replica 0 by twin from logical [3]" in format_report(tmp_path / "run")


def test_a_second_failure_during_the_twin_copy_brings_both_stages_back_bitwise(tmp_path, failure_free):
    # Logical 0 dies as generation 1 starts to copy stage 1 to logical 1's replacement: generation 2
    # brings back both, each from its twin, the replacement of the interrupted copy included.
    job = launch(tmp_path, 4, "--spares", "2", "--inject", "1@6,0@restore/g1", program=MESH_2X2)
    assert finished(job)["sha256"] == failure_free
    assert rebuilt(job) == [(2, 0, 0, "twin", (2,)), (2, 1, 1, "twin", (3,))]


def test_a_shrink_takes_the_lost_ranks_replica_out_of_use_and_the_other_carries_the_global_batch(tmp_path, reference):
    job = launch(tmp_path, 4, "--rebuild", "shrink", "--inject", "1@6", program=MESH_2X2)
    result = finished(job)
    assert result["in_use"] == [1] and [r["replica"] for r in result["stages"]] == [1, 1]
    assert {(e["mode"], tuple(e["failed"])) for e in job.of("rebuilt")} == {("shrink", (1,))}
    assert not job.of("stage_rebuilt")  # nothing to bring back: replica 1 holds every stage
    # The same samples per step, summed in another order: the loss stays with the failure-free run's.
    assert result["final_loss"] == pytest.approx(reference["final_loss"], rel=1e-4)


def test_every_replica_of_a_stage_lost_comes_back_bitwise_from_the_store(tmp_path, failure_free):
    job = launch(tmp_path, 4, "--spares", "2", "--inject", "1@6,3@6", program=MESH_2X2)
    assert finished(job)["sha256"] == failure_free
    assert last_rebuilt(job) == [(1, 1, "store", ()), (3, 1, "store", ())]  # rolled back to the commit of step 5
    assert "rebuilt stage 1 of replica 0 by store from the commit of step 5" in format_report(tmp_path / "run")


def test_two_neighbouring_stages_lost_on_every_replica_stop_every_rank_naming_them(tmp_path):
    # Spawn allowed, nothing parked: the mesh's policy stops before starting a replacement for nothing
    # (were the four deaths seen over two rebuilds, StageRebuild would stop the job the same way).
    job = launch(tmp_path, 6, "--rebuild", "spawn", "--inject", "1@6,2@6,4@6,5@6", program=MESH_2X3 + NO_COPIES)
    assert job.rc == 1, job.output
    errors = [o for o in job.outcomes if o["status"] == "error"]
    assert {o["kind"] for o in errors} == {"Unrecoverable"}, job.outcomes
    assert sorted(o["logical"] for o in errors) == [0, 3]  # both survivors, and no replacement was started
    assert all("every data-parallel replica of stage(s) [1, 2] was lost and CheckFree cannot" in o["message"]
               for o in errors)
    assert not job.of("stage_rebuilt")


def test_stages_whose_copies_survived_come_from_the_store_and_the_others_by_checkfree_beside_them(tmp_path):
    # The same four deaths with copies: stage 2's (on logical 3 and 0) survived, stage 1's (on 2 and 5)
    # did not. Every rank rolls back to the commit of step 5, stage 2 comes back from the store and
    # stage 1 by CheckFree from stage 0 and the restored stage 2; without copies the job stopped.
    job = launch(tmp_path, 6, "--rebuild", "spawn", "--inject", "1@6,2@6,4@6,5@6", program=MESH_2X3)
    finished(job)  # both replicas of stage 1 rebuilt alike: equal again
    assert last_rebuilt(job) == [(1, 1, "checkfree", (0, 2)), (2, 2, "store", ()), (4, 1, "checkfree", (0, 2)),
                                 (5, 2, "store", ())]
    assert [e["given_up"] for e in job.of("store_recovered") if e["logical"] == 0][-1] == [1, 4]
    steps = final_steps(job.events)
    assert sorted(steps) == list(range(1, 17))  # the loss curve, through the failure
    assert steps[16]["loss"] < steps[1]["loss"], {s: steps[s]["loss"] for s in steps}

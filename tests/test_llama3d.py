"""An LLM in the shape torchtitan composes (``examples/llama3d.py``: torch's pipeline schedules on
pp, tensor parallel on tp, FSDP2 as HSDP over dp, one ``DeviceMesh``, all on the ``ulfm`` process
group) losing ranks to real kills, in every part of a step: a pipeline transfer (forward and
backward), a TP all-reduce, the optimizer step, a second death during the recovery, a stopped
rank. With a spare the run ends bitwise where a failure-free run ends (every rank's digest of its
parameter and optimizer slices); a shrink carries the global batch on the replica left; every
replica of a stage lost goes back to the last commit, or, with none, stops every rank naming the
slices. Logical rank k: replica k // (pp * tp), stage (k % (pp * tp)) // tp, tp rank k % tp.
"""
from __future__ import annotations

import re

import pytest

from conftest import launch
from elastic.report import format_report

pytestmark = pytest.mark.fault
PP_DP = ("examples/llama3d.py", "--pp", "2", "--dp", "2", "--steps", "10")
GPIPE, ONE_F_ONE_B = PP_DP + ("--schedule", "gpipe"), PP_DP + ("--schedule", "1f1b")
THREE_D = ("examples/llama3d.py", "--pp", "2", "--dp", "2", "--tp", "2", "--steps", "12")


def digests(job) -> dict[int, str]:
    """Each logical rank's ``digest`` line (its parameter and optimizer slices' sha256)."""
    assert job.rc == 0, job.output
    assert job.result["steps"] in (10, 12), job.result
    return {int(k): h for k, h in re.findall(r"^digest (\d+) ([0-9a-f]{64})$", job.output, re.M)}


_REFERENCES: dict[tuple[str, ...], tuple[dict[int, str], float]] = {}


def reference(tmp_path_factory, program: tuple[str, ...], n: int) -> tuple[dict[int, str], float]:
    """The failure-free run's digests and final loss, once per program."""
    if program not in _REFERENCES:
        job = launch(tmp_path_factory.mktemp("llama3d"), n, program=program)
        found = digests(job)
        assert len(found) == n and len(set(found.values())) == n // 2, found  # twins alike, nothing else
        _REFERENCES[program] = (found, job.result["final_loss"])
    return _REFERENCES[program]


def replaced(job) -> list[tuple[str, tuple[int, ...]]]:
    return sorted({(e["mode"], tuple(e["failed"])) for e in job.of("rebuilt")})


@pytest.mark.parametrize("program, inject, where", [
    (GPIPE, "0@p6", "stage 0's first activation send"),
    (GPIPE, "1@p6.4", "stage 1's first gradient send (after its four activation receives)"),
    (ONE_F_ONE_B, "3@p6.7", "stage 1's last gradient send, in replica 1"),
    (ONE_F_ONE_B, "2@p6", "stage 0's first activation send, in replica 1"),
    # fsdp=1: FSDP2 all-gathers nothing (each replica holds its slot whole) and reduces the gradients
    # over dp, the step's first reduction
    (GPIPE, "3@c6", "FSDP2's gradient reduction"),
])
def test_a_kill_inside_a_transfer_or_the_gradient_reduction_ends_bitwise_with_a_spare(tmp_path, tmp_path_factory,
                                                                                       program, inject, where):
    expected, _ = reference(tmp_path_factory, program, 4)
    job = launch(tmp_path, 4, "--spares", "1", "--inject", inject, program=program)
    assert digests(job) == expected, where
    victim = int(inject.split("@")[0])
    assert replaced(job) == [("spare", (victim,))]
    twin = (victim + 2) % 4  # the same stage in the other replica
    assert f"logical rank {victim}'s slices from its twin(s) logical [{twin}]" in format_report(tmp_path / "run")
    assert [o["status"] for o in job.outcomes if o.get("logical") == victim and o["gen"] == 0] == ["injected-kill"]


@pytest.mark.parametrize("inject", ["3@p6", "5@c6"])  # a pipeline transfer; the first TP all-reduce of the step
def test_a_3d_job_loses_a_rank_and_ends_bitwise_with_a_spare(tmp_path, tmp_path_factory, inject):
    expected, _ = reference(tmp_path_factory, THREE_D, 8)
    job = launch(tmp_path, 8, "--spares", "1", "--inject", inject, program=THREE_D)
    assert digests(job) == expected
    assert replaced(job) == [("spare", (int(inject[0]),))]


def test_a_kill_inside_the_optimizer_step_past_the_step_point_ends_bitwise(tmp_path, tmp_path_factory):
    expected, _ = reference(tmp_path_factory, GPIPE, 4)
    job = launch(tmp_path, 4, "--spares", "1", "--inject", "1@u6", program=GPIPE)
    assert digests(job) == expected


def test_a_second_death_during_the_recovery_brings_both_back_bitwise(tmp_path, tmp_path_factory):
    # Logical 2 (replica 1, stage 0) dies once the first failure's set is agreed: each lost slot
    # still has its twin (0 for 2, 3 for 1), the lost ranks' own values (RNG states) a third copy,
    # and two spares take the places.
    expected, _ = reference(tmp_path_factory, GPIPE, 4)
    job = launch(tmp_path, 4, "--spares", "2", "--inject", "1@p6.4,2@rebuild", program=GPIPE + ("--replication", "3"))
    assert digests(job) == expected
    assert {r for _, failed in replaced(job) for r in failed} == {1, 2}


def test_a_stopped_rank_is_found_and_replaced_bitwise(tmp_path, tmp_path_factory):
    expected, _ = reference(tmp_path_factory, GPIPE, 4)
    job = launch(tmp_path, 4, "--spares", "1", "--hang-timeout", "3", "--inject", "1@p6:hang", program=GPIPE)
    assert digests(job) == expected
    assert replaced(job) == [("spare", (1,))]


def test_a_shrink_takes_the_lost_rank_s_replica_out_of_use_and_keeps_its_survivor_a_twin(tmp_path, tmp_path_factory):
    expected, loss = reference(tmp_path_factory, GPIPE, 4)
    job = launch(tmp_path, 4, "--rebuild", "shrink", "--inject", "1@p6.4", program=GPIPE)
    found = digests(job)
    assert replaced(job) == [("shrink", (1,))] and job.result["in_use"] == [1]
    assert found[0] == found[2]  # logical 0, out of use, kept in step by its twin in replica 1
    assert found[2] != expected[2]  # one replica carried the global batch: the same samples, another sum
    assert job.result["final_loss"] == pytest.approx(loss, rel=1e-3)


def test_every_replica_of_a_stage_lost_goes_back_to_the_commit_bitwise(tmp_path, tmp_path_factory):
    program = GPIPE + ("--commit-every", "3")
    expected, _ = reference(tmp_path_factory, program, 4)
    job = launch(tmp_path, 4, "--spares", "2", "--inject", "1@p6,3@p6", program=program)
    assert digests(job) == expected
    lost = job.of("twins_lost")
    assert lost and lost[0]["version"] is not None and sorted(lost[0]["ranks"]) == [1, 3]
    assert f"every twin of logical [1, 3] lost: every rank back to the commit of version {lost[0]['version']}" \
        in format_report(tmp_path / "run")


def test_every_replica_of_a_stage_lost_without_a_commit_stops_every_rank_naming_the_slices(tmp_path):
    job = launch(tmp_path, 4, "--spares", "2", "--inject", "1@p6,3@p6", program=GPIPE)
    assert job.rc != 0
    assert "DataLost" in job.output and "every twin died at once and no commit holds it" in job.output
    assert "logical rank 1's shard, held by logical ranks [1, 3]" in job.output
    survivors = {e["logical"] for e in job.of("data_lost")}
    assert len(survivors) >= 2  # every rank that stopped said so, alike

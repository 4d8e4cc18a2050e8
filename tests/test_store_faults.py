"""The replicated store under real kills: restored state must be bitwise what the dead rank committed.

What only real processes can show is here (no roll-back copy, spawned processes, a corrupted copy); the
combinations of losses (a spare, a shrink's adoption, two at once, inside a commit or a recovery, every
copy lost) run in a simulated job in tests/test_sim.py, and the failure table's real-kill tests
(CONTRIBUTING.md) keep one of each through the whole program."""
from __future__ import annotations

import pytest

from conftest import launch

pytestmark = pytest.mark.fault
STORE = ("examples/store_demo.py",)


def assert_all_verified(job, owners: set[int]) -> None:
    assert job.rc == 0, job.output
    checks = job.result["checks"]
    assert checks and all(c["ok"] for c in checks), checks
    assert {c["owner"] for c in checks} == owners
    assert job.result["version"] == 10


@pytest.mark.parametrize("inject", ["1@5", "1@commit5"])
def test_store_without_rollback_copy(tmp_path, inject):
    # The store keeps references to the caller's arrays: a spare, and a kill mid-commit (everyone
    # goes back to the version before), still give back every committed state bit for bit.
    job = launch(tmp_path, 4, "--spares", "1", "--inject", inject, program=STORE + ("--no-rollback-copy",))
    assert_all_verified(job, {0, 1, 2, 3})
    assert job.of("promoted")


def test_spawned_rank_gets_state_and_two_failures_in_sequence(tmp_path):
    job = launch(tmp_path, 4, "--rebuild", "spawn", "--inject", "1@3,3@7/g1", program=STORE)
    assert_all_verified(job, {0, 1, 2, 3})
    assert job.result["generation"] == 2


def test_corrupted_copy_is_detected_and_another_replica_used(tmp_path):
    job = launch(tmp_path, 4, "--spares", "1", "--inject", "1@5",
                 program=("tests/programs/corrupt_store.py", "--replication", "3"),
                 env={"CORRUPT_OWNER": "1", "CORRUPT_AT": "5"})
    assert_all_verified(job, {0, 1, 2, 3})
    corrupt = job.of("corrupt_copy")
    assert corrupt and all(e["owner"] == 1 and e["holder"] == 0 for e in corrupt)
    # Each corrupted chunk was fetched a second time, from the other surviving holder.
    assert sum(e["chunks"] for e in job.of("restored")) >= len(corrupt)

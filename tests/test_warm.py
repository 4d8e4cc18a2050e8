"""Warm processes (issue 30): every rank, a spawned replacement and a relaunched rank forked from a
process that has imported everything already, with the sentinel's guarantees, and the cold start
wherever that cannot be (the warm process is gone, the program asks for it, ``--cold``)."""
from __future__ import annotations

import pytest

from conftest import assert_bitwise, launch

pytestmark = pytest.mark.fault
TRAIN = ("examples/train.py",)
SPAWN = ("--rebuild", "spawn", "--inject")


@pytest.fixture(autouse=True)
def own_warm_process(monkeypatch):
    """These tests are of the launcher's own warm process (killed, stopped): not the session's."""
    monkeypatch.setenv("ELASTIC_WARM_SERVER", "")


def _warm(job, event: str) -> list[bool]:
    return [e["warm"] for e in job.of(event)]


def test_a_spawned_replacement_forked_warm_is_bitwise_a_cold_one(tmp_path, reference):
    warm = launch(tmp_path / "warm", 4, *SPAWN, "1@20", program=TRAIN)
    assert_bitwise(warm, reference(TRAIN), "optimizer_sha256")
    assert _warm(warm, "started") == [True] * 4 and _warm(warm, "spawned") == [True]
    cold = launch(tmp_path / "cold", 4, "--cold", *SPAWN, "1@20", program=TRAIN)
    assert_bitwise(cold, reference(TRAIN), "optimizer_sha256")
    assert _warm(cold, "started") == [False] * 4 and _warm(cold, "spawned") == [False]
    assert "a cold start" not in cold.output  # asked for: nothing to say


def test_a_warm_process_killed_before_it_is_needed_leaves_a_cold_spawn_that_recovers(tmp_path, reference):
    # Logical 0 kills this machine's warm process at step 10; logical 1 dies at step 20.
    job = launch(tmp_path, 4, *SPAWN, "0@10:warm,1@20", program=TRAIN)
    assert_bitwise(job, reference(TRAIN), "optimizer_sha256")
    assert _warm(job, "started") == [True] * 4 and _warm(job, "spawned") == [False]
    assert job.output.count("a cold start on") == 1 and "did not answer" in job.output
    assert [o["logical"] for o in job.outcomes if o["status"] != "finished"] == [1]  # the injector went on


def test_a_warm_process_stopped_before_a_spawn_costs_a_cold_start_and_the_launcher_ends_it(tmp_path, reference):
    """Logical 0 stops (SIGSTOP) this machine's warm process at step 10, logical 1 dies at step 20: the
    spawned replacement's sentinel gets no answer (WARM_ANSWER_SECONDS at most, well inside the
    spawn's bound), starts it cold, and the run is bitwise; the launcher kills the stopped warm
    process, so the streams a request left in it keep nothing waiting (the job ends, not its bound)."""
    job = launch(tmp_path, 4, *SPAWN, "0@10:warm-stop,1@20", program=TRAIN)
    assert_bitwise(job, reference(TRAIN), "optimizer_sha256")
    assert _warm(job, "started") == [True] * 4 and _warm(job, "spawned") == [False]
    assert [e["mode"] for e in job.of("rebuilt") if e["logical"] == 0] == ["spawn"]
    assert job.output.count("a cold start on") == 1
    assert "has been stopped for" in job.output and "ranks started on this host from now on start cold" in job.output


def test_a_program_that_asks_for_cold_starts_gets_them_and_it_is_said_once(tmp_path):
    job = launch(tmp_path, 2, "--spares", "1", "--inject", "1@10", program=("tests/programs/cold_start.py",))
    assert job.rc == 0, job.output
    assert _warm(job, "started") == [False] * 3
    assert job.output.count("asks for cold starts") == 1 and "a cold start on" not in job.output

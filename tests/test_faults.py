"""Real failures: ranks are SIGKILLed (or SIGSTOPped) under mpiexec --with-ft ulfm and the job must go on.

Each test asserts on the recovered iterate (bitwise equal to a failure-free run),
on the agreed failed set and rebuild recorded in every survivor's events, and
on each process's own outcome file.
"""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from conftest import JOB_TIMEOUT, ROOT, launch
from elastic.report import ettr, timeline

pytestmark = pytest.mark.fault


def survivors_agree(job, generation: int) -> dict:
    """Every process that completed rebuild `generation` recorded the same rebuild; return it."""
    rebuilt = [e for e in job.of("rebuilt") if e["gen"] == generation]
    assert rebuilt, f"no process recorded rebuild {generation}:\n{job.output}"
    keys = {(tuple(e["failed"]), tuple(e["replaced"]), tuple(e["removed"]), e["mode"]) for e in rebuilt}
    assert len(keys) == 1, f"processes disagree on rebuild {generation}: {keys}"
    return rebuilt[0]


def test_spare_replaces_killed_rank(elastic_launch, reference_hash):
    # Through the pytest plugin that users get (elastic.testing), as a user's own fault test would.
    job = elastic_launch(["examples/jacobi.py"], n=4, args=["--spares", "1", "--rebuild", "spare", "--inject", "1@10"],
                         cwd=ROOT, timeout=JOB_TIMEOUT)
    assert job.rc == 0, job.output
    rebuild = survivors_agree(job, 1)
    assert (rebuild["mode"], rebuild["failed"], rebuild["replaced"]) == ("spare", [1], [1])
    assert job.statuses() == ["finished"] * 4 + ["injected-kill"]
    promoted = job.of("promoted")
    assert [e["logical"] for e in promoted] == [1]
    assert job.result["x_sha256"] == reference_hash
    assert job.result["size"] == 4
    # A World-level program that times its steps (elastic.StepClock) gets the report's ETTR and
    # the recovery's down time, as a State program does.
    row = timeline(job.events)[0]
    assert row["down"] > 0 and row["redone"] in (0, 1) and 0 < ettr(job.events) < 1


def test_two_simultaneous_kills_shrink(tmp_path, reference_hash):
    job = launch(tmp_path, 4, "--rebuild", "shrink", "--inject", "1@10,2@10")
    assert job.rc == 0, job.output
    last = max(e["gen"] for e in job.of("rebuilt"))
    failed = sorted({r for e in job.of("rebuilt") for r in e["failed"]})
    assert failed == [1, 2]
    assert survivors_agree(job, last)["mode"] == "shrink"
    assert job.result["logical_ranks"] == [0, 3]
    assert job.result["x_sha256"] == reference_hash
    assert job.statuses() == ["finished"] * 2 + ["injected-kill"] * 2


def test_spawn_replaces_killed_rank(tmp_path, reference_hash):
    job = launch(tmp_path, 4, "--rebuild", "spawn", "--inject", "2@10")
    assert job.rc == 0, job.output
    rebuild = survivors_agree(job, 1)
    assert (rebuild["mode"], rebuild["replaced"]) == ("spawn", [2])
    spawned = job.of("spawned")
    assert len(spawned) == 1 and spawned[0]["pid"] not in {e["pid"] for e in job.of("started")}
    assert job.result["size"] == 4 and job.result["x_sha256"] == reference_hash


def test_three_failures_in_sequence_spawn(tmp_path, reference_hash):
    job = launch(tmp_path, 4, "--rebuild", "spawn", "--inject", "1@5,2@12/g1,3@20/g2")
    assert job.rc == 0, job.output
    for gen, lost in ((1, [1]), (2, [2]), (3, [3])):
        assert survivors_agree(job, gen)["failed"] == lost
    assert job.result["generation"] == 3 and job.result["x_sha256"] == reference_hash
    assert job.statuses().count("injected-kill") == 3


def test_repeated_failures_spare_then_shrink(tmp_path, reference_hash):
    job = launch(tmp_path, 4, "--spares", "1", "--rebuild", "spare,shrink", "--inject", "0@5,3@12/g1")
    assert job.rc == 0, job.output
    assert survivors_agree(job, 1)["mode"] == "spare"   # logical rank 0, the would-be root, is replaced
    assert survivors_agree(job, 2)["mode"] == "shrink"  # no spare left for the second failure
    assert job.result["logical_ranks"] == [0, 1, 2]
    assert job.result["x_sha256"] == reference_hash


def test_failure_during_rebuild(tmp_path, reference_hash):
    # Logical rank 2 dies after the failed set of the first failure is agreed, before the shrink.
    job = launch(tmp_path, 4, "--rebuild", "shrink", "--inject", "1@8,2@rebuild")
    assert job.rc == 0, job.output
    injected = sorted((e["rank"], e["point"]) for e in job.of("inject"))
    assert injected == [(1, "step"), (2, "rebuild")]
    # The survivors agreed on [1] first; the second death was caught inside the same rebuild.
    assert (1,) in {tuple(e["failed"]) for e in job.of("agreed")}
    assert survivors_agree(job, 1)["failed"] == [1, 2]
    assert job.result["logical_ranks"] == [0, 3] and job.result["x_sha256"] == reference_hash


def test_kill_in_the_middle_of_a_collective(tmp_path, reference_hash):
    job = launch(tmp_path, 4, "--spares", "1", "--inject", "3@c7")
    assert job.rc == 0, job.output
    assert [e["point"] for e in job.of("inject")] == ["collective"]
    assert survivors_agree(job, 1)["failed"] == [3]
    assert job.result["x_sha256"] == reference_hash


def test_a_stencil_shrinks_and_its_halos_follow_the_slabs_bitwise(tmp_path, reference):
    """Killed inside the halo exchange: its neighbours, waiting in Waitall, get ProcessFailure (no
    crash inside MPI), a survivor adopts slab 1 and computes it, and the rod is the failure-free one."""
    stencil = ("examples/stencil.py",)
    job = launch(tmp_path, 4, "--rebuild", "shrink", "--inject", "1@c12", program=stencil)
    assert job.rc == 0, job.output
    assert job.result["rod_sha256"] == reference(stencil)["result"]["rod_sha256"]
    assert job.result["size"] == 3 and job.result["logical_ranks"] == [0, 2, 3]
    assert survivors_agree(job, 1)["removed"] == [1]
    assert [e["point"] for e in job.of("inject")] == ["collective"]


def test_hung_rank_is_detected_and_fenced(tmp_path, reference_hash):
    job = launch(tmp_path, 4, "--detector", "--rebuild", "shrink", "--inject", "2@6:hang")
    assert job.rc == 0, job.output
    assert survivors_agree(job, 1)["failed"] == [2]
    hung_pid = job.of("inject")[0]["pid"]
    assert {(e["victim_pid"], e["victim_logical"]) for e in job.of("fenced")} == {(hung_pid, 2)}
    assert job.result["x_sha256"] == reference_hash


def test_more_failures_than_allowed_is_a_clear_error(tmp_path):
    job = launch(tmp_path, 4, "--rebuild", "shrink", "--min-size", "3", "--inject", "1@4,2@4")
    assert job.rc == 1, job.output
    errors = [o for o in job.outcomes if o["status"] == "error"]
    assert len(errors) == 2  # both survivors stop with the same decision
    assert all("below min_size=3" in o["message"] for o in errors)
    assert not job.has_result


def test_without_ulfm_the_job_says_what_to_run(tmp_path):
    import os
    import shutil
    import subprocess
    import sys
    cmd = [shutil.which("mpiexec"), "-n", "2", "--oversubscribe", sys.executable, "-c",
           "import elastic; elastic.init()"]
    if os.geteuid() == 0:
        cmd.insert(1, "--allow-run-as-root")
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0
    assert "mpiexec was run without `--with-ft ulfm`" in proc.stderr
    assert "UlfmUnavailable" in proc.stderr


def test_a_single_process_without_mpiexec_runs_as_a_world_of_one():
    import os
    import subprocess
    import sys
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ELASTIC_", "OMPI_", "PMIX_"))}
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.run([sys.executable, "examples/train.py", "--steps", "12"], capture_output=True, text=True,
                          timeout=120, env=env, cwd=root)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "a single process without mpiexec" in proc.stderr  # said once, with what to run instead
    assert "done: 12 steps on 1 ranks" in proc.stdout
    strict = subprocess.run([sys.executable, "examples/jacobi.py"], capture_output=True, text=True,
                            timeout=120, env={**env, "ELASTIC_REQUIRE_ULFM": "1"}, cwd=root)
    assert strict.returncode != 0 and "UlfmUnavailable" in strict.stderr


def test_quiet_and_verbose(tmp_path):
    quiet = launch(tmp_path / "q", 4, "--quiet", "--spares", "1", "--inject", "1@12",
                   program=("examples/train.py", "--steps", "20"))
    assert quiet.rc == 0, quiet.output
    assert "[train] step" not in quiet.output and "[launch] /" not in quiet.output  # no progress, no echo
    assert "[launch] training finished" in quiet.output and "injected kill at step 12" in quiet.output
    verbose = launch(tmp_path / "v", 4, "--verbose", "--spares", "1", "--inject", "1@10")
    assert verbose.rc == 0, verbose.output
    logged = [json.loads(line.split("[event] ", 1)[1]) for line in verbose.output.splitlines() if "[event] " in line]
    assert {"started", "failure_seen", "rebuilt", "finished"} <= {e["event"] for e in logged}
    recorded = verbose.events  # every event of every process, logged as it happened (the killed rank's
    assert {e["event"] for e in logged} == {e["event"] for e in recorded}  # last line may die with it)
    assert len(recorded) - 1 <= len(logged) <= len(recorded)



CG = ("examples/cg.py", "--n", "128")


@pytest.mark.parametrize("rebuild", ["spare", "shrink"])
def test_cg_after_a_spare_or_a_shrink_is_bitwise_in_as_many_iterations_and_reported(tmp_path, reference, rebuild):
    """A 2-D Poisson CG (halo exchanges, dot products in strip order), every iteration a recovery
    point: logical rank 2 killed at iteration 30, the solve ends on the failure-free run's iterate in
    as many iterations, nothing redone; the report gives a World/State solver its ETTR and down time."""
    ref = reference(CG)
    args = ("--spares", "1") if rebuild == "spare" else ("--rebuild", "shrink")
    job = launch(tmp_path, 4, *args, "--inject", "2@30", program=CG)
    assert job.rc == 0, job.output
    assert (job.result["x_sha256"], job.result["steps"]) == (ref["result"]["x_sha256"], ref["result"]["steps"])
    assert job.result["size"] == (4 if rebuild == "spare" else 3)
    (row,) = timeline(job.events)
    assert row["mode"] == rebuild and row["redone"] == 0 and row["down"] > 0
    assert row["bytes"] > 0  # the lost strips came from the store, to the spare or to their adopter
    report = subprocess.run([sys.executable, "-m", "elastic.report", str(tmp_path / "run")], capture_output=True,
                            text=True, timeout=60, cwd=ROOT)
    assert report.returncode == 0, report.stderr
    assert f"1 failure(s), ETTR {ettr(job.events):.3f}" in report.stdout and 0 < ettr(job.events) < 1
    assert f"{row['down']:.1f}" in report.stdout

"""The batch template under a real Slurm: slurmctld + slurmd + munged started on this machine.

`sbatch --wait` submits scripts/slurm/train.sbatch; a rank is SIGKILLed inside
the allocation, the spare takes over, and the job must end COMPLETED with the
model bitwise equal to a failure-free run. When the policy cannot go on, the
job must end FAILED with a non-zero exit. .ci/run installs Debian's slurmd,
slurmctld, slurm-client and munge; where they cannot be had the tests skip.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import time

import pytest

from conftest import ROOT
from elastic.comm.events import read_events, read_outcomes, read_result

CLUSTER = ROOT / "scripts" / "slurm" / "local_cluster.sh"
pytestmark = [
    pytest.mark.fault,
    pytest.mark.skipif(not all(shutil.which(t) for t in ("slurmctld", "slurmd", "munged", "sbatch")),
                       reason="Slurm is not installed here (apt-get install slurmd slurmctld slurm-client munge)"),
    pytest.mark.skipif(os.geteuid() != 0, reason="the local Slurm runs its daemons as root"),
]


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    state = tmp_path_factory.mktemp("slurm")
    started = subprocess.run([str(CLUSTER), "start", str(state)], capture_output=True, text=True, timeout=60)
    assert started.returncode == 0, started.stderr
    try:
        yield {**os.environ, "SLURM_CONF": str(state / "slurm.conf")}
    finally:
        subprocess.run([str(CLUSTER), "stop", str(state)], timeout=60)


ENDED = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED", "BOOT_FAIL")


def sbatch(env: dict, tmp_path, launch_args: str) -> tuple[int, str, str]:
    """Submit the template and wait for it to end; returns (exit status, job id, the job's state
    in Slurm). The job's state is polled (a condition, every 0.2 s): ``sbatch --wait`` polls with a
    growing interval and came back up to 10 s after the job had ended."""
    proc = subprocess.run(["sbatch", "--parsable", f"--output={tmp_path}/slurm-%j.out",
                           str(ROOT / "scripts" / "slurm" / "train.sbatch")],
                          cwd=ROOT, capture_output=True, text=True, timeout=60,
                          env={**env, "ELASTIC_RUN_BASE": str(tmp_path), "ELASTIC_TIMEOUT": "300",
                               "ELASTIC_VENV": os.environ.get("VIRTUAL_ENV", str(ROOT / ".venv")),
                               "ELASTIC_LAUNCH_ARGS": launch_args})
    assert proc.returncode == 0, proc.stderr
    job = proc.stdout.strip().split(";")[0]
    deadline = time.monotonic() + 400
    while time.monotonic() < deadline:
        shown = subprocess.run(["scontrol", "show", "job", job], capture_output=True, text=True, timeout=30,
                               env=env).stdout.split()
        fields = dict(w.split("=", 1) for w in shown if "=" in w)
        if fields.get("JobState") in ENDED:
            return int(fields["ExitCode"].split(":")[0]), job, fields["JobState"]
        time.sleep(0.2)
    raise AssertionError(f"Slurm job {job} did not end within 400 s")


def test_a_rank_killed_inside_the_allocation_is_replaced(slurm, tmp_path, reference):
    rc, job, state = sbatch(slurm, tmp_path, "--inject 1@13")
    output = (tmp_path / f"slurm-{job}.out").read_text(errors="replace")
    assert (rc, state) == (0, "COMPLETED"), output
    run_dir = tmp_path / job
    rebuilt = [e for e in read_events(run_dir) if e["event"] == "rebuilt"]
    assert rebuilt and {(e["mode"], tuple(e["failed"])) for e in rebuilt} == {("spare", (1,))}
    assert sorted(o["status"] for o in read_outcomes(run_dir)) == ["finished"] * 4 + ["injected-kill"]
    result = read_result(run_dir)
    assert result["model_sha256"] == reference(("examples/train.py",))["result"]["model_sha256"]


def test_a_job_that_cannot_go_on_ends_failed(slurm, tmp_path):
    rc, job, state = sbatch(slurm, tmp_path, "--rebuild shrink --min-size 4 --inject 2@5")
    assert (rc, state) == (1, "FAILED"), (tmp_path / f"slurm-{job}.out").read_text(errors="replace")
    errors = [o for o in read_outcomes(tmp_path / job) if o["status"] == "error"]
    # The three survivors and the parked spare (it takes part in every rebuild) stop with one reason.
    assert len(errors) == 4 and all("below min_size=4" in o["message"] for o in errors)

"""Shared helpers: run a job through the launcher with a hard timeout and read what every rank wrote."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from elastic.comm import read_events, read_fates, read_outcomes, read_result
from elastic.report import final_steps

ROOT = Path(__file__).resolve().parents[1]
JOB_TIMEOUT = float(os.environ.get("ELASTIC_TEST_JOB_TIMEOUT", "120"))

# tests/mpi/ runs under mpiexec with --with-mpi (see test_multirank.py), not in this process.
collect_ignore = [] if "--with-mpi" in sys.argv else ["mpi"]


@dataclass
class Job:
    rc: int
    output: str
    run_dir: Path

    @property
    def events(self) -> list[dict]:
        return read_events(self.run_dir)

    @property
    def outcomes(self) -> list[dict]:
        return read_outcomes(self.run_dir)

    @property
    def fates(self) -> list[dict]:
        """How each process ended, as its sentinel saw it."""
        return read_fates(self.run_dir)

    @property
    def summary(self) -> dict:
        return json.loads((self.run_dir / "summary.json").read_text())

    @property
    def result(self) -> dict:
        """What the program recorded as its result (``World.record_result``)."""
        result = read_result(self.run_dir)
        assert result is not None, f"the program recorded no result:\n{self.output[-3000:]}"
        return result

    @property
    def has_result(self) -> bool:
        return read_result(self.run_dir) is not None

    def of(self, name: str) -> list[dict]:
        return [e for e in self.events if e["event"] == name]

    def statuses(self) -> list[str]:
        return sorted(o["status"] for o in self.outcomes)


def launch(tmp_path: Path, n: int, *launcher_args: str, program: tuple[str, ...] = ("examples/jacobi.py",),
           env: dict[str, str] | None = None) -> Job:
    """Run ``python -m elastic.launch -n N ... -- python PROGRAM`` with a timeout on both layers."""
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "elastic.launch", "-n", str(n), "--timeout", str(JOB_TIMEOUT),
           "--run-dir", str(run_dir), *launcher_args, "--", sys.executable, *program]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=JOB_TIMEOUT + 30,
                          env={**os.environ, "OPENBLAS_NUM_THREADS": "1", **(env or {})})
    return Job(proc.returncode, proc.stdout + proc.stderr, run_dir)


@pytest.fixture(scope="session")
def reference_hash(tmp_path_factory) -> str:
    """The Jacobi iterate of a failure-free 4-rank run: every recovered run must match it bit for bit."""
    job = launch(tmp_path_factory.mktemp("reference"), 4)
    assert job.rc == 0, job.output
    return job.result["x_sha256"]


@pytest.fixture(scope="session")
def reference(tmp_path_factory):
    """Failure-free 4-rank runs, by program and arguments, computed once each."""
    cache: dict[tuple[str, ...], dict] = {}

    def get(program: tuple[str, ...]) -> dict:
        if program not in cache:
            job = launch(tmp_path_factory.mktemp("reference"), 4, program=program)
            assert job.rc == 0, job.output
            cache[program] = {"result": job.result, "steps": final_steps(job.events)}
        return cache[program]
    return get


def assert_bitwise(job: Job, ref: dict, *keys: str) -> None:
    """The job finished with the model (and ``keys``) bit for bit those of the failure-free run."""
    assert job.rc == 0, job.output
    for key in ("model_sha256",) + keys:
        assert job.result[key] == ref["result"][key], key
    assert job.result["steps"] == ref["result"]["steps"]


def fault(kind: str, rank: int = 1, step: int = 12, always: bool = False) -> dict[str, str]:
    """The environment of tests/programs/faulty_train.py: which bug, on which rank, at which step."""
    return {"FAULT": kind, "FAULT_RANK": str(rank), "FAULT_STEP": str(step), "FAULT_ALWAYS": str(int(always))}

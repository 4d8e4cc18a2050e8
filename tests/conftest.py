"""Shared helpers: run a job through the launcher with a hard timeout and read what every rank wrote."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from elastic import testing
from elastic.report import final_steps
from elastic.testing import Job

ROOT = Path(__file__).resolve().parents[1]
JOB_TIMEOUT = float(os.environ.get("ELASTIC_TEST_JOB_TIMEOUT", "120"))

# tests/mpi/ runs under mpiexec with --with-mpi (see test_multirank.py), not in this process.
collect_ignore = [] if "--with-mpi" in sys.argv else ["mpi"]

WARM_SERVER_ENV = "ELASTIC_WARM_SERVER"
# What the session's warm process imports: libraries only (a program's own modules, which two
# programs may name alike, each job's ranks import themselves).
WARM_MODULES = ("torch.utils.data", "torch.distributed.fsdp", "torch.distributed.checkpoint",
                "torch.distributed.tensor.parallel", "torch.distributed.pipelining", "elastic.distributed",
                "elastic.data", "elastic.mesh", "elastic.pipeline", "transformers", "accelerate")


@pytest.fixture(scope="session", autouse=True)
def warm_server():
    """One warm process for every job this session starts (``ELASTIC_WARM_SERVER``): a job forks its
    ranks from it instead of waiting for a warm process of its own to import torch (~2.5 s a job).
    Launches before it serves start their own; tests of the launcher's own warm process (killed,
    stopped) and campaigns that signal it set the variable empty. Set it empty to turn this off."""
    if WARM_SERVER_ENV in os.environ or "--with-mpi" in sys.argv:
        yield
        return
    path = f"/dev/shm/elastic-tests-{os.getpid()}.sock"
    serve = [sys.executable, "-c", "import sys; from elastic.comm._warm import main; sys.exit(main(sys.argv[1:]))",
             "serve", path, *WARM_MODULES]
    proc = subprocess.Popen(serve, stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, cwd=ROOT, start_new_session=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"})
    os.environ[WARM_SERVER_ENV] = path
    try:
        yield
    finally:
        del os.environ[WARM_SERVER_ENV]
        assert proc.stdin is not None
        proc.stdin.close()  # it ends on its closed input, and removes its socket
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()



def launch(tmp_path: Path, n: int, *launcher_args: str, program: tuple[str, ...] = ("examples/jacobi.py",),
           env: dict[str, str] | None = None) -> Job:
    """Run ``python -m elastic.launch -n N ... -- python PROGRAM`` with a timeout on both layers
    (``elastic.testing.launch``, the plugin users get, with this project's defaults)."""
    return testing.launch(program, n, tmp_path / "run", launcher_args, timeout=JOB_TIMEOUT, env=env, cwd=ROOT)


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

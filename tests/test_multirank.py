"""Runs tests/mpi under mpiexec --with-ft ulfm at 4 ranks and requires every rank to pass."""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys

from conftest import ROOT


def test_pytest_mpi_suite_at_four_ranks():
    cmd = [shutil.which("mpiexec"), "--with-ft", "ulfm", "--oversubscribe", "-n", "4",
           sys.executable, "-m", "pytest", "--with-mpi", "-q", "-p", "no:cacheprovider", "tests/mpi"]
    if os.geteuid() == 0:
        cmd.insert(1, "--allow-run-as-root")
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=180)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    passed = [int(n) for n in re.findall(r"(\d+) passed", out)]
    assert passed == [13, 13, 13, 13], out  # each rank ran and passed all thirteen tests
    assert "failed" not in out and "skipped" not in out, out


def test_a_test_failing_on_one_rank_ends_the_job_instead_of_hanging_it():
    """A user's pytest-mpi suite where rank 1 fails before a Barrier rank 0 already waits in: the
    plugin (elastic.testing) prints rank 1's failure and aborts; without it this hangs until the
    timeout (checked with --mpi-keep-going when the plugin was written)."""
    cmd = [shutil.which("mpiexec"), "--with-ft", "ulfm", "--oversubscribe", "-n", "2",
           sys.executable, "-m", "pytest", "--with-mpi", "-q", "-p", "no:cacheprovider",
           "tests/programs/user_mpi_suite.py"]
    if os.geteuid() == 0:
        cmd.insert(1, "--allow-run-as-root")
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out
    assert "[elastic.testing] rank 1: tests/programs/user_mpi_suite.py::test_fails_on_one_rank_only failed" in out
    assert "rank 1 disagrees" in out and "MPI_ABORT was invoked on rank 1" in out, out

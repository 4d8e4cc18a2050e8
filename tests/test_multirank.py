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
    assert passed == [5, 5, 5, 5], out  # each rank ran and passed all five tests
    assert "failed" not in out and "skipped" not in out, out

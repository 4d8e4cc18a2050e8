"""Test your own programs as ulfm-elastic tests itself: run them through the launcher with
injected failures and a bound, then look at what every process did.

    def test_training_survives_a_kill(elastic_launch):
        job = elastic_launch(["train.py", "--steps", "30"], n=4, args=["--spares", "1", "--inject", "1@12"])
        assert job.rc == 0, job.output
        assert [e["mode"] for e in job.of("rebuilt")] == ["spare"]
        assert job.result["model_sha256"] == EXPECTED

A pytest plugin (entry point ``elastic``): once ulfm-elastic is installed the
``elastic_launch`` fixture is there in every test. Each job runs under
``python -m elastic.launch`` with ``--timeout`` and a subprocess timeout above
it, so a hang fails the test instead of stalling the suite. ``Job`` gives the
launcher's exit status and output, and the run directory's events, outcomes,
sentinel fates and the program's result (its ``result`` event:
``world.events.emit("result", ...)``).

Multi-rank pytest-mpi suites (``mpiexec --with-ft ulfm -n N python -m pytest
--with-mpi``): a test that fails on some ranks only would leave the others
waiting in their next collective for ever. The plugin prints the failure with
the rank that had it and aborts the job (``MPI_Abort``), so the suite ends
with a non-zero status instead of hanging. ``--mpi-keep-going`` turns it off.

Recovery logic without processes: ``SimJob`` runs N ranks as threads over an
in-memory fabric (no MPI, milliseconds), with the same fault schedule, store,
``State``, ``elastic.run`` and rebuild policy::

    def test_my_loop_survives_a_kill():
        job = SimJob(4, spares=1, inject="1@3")
        results = job.run(main)            # main(world) on every rank and each replacement
        assert [e["mode"] for e in job.of("rebuilt")] == ["spare"]
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Generator, Mapping, Sequence

import pytest

from elastic._sim import SimJob, SimRank
from elastic.comm.events import read_events, read_fates, read_outcomes, read_result

__all__ = ["Job", "launch", "elastic_launch", "SimJob", "SimRank"]

DEFAULT_TIMEOUT = float(os.environ.get("ELASTIC_TEST_JOB_TIMEOUT", "120"))


@dataclass
class Job:
    """A finished job: the launcher's exit status and output, and what every process recorded."""

    rc: int
    output: str
    run_dir: Path

    @property
    def events(self) -> list[dict]:
        """Every process's events, by time."""
        return read_events(self.run_dir)

    @property
    def outcomes(self) -> list[dict]:
        """Each process's own account of how it ended (a killed one has none)."""
        return read_outcomes(self.run_dir)

    @property
    def fates(self) -> list[dict]:
        """How each process ended, as its sentinel saw it."""
        return read_fates(self.run_dir)

    @property
    def summary(self) -> dict:
        """The launcher's summary (``summary.json``)."""
        return json.loads((self.run_dir / "summary.json").read_text())

    @property
    def result(self) -> dict:
        """What the program recorded as its result (its ``result`` event); fails the test if none."""
        result = read_result(self.run_dir)
        assert result is not None, f"the program recorded no result:\n{self.output[-3000:]}"
        return result

    @property
    def has_result(self) -> bool:
        return read_result(self.run_dir) is not None

    def of(self, name: str) -> list[dict]:
        """The events called ``name``."""
        return [e for e in self.events if e["event"] == name]

    def statuses(self) -> list[str]:
        return sorted(o["status"] for o in self.outcomes)


def launch(program: Sequence[str], n: int, run_dir: Path, args: Sequence[str] = (), *,
           timeout: float = DEFAULT_TIMEOUT, env: Mapping[str, str] | None = None,
           cwd: str | os.PathLike[str] | None = None) -> Job:
    """Run ``python -m elastic.launch -n N ARGS -- python PROGRAM`` with a bound on both layers.

    ``program``: the script and its arguments (run with this Python); ``args``: launcher
    options (``--spares 1``, ``--rebuild shrink``, ``--inject 1@12``, ...).
    """
    cmd = [sys.executable, "-m", "elastic.launch", "-n", str(n), "--timeout", str(timeout),
           "--run-dir", str(run_dir), *args, "--", sys.executable, *program]
    proc = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=timeout + 30,
                          env={**os.environ, "OPENBLAS_NUM_THREADS": "1", **(env or {})})
    return Job(proc.returncode, proc.stdout + proc.stderr, Path(run_dir))


@pytest.fixture
def elastic_launch(tmp_path: Path) -> Callable[..., Job]:
    """``elastic_launch(program, n=4, args=(...), timeout=..., env=...)``: one job per call, each
    in its own run directory under the test's ``tmp_path``."""
    count = iter(range(1 << 30))

    def run(program: Sequence[str], n: int = 4, args: Sequence[str] = (), **kwargs) -> Job:
        return launch(program, n, tmp_path / f"run-{next(count)}", args, **kwargs)
    return run


# ------------------------------------------------------------------ pytest-mpi suites
def pytest_addoption(parser: pytest.Parser) -> None:
    parser.getgroup("elastic").addoption(
        "--mpi-keep-going", action="store_true",
        help="under mpiexec with --with-mpi: do not abort the job when a test fails on a rank "
             "(the other ranks may then wait for it for ever)")


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo) -> Generator[None, pytest.TestReport,
                                                                                     pytest.TestReport]:
    report = yield
    if not report.failed or not _in_a_multirank_suite(item.config):
        return report
    rank = os.environ.get("OMPI_COMM_WORLD_RANK") or os.environ.get("PMI_RANK") or "?"
    sys.stderr.write(f"\n[elastic.testing] rank {rank}: {item.nodeid} failed ({report.when}); aborting the job, "
                     f"whose other ranks would wait for this one (--mpi-keep-going: do not)\n"
                     f"{report.longreprtext}\n")
    sys.stderr.flush()
    from mpi4py import MPI
    MPI.COMM_WORLD.Abort(1)
    return report  # not reached


def _in_a_multirank_suite(config: pytest.Config) -> bool:
    size = os.environ.get("OMPI_COMM_WORLD_SIZE") or os.environ.get("PMI_SIZE") or "1"
    return bool(config.getoption("with_mpi", default=False)) and not config.getoption("mpi_keep_going") \
        and int(size) > 1

"""A user's pytest-mpi suite in which one test fails on rank 1 only, before a collective that
the other ranks are already waiting in (for test_multirank: the job must end, not hang)."""
from __future__ import annotations

import pytest
from mpi4py import MPI


@pytest.mark.mpi(min_size=2)
def test_fails_on_one_rank_only():
    comm = MPI.COMM_WORLD
    assert comm.Get_rank() != 1, "rank 1 disagrees"
    comm.Barrier()


@pytest.mark.mpi(min_size=2)
def test_after_it():
    MPI.COMM_WORLD.Barrier()

"""Multi-rank tests without failures, run at any -n by pytest-mpi:

    mpiexec --with-ft ulfm -n 4 python -m pytest --with-mpi tests/mpi
"""
from __future__ import annotations

import numpy as np
import pytest
from mpi4py import MPI

import elastic
from elastic.comm import ProcessFailure
from elastic.comm._errors import mpi_errors


@pytest.mark.mpi(min_size=2)
def test_initial_world_maps_logical_to_current(world):
    assert world.generation == 0 and world.role is elastic.Role.INITIAL
    assert world.size == MPI.COMM_WORLD.Get_size()
    assert int(world.logical_rank) == int(world.rank) == MPI.COMM_WORLD.Get_rank()
    assert world.logical_ranks == tuple(range(world.size))
    assert world.logical_ranks.index(world.size - 1) == world.size - 1
    assert world.job.first_survivor == 0


@pytest.mark.mpi(min_size=2)
def test_local_rank_and_torchrun_variables(world):
    import os

    # One host here: every rank on it, numbered by logical rank (Open MPI's own local numbering
    # follows its mapping, not the ranks), and torchrun's variables in current ranks.
    assert world.job.local_size == int(os.environ["OMPI_COMM_WORLD_LOCAL_SIZE"]) == world.size
    assert world.job.local_rank == int(world.logical_rank)
    assert (os.environ["RANK"], os.environ["WORLD_SIZE"]) == (str(world.rank), str(world.size))
    assert (os.environ["LOCAL_RANK"], os.environ["LOCAL_WORLD_SIZE"]) == \
        (str(world.job.local_rank), str(world.job.local_size))
    assert str(elastic.device(world)) == "cpu"


@pytest.mark.mpi(min_size=2)
def test_allgather_over_the_active_comm(world):
    out = np.empty((world.size, 3))
    world.mpi.Allgather(np.full(3, float(world.rank)), out, step=0)
    assert (out == np.arange(world.size)[:, None]).all()


@pytest.mark.mpi(min_size=2)
def test_revocation_reaches_every_rank_as_process_failure(world):
    comm = world.mpi.comm.Dup()
    comm.Set_errhandler(MPI.ERRORS_RETURN)
    # Revoking while a peer is still inside Dup crashes Open MPI 5.0 (seen here): let everyone finish it.
    # The wait is on another communicator: a barrier on `comm` itself can still be running on one rank
    # when rank 0 leaves it and revokes (seen here, about one run in three).
    world.vote(True)
    if comm.Get_rank() == 0:
        comm.Revoke()
    with pytest.raises(ProcessFailure):
        with mpi_errors(comm):
            comm.Barrier()
    assert comm.Is_revoked()
    # What a rebuild runs on a revoked communicator still works: the agreement, and the shrink (nobody died).
    assert comm.Agree(1) == 1
    assert comm.Shrink().Get_size() == comm.Get_size()


@pytest.mark.mpi(min_size=2)
def test_no_communicator_of_the_library_aborts_on_an_error(world):
    """MPI_ERRORS_ARE_FATAL anywhere would turn a peer's death into this rank's abort: every
    communicator the library uses, and COMM_SELF (what an MPI call with no communicator, such as
    a request's completion, reports to), return errors instead."""
    for comm in (MPI.COMM_SELF, MPI.COMM_WORLD, world.mpi.comm, world.mpi.universe):
        assert comm.Get_errhandler() == MPI.ERRORS_RETURN, comm


@pytest.mark.mpi(min_size=2)
def test_the_old_name_of_neighbors_still_works_and_says_the_new_one(world):
    n, r = world.size, world.rank
    got = np.zeros(2)
    with pytest.warns(DeprecationWarning, match=r"world.mpi.neighbors is world.neighbors now"):
        world.mpi.neighbors([((r + 1) % n, 3, np.full(2, float(r)))], [((r - 1) % n, 3, got)])
    assert got.tolist() == [float((r - 1) % n)] * 2


@pytest.mark.mpi(min_size=2)
def test_an_exchange_with_a_known_plan_moves_the_same_bytes_and_refuses_a_plan_that_differs(world):
    """``exchange(known=True)``: point to point, no counts exchanged. Each rank sends its right-hand
    neighbour three arrays that the receiver takes into two (the bytes cross the arrays' bounds, as
    a payload's fields cross a parity segment's); a receiver that expects more than is sent says so."""
    from elastic.comm import Unrecoverable

    n, me = world.size, int(world.logical_rank)
    right, left = (me + 1) % n, (me - 1) % n
    sent = [np.full(5, me, np.uint8), np.arange(7, dtype=np.uint8) + me, np.full(4, 200 + me, np.uint8)]
    into = [np.zeros(9, np.uint8), np.zeros(7, np.uint8)]
    assert world.exchange({right: sent}, {left: into}, known=True) == 16
    assert np.array_equal(np.concatenate(into), np.concatenate(
        [np.full(5, left), np.arange(7) + left, np.full(4, 200 + left)]).astype(np.uint8))
    world.vote(True)
    with pytest.raises(Unrecoverable, match="transfer plan differs across ranks"):
        world.exchange({right: sent}, {left: [np.zeros(20, np.uint8)]}, known=True)  # 16 bytes arrive, 20 expected

"""The communicator programs get from ``world.mpi.comm``: mpi4py's, with a fault-safe send-receive.

Open MPI's blocking ``MPI_Sendrecv`` against a peer that dies has crashed survivors inside the
library (seen in ``PMPI_Sendrecv``: the process dies instead of the call returning
``MPI_ERR_PROC_FAILED``), and a survivor waiting in it for a peer that began a recovery has
nothing to end the wait. Posted as a non-blocking pair and waited for together, the same exchange
fails cleanly: the dead peer or the peer's revoke ends the wait with an error the World's
``guard()`` turns into ``ProcessFailure``. Every other call is mpi4py's own.

A reproducer of the crash (Open MPI 5.0.x, ``mpiexec --with-ft ulfm -n 4``): every rank loops
``comm.Sendrecv(a, dest=(r + 1) % n, recvbuf=b, source=(r - 1) % n)`` with the communicator's
error handler ``ERRORS_RETURN``, and rank 1 is SIGKILLed; now and then (2 of 23 kills here) rank
0 or 2 dies with it, inside ``PMPI_Sendrecv``, instead of raising. Imports MPI (loaded by ``World``).
"""
from __future__ import annotations

from typing import Any

from mpi4py import MPI


class HaloComm(MPI.Intracomm):
    """``world.mpi.comm``: the active ranks' communicator of this generation (the same handle)."""

    def Sendrecv(self, sendbuf: Any, dest: int, sendtag: int = 0, recvbuf: Any = None,  # noqa: N802
                 source: int = MPI.ANY_SOURCE, recvtag: int = MPI.ANY_TAG, status: MPI.Status | None = None) -> None:
        """Send ``sendbuf`` to ``dest`` and receive into ``recvbuf`` from ``source`` (as mpi4py's),
        as ``Irecv`` + ``Isend`` waited for together: a failure ends it with an error, never a crash."""
        requests = [self.Irecv(recvbuf, source, recvtag), self.Isend(sendbuf, dest, sendtag)]
        MPI.Request.Waitall(requests, None if status is None else [status, MPI.Status()])

    def sendrecv(self, sendobj: Any, dest: int, sendtag: int = 0, recvbuf: Any = None,
                 source: int = MPI.ANY_SOURCE, recvtag: int = MPI.ANY_TAG, status: MPI.Status | None = None) -> Any:
        """mpi4py's object send-receive (the program's own pickling), as a non-blocking pair."""
        received = self.irecv(recvbuf, source, recvtag)
        sent = self.isend(sendobj, dest, sendtag)
        obj = received.wait(status)
        sent.wait()
        return obj

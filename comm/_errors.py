"""The project's exceptions, split by how the caller recovers, and the one place
where MPI errors become them."""
from __future__ import annotations

import contextlib
from typing import Iterator

from mpi4py import MPI


class ElasticError(Exception):
    """Base of every error this framework raises."""


class ProcessFailure(ElasticError):
    """A peer died or the communicator was revoked: call ``World.recover()`` on every survivor."""

    def __init__(self, message: str, error_class: int | None = None) -> None:
        super().__init__(message)
        self.error_class = error_class


class Unrecoverable(ElasticError):
    """The job cannot continue: too few ranks left, no way to rebuild, or a broken MPI."""


class UlfmUnavailable(Unrecoverable):
    """The MPI library or the launch lacks ULFM fault tolerance."""


class ConfigError(ElasticError, ValueError):
    """A configuration value is wrong; the message says what to set instead."""


# Error classes that mean "membership changed": recover, do not crash.
_FAILURE_CLASSES = frozenset({MPI.ERR_PROC_FAILED, MPI.ERR_PROC_FAILED_PENDING, MPI.ERR_REVOKED})


def translate(exc: MPI.Exception, comm: MPI.Comm | None = None) -> ElasticError:
    """Map an mpi4py error to the project's exception (local, no communication).

    ULFM sometimes reports a dead peer inside a collective as ERR_OTHER (seen
    with Open MPI 5 barriers), and ``Waitall`` over requests one of which met
    the failure as ERR_IN_STATUS; when ``comm`` already knows of a failed
    process (or is revoked) such an error is treated as a process failure too.
    """
    cls = exc.Get_error_class()
    if cls in _FAILURE_CLASSES:
        return ProcessFailure(f"MPI reported a process failure: {exc.Get_error_string()}", cls)
    if comm is not None and cls in (MPI.ERR_OTHER, MPI.ERR_IN_STATUS):
        try:
            if comm.Is_revoked() or comm.Get_failed().Get_size() > 0:
                return ProcessFailure(f"MPI error with a failed peer: {exc.Get_error_string()}", cls)
        except MPI.Exception:
            pass
    return Unrecoverable(f"MPI error {cls}: {exc.Get_error_string()}")


@contextlib.contextmanager
def mpi_errors(comm: MPI.Comm | None = None) -> Iterator[None]:
    """Run MPI calls, re-raising their errors as the project's exceptions."""
    try:
        yield
    except MPI.Exception as exc:
        raise translate(exc, comm) from exc

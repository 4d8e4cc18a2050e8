"""The project's exceptions, split by how the caller recovers, and the one place
where MPI errors become them.

Two ways an error can end a process, told apart by ``is_agreed``:

* agreed: raised on every process of the job alike, after a vote (``Unrecoverable``
  when the policy cannot go on, ``DataLost``, a commit refused). Every process
  then leaves together and the job stops with that error.
* anything else (a bug in one rank, ``sys.exit``, an injected fault): this
  process's own failure. It leaves at once in a way the others detect, and
  they recover from it as from a kill.
"""
from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Iterator, TypeVar

if TYPE_CHECKING:
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
    """A configuration value is wrong; the message says what to set instead. The errors below are
    kinds of it, split by what the caller does next (``except ConfigError`` still catches them)."""


class ProtocolError(ConfigError):
    """A message another process sent is not one this version wrote: every process of the job must
    run the same ulfm-elastic."""


E = TypeVar("E", bound=BaseException)
# The last agreed error that ended the job here: even if the program catches it and ends
# quietly, the job is over, so the process must leave together with the others.
last_agreed: list[BaseException] = []


def agreed(exc: E, final: bool = True) -> E:
    """Mark ``exc`` as raised on every process alike (local): ``raise elastic.agreed(MyError(...))``.

    For errors every rank decides the same way from data they all hold (a
    loss that is NaN after the all-reduce, a plan computed from the agreed
    rebuild): uncaught, they end the job together with exit status 1, instead
    of each counting as that rank's own failure to recover from.

    ``final``: the job cannot go on (not so for a refused commit, which a
    program may catch and then train on from the last version).
    """
    exc.elastic_agreed = True  # type: ignore[attr-defined]
    if final:
        last_agreed[:] = [exc]
    return exc


def is_agreed(exc: BaseException) -> bool:
    return bool(getattr(exc, "elastic_agreed", False))


def translate(exc: "MPI.Exception", comm: "MPI.Comm | None" = None) -> ElasticError:
    """Map an mpi4py error to the project's exception (local, no communication).

    ULFM sometimes reports a dead peer inside a collective as ERR_OTHER (seen
    with Open MPI 5 barriers), and ``Waitall`` over requests one of which met
    the failure as ERR_IN_STATUS; when ``comm`` already knows of a failed
    process (or is revoked) such an error is treated as a process failure too.
    """
    from mpi4py import MPI

    cls = exc.Get_error_class()
    if cls in (MPI.ERR_PROC_FAILED, MPI.ERR_PROC_FAILED_PENDING, MPI.ERR_REVOKED):
        return ProcessFailure(f"MPI reported a process failure: {exc.Get_error_string()}", cls)
    if comm is not None and cls in (MPI.ERR_OTHER, MPI.ERR_IN_STATUS):
        try:
            if comm.Is_revoked() or comm.Get_failed().Get_size() > 0:
                return ProcessFailure(f"MPI error with a failed peer: {exc.Get_error_string()}", cls)
        except MPI.Exception:
            pass
    return Unrecoverable(f"MPI error {cls}: {exc.Get_error_string()}")


@contextlib.contextmanager
def mpi_errors(comm: "MPI.Comm | None" = None) -> Iterator[None]:
    """Run MPI calls, re-raising their errors as the project's exceptions."""
    from mpi4py import MPI

    try:
        yield
    except MPI.Exception as exc:
        raise translate(exc, comm) from exc

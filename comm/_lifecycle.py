"""How a process of the job ends: together with the others, or alone and at once.

Every end falls in one of two cases (see ``_errors``):

* **together** -- the job finished (``World.finish()``), a parked spare was
  released, or an agreed error stops every process alike. The processes meet in
  a last ULFM ``Agree`` on the universe, acknowledging and skipping any process
  that dies meanwhile (a parked spare that died, a rank lost after the vote);
  the lowest live active rank releases the parked spares, again after every
  change, so a dead rank 0 cannot leave them waiting. Then ``MPI_Finalize`` if
  the job never saw a failure, else ``os._exit`` (``MPI_Finalize`` can hang
  after failures, ompi #11404). This runs as an ``atexit`` handler registered
  when ``elastic.comm`` is imported, so the program's own handlers registered
  after that (a logger's flush, ``wandb``, ``SummaryWriter.close``) run first,
  survivors of a failure included.
* **alone** -- anything else: an exception in this process only, ``sys.exit``
  or the end of the program before ``finish()``. The error is written to the
  events and to this process's outcome, then the process kills itself with
  SIGKILL, which the survivors detect within milliseconds and recover from
  exactly as from a crash. Leaving cleanly instead would let the others wait
  forever (a clean ``MPI_Finalize`` is not a failure to ULFM).
"""
from __future__ import annotations

import atexit
import logging
import os
import signal
import sys
import traceback
from typing import TYPE_CHECKING, Any, Protocol

from ._errors import is_agreed, last_agreed
from .events import EventLog
from ._watchdog import Watchdog

if TYPE_CHECKING:  # importing elastic.comm must not initialize MPI
    from mpi4py import MPI

_installed: list["Lifecycle"] = []
TRACEBACK_LINES = 20  # of a failed rank's traceback, kept in its outcome for the launcher to show


def _program_traceback(kind: type[BaseException], exc: BaseException, tb: Any) -> list[str]:
    """The last lines of a traceback, the program's frames only (not this library's, nor runpy's,
    which every rank shares) unless the error arose in the library."""
    ours = {getattr(m, "__file__", None) for name, m in list(sys.modules.items())
            if name.split(".")[0] in ("elastic", "runpy")}
    frames = traceback.extract_tb(tb)
    mine = [f for f in frames if f.filename not in ours and not f.filename.startswith("<frozen")] or frames
    text = "".join(traceback.format_list(mine) + traceback.format_exception_only(kind, exc))
    return text.rstrip().splitlines()[-TRACEBACK_LINES:]


@atexit.register  # at import: the program's own atexit handlers, registered later, run before this one
def _leave_at_exit() -> None:
    if _installed:
        _installed[-1]._at_exit()


class Host(Protocol):
    """What the exit paths need of the process's World (its internals, comm's own; read-only, and
    the spares' release)."""

    @property
    def events(self) -> EventLog: ...
    @property
    def _watchdog(self) -> Watchdog: ...
    @property
    def _step(self) -> int | None: ...
    @property
    def _failures_seen(self) -> bool: ...
    @property
    def _universe(self) -> "MPI.Intracomm": ...

    def _release_spares(self) -> None: ...


class Lifecycle:
    """The exit paths of one process (local, except ``leave_together``: collective over the universe)."""

    def __init__(self, world: Host) -> None:
        self._world = world
        self.finished = False      # finish() done, or a spare released: leave together, exit 0
        self.stopped = False       # an agreed error ends the job: leave together, exit 1
        self.after_finish = False
        self._recorded = False     # this process's outcome says how it ends (an injection, an error)
        self._left = False

    def install(self) -> None:
        import faulthandler
        _installed.append(self)
        sys.excepthook = self._excepthook
        if signal.getsignal(signal.SIGUSR1) is signal.SIG_DFL:
            # The sentinel sends SIGUSR1 before killing a rank that made no progress: say where it was.
            faulthandler.register(signal.SIGUSR1, all_threads=True)

    def injected(self) -> None:
        """An injected fault recorded this process's outcome already."""
        self._recorded = True

    # ------------------------------------------------------------------ alone
    def fail(self, kind: str, message: str, trace: list[str] | None = None) -> None:
        """Record this process's own failure (``trace``: the last lines of its traceback, which the
        launcher shows once), then die so that the others see it at once. Never returns."""
        world = self._world
        step = world._step
        if not self._recorded:
            fields: dict[str, Any] = {"kind": kind, "message": message, "step": step}
            if trace:
                fields["traceback"] = trace
            if self.finished:
                fields["after_finish"] = True
            world.events.emit("error", scope="rank", **fields)
            world.events.write_outcome("failed", **fields)
        sys.stdout.flush()
        sys.stderr.flush()
        os.kill(os.getpid(), signal.SIGKILL)

    # --------------------------------------------------------------- together
    def stop(self, exc: BaseException) -> None:
        """An agreed error ends the job on every process: record it; leave together at exit."""
        if not self.stopped and not self._recorded:
            name, message = type(exc).__name__, str(exc)
            self._world.events.emit("error", scope="job", kind=name, message=message)
            self._world.events.write_outcome("error", kind=name, message=message)
        self.stopped = True

    def leave_together(self, code: int) -> None:
        """Meet every live process of the job in a last agreement, then go (collective over the universe).

        Returns (after ``MPI_Finalize``) only when the job never saw a failure and no sentinel
        watches this process; otherwise ends the process with ``code``.
        """
        from mpi4py import MPI

        world = self._world
        self._left = True
        world._watchdog.watch_progress(False)
        failures = world._failures_seen
        universe = world._universe
        while True:
            world._release_spares()
            try:
                universe.Agree(1)
                break
            except MPI.Exception as exc:
                if exc.Get_error_class() not in (MPI.ERR_PROC_FAILED, MPI.ERR_PROC_FAILED_PENDING):
                    break  # nothing more can be agreed with a broken MPI; leave anyway
                failures = True
                universe.Ack_failed()
        world._watchdog.announce_exit(code)
        if not failures and not MPI.Is_finalized():  # ourselves: whoever initialized MPI, leave it cleanly
            MPI.Finalize()
        if failures or world._watchdog.active:
            # Under a sentinel, which passes the announced code on, go without the interpreter's
            # teardown too: with torch loaded, freeing every module costs a noticeable share of a short
            # job's wall time (docs/measurements.md) and nothing in it concerns the job; what
            # would matter, flushing, is done here. Without one the program's own exit status
            # (a pytest-mpi suite's) must come through: return.
            logging.shutdown()
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)

    # ------------------------------------------------------------------ hooks
    def _excepthook(self, kind: type[BaseException], exc: BaseException, tb: Any) -> None:
        sys.__excepthook__(kind, exc, tb)
        if is_agreed(exc):
            self.stop(exc)
        elif not self._left:
            self.fail(kind.__name__, str(exc) or kind.__name__, _program_traceback(kind, exc, tb))

    def _at_exit(self) -> None:
        if self._left:
            return
        if self.stopped:
            self.leave_together(1)
        elif self.finished:
            self.leave_together(0)
        elif last_agreed:  # the program caught an agreed error and ended: the job stops all the same
            self.stop(last_agreed[0])
            self.leave_together(1)
        else:
            self.fail("SystemExit", "the program ended (sys.exit, or the end of the script) before "
                      "world.finish(): every rank must call finish(), or return from the function that "
                      "elastic.run wraps")

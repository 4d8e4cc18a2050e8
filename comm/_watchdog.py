"""This process's side of the sentinel (``elastic._sentinel``): heartbeats, progress, deadlines.

Under the launcher every rank runs as the child of a small sentinel process,
which is what the MPI runtime started. The sentinel turns every way the rank
can end or stall into a death the runtime reports to ULFM (a SIGKILL of the
sentinel itself), and writes down how the rank ended:

* liveness: a daemon thread here writes a heartbeat every ``BEAT_SECONDS``,
  whatever the user's code is doing (mpi4py releases the GIL inside MPI
  calls). A SIGSTOPped or frozen process stops beating; after
  ``ELASTIC_HANG_TIMEOUT`` seconds the sentinel kills it.
* progress: ``progress(step)`` marks that the loop moved on. With
  ``ELASTIC_PROGRESS_TIMEOUT`` set, a rank that is alive but makes no progress
  for that long (a deadlock, a stuck read) is killed too; parked spares and
  finished ranks are exempt.
* a one-shot deadline: ``deadline(seconds)`` ... ``deadline(None)`` bounds one
  operation (a spawned process joining its parents).
* exit: ``announce_exit(code)`` says the process is about to leave on purpose;
  any other end (``os._exit``, a native ``exit()``, a signal) is a failure.

The protocol is one text line per message on a pipe whose write end is
``ELASTIC_SENTINEL_FD``. Without a sentinel every call is a no-op.
"""
from __future__ import annotations

import os
import signal
import threading
import time

SENTINEL_FD_ENV = "ELASTIC_SENTINEL_FD"
BEAT_SECONDS = 0.5
_PROGRESS_EVERY = 0.2  # seconds: progress lines are rate-limited, a step can take microseconds


class Watchdog:
    """The link to this process's sentinel (local; thread-safe: each message is one write)."""

    def __init__(self, fd: int | None) -> None:
        self._fd = fd
        self._last_progress = 0.0
        self._step: int | None = None
        self._thread: threading.Thread | None = None

    @classmethod
    def from_env(cls) -> "Watchdog":
        text = os.environ.get(SENTINEL_FD_ENV)
        return cls(int(text) if text and text.isdigit() else None)

    @property
    def active(self) -> bool:
        """True when a sentinel watches this process."""
        return self._fd is not None

    def start(self) -> None:
        """Start the heartbeat thread (idempotent)."""
        if self._fd is None or self._thread is not None:
            return
        self._thread = threading.Thread(target=self._beat, name="elastic-heartbeat", daemon=True)
        self._thread.start()

    def progress(self, step: int | None = None) -> None:
        """The loop moved on (``step``: where it is now, recorded when this process dies).

        A new step is always sent (the sentinel must know the exact step of a
        death); other progress at most every ``_PROGRESS_EVERY`` seconds.
        """
        now = time.monotonic()
        if (step is not None and step != self._step) or now - self._last_progress >= _PROGRESS_EVERY:
            self._step = self._step if step is None else step
            self._last_progress = now
            self._send(f"progress {'-' if self._step is None else self._step}")

    def watch_progress(self, on: bool) -> None:
        """Arm (active rank) or disarm (parked spare, finished) the progress timeout."""
        self._send("arm" if on else "disarm")

    def deadline(self, seconds: float | None) -> None:
        """Kill this process unless ``deadline(None)`` comes within ``seconds``."""
        self._send("deadline off" if seconds is None else f"deadline {seconds:.3f}")

    def announce_exit(self, code: int) -> None:
        """This process leaves on purpose with ``code``; the sentinel then passes the code on."""
        self._send(f"exit {code}")

    def _beat(self) -> None:
        while self._send("beat"):
            time.sleep(BEAT_SECONDS)

    def _send(self, line: str) -> bool:
        if self._fd is None:
            return False
        try:
            os.write(self._fd, (line + "\n").encode())
            return True
        except OSError:
            # The sentinel is gone: the runtime already counts this rank as dead, so it must
            # not go on as a process nobody waits for.
            os.kill(os.getpid(), signal.SIGKILL)
            return False

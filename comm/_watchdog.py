"""This process's side of the sentinel (``elastic.comm._sentinel``): heartbeat, progress, deadlines.

Under the launcher every rank runs as the child of a small sentinel process,
which is what the MPI runtime started. The sentinel turns every way the rank
can end or stall into a death the runtime reports to ULFM, and writes down how
the rank ended. What it needs to know, this process writes into a page of
memory the two share (``ELASTIC_SENTINEL_FD``), so that telling it costs no
system call, even once per step:

* ``beat``: a daemon thread here counts up every ``BEAT_SECONDS`` whatever the
  user's code is doing (mpi4py releases the GIL inside MPI calls). A
  SIGSTOPped or frozen process stops counting; after ``ELASTIC_HANG_TIMEOUT``
  seconds the sentinel kills it.
* ``progress`` / ``step``: the loop moved on, and where it is. With
  ``ELASTIC_PROGRESS_TIMEOUT`` set, a rank that is alive but makes no progress
  for that long (a deadlock, a read that never returns) is killed.
* ``waiting``: inside an MPI call of the library (``world.mpi.guard()``). A rank
  waiting there for a stuck peer is a victim, not the culprit: it gets twice
  the progress timeout, so the stuck rank dies first and the others recover.
* ``armed``: parked spares and finished ranks are exempt from the progress timeout.
* ``deadline``: a one-shot bound on one operation (a spawned process joining).
* ``exit``: the process is about to leave on purpose, with this code; any other
  end (``os._exit``, a native ``exit()``, a signal) is a failure.
* ``bound_ms`` (written by the sentinel): how long the sentinel may stay stopped
  (SIGSTOP) before the heartbeat thread here kills it. The runtime watches the
  sentinel, not this process, so a stopped sentinel would hide any end of this
  one; killed, it takes this process with it (its parent-death signal) and the
  survivors see one failure.

Without a sentinel every call is a no-op.
"""
from __future__ import annotations

import contextlib
import mmap
import os
import signal
import struct
import threading
import time
from typing import Iterator

from .events import write_fate

SENTINEL_FD_ENV = "ELASTIC_SENTINEL_FD"
SENTINEL_PID_ENV = "ELASTIC_SENTINEL_PID"
WARM_CHILD_ENV = "ELASTIC_WARM_CHILD"  # set in a rank a warm process forked: the pid of its sentinel
WARM_HOST_ENV = "ELASTIC_WARM_HOST"  # and the host of the warm process that forked it
BEAT_SECONDS = 0.5
STOPPED_SENTINEL_SECONDS = 10.0  # how long a sentinel may stay stopped when the heartbeat bound is off
PAGE = 4096
# Slots of the shared page, one signed 64-bit integer each.
SLOTS = ("beat", "progress", "step", "waiting", "armed", "deadline", "exit", "bound_ms")
_UNSET = -(1 << 62)  # "no step", "no deadline", "no exit" (every slot starts at 0: written at start)


class Page:
    """The page both processes map: named 64-bit slots (local; a slot is written by one side only)."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self._map = mmap.mmap(fd, PAGE)

    @classmethod
    def create(cls) -> "Page":
        fd = os.memfd_create("elastic-sentinel") if hasattr(os, "memfd_create") else _temp_fd()
        os.ftruncate(fd, PAGE)
        page = cls(fd)
        for name in ("step", "deadline", "exit"):
            page[name] = _UNSET
        return page

    def __getitem__(self, name: str) -> int:
        value: int = struct.unpack_from("q", self._map, 8 * SLOTS.index(name))[0]
        return value

    def __setitem__(self, name: str, value: int) -> None:
        struct.pack_into("q", self._map, 8 * SLOTS.index(name), value)

    def read(self) -> dict[str, int | None]:
        values = struct.unpack_from(f"{len(SLOTS)}q", self._map, 0)
        return {name: (None if v == _UNSET else v) for name, v in zip(SLOTS, values)}


def _temp_fd() -> int:
    import tempfile
    fd, path = tempfile.mkstemp(prefix="elastic-sentinel-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    os.unlink(path)
    return fd


class Watchdog:
    """The link to this process's sentinel (local; every method is a few stores into shared memory)."""

    def __init__(self, page: Page | None, sentinel_pid: int | None) -> None:
        self._page = page
        self._sentinel = sentinel_pid
        self._thread: threading.Thread | None = None
        self._run_dir: str | None = None

    @classmethod
    def from_env(cls) -> "Watchdog":
        fd, pid = os.environ.get(SENTINEL_FD_ENV, ""), os.environ.get(SENTINEL_PID_ENV, "")
        # A sentinel starts its program (its parent), or has a warm process fork it (``_warm``: its
        # parent is the warm process, which says whose it is).
        mine = pid.isdigit() and (int(pid) == os.getppid() or os.environ.get(WARM_CHILD_ENV) == pid)
        if not (fd.isdigit() and mine):
            return cls(None, None)  # no sentinel, or the variables leaked into a process it did not start
        return cls(Page(int(fd)), int(pid))

    def adopt_env(self) -> None:
        """Read the sentinel's variables again (a warm process's fork: this object was made before
        the child had them)."""
        fresh = Watchdog.from_env()
        self._page, self._sentinel = fresh._page, fresh._sentinel

    @property
    def active(self) -> bool:
        """True when a sentinel watches this process."""
        return self._page is not None

    @property
    def sentinel_pid(self) -> int | None:
        """The sentinel's pid (the process the runtime started for this rank), if one watches."""
        return self._sentinel

    def start(self, run_dir: str | None = None) -> None:
        """Start the heartbeat thread (idempotent); ``run_dir``: where it records a stopped
        sentinel's end and its own, which the sentinel cannot."""
        self._run_dir = run_dir
        if self._page is None or self._thread is not None:
            return
        self._thread = threading.Thread(target=self._beat, name="elastic-heartbeat", daemon=True)
        self._thread.start()

    def progress(self, step: int | None = None) -> None:
        """The loop moved on (``step``: where it is now, recorded if this process dies)."""
        if self._page is not None:
            self._page["progress"] += 1
            if step is not None:
                self._page["step"] = step

    @contextlib.contextmanager
    def waiting(self) -> Iterator[None]:
        """Inside: this process waits in MPI (for its peers), see the module docstring."""
        if self._page is None:
            yield
            return
        self._page["waiting"] += 1
        try:
            yield
        finally:
            self._page["waiting"] -= 1

    def watch_progress(self, on: bool) -> None:
        """Arm (active rank) or disarm (parked spare, finished) the progress timeout."""
        if self._page is not None:
            self._page["progress"] += 1  # arming starts the clock afresh
            self._page["armed"] = int(on)

    @contextlib.contextmanager
    def bounded(self, seconds: float) -> Iterator[None]:
        """Inside: one operation with a bound of its own (a spawn and the merge with it), in place
        of the progress timeout; the process is killed unless it leaves within ``seconds``."""
        if self._page is None:
            yield
            return
        armed = self._page["armed"]
        self._page["armed"] = 0
        self.deadline(seconds)
        try:
            yield
        finally:
            self.deadline(None)
            self._page["progress"] += 1  # the clock starts afresh after it
            self._page["armed"] = armed

    def deadline(self, seconds: float | None) -> None:
        """Kill this process unless ``deadline(None)`` comes within ``seconds``."""
        if self._page is not None:
            self._page["deadline"] = _UNSET if seconds is None else time.monotonic_ns() + int(seconds * 1e9)

    def announce_exit(self, code: int) -> None:
        """This process leaves on purpose with ``code``; the sentinel then passes the code on."""
        if self._page is not None:
            self._page["exit"] = code

    def _beat(self) -> None:
        assert self._page is not None and self._sentinel is not None
        stopped_since: float | None = None
        forked = os.environ.get(WARM_CHILD_ENV) == str(self._sentinel)
        while True:
            if (not os.path.exists(f"/proc/{self._sentinel}")) if forked else os.getppid() != self._sentinel:
                # The sentinel is gone: the runtime already counts this rank as dead, so it must
                # not go on as a process nobody waits for.
                os.kill(os.getpid(), signal.SIGKILL)
            self._page["beat"] += 1
            now = time.monotonic()
            if not _stopped(self._sentinel):
                stopped_since = None
            elif stopped_since is None:
                stopped_since = now
            elif now - stopped_since > self._page["bound_ms"] / 1000:
                if self._run_dir:  # the sentinel cannot say it: its end and this one's, in its place
                    with contextlib.suppress(OSError):
                        write_fate(self._run_dir, os.getpid(), "sentinel-stopped", sentinel_pid=self._sentinel,
                                   seconds=self._page["bound_ms"] / 1000, step=self._page["step"])
                os.kill(self._sentinel, signal.SIGKILL)  # this process follows: its parent-death signal
            time.sleep(BEAT_SECONDS)


def _stopped(pid: int) -> bool:
    """True when process ``pid`` is stopped (SIGSTOP, SIGTSTP) or traced (local, one /proc read)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            return stat.read().rsplit(b")", 1)[1].split()[0] in (b"T", b"t")
    except (OSError, IndexError):
        return False

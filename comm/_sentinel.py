"""The sentinel: runs one rank as its child and makes every bad end of it a death ULFM sees.

    mpiexec --with-ft ulfm ... python -m elastic.comm._sentinel -- python train.py ...

``python -m elastic.launch`` puts it in front of every rank (and of every
spawned replacement). The MPI runtime starts the sentinel; the sentinel starts
the program, which runs MPI as usual. Open MPI 5 reports a rank's death to the
survivors when the process it started dies by a signal or exits 0, but not when
it exits with another code, and it never notices a stopped process. So the
sentinel watches the program (see ``_watchdog`` for the messages) and, when the
program

* exits without having announced it (``os._exit(3)``, a native ``exit()``, a
  signal), or
* stops beating for ``ELASTIC_HANG_TIMEOUT`` seconds (SIGSTOP, a frozen
  process), or makes no progress for ``ELASTIC_PROGRESS_TIMEOUT`` seconds, or
  misses a deadline it asked for,

kills what is left of it and then itself with SIGKILL: the survivors see a
failure within milliseconds and recover. Each time it writes
``fate-<host>-<pid>.json`` (pid: the program's) in ``ELASTIC_RUN_DIR``, saying
how the process ended, which the launcher lists. SIGTERM / SIGINT / SIGHUP are
passed on to the program, which gets ``ELASTIC_TERM_GRACE`` seconds to leave
before it is killed. This module imports no MPI.
"""
from __future__ import annotations

import json
import os
import select
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from ._watchdog import SENTINEL_FD_ENV

HANG_TIMEOUT_ENV = "ELASTIC_HANG_TIMEOUT"
PROGRESS_TIMEOUT_ENV = "ELASTIC_PROGRESS_TIMEOUT"
TERM_GRACE_ENV = "ELASTIC_TERM_GRACE"
DEFAULT_HANG_TIMEOUT = 10.0
DEFAULT_TERM_GRACE = 5.0
EXIT_GRACE = 30.0        # after an announced exit: MPI_Finalize may hang after failures (ompi #11404)
DUMP_SECONDS = 1.0       # time given to a stuck process to print its traceback (SIGUSR1) before the kill
_FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2)


def _seconds(name: str, default: float) -> float:
    text = os.environ.get(name, "")
    try:
        value = float(text) if text else default
    except ValueError:
        value = -1.0
    if value < 0:
        sys.stderr.write(f"[sentinel] {name}={text!r}: give seconds >= 0 (0 turns it off); using {default}\n")
        value = default
    return value


class Sentinel:
    """Watches one child process; see the module docstring (local to this host)."""

    def __init__(self, command: list[str]) -> None:
        self.command = command
        self.hang_timeout = _seconds(HANG_TIMEOUT_ENV, DEFAULT_HANG_TIMEOUT)
        self.progress_timeout = _seconds(PROGRESS_TIMEOUT_ENV, 0.0)
        self.term_grace = _seconds(TERM_GRACE_ENV, DEFAULT_TERM_GRACE)
        run_dir = os.environ.get("ELASTIC_RUN_DIR")
        self.run_dir = Path(run_dir) if run_dir else None
        now = time.monotonic()
        self.last_beat: float | None = None      # liveness is armed by the first heartbeat
        self.last_progress = now
        self.progress_armed = False
        self.step: str = "-"
        self.deadline_at: float | None = None
        self.announced: int | None = None
        self.announced_at = 0.0
        self.signalled: int | None = None
        self.signalled_at = 0.0

    def run(self) -> int:
        read_end, write_end = os.pipe()
        env = {**os.environ, SENTINEL_FD_ENV: str(write_end)}
        try:
            self.child = subprocess.Popen(self.command, pass_fds=(write_end,), env=env)
        except OSError as exc:
            sys.stderr.write(f"[sentinel] cannot start {self.command!r}: {exc}\n")
            return 127
        os.close(write_end)
        for sig in _FORWARDED:
            signal.signal(sig, self._forward)
        verdict = self._watch(read_end)
        if verdict is not None:
            return self._kill(verdict)
        code = self.child.wait()
        if self.announced is not None:
            self._write_fate("exited", code=code, announced=self.announced)
            return self.announced
        if self.signalled is not None:
            self._write_fate("terminated", signal=signal.Signals(self.signalled).name, code=code)
            return 128 + self.signalled
        ended = {"signal": signal.Signals(-code).name} if code < 0 else {"code": code}
        self._write_fate("died", **ended)
        self._die()
        return 1  # not reached

    # ------------------------------------------------------------------ watching
    def _watch(self, read_end: int) -> str | None:
        """Read the child's messages until it exits (None) or must be killed (the reason)."""
        pending = b""
        while True:
            ready, _, _ = select.select([read_end], [], [], 0.25)
            if ready:
                data = os.read(read_end, 65536)
                if not data:  # every copy of the write end is closed: the child has gone
                    return None
                pending += data
                *lines, pending = pending.split(b"\n")
                for line in lines:
                    self._message(line.decode(errors="replace").split())
            if self.child.poll() is not None:
                return None
            verdict = self._verdict(time.monotonic())
            if verdict is not None:
                return verdict

    def _message(self, words: list[str]) -> None:
        now = time.monotonic()
        if not words:
            return
        kind = words[0]
        if kind == "beat":
            self.last_beat = now
        elif kind == "progress":
            self.last_progress = now
            self.step = words[1] if len(words) > 1 else self.step
        elif kind == "arm":
            self.progress_armed, self.last_progress = True, now
        elif kind == "disarm":
            self.progress_armed = False
        elif kind == "deadline":
            self.deadline_at = None if words[1:] == ["off"] else now + float(words[1])
        elif kind == "exit":
            self.announced, self.announced_at = int(words[1]), now

    def _verdict(self, now: float) -> str | None:
        if self.announced is not None:
            return "stuck-exiting" if now - self.announced_at > EXIT_GRACE else None
        if self.signalled is not None:
            return "terminated" if now - self.signalled_at > self.term_grace else None
        if self.hang_timeout and self.last_beat is not None and now - self.last_beat > self.hang_timeout:
            return "hung"
        if self.progress_timeout and self.progress_armed and now - self.last_progress > self.progress_timeout:
            return "no-progress"
        if self.deadline_at is not None and now > self.deadline_at:
            return "deadline"
        return None

    def _forward(self, sig: int, _frame: Any) -> None:
        if sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP) and self.signalled is None:
            self.signalled, self.signalled_at = sig, time.monotonic()
        try:
            self.child.send_signal(sig)
        except OSError:
            pass

    # ------------------------------------------------------------------ ending
    def _kill(self, verdict: str) -> int:
        if verdict == "no-progress":
            self.child.send_signal(signal.SIGUSR1)  # the program's faulthandler prints where it is stuck
            try:
                self.child.wait(DUMP_SECONDS)
            except subprocess.TimeoutExpired:
                pass
        self.child.kill()
        code = self.child.wait()
        seconds = {"hung": self.hang_timeout, "no-progress": self.progress_timeout}.get(verdict)
        self._write_fate(verdict, code=code, seconds=seconds)
        if verdict == "stuck-exiting" and self.announced is not None:
            return self.announced   # it had left the job already; only MPI_Finalize hung
        if verdict == "terminated" and self.signalled is not None:
            return 128 + self.signalled
        self._die()
        return 1  # not reached

    def _die(self) -> None:
        """Die by SIGKILL: the one end of this process that Open MPI reports to the survivors."""
        sys.stderr.flush()
        os.kill(os.getpid(), signal.SIGKILL)

    def _write_fate(self, end: str, **fields: Any) -> None:
        if self.run_dir is None:
            return
        host, pid = socket.gethostname(), self.child.pid
        record = {"end": end, "pid": pid, "sentinel_pid": os.getpid(), "host": host, "t": time.time(),
                  "step": None if self.step == "-" else int(self.step), **fields}
        try:
            path = self.run_dir / f"fate-{host}-{pid}.json"
            tmp = path.with_suffix(".tmp")
            tmp.write_text(json.dumps(record))
            tmp.replace(path)
        except OSError as exc:
            sys.stderr.write(f"[sentinel] could not record the end of pid {pid}: {exc}\n")


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if args[:1] == ["--"]:
        args = args[1:]
    if not args:
        sys.stderr.write("usage: python -m elastic.comm._sentinel -- PROGRAM [ARGS...]\n")
        return 2
    return Sentinel(args).run()


if __name__ == "__main__":
    sys.exit(main())

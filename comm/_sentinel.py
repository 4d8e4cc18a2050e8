"""The sentinel: runs one rank as its child and makes every bad end of it a death ULFM sees.

    mpiexec --with-ft ulfm ... python -m elastic.comm._sentinel -- python train.py ...

``python -m elastic.launch`` puts it in front of every rank (and of every
spawned replacement). The MPI runtime starts the sentinel; the sentinel starts
the program, which runs MPI as usual. Open MPI 5 reports a rank's death to the
survivors when the process it started dies by a signal or exits 0, but not when
it exits with another code, and it never notices a stopped process. So the
sentinel watches the program (through a page of shared memory, see
``_watchdog``) and, when the program

* exits without having announced it (``os._exit(3)``, a native ``exit()``, a
  signal), or
* stops beating for ``hang_timeout`` seconds (SIGSTOP, a frozen process), or
  makes no progress for ``progress_timeout`` seconds (by default 20 times its
  slowest step, at least 120 s; twice that while it waits in MPI for its
  peers, and counted afresh once such a wait ends), or misses a deadline it
  asked for,

kills what is left of it and then itself with SIGKILL: the survivors see a
failure within milliseconds and recover. The program's end wakes the sentinel
at once (a pidfd the kernel makes readable); the page is read on a period. Each time it writes
``fate-<host>-<pid>.json`` (pid: the program's) in the run directory, saying
how the process ended, which the launcher lists. SIGTERM / SIGINT / SIGHUP are
passed on to the program, which gets ``term_grace`` seconds to leave before it
is killed; unless it then left on purpose (an announced exit), the sentinel
dies by the same signal: a plain non-zero exit would be a death nobody sees.

The sentinel must never be the weak link. Its program dies with it: the
program gets SIGKILL the moment the sentinel ends, however it ends
(``PR_SET_PDEATHSIG``), so a sentinel's crash is exactly one rank's failure,
never a program left running in MPI after the runtime counted it dead. A
stopped sentinel is found by its program's heartbeat thread (``_watchdog``),
which kills it after the hang bound. The settings are the job's ``Config``.
This module imports no MPI.
"""
from __future__ import annotations

import ctypes
import select
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable, NoReturn

from . import _warm
from ._config import Config
from ._errors import ConfigError
from ._watchdog import SENTINEL_FD_ENV, SENTINEL_PID_ENV, STOPPED_SENTINEL_SECONDS, Page
from .events import write_fate

EXIT_GRACE = 30.0        # after an announced exit: MPI_Finalize may hang after failures (ompi #11404)
POLL_SECONDS = 0.1
# With no progress timeout given, a rank that makes no progress for AUTO_FACTOR x the slowest step it
# made (never less than AUTO_FLOOR s, and only once AUTO_STEPS steps were seen) is stalled: no hang
# is without a bound by default. ``--progress-timeout 0`` turns it off, a value sets it.
AUTO_FACTOR, AUTO_FLOOR, AUTO_STEPS = 20.0, 120.0, 3
DUMP_SECONDS = 1.0       # time given to a stuck process to print its traceback (SIGUSR1) before the kill
_FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2)
# The others that end a process by default: recorded as the rank's end before the sentinel dies of them.
_FATAL = (signal.SIGSEGV, signal.SIGABRT, signal.SIGBUS, signal.SIGFPE, signal.SIGILL, signal.SIGQUIT,
          signal.SIGALRM, signal.SIGTRAP, signal.SIGSYS)
_PR_SET_PDEATHSIG = 1


class Sentinel:
    """Watches one child process; see the module docstring (local to this host)."""

    def __init__(self, command: list[str], config: Config) -> None:
        self.command = command
        self.hang_timeout, self.progress_timeout = config.hang_timeout, config.progress_timeout
        self.term_grace = config.term_grace
        self.warm_socket = config.warm_socket  # fork the program from this host's warm process, if it serves
        self.run_dir = Path(config.run_dir) if config.run_dir else None
        self.page = Page.create()
        # The program watches this process too (a stopped sentinel), within the same bound.
        self.page["bound_ms"] = int(1000 * (self.hang_timeout or STOPPED_SENTINEL_SECONDS))
        self.seen: dict[str, int | None] = self.page.read()
        self.last_beat: float | None = None      # liveness is armed by the first heartbeat
        self.last_progress = time.monotonic()
        self.left_wait = 0.0                     # when it last left a wait for its peers
        self.slowest = 0.0                       # the longest the program went between two steps, armed
        self.steps_seen = 0
        self.announced_at: float | None = None
        self.signalled: int | None = None
        self.signalled_at = 0.0

    def run(self) -> int:
        env = {**os.environ, SENTINEL_FD_ENV: str(self.page.fd), SENTINEL_PID_ENV: str(os.getpid())}
        signal.pthread_sigmask(signal.SIG_BLOCK, _FATAL)  # for _await_fatal (the program unblocks them)
        threading.Thread(target=self._await_fatal, name="sentinel-fatal", daemon=True).start()
        try:
            warm, why = _warm.start(self.warm_socket, self.command, env, self.page.fd) if self.warm_socket else \
                (None, "")
            if warm is not None:
                self.child: subprocess.Popen[bytes] | _warm.WarmChild = warm
            else:
                if self.warm_socket:
                    self._say_once("cold", f"[sentinel] a cold start on {socket.gethostname()}: {why}\n")
                self.child = subprocess.Popen(self.command, pass_fds=(self.page.fd,), env=env,
                                              preexec_fn=_die_with_parent(os.getpid()))
        except OSError as exc:
            sys.stderr.write(f"[sentinel] cannot start {self.command!r}: {exc}\n")
            self._die()  # a plain exit code would leave the others waiting for this rank
        for sig in _FORWARDED:
            signal.signal(sig, self._forward)
        verdict = self._watch()
        if verdict is not None:
            return self._kill(verdict)
        code = self.child.wait()
        announced = self.page.read()["exit"]
        if announced is not None:
            self._write_fate("exited", code=code, announced=announced)
            return announced
        if self.signalled is not None:
            self._write_fate("terminated", signal=signal.Signals(self.signalled).name, code=code)
            self._die(self.signalled)
        ended = {"signal": signal.Signals(-code).name} if code < 0 else {"code": code}
        self._write_fate("died", **ended)
        self._die()

    # ------------------------------------------------------------------ watching
    def _watch(self) -> str | None:
        """Watch the child and the shared page until the child exits (None) or must be killed (why).
        The child's end wakes the watch at once (the kernel's notification on a pidfd: no timer in
        the way of the survivors learning of it); the page is read every ``POLL_SECONDS``."""
        ended = _end_of(self.child)
        while self.child.poll() is None:
            now = time.monotonic()
            page = self.page.read()
            self._saw(now, page)
            verdict = self._verdict(now, page)
            if verdict is not None:
                return verdict
            ended(POLL_SECONDS)
        return None

    def _saw(self, now: float, page: dict[str, int | None]) -> None:
        """What the page says since the last look (local)."""
        seen = self.seen
        if page["beat"] != seen["beat"]:
            self.last_beat = now
        if page["progress"] != seen["progress"]:
            if page["armed"] and seen["armed"]:  # a parked spare's wait, or a restart, is no step
                self.slowest, self.steps_seen = max(self.slowest, now - self.last_progress), self.steps_seen + 1
            self.last_progress = now
        if seen["waiting"] and not page["waiting"]:
            # A wait for its peers ended (a stuck peer died, or a revoke came): the program's own time
            # starts now, not at its last step. Else a survivor that waited out the stuck peer's bound
            # is itself "without progress" in the moment before its recovery marks progress (seen).
            self.left_wait = now
        if page["exit"] is not None and self.announced_at is None:
            self.announced_at = now
        self.seen = page

    def _verdict(self, now: float, page: dict[str, int | None]) -> str | None:
        if self.announced_at is not None:
            return "stuck-exiting" if now - self.announced_at > EXIT_GRACE else None
        if self.signalled is not None:
            return "terminated" if now - self.signalled_at > self.term_grace else None
        if self.hang_timeout and self.last_beat is not None and now - self.last_beat > self.hang_timeout:
            return "hung"
        # A rank waiting in MPI for a stuck peer gets twice as long: the stuck one dies first.
        timeout = self.progress_bound()
        quiet = now - max(self.last_progress, self.left_wait)
        if timeout and page["armed"] and quiet > timeout * (2 if page["waiting"] else 1):
            return "no-progress"
        if page["deadline"] is not None and time.monotonic_ns() > page["deadline"]:
            return "deadline"
        return None

    def progress_bound(self) -> float:
        """The progress timeout in force: the one given, else ``auto_bound`` of the steps seen (0: none)."""
        if self.progress_timeout is not None:
            return self.progress_timeout
        return auto_bound(self.slowest, self.steps_seen)

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
        seconds = {"hung": self.hang_timeout, "no-progress": self.progress_bound()}.get(verdict)
        self._write_fate(verdict, code=code, seconds=seconds)
        announced = self.page.read()["exit"]
        if verdict == "stuck-exiting" and announced is not None:
            return announced   # it had left the job already; only MPI_Finalize hung
        self._die(self.signalled if verdict == "terminated" and self.signalled is not None else signal.SIGKILL)

    def _die(self, sig: int = signal.SIGKILL) -> NoReturn:
        """Die by ``sig``: an end by a signal is the one Open MPI reports to the survivors (a plain
        non-zero exit never is). A signal the sentinel was sent dies as that signal, so that whoever
        sent it (a batch system's SIGTERM) sees its own signal in the exit status."""
        sys.stderr.flush()
        if sig != signal.SIGKILL:
            signal.signal(sig, signal.SIG_DFL)
            os.kill(os.getpid(), sig)
        os.kill(os.getpid(), signal.SIGKILL)  # a signal the process could not die of (blocked): no other end
        raise AssertionError("not reached")

    def _say_once(self, what: str, text: str) -> None:
        """Write ``text`` to stderr if no other sentinel of the job on this host has said ``what``."""
        if self.run_dir is not None:
            try:
                os.close(os.open(self.run_dir / f".said-{what}-{socket.gethostname()}", os.O_CREAT | os.O_EXCL))
            except OSError:
                return
        sys.stderr.write(text)

    def _write_fate(self, end: str, **fields: Any) -> None:
        if self.run_dir is None:
            return
        try:
            write_fate(self.run_dir, self.child.pid, end, sentinel_pid=os.getpid(), step=self.page.read()["step"],
                       **fields)
        except OSError as exc:
            sys.stderr.write(f"[sentinel] could not record the end of pid {self.child.pid}: {exc}\n")

    def _await_fatal(self) -> None:
        """A thread of its own: a signal that would end this process without a word (SIGSEGV,
        SIGABRT, ... sent from outside) is recorded as the program's end, then ends it (its
        program with it: its parent-death signal). They are blocked in every thread and taken
        here: a real fault of this process's own code, blocked, still ends it at once."""
        info = signal.sigwaitinfo(_FATAL)
        sig = signal.Signals(info.si_signo)
        self._write_fate("sentinel-signalled", signal=sig.name, sender=info.si_pid)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, [sig])
        os.kill(os.getpid(), sig)  # its default action: this thread is the one that takes it now
        os.kill(os.getpid(), signal.SIGKILL)


def auto_bound(slowest: float, steps: int) -> float:
    """The default progress timeout: ``AUTO_FACTOR`` x the slowest step seen, at least ``AUTO_FLOOR``
    seconds, once ``AUTO_STEPS`` steps were seen (0 before: a job's start, its imports and its first
    compilation are no steps)."""
    return max(AUTO_FLOOR, AUTO_FACTOR * slowest) if steps >= AUTO_STEPS else 0.0


def _end_of(child: Any) -> Callable[[float], bool]:
    """A wait of at most ``seconds`` that returns as soon as ``child`` ends (True then): select on its
    pidfd (a started child's, or the one a warm process's child is watched through); a plain sleep
    where the kernel has no pidfds."""
    try:
        pidfd = child.pidfd if isinstance(child, _warm.WarmChild) else os.pidfd_open(child.pid)
    except (AttributeError, OSError):
        pidfd = None

    def wait(seconds: float) -> bool:
        if pidfd is None:
            time.sleep(seconds)
            return False
        return bool(select.select([pidfd], [], [], seconds)[0])
    return wait


def _die_with_parent(sentinel: int) -> Any:
    """The program's first act (between fork and exec): SIGKILL when its parent, this sentinel, ends.
    Linux only; elsewhere the program's heartbeat thread finds an orphan within half a second."""
    prctl = getattr(ctypes.CDLL(None, use_errno=True), "prctl", None) if sys.platform == "linux" else None

    def arm() -> None:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, _FATAL)  # the sentinel's mask, not the program's
        if prctl is not None:
            prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
            if os.getppid() != sentinel:  # the sentinel died before the signal was armed
                os.kill(os.getpid(), signal.SIGKILL)
    return arm


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if args[:1] == ["--"]:
        args = args[1:]
    if not args:
        sys.stderr.write("usage: python -m elastic.comm._sentinel -- PROGRAM [ARGS...]\n")
        return 2
    try:
        config = Config.from_env()
    except ConfigError as exc:
        sys.stderr.write(f"[sentinel] {exc}\n")
        return 2
    return Sentinel(args, config).run()


if __name__ == "__main__":
    sys.exit(main())

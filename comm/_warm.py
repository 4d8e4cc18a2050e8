"""Warm processes: a rank forked from a process that has imported everything already.

A cold rank starts Python and imports numpy, torch, mpi4py and the program's modules: seconds on
a busy node, paid again by every spawned replacement and every rank of a relaunch. The launcher
keeps a warm process on each host of the job (``serve``: it has imported those, never initialised
MPI, started no thread), listening on a Unix socket (``Config.warm_socket``, ``ELASTIC_WARM_SOCKET``;
in the host's /dev/shm, so that the same path finds each host's own), until the launcher closes its
standard input. A
sentinel that finds the socket asks it for the program instead of starting one (``start``): it
sends the command, its
environment, its working directory and its standard streams and page (as file descriptors); the
warm process forks, and the child takes all of them, enters the sentinel's namespaces where they
differ (a simulated node's hostname and node memory), and runs the program as ``python PROGRAM``
would (``runpy``, as ``__main__``). It then initialises MPI like any rank: the runtime knows the
process by what the sentinel's environment says, not by its pid.

The sentinel's guarantees hold for a forked rank as for a started one: it watches the child
(``WarmChild`` answers as ``subprocess.Popen`` does: the warm process reports its wait status over
the socket), the child dies the moment its sentinel does (a pidfd watched in a thread of its own,
where a started child has its parent-death signal), and its heartbeat thread treats the sentinel as
its parent. Where no warm process can serve (none on this host, it died, the program runs a module
with ``-m`` or is not Python), the sentinel starts the program cold, and says why on stderr.
This module imports no MPI until it serves.
"""
from __future__ import annotations

import array
import ast
import contextlib
import importlib
import json
import os
import select
import signal
import socket
import stat
import struct
import sys
import threading
from pathlib import Path
from typing import Any, NoReturn

from ._watchdog import WARM_CHILD_ENV, WARM_HOST_ENV

_PRELOAD = ("numpy", "torch", "xxhash", "networkx", "elastic", "elastic.comm._join", "elastic.comm._world")
_FDS = 4  # stdin, stdout, stderr, the sentinel's page
_CLONE_NEWNS, _CLONE_NEWUTS = 0x00020000, 0x04000000
STATUS_SECONDS = 1.0  # how long a sentinel waits for the warm process to say how its child ended
# How long a sentinel waits for the warm process to fork its rank (it takes milliseconds), and the
# warm process for a sentinel's request. Then the sentinel starts its rank cold, which must still fit
# in a spawn's bound (``_rebuild.JOIN_SECONDS``, 30 s: this and a cold start, a few seconds, well
# inside); the launcher kills a warm process stopped this long (``_supervise``).
ANSWER_SECONDS = 5.0


def serving_pid(path: str) -> int | None:
    """The pid of the warm process listening at ``path`` (the socket's peer credentials), or None
    where none listens (local; a connection that says nothing, which it drops)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
        conn.settimeout(ANSWER_SECONDS)
        try:
            conn.connect(path)
        except OSError:
            return None
        pid: int = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))[0]
        return pid


# ------------------------------------------------------------------ the sentinel's side
class WarmChild:
    """A program forked by the warm process, seen from the sentinel as a ``subprocess.Popen``: the
    warm process tells its wait status over the socket. Should the warm process die first, the
    child lives on (reparented), and its end is seen through a pidfd instead, its status unknown."""

    def __init__(self, conn: socket.socket, pid: int) -> None:
        self._conn, self.pid = conn, pid
        self._pidfd = os.pidfd_open(pid)
        self._told = True  # the warm process is there to tell the status
        self.returncode: int | None = None

    @property
    def pidfd(self) -> int:
        """Readable once the child has ended (what the sentinel's watch waits on)."""
        return self._pidfd

    def poll(self) -> int | None:
        return self._wait(0)

    def wait(self, timeout: float | None = None) -> int:
        code = self._wait(timeout)
        if code is None:
            import subprocess
            raise subprocess.TimeoutExpired("a warm process's child", timeout or 0)
        return code

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:
            try:
                signal.pidfd_send_signal(self._pidfd, sig)
            except ProcessLookupError:
                pass  # it has ended: the next poll says so

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def _wait(self, timeout: float | None) -> int | None:
        """The child's end is seen on its pidfd; how it ended, from the warm process (it reaps the
        child, then says), or, when that does not come within a second (the warm process died), as
        a death: an announced exit is on the page anyway."""
        if self.returncode is not None:
            return self.returncode
        watched = [self._pidfd, self._conn.fileno()] if self._told else [self._pidfd]
        readable, _, _ = select.select(watched, [], [], timeout)
        if not readable:
            return None
        if self._told and not select.select([self._conn], [], [], STATUS_SECONDS)[0]:
            self._told = False
        data = self._conn.recv(64) if self._told else b""
        if data.strip():
            self.returncode = os.waitstatus_to_exitcode(int(data))
        elif select.select([self._pidfd], [], [], 0)[0]:
            self.returncode = -signal.SIGKILL
        else:  # the warm process died, the child did not: watch it alone from now on
            self._told = False
        return self.returncode


def start(path: str, command: list[str], env: dict[str, str], page_fd: int) -> tuple[WarmChild | None, str]:
    """Ask the warm process at ``path`` to fork ``command`` (``python PROGRAM ARGS``); returns the
    child, or None and why not (the caller then starts it cold)."""
    if len(command) < 2 or Path(command[0]).name not in (Path(sys.executable).name, "python", "python3") \
            or command[1].startswith("-") or not command[1].endswith(".py"):
        return None, f"not a Python script the warm process can run: {' '.join(command[:3])}"
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    conn.settimeout(ANSWER_SECONDS)  # a warm process that is there but does not answer (stopped): cold
    try:
        conn.connect(path)
        request = json.dumps({"argv": command[1:], "env": env, "cwd": os.getcwd(), "sentinel": os.getpid(),
                              "page_fd": page_fd}).encode()
        fds = array.array("i", [0, 1, 2, page_fd])
        conn.sendmsg([struct.pack("!I", len(request)), request], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, fds)])
        answer = conn.recv(64)
        if not answer.strip().isdigit():
            raise OSError(f"the warm process said {answer[:60]!r}")
        conn.settimeout(None)
        return WarmChild(conn, int(answer)), ""
    except OSError as exc:
        conn.close()
        return None, f"the warm process at {path} did not answer ({exc})"


# ------------------------------------------------------------------ the warm process
def serve(path: str, programs: list[str]) -> NoReturn:
    """Import what the ranks will import, then fork a rank for each sentinel that asks (never
    returns; SIGTERM ends it). Single-threaded: a fork from a process with threads may inherit a
    lock held by one of them."""
    preload(programs)
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        print("[warm] not serving: CUDA was initialised while importing the program's modules, and a forked "
              "process cannot use it", flush=True)
        os._exit(1)
    children: dict[int, socket.socket] = {}
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    if os.path.exists(path):
        os.unlink(path)
    listener.bind(path)
    listener.listen(64)
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)  # wakes the select through the pipe
    # The launcher holds the other end of a pipe (or ssh's socket) on standard input: its end, or the
    # launcher's, or the connection's to this host, ends this process, which outlives each mpiexec.
    launcher = [0] if stat.S_ISFIFO(os.fstat(0).st_mode) or stat.S_ISSOCK(os.fstat(0).st_mode) else []
    print(f"[warm] ready at {path}", flush=True)
    while True:
        try:
            readable, _, _ = select.select([listener.fileno(), wake_r, *launcher], [], [])
        except InterruptedError:
            continue
        if launcher and 0 in readable and not os.read(0, 512):
            listener.close()
            with contextlib.suppress(OSError):
                os.unlink(path)
            os._exit(0)
        if wake_r in readable:
            os.read(wake_r, 512)
            _reap(children)
        if listener.fileno() in readable:
            conn, _ = listener.accept()
            pid = _fork_one(conn, [listener, *children.values()], wake_r, wake_w)
            if pid is not None:
                children[pid] = conn
        _reap(children)


def _reap(children: dict[int, socket.socket]) -> None:
    """Tell each sentinel whose child ended how it ended (its wait status)."""
    while children:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        conn = children.pop(pid, None)
        if conn is not None:
            try:
                conn.sendall(str(status).encode())
            except OSError:
                pass
            conn.close()


def _fork_one(conn: socket.socket, others: list[socket.socket], *pipe: int) -> int | None:
    """Read one request and fork its rank; the child never returns from here. ``others``: the
    listener and the other sentinels' connections, which the child must not hold (a sentinel
    learns that the warm process died when its connection closes)."""
    conn.settimeout(ANSWER_SECONDS)  # a sentinel that connects and says nothing does not stop the others
    try:
        # The descriptors come with the first bytes: read them with the size.
        head, fds, _, _ = conn.recvmsg(4, socket.CMSG_SPACE(_FDS * 4))
        received = _fds_of(fds)
        size = struct.unpack("!I", head + _recv_exactly(conn, 4 - len(head)))[0]
        message = _recv_exactly(conn, size)
        request = json.loads(message)
        if len(received) != _FDS:
            raise ValueError(f"{len(received)} file descriptors, not {_FDS}")
    except (OSError, ValueError, struct.error) as exc:
        try:
            conn.sendall(f"error {exc}".encode())
        except OSError:
            pass
        conn.close()
        return None
    pid = os.fork()
    if pid == 0:
        for other in others:
            other.close()
        for fd in pipe:
            os.close(fd)
        _become(request, received, conn)
    for fd in received:
        os.close(fd)
    try:
        conn.sendall(str(pid).encode())
    except OSError:  # the sentinel gave up waiting (and starts its rank cold): this one must not run
        os.kill(pid, signal.SIGKILL)
    return pid


def _become(request: dict[str, Any], fds: list[int], conn: socket.socket) -> NoReturn:
    """In the forked child: take the sentinel's streams, page, environment, directory and
    namespaces, watch the sentinel, and run the program as ``__main__``."""
    code = 1
    try:
        conn.close()
        signal.set_wakeup_fd(-1)
        for sig in (signal.SIGCHLD, signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(sig, signal.SIG_DFL if sig != signal.SIGINT else signal.default_int_handler)
        for target, fd in zip((0, 1, 2, int(request["page_fd"])), fds):
            if fd != target:
                os.dup2(fd, target)
                os.close(fd)
        os.set_inheritable(int(request["page_fd"]), True)
        sentinel = int(request["sentinel"])
        forked_on = socket.gethostname()  # the warm process's host, before the sentinel's namespaces
        _enter_namespaces(sentinel)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        os.environ[WARM_CHILD_ENV] = str(sentinel)
        os.environ[WARM_HOST_ENV] = forked_on
        _die_with(sentinel)
        world = sys.modules.get("elastic.comm._world")
        if world is not None:  # imported here before the child had the sentinel's variables
            world.WATCHDOG.adopt_env()
        torch = sys.modules.get("torch")
        if torch is not None and os.environ.get("OMP_NUM_THREADS", "").isdigit():
            # a warm process shared by jobs (ELASTIC_WARM_SERVER) imported torch under its own value
            torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
        if "numpy" in sys.modules:  # a fresh process draws numpy's global seed from the OS, not its parent's
            sys.modules["numpy"].random.seed()
        argv = [str(a) for a in request["argv"]]
        sys.argv = argv
        sys.orig_argv = [sys.executable] + argv
        sys.path[0] = os.path.dirname(os.path.abspath(argv[0]))
        import runpy
        runpy.run_path(argv[0], run_name="__main__")
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        if not isinstance(exc.code, (int, type(None))):
            print(exc.code, file=sys.stderr)
    except BaseException:  # noqa: BLE001  (as the interpreter does: sys.excepthook, exit 1)
        sys.excepthook(*sys.exc_info())
        code = 1
    finally:
        _exit(code)
    raise AssertionError("not reached")


def _exit(code: int) -> NoReturn:
    """Leave as the interpreter would after ``python PROGRAM``: the program's exit handlers, flushed
    streams, then the status (never back into the warm process's loop)."""
    import atexit
    try:
        shutdown = getattr(threading, "_shutdown", None)
        if shutdown is not None:
            shutdown()  # the program's non-daemon threads, as the interpreter waits for them
        atexit._run_exitfuncs()
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def _die_with(sentinel: int) -> None:
    """SIGKILL this process the moment its sentinel ends (a started child has its parent-death signal
    for that; a forked one's parent is the warm process)."""
    try:
        watched = os.pidfd_open(sentinel)
    except OSError:
        os.kill(os.getpid(), signal.SIGKILL)  # already gone
        raise

    def watch() -> None:
        select.select([watched], [], [])
        os.kill(os.getpid(), signal.SIGKILL)
    threading.Thread(target=watch, name="elastic-sentinel-watch", daemon=True).start()


def _enter_namespaces(sentinel: int) -> None:
    """Join the sentinel's UTS and mount namespaces where they are not this process's (a simulated
    node: its hostname, its node memory at /dev/shm). Needs the rights ``unshare`` needed."""
    import ctypes
    libc = ctypes.CDLL(None, use_errno=True)
    for kind, flag in (("uts", _CLONE_NEWUTS), ("mnt", _CLONE_NEWNS)):
        if os.readlink(f"/proc/{sentinel}/ns/{kind}") == os.readlink(f"/proc/self/ns/{kind}"):
            continue
        fd = os.open(f"/proc/{sentinel}/ns/{kind}", os.O_RDONLY)
        try:
            if libc.setns(fd, flag) != 0:
                raise OSError(ctypes.get_errno(), f"setns({kind}) into the sentinel's namespace")
        finally:
            os.close(fd)


def preload(programs: list[str]) -> list[str]:
    """Import the modules every rank imports, and each program's top-level imports (read from its
    source, never run), or the modules named where an entry is no ``.py`` path. Returns what could
    not be imported (the child imports those itself)."""
    import mpi4py
    mpi4py.rc.initialize = False  # MPI starts in the child, in its own environment
    missed = []
    names = list(_PRELOAD) + ["mpi4py.MPI"]
    for program in programs:
        if not program.endswith(".py"):  # a module's name (a shared warm process's libraries)
            names.append(program)
            continue
        folder = os.path.dirname(os.path.abspath(program))
        if folder not in sys.path:
            sys.path.insert(0, folder)
        names += _imports_of(program)
    for name in dict.fromkeys(names):
        try:
            importlib.import_module(name)
        except Exception:  # noqa: BLE001  (anything: the child imports it as the program does)
            missed.append(name)
    if "torch" in sys.modules:
        import torch._dynamo  # noqa: F401  (a first optimizer imports it, see elastic.init)
    return missed


def _imports_of(program: str) -> list[str]:
    try:
        tree = ast.parse(Path(program).read_text(), program)
    except (OSError, SyntaxError, ValueError):
        return []
    names = []
    for node in tree.body:
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.append(node.module)
    return names


def _recv_exactly(conn: socket.socket, size: int) -> bytes:
    data = b""
    if size <= 0:
        return data
    while len(data) < size:
        chunk = conn.recv(size - len(data))
        if not chunk:
            raise OSError("the sentinel hung up")
        data += chunk
    return data


def _fds_of(ancillary: list[tuple[int, int, bytes]]) -> list[int]:
    fds = array.array("i")
    for level, kind, data in ancillary:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(data[:len(data) - len(data) % fds.itemsize])
    return list(fds)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) < 2 or args[0] != "serve":
        sys.stderr.write("usage: elastic.comm._warm.main: serve SOCKET [PROGRAM.py | MODULE ...]\n")
        return 2
    signal.signal(signal.SIGTERM, lambda *_: os._exit(0))
    serve(args[1], args[2:])


if __name__ == "__main__":
    sys.exit(main())
